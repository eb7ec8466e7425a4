"""The columnar batch handed to training and evaluation code.

One int64 array of global sample indexes, one array or tensor per field, and the schema of
each field stored once per field, never per sample. Building a batch costs O(fields) Python
objects, whatever the batch size. A batch serialises as one small header plus one buffer
per field (see :meth:`Batch.to_buffers`); pickling uses that form.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True, slots=True)
class FieldSchema:
    """What every sample's value of one field looks like."""

    dtype: str
    #: Shape of one sample's value; ``-1`` marks a variable-length axis.
    shape: tuple[int, ...]
    #: Values of all samples in one buffer plus offsets, rather than one dense array.
    nested: bool = False
    #: False for values that are not numbers (strings, JSON objects).
    tensor: bool = True


@dataclass(eq=False, slots=True)
class Batch(Mapping[str, Any]):
    """``batch["tokens"]`` is a field; ``batch.global_indexes`` names the samples."""

    global_indexes: npt.NDArray[np.int64]
    fields: dict[str, Any]
    schema: dict[str, FieldSchema]
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def batch_size(self) -> int:
        return int(self.global_indexes.size)

    def to_buffers(self) -> tuple[dict[str, Any], list[memoryview]]:
        """A header (plain Python values) and one buffer per field, plus one for the indexes."""
        header: dict[str, Any] = {"extra": self.extra, "fields": []}
        buffers = [_bytes_view(self.global_indexes)]
        for name, value in self.fields.items():
            is_tensor = isinstance(value, torch.Tensor)
            array = value.numpy(force=True) if is_tensor else np.asarray(value)
            header["fields"].append(
                {
                    "name": name,
                    "schema": self.schema[name],
                    "torch": is_tensor,
                    "dtype": array.dtype.str,
                    "shape": array.shape,
                }
            )
            buffers.append(_bytes_view(array))
        return header, buffers

    @classmethod
    def from_buffers(cls, header: Mapping[str, Any], buffers: list[memoryview]) -> Batch:
        """Inverse of :meth:`to_buffers`; arrays are views of ``buffers`` where possible."""
        indexes = np.frombuffer(buffers[0], dtype=np.int64)
        fields: dict[str, Any] = {}
        schema: dict[str, FieldSchema] = {}
        for spec, buffer in zip(header["fields"], buffers[1:], strict=True):
            array = np.frombuffer(buffer, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
            fields[spec["name"]] = torch.from_numpy(array.copy()) if spec["torch"] else array
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


def _bytes_view(array: npt.NDArray[Any]) -> memoryview:
    """The bytes of ``array`` (copied first only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _from_pickle(header: dict[str, Any], buffers: list[bytes]) -> Batch:
    return Batch.from_buffers(header, [memoryview(b) for b in buffers])
