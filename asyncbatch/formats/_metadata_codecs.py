"""Metadata codecs: how metadata values become bytes and back, by name.

A codec is named in a manifest (``{"name": "json", "options": {}}``) and built by
:func:`make_codec`; three are built in (``bytes``, ``json``, ``numpy``) and
:func:`register_codec` adds more. Used by the metadata stream format and by documents with
per-document metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._errors import ConfigError, FormatError

# torch is imported inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.

Int64Array = npt.NDArray[np.int64]


class Codec(Protocol):
    """Turns metadata values into bytes and back.

    ``decode(data, offsets)`` gets ``n`` encoded values back to back (value ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``) and returns ``n`` values as anything sliceable and
    indexable along its first axis (a tensor, a numpy array, an object array). A codec may
    instead define ``decode_item(data: bytes)`` for one value at a time. ``schema`` (optional)
    describes one value; without it values are Python objects.
    """

    def encode(self, value: Any) -> bytes: ...


class BytesCodec:
    """Values are ``bytes`` kept as they are."""

    schema = FieldSchema("object", (-1,), nested=True, tensor=False)

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ConfigError(f"the bytes codec takes bytes, got {type(value).__name__}")
        return bytes(value)

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> npt.NDArray[Any]:
        raw = data.tobytes()
        bounds = offsets.tolist()
        return _objects([raw[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


class JsonCodec:
    """JSON values, one per line: a data file is JSON Lines, decoded in one ``json.loads``."""

    schema = FieldSchema("object", (-1,), nested=True, tensor=False)

    def encode(self, value: Any) -> bytes:
        # json.dumps escapes newlines inside strings: a newline only ever ends a value.
        return json.dumps(value, separators=(",", ":")).encode() + b"\n"

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> npt.NDArray[Any]:
        if offsets.size <= 1:
            return _objects([])
        text = data[int(offsets[0]) : int(offsets[-1]) - 1].tobytes().replace(b"\n", b",")
        return _objects(json.loads(b"[" + text + b"]"))


class NumpyCodec:
    """Numpy values of one dtype: of one ``shape`` (a tensor of all values) or, with
    ``shape=None``, 1-D of any length (an object array of arrays)."""

    def __init__(self, dtype: str = "<i8", shape: Sequence[int] | None = ()) -> None:
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigError(f"numpy codec: dtype={dtype!r} is not a numpy dtype") from exc
        if self.dtype.hasobject or self.dtype.names:
            raise ConfigError(f"numpy codec: dtype {self.dtype} is not a plain numeric dtype")
        self.shape = None if shape is None else tuple(int(n) for n in shape)
        width = (-1,) if self.shape is None else self.shape
        self.schema = FieldSchema(
            str(self.dtype), (-1, *width), nested=True, tensor=self.shape is not None
        )

    def encode(self, value: Any) -> bytes:
        array = np.asarray(value)
        if self.shape is not None and array.shape != self.shape:
            raise ConfigError(f"numpy codec: value of shape {array.shape}, expected {self.shape}")
        if self.shape is None and array.ndim != 1:
            raise ConfigError(f"numpy codec: value of shape {array.shape}, expected 1-D")
        if array.dtype != self.dtype and not np.can_cast(array.dtype, self.dtype, "same_kind"):
            raise ConfigError(f"numpy codec: {array.dtype} values do not convert to {self.dtype}")
        return np.ascontiguousarray(array, dtype=self.dtype).tobytes()

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> Any:
        import torch

        size = self.dtype.itemsize
        if self.shape is None:
            if np.any(offsets % size):
                raise FormatError(f"numpy codec: a value is not a whole number of {self.dtype}")
            flat = data[int(offsets[0]) : int(offsets[-1])].copy().view(self.dtype)
            return _objects(np.split(flat, (offsets[1:-1] - offsets[0]) // size))
        each = size * int(np.prod(self.shape, dtype=np.int64))
        if np.any(np.diff(offsets) != each):
            raise FormatError(
                f"numpy codec: a value is not {each} bytes ({self.shape} {self.dtype})"
            )
        flat = data[int(offsets[0]) : int(offsets[-1])].copy().view(self.dtype)
        return torch.from_numpy(flat.reshape(offsets.size - 1, *self.shape))


def _objects(items: Sequence[Any]) -> npt.NDArray[Any]:
    """A 1-D object array of ``items`` (never broadcast into more dimensions)."""
    return np.fromiter(items, dtype=object, count=len(items))


_CODECS: dict[str, Callable[..., Any]] = {
    "bytes": BytesCodec,
    "json": JsonCodec,
    "numpy": NumpyCodec,
}


def register_codec(name: str, factory: Callable[..., Any], *, clobber: bool = False) -> None:
    """Make ``factory(**codec_options)`` (a class, usually) the metadata codec named ``name``.

    Metadata streams name their codec in the manifest; a reader registers the same name before
    opening one. Replacing a registered name needs ``clobber=True``.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a codec name must be a non-empty string, got {name!r}")
    if name in _CODECS and not clobber:
        raise ConfigError(f"codec {name!r} is already registered (pass clobber=True to replace)")
    _CODECS[name] = factory


def make_codec(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The codec registered as ``name``, built with ``options``."""
    factory = _CODECS.get(name)
    if factory is None:
        raise ConfigError(
            f"no metadata codec {name!r} (known: {', '.join(sorted(_CODECS))});"
            " register it with asyncbatch.register_codec"
        )
    try:
        codec = factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: bad codec_options {dict(options or {})!r}") from exc
    if not callable(getattr(codec, "encode", None)) or not (
        callable(getattr(codec, "decode", None)) or callable(getattr(codec, "decode_item", None))
    ):
        raise ConfigError(f"codec {name!r} needs encode() and decode() or decode_item()")
    return codec


def decode_values(codec: Any, data: npt.NDArray[np.uint8], offsets: Int64Array) -> Any:
    """``offsets.size - 1`` values decoded by ``codec``; numbers come back as a tensor."""
    import torch

    decode = getattr(codec, "decode", None)
    if decode is not None:
        values = decode(data, offsets)
    else:
        raw = data.tobytes()
        bounds = offsets.tolist()
        values = _objects(
            [codec.decode_item(raw[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        )
    if isinstance(values, np.ndarray) and values.dtype != object:
        values = torch.from_numpy(np.ascontiguousarray(values))
    if len(values) != offsets.size - 1:
        raise FormatError(f"codec {codec!r} decoded {len(values)} values of {offsets.size - 1}")
    return values
