"""Single rows of Arrow record batches, read by their byte ranges: what an exact shuffle
reads instead of whole record batches.

An uncompressed record batch keeps each buffer as it is in memory, so a row's bytes are
found by arithmetic: a number's ``width`` bytes at ``row * width`` of its values buffer (a
boolean's byte, a fixed-size list's ``size * width``); a string's or a list's two offsets at
``row * 4`` (``* 8`` when large) of its offsets buffer, then, in a second read, the values
between them. Every selected column of every row of a group is one range of the first plan,
every variable-length one a range of the second; the engine coalesces neighbours as for any
read. Where the offsets of all record batches fit in :data:`OFFSETS_CACHE` bytes, a record
batch's whole offsets buffer is read the first time one of its rows is, and kept: its later
rows need no offsets read. Offsets read are checked against their buffer's bounds (a
FormatError names the file and byte), and pyarrow validates the arrays built from the
bytes.

Record batches with a compressed body, or with nulls in a selected column (a validity bit
per row would be one more read each), are read whole instead (:class:`RowPicker.readable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .._batch import Jagged, Strings
from .._errors import FormatError
from ..stores._copying import copy_pieces
from . import _arrow_ipc as ipc
from ._arrow_fields import Field

# torch is imported inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.

Int64Array = npt.NDArray[np.int64]

#: Bytes of variable-length columns' offsets kept (int64, one per row and column): when a
#: dataset's fit, each record batch's offsets buffer is read whole once, and later rows of it
#: need one read each, not two.
OFFSETS_CACHE = 64 << 20


@dataclass(frozen=True)
class Column:
    """A field read (:class:`~asyncbatch.formats._arrow_fields.Field`): its leaf's Arrow
    type and first and end node and buffer; the node and validity buffer of each struct
    above it, outermost first."""

    name: str
    kind: Any
    nodes: tuple[int, int]
    buffers: tuple[int, int]
    parents: tuple[tuple[int, int], ...] = ()
    field: Field | None = None

    @property
    def node_ids(self) -> list[int]:
        """Its nodes and those of the structs above it."""
        return [n for n, _ in self.parents] + list(range(*self.nodes))

    @property
    def buffer_ids(self) -> list[int]:
        """Its buffers and the validity buffers of the structs above it."""
        return [b for _, b in self.parents] + list(range(*self.buffers))


class RecordBatches(Protocol):
    """What :class:`RowPicker` reads of the record batches of a dataset
    (:class:`~asyncbatch.formats._arrow.ArrowRows`)."""

    selected: Sequence[Column]
    #: Per record batch: rows, codec, ``[node, (length, nulls)]``, ``[buffer, (offset,
    #: length)]`` and where its body starts (file-concatenated).
    rows: Int64Array
    codec: Int64Array
    nodes: Int64Array
    buffers: Int64Array
    body: Int64Array

    def where(self, batch: int) -> str: ...


@dataclass(frozen=True)
class Layout:
    """How a column's row is found: ``fixed`` bytes (``width`` each; one byte of bits for
    booleans) in buffer ``values``, or ``var``: two offsets of ``width`` bytes in buffer
    ``offsets``, then ``item`` bytes per value in buffer ``values``."""

    kind: str  # "fixed", "bits" or "var"
    width: int
    values: int
    offsets: int = -1
    item: int = 1


def column_layout(kind: Any, first_buffer: int, pa: Any) -> Layout | None:
    """The :class:`Layout` of a column of Arrow type ``kind`` (None: not read by row)."""
    t = pa.types
    if t.is_boolean(kind):
        return Layout("bits", 1, first_buffer + 1)
    if t.is_integer(kind) or t.is_floating(kind):
        return Layout("fixed", kind.bit_width // 8, first_buffer + 1)
    item: Any = getattr(kind, "value_type", None)
    numbers = item is not None and (t.is_integer(item) or t.is_floating(item))
    if t.is_fixed_size_list(kind) and numbers:
        return Layout("fixed", kind.list_size * item.bit_width // 8, first_buffer + 2)
    if t.is_string(kind) or t.is_binary(kind):
        return Layout("var", 4, first_buffer + 2, first_buffer + 1)
    if t.is_large_string(kind) or t.is_large_binary(kind):
        return Layout("var", 8, first_buffer + 2, first_buffer + 1)
    if (t.is_list(kind) or t.is_large_list(kind)) and numbers:
        width = 4 if t.is_list(kind) else 8
        return Layout("var", width, first_buffer + 3, first_buffer + 1, item.bit_width // 8)
    return None


@dataclass
class Picks:
    """The rows of a group read by row: their record batches and rows, the first plan's
    ranges (every column's rows one after another), and the offsets the first read
    brought (per variable-length column, filled by :meth:`RowPicker.second`)."""

    batches: Int64Array
    rows: Int64Array
    starts: Int64Array
    lengths: Int64Array
    #: Where each column's part of the first read starts.
    parts: list[int] = field(default_factory=list)
    #: Per cached variable-length column: the record batches whose whole offsets buffer the
    #: first read brings.
    loading: dict[int, Int64Array] = field(default_factory=dict)
    offsets: dict[int, tuple[Int64Array, Int64Array]] = field(default_factory=dict)


class RowPicker:
    """Plans and decodes the rows of record batches read by row."""

    def __init__(self, source: RecordBatches) -> None:
        from ._parquet import pyarrow_modules

        pa, _ = pyarrow_modules()
        self.source = source
        self.layouts = [column_layout(c.kind, c.buffers[0], pa) for c in source.selected]
        nulls = np.zeros(source.rows.size, dtype=bool)
        for column in source.selected:
            own = source.nodes[:, column.node_ids, 1]
            nulls |= (own > 0).any(axis=1)
        #: Record batches whose rows are read by row: uncompressed, no nulls, known types.
        self.readable = (
            (source.codec == ipc.NO_CODEC)
            & ~nulls
            & (source.rows > 0)
            & all(layout is not None for layout in self.layouts)
        )
        # Offsets of variable-length columns, kept once read whole where all of them fit in
        # OFFSETS_CACHE bytes: later rows then need no first read of their own.
        counts = source.rows + 1
        self.flat_base = np.cumsum(counts) - counts
        var = [c for c, lay in enumerate(self.layouts) if lay is not None and lay.kind == "var"]
        cached = bool(var) and int(counts.sum()) * 8 * len(var) <= OFFSETS_CACHE
        self.flat = {c: np.zeros(int(counts.sum()), dtype=np.int64) for c in var if cached}
        self.loaded = {c: np.zeros(source.rows.size, dtype=bool) for c in self.flat}
        #: Whether every record batch's offsets of the column are kept.
        self.complete = {c: False for c in self.flat}
        self.none = np.zeros(0, dtype=np.int64)

    def _buffer(self, batches: Int64Array, k: int) -> tuple[Int64Array, Int64Array]:
        """Where buffer ``k`` of each of ``batches`` starts (file-concatenated) and its length."""
        s = self.source
        return s.body[batches] + s.buffers[batches, k, 0], s.buffers[batches, k, 1]

    def _check(self, batches: Int64Array, ends: Int64Array, limit: Int64Array, what: str) -> None:
        bad = np.flatnonzero(ends > limit)
        if bad.size:
            b = int(batches[bad[0]])
            raise FormatError(
                f"{self.source.where(b)}: {what} ends at byte {int(ends[bad[0]])} of a buffer"
                f" of {int(limit[bad[0]])} (corrupt)"
            )

    def first(self, batches: Int64Array, rows: Int64Array) -> Picks:
        """The first plan's ranges of rows ``rows`` of record batches ``batches``."""
        starts: list[Int64Array] = []
        lengths: list[Int64Array] = []
        parts: list[int] = []
        loading: dict[int, Int64Array] = {}
        at_part = 0
        for c, layout in enumerate(self.layouts):
            assert layout is not None
            parts.append(at_part)
            if c in self.flat:  # whole offsets buffers of the batches not read yet
                new = (
                    self.none if self.complete[c] else np.unique(batches[~self.loaded[c][batches]])
                )
                at, size = self._buffer(new, layout.offsets)
                whole = (self.source.rows[new] + 1) * layout.width
                self._check(new, whole, size, "the offsets")
                loading[c] = new
                starts.append(at)
                lengths.append(whole)
                at_part += int(whole.sum())
                continue
            if layout.kind == "var":
                at, size = self._buffer(batches, layout.offsets)
                offset, length = rows * layout.width, 2 * layout.width
            elif layout.kind == "bits":
                at, size = self._buffer(batches, layout.values)
                offset, length = rows // 8, 1
            else:
                at, size = self._buffer(batches, layout.values)
                offset, length = rows * layout.width, layout.width
            self._check(batches, offset + length, size, "a row")
            starts.append(at + offset)
            lengths.append(np.full(rows.size, length, dtype=np.int64))
            at_part += rows.size * length
        return Picks(batches, rows, np.concatenate(starts), np.concatenate(lengths), parts, loading)

    def _offsets(
        self, c: int, layout: Layout, picks: Picks, picked: npt.NDArray[np.uint8]
    ) -> tuple[Int64Array, Int64Array]:
        """Each picked row's two offsets in column ``c``: from the first read, or from the
        kept offsets (those the first read brought whole put there first)."""
        dtype = "<i4" if layout.width == 4 else "<i8"
        at = picks.parts[c]
        if c not in self.flat:
            count = 2 * picks.rows.size
            pairs = np.frombuffer(picked, dtype=dtype, count=count, offset=at).astype(np.int64)
            return pairs[0::2], pairs[1::2]
        new = picks.loading[c]
        if new.size:
            counts = self.source.rows[new] + 1
            values = np.frombuffer(picked, dtype=dtype, count=int(counts.sum()), offset=at)
            first = np.repeat(self.flat_base[new] - (np.cumsum(counts) - counts), counts)
            self.flat[c][first + np.arange(values.size)] = values
            self.loaded[c][new] = True
            self.complete[c] = bool(self.loaded[c].all())
        row = self.flat_base[picks.batches] + picks.rows
        return self.flat[c][row], self.flat[c][row + 1]

    def second(self, picks: Picks, picked: npt.NDArray[np.uint8]) -> tuple[Int64Array, Int64Array]:
        """The second plan: the values of the variable-length columns' rows, whose offsets
        ``picked`` (the first read's bytes) holds."""
        starts, lengths = [], []
        for c, layout in enumerate(self.layouts):
            assert layout is not None
            if layout.kind != "var":
                continue
            begin, end = self._offsets(c, layout, picks, picked)
            data, size = self._buffer(picks.batches, layout.values)
            # An end past the values' buffer, compared in values: in bytes it could overflow.
            bad = np.flatnonzero((begin < 0) | (end < begin) | (end > size // layout.item))
            if bad.size:
                b = int(picks.batches[bad[0]])
                raise FormatError(
                    f"{self.source.where(b)}: row {int(picks.rows[bad[0]])} has offsets"
                    f" {int(begin[bad[0]])}, {int(end[bad[0]])} (corrupt)"
                )
            picks.offsets[c] = begin, end
            starts.append(data + begin * layout.item)
            lengths.append((end - begin) * layout.item)
        if not starts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(starts), np.concatenate(lengths)

    def decode(
        self, picks: Picks, picked: npt.NDArray[np.uint8], values: npt.NDArray[np.uint8]
    ) -> dict[str, Any]:
        """The rows' columns as Arrow arrays (of the columns' own types), from both reads."""
        return {name: array for name, (array, _) in self._decoded(picks, picked, values).items()}

    def fields(
        self, picks: Picks, picked: npt.NDArray[np.uint8], values: npt.NDArray[np.uint8]
    ) -> dict[str, Any]:
        """The rows' batch fields: numbers and lists of numbers as tensors over the bytes
        read (pyarrow built and validated the arrays over the same bytes), the rest as
        :func:`~asyncbatch.formats._parquet._to_field` converts the arrays."""
        from ._parquet import _to_field, pyarrow_modules

        pa, _ = pyarrow_modules()
        return {
            name: tensors if tensors is not None else _to_field(array, False, pa)
            for name, (array, tensors) in self._decoded(picks, picked, values).items()
        }

    def _decoded(
        self, picks: Picks, picked: npt.NDArray[np.uint8], values: npt.NDArray[np.uint8]
    ) -> dict[str, tuple[Any, Any]]:
        """Each column's Arrow array, validated, and its field where the bytes are the
        values (None elsewhere)."""
        import torch

        from ._parquet import pyarrow_modules

        pa, _ = pyarrow_modules()
        n = picks.rows.size
        out: dict[str, tuple[Any, Any]] = {}
        value_at = 0
        for c, (layout, at) in enumerate(zip(self.layouts, picks.parts, strict=True)):
            assert layout is not None
            column = self.source.selected[c]
            kind = column.kind
            tensors: Any = None
            if layout.kind == "bits":
                raw = np.frombuffer(picked, dtype=np.uint8, count=n, offset=at)
                bits = (raw >> (picks.rows % 8).astype(np.uint8)) & 1
                packed = np.packbits(bits.astype(np.uint8), bitorder="little")
                array = pa.Array.from_buffers(kind, n, [None, pa.py_buffer(packed)])
            elif layout.kind == "fixed":
                raw = _aligned(picked[at : at + n * layout.width], layout.width)
                data = pa.py_buffer(raw)
                if pa.types.is_fixed_size_list(kind):
                    child = pa.Array.from_buffers(kind.value_type, n * kind.list_size, [None, data])
                    array = pa.Array.from_buffers(kind, n, [None], children=[child])
                    item = kind.value_type
                    shape: tuple[int, ...] = (n, kind.list_size)
                else:
                    array = pa.Array.from_buffers(kind, n, [None, data])
                    item, shape = kind, (n,)
                tensors = _tensor(raw, item, pa, shape)
            else:
                begin, end = picks.offsets[c]
                counts = end - begin
                total = int(counts.sum())
                if layout.width == 4 and total >= 1 << 31:
                    raise FormatError(
                        f"{self.source.where(int(picks.batches[0]))}: column {column.name!r}:"
                        f" {total} values in one group overflow its 32-bit offsets"
                    )
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(counts, out=offsets[1:])
                stored = offsets.astype(np.int32) if layout.width == 4 else offsets
                nbytes = total * layout.item
                raw = _aligned(values[value_at : value_at + nbytes], layout.item)
                value_at += nbytes
                data = pa.py_buffer(raw)
                if pa.types.is_list(kind) or pa.types.is_large_list(kind):
                    child = pa.Array.from_buffers(kind.value_type, total, [None, data])
                    array = pa.Array.from_buffers(
                        kind, n, [None, pa.py_buffer(stored)], children=[child]
                    )
                    tensors = Jagged(
                        _tensor(raw, kind.value_type, pa, (total,)), torch.from_numpy(offsets)
                    )
                else:
                    array = pa.Array.from_buffers(kind, n, [None, pa.py_buffer(stored), data])
            try:
                array.validate(full=True)
            except pa.ArrowException as exc:
                where = self.source.where(int(picks.batches[0]))
                raise FormatError(
                    f"{where}: column {column.name!r} does not decode: {exc}"
                ) from exc
            out[column.name] = array, tensors
        return out


def gathered(
    buffer: npt.NDArray[np.uint8],
    layout: Layout,
    kind: Any,
    placed: Int64Array,
    rows: Int64Array,
    empty: Callable[[int], npt.NDArray[np.uint8]],
) -> Any:
    """The batch field of rows ``rows`` of a column laid out as ``layout`` (not ``bits``),
    copied out of ``buffer``, where ``placed[i, k]`` is the byte at which row ``i``'s record
    batch keeps its buffer ``k``, into buffers from ``empty(nbytes)``; the record batches'
    arrays validated already."""
    import torch

    from ._parquet import pyarrow_modules

    pa, _ = pyarrow_modules()
    n = rows.size
    if layout.kind == "fixed":
        source = placed[:, layout.values] + rows * layout.width
        lengths = np.full(n, layout.width, dtype=np.int64)
        dest = empty(n * layout.width)
        copy_pieces(buffer, source, lengths, dest, np.arange(n, dtype=np.int64) * layout.width)
        if pa.types.is_fixed_size_list(kind):
            return _tensor(dest, kind.value_type, pa, (n, kind.list_size))
        return _tensor(dest, kind, pa, (n,))
    # Each row's two offsets, from wherever they lie (bytes gathered, then read as numbers).
    at = placed[:, layout.offsets] + rows * layout.width
    pairs = buffer[at[:, None] + np.arange(2 * layout.width)]
    bounds = pairs.view("<i4" if layout.width == 4 else "<i8").astype(np.int64)
    counts = bounds[:, 1] - bounds[:, 0]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    dest = empty(int(offsets[-1]) * layout.item)
    source = placed[:, layout.values] + bounds[:, 0] * layout.item
    copy_pieces(buffer, source, counts * layout.item, dest, offsets[:-1] * layout.item)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return Jagged(
            _tensor(dest, kind.value_type, pa, (int(offsets[-1]),)), torch.from_numpy(offsets)
        )
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    return Strings(torch.from_numpy(dest), torch.from_numpy(offsets), binary)


def _aligned(raw: npt.NDArray[np.uint8], width: int) -> npt.NDArray[np.uint8]:
    """``raw`` (bytes of a read buffer), or a copy where it does not start on a multiple of
    ``width`` (the values of a column after another's of odd length)."""
    aligned = raw.ctypes.data % min(8, width & -width or 1) == 0
    return raw if aligned else np.array(raw)


def _tensor(raw: npt.NDArray[np.uint8], kind: Any, pa: Any, shape: tuple[int, ...]) -> Any:
    """The numbers ``raw`` holds, of Arrow type ``kind``, as a tensor sharing its bytes."""
    import torch

    dtype = np.dtype(kind.to_pandas_dtype())
    return torch.from_numpy(raw.view(dtype).reshape(shape))
