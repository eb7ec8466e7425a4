"""The C copy helpers (``_preadv``) that every module copying bytes between buffers shares:
the conversions they make (``u2>i8``, ...), and :func:`copy_pieces`, which copies (and
widens) many pieces of one buffer into another in one GIL-free call. The local store reads
files with the same extension; the engine copies a plan's merged pieces into place with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

try:
    from . import _preadv
except ImportError:  # pragma: no cover - built without a C compiler
    _preadv = None  # type: ignore[assignment]

Int64Array = npt.NDArray[np.int64]


def c_conversion(source: np.dtype[Any], target: np.dtype[Any]) -> str | None:
    """The C helper's name for converting ``source`` to ``target`` ("u2>i8"), or None when it
    has no such conversion (or is absent): native-order integers to wider integers or floats."""
    if _preadv is None or not (source.isnative and target.isnative):
        return None
    name = f"{source.kind}{source.itemsize}>{target.kind}{target.itemsize}"
    return name if name in C_CONVERSIONS else None


#: The conversions ``_preadv.copy_many`` makes (every one a safe cast).
C_CONVERSIONS = frozenset(
    f"{a}>{b}"
    for a, bs in {
        "u1": "i2 i4 i8 u2 u4 u8 f4 f8",
        "u2": "i4 i8 u4 u8 f4 f8",
        "u4": "i8 u8 f8",
        "i1": "i2 i4 i8 f4 f8",
        "i2": "i4 i8 f4 f8",
        "i4": "i8 f8",
    }.items()
    for b in bs.split()
)


def copy_pieces(
    source: npt.NDArray[np.uint8],
    source_offsets: Int64Array,
    lengths: Int64Array,
    dest: npt.NDArray[np.uint8],
    dest_offsets: Int64Array,
    convert: str | None = None,
) -> None:
    """Copy ``source[source_offsets[i]:][:lengths[i]]`` to ``dest[dest_offsets[i]:]``, in one
    GIL-free call of the C helper when it is there (``convert``: one of its conversions,
    ``lengths`` then counting source bytes)."""
    if _preadv is not None and source.size:
        count = source_offsets.size
        bases = np.full(count, source.ctypes.data, dtype=np.int64)
        limits = np.full(count, source.size, dtype=np.int64)
        extra = () if convert is None else (convert,)
        done, _, _ = _preadv.copy_many(
            bases, limits, source_offsets, lengths, dest, dest_offsets, *extra
        )
        assert done == count, "pieces lie inside their source"
        return
    assert convert is None, "conversions need the C helper"
    into, out = memoryview(dest), memoryview(source)  # type: ignore[arg-type]
    rows = zip(source_offsets.tolist(), dest_offsets.tolist(), lengths.tolist(), strict=True)
    for src, at, length in rows:
        into[at : at + length] = out[src : src + length]
