"""The columnar batch handed to training and evaluation code.

One int64 array of global sample indexes, one array or tensor per field, and the schema of
each field stored once per field, never per sample. A field of variable-length values is a
:class:`Jagged` column: all samples' values in one buffer plus ``offsets``, never padded
unless asked. Building a batch costs O(fields) Python objects, whatever the batch size. A
batch serialises as one small header plus one buffer per field (two for a jagged one; see
:meth:`Batch.to_buffers`); pickling uses that form.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._schema import FieldSchema as FieldSchema

# torch loads inside the methods that use it: the modules that only name these types (the
# formats that `asyncbatch inspect`, `verify` and `index` open) do not import it.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False, slots=True)
class Jagged:
    """Variable-length values: sample ``i`` holds ``values[offsets[i]:offsets[i + 1]]``.

    ``values`` is a tensor (numbers) or a numpy object array (decoded strings, JSON), its
    first axis running through every sample's values; ``offsets`` is int64 with one entry
    more than there are samples, starting at 0. Slicing samples (``column[a:b]``) gives a
    view with rebased offsets; ``column[i]`` is one sample's values.
    """

    values: Any
    offsets: torch.Tensor

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("a jagged column slices with step 1 only")
            stop = max(start, stop)
            offsets = self.offsets[start : stop + 1]
            first, last = int(offsets[0]), int(offsets[-1])
            return Jagged(self.values[first:last], offsets - first)
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a jagged column of {len(self)}")
        index %= len(self)
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def to_nested(self) -> torch.Tensor:
        """A ``torch.nested`` tensor of layout ``torch.jagged`` sharing ``values``."""
        import torch

        if not isinstance(self.values, torch.Tensor):
            raise TypeError("only a jagged column of numbers converts to a nested tensor")
        offsets = self.offsets - self.offsets[0]
        return torch.nested.nested_tensor_from_jagged(self.values, offsets)

    def to_padded(self, pad: int | float = 0, length: int | None = None) -> torch.Tensor:
        """``[samples, length, ...]`` padded with ``pad`` (``length``: the longest sample's);
        values past ``length`` are cut. :attr:`lengths` or :meth:`mask` tell what is real."""
        import torch

        if not isinstance(self.values, torch.Tensor):
            raise TypeError("only a jagged column of numbers pads into a tensor")
        lengths = self.lengths
        width = int(lengths.max()) if length is None and len(self) else int(length or 0)
        out = self.values.new_full((len(self), width, *self.values.shape[1:]), pad)
        keep = self.mask(width)
        position = torch.arange(width).expand(len(self), width)
        source = (self.offsets[:-1, None] - self.offsets[0] + position)[keep]
        out[keep] = self.values[source]
        return out

    def mask(self, length: int | None = None) -> torch.Tensor:
        """Bool ``[samples, length]``: True where a padded position holds a real value."""
        import torch

        lengths = self.lengths
        width = int(lengths.max()) if length is None and len(self) else int(length or 0)
        return torch.arange(width)[None, :] < lengths[:, None]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Jagged:
        """The same column with its tensors on ``device`` (object values stay as they are)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Jagged:
        """The same column with its tensors in page-locked memory (needs an accelerator)."""
        import torch

        return self._map(torch.Tensor.pin_memory)

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Jagged:
        import torch

        values = move(self.values) if isinstance(self.values, torch.Tensor) else self.values
        return Jagged(values, move(self.offsets))

    def __repr__(self) -> str:
        return f"Jagged(samples={len(self)}, values={tuple(getattr(self.values, 'shape', ()))})"


@dataclass(frozen=True, eq=False, slots=True)
class Strings:
    """Strings (or bytes) of every sample in Arrow's layout: sample ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``, UTF-8 unless ``binary``.

    ``data`` is one uint8 tensor, ``offsets`` int64 with one entry more than there are
    samples; no Python object per sample exists until asked for (``column[i]``,
    :meth:`to_pylist`). Slicing samples gives a view with rebased offsets.
    """

    data: torch.Tensor
    offsets: torch.Tensor
    binary: bool = False

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def lengths(self) -> torch.Tensor:
        """Bytes of each sample."""
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            part = Jagged(self.data, self.offsets)[index]
            return Strings(part.values, part.offsets, self.binary)
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a string column of {len(self)}")
        index %= len(self)
        raw = self.data[int(self.offsets[index]) : int(self.offsets[index + 1])].numpy().tobytes()
        return raw if self.binary else raw.decode()

    def to_pylist(self) -> list[Any]:
        """Every sample as ``str`` (``bytes`` if ``binary``)."""
        raw = self.data.numpy().tobytes()
        base = int(self.offsets[0]) if len(self.offsets) else 0
        cuts = (self.offsets - base).tolist()
        items = [raw[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        return items if self.binary else [item.decode() for item in items]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Strings:
        """Strings stay on the CPU: only numbers move to an accelerator."""
        return self

    def pin_memory(self) -> Strings:
        return self

    def __repr__(self) -> str:
        kind = "bytes" if self.binary else "str"
        return f"Strings(samples={len(self)}, {kind}, bytes={int(self.data.numel())})"


@dataclass(eq=False, slots=True)
class Batch(MutableMapping[str, Any]):
    """``batch["tokens"]`` is a field; ``batch.global_indexes`` names the samples.

    A mutable mapping whose shallow copy is a ``Batch``: torch's ``default_convert`` (the
    collate function of ``DataLoader(batch_size=None)``) copies it and replaces its fields,
    so a Batch stays a Batch there.
    """

    global_indexes: npt.NDArray[np.int64]
    fields: dict[str, Any]
    schema: dict[str, FieldSchema]
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __setitem__(self, name: str, value: Any) -> None:
        """Replace the values of field ``name`` (a new field needs its ``schema`` entry first)."""
        if name not in self.schema:
            raise KeyError(f"no field {name!r} in the schema: add schema[{name!r}] first")
        self.fields[name] = value

    def __delitem__(self, name: str) -> None:
        del self.fields[name]
        self.schema.pop(name, None)

    def __copy__(self) -> Batch:
        """A new batch holding the same arrays (not a copy of their bytes)."""
        return Batch(self.global_indexes, dict(self.fields), dict(self.schema), dict(self.extra))

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def batch_size(self) -> int:
        return int(self.global_indexes.size)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """The same batch with every tensor (jagged ones too) on ``device``.

        ``global_indexes``, the schema, ``extra`` (the position) and non-tensor fields are
        kept as they are; with ``non_blocking=True`` a copy from pinned memory is
        asynchronous, as with ``torch.Tensor.to``.
        """
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The same batch with every tensor in page-locked memory, ready for a fast,
        asynchronous copy to the GPU; what ``DataLoader(pin_memory=True)`` calls.

        Like ``torch.Tensor.pin_memory``, it needs an accelerator: without one, torch raises
        (and ``DataLoader`` skips pinning altogether).
        """
        import torch

        return self._map(torch.Tensor.pin_memory)

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        fields = {name: _move(value, move) for name, value in self.fields.items()}
        return replace(self, fields=fields, extra=dict(self.extra))

    def to_buffers(self) -> tuple[dict[str, Any], list[memoryview]]:
        """A header (plain Python values) and one buffer per field (a jagged field: values,
        then offsets), plus one for the indexes. Object values are pickled into one buffer."""
        header: dict[str, Any] = {"extra": self.extra, "fields": []}
        buffers = [_bytes_view(self.global_indexes)]
        for name, value in self.fields.items():
            spec: dict[str, Any] = {"name": name, "schema": self.schema[name]}
            if isinstance(value, Jagged):
                spec["jagged"] = True
                spec["values"] = _add_buffer(value.values, buffers)
                spec["offsets"] = _add_buffer(value.offsets, buffers)
            elif isinstance(value, Strings):
                spec["strings"] = "binary" if value.binary else "utf8"
                spec["values"] = _add_buffer(value.data, buffers)
                spec["offsets"] = _add_buffer(value.offsets, buffers)
            elif isinstance(value, list):  # decode=: values of several shapes, one per sample
                spec["list"] = True
                buffers.append(memoryview(pickle.dumps(value, protocol=5)))
            else:
                spec["values"] = _add_buffer(value, buffers)
            header["fields"].append(spec)
        return header, buffers

    @classmethod
    def from_buffers(cls, header: Mapping[str, Any], buffers: list[memoryview]) -> Batch:
        """Inverse of :meth:`to_buffers`."""
        indexes = np.frombuffer(buffers[0], dtype=np.int64)
        fields: dict[str, Any] = {}
        schema: dict[str, FieldSchema] = {}
        rest = iter(buffers[1:])
        for spec in header["fields"]:
            if spec.get("list"):
                fields[spec["name"]] = pickle.loads(next(rest))
                schema[spec["name"]] = spec["schema"]
                continue
            value = _from_buffer(spec["values"], next(rest))
            if spec.get("jagged"):
                value = Jagged(value, _from_buffer(spec["offsets"], next(rest)))
            elif spec.get("strings"):
                offsets = _from_buffer(spec["offsets"], next(rest))
                value = Strings(value, offsets, spec["strings"] == "binary")
            fields[spec["name"]] = value
            schema[spec["name"]] = spec["schema"]
        return cls(indexes.copy(), fields, schema, dict(header["extra"]))

    def __reduce__(self) -> tuple[Any, ...]:
        header, buffers = self.to_buffers()
        return (_from_pickle, (header, [bytes(b) for b in buffers]))

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{name}: {tuple(getattr(v, 'shape', ()))}" for name, v in self.fields.items()
        )
        return f"Batch(size={self.batch_size}, {shapes})"


def _move(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``move`` applied to its tensors (a jagged column's too)."""
    import torch

    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, Jagged):
        return value._map(move)
    if isinstance(value, list):  # decode=: a field of tensors of several shapes
        return [move(v) if isinstance(v, torch.Tensor) else v for v in value]
    return value


def _add_buffer(value: Any, buffers: list[memoryview]) -> dict[str, Any]:
    """Append ``value``'s bytes to ``buffers``; returns what rebuilds it from them."""
    import torch

    is_tensor = isinstance(value, torch.Tensor)
    array = value.numpy(force=True) if is_tensor else np.asarray(value)
    if array.dtype == object:
        buffers.append(memoryview(pickle.dumps(list(array.reshape(-1)), protocol=5)))
        return {"objects": True, "shape": array.shape}
    buffers.append(_bytes_view(array))
    return {"torch": is_tensor, "dtype": array.dtype.str, "shape": array.shape}


def _from_buffer(spec: Mapping[str, Any], buffer: memoryview) -> Any:
    import torch

    if spec.get("objects"):
        items = pickle.loads(buffer)
        return np.fromiter(items, dtype=object, count=len(items)).reshape(spec["shape"])
    array = np.frombuffer(buffer, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
    return torch.from_numpy(array.copy()) if spec["torch"] else array.copy()


def _bytes_view(array: npt.NDArray[Any]) -> memoryview:
    """The bytes of ``array`` (copied first only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _from_pickle(header: dict[str, Any], buffers: list[bytes]) -> Batch:
    return Batch.from_buffers(header, [memoryview(b) for b in buffers])
