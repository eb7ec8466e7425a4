"""Where the bytes of a batch live: shard map and read planning, vectorised over the batch.

Elements of a dataset are numbered across the concatenation of its shards. A batch asks for
spans of elements (``starts[i]``, ``lengths[i]``) laid out one after another in the batch
buffer. :class:`ShardMap` turns them into reads with ``np.searchsorted`` on the cumulative
element counts, splits spans at shard ends, and merges neighbouring spans of one shard when
the gap between them costs less than one more request, within a budget of wasted bytes. No
Python loop runs over the spans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Reads that fill one batch buffer.

    Read ``r`` fetches bytes ``[read_start[r], read_end[r])`` of shard ``read_shard[r]``.
    If ``read_dest[r] >= 0`` the bytes go straight to that offset of the batch buffer;
    otherwise they land in a scratch buffer and the pieces with ``piece_read == r`` are copied
    from ``piece_src`` (offset in the read) to ``piece_dest`` (offset in the batch buffer).
    """

    read_shard: Int64Array
    read_start: Int64Array
    read_end: Int64Array
    read_dest: Int64Array
    piece_read: Int64Array
    piece_src: Int64Array
    piece_dest: Int64Array
    piece_length: Int64Array
    nbytes: int

    @property
    def num_reads(self) -> int:
        return int(self.read_shard.size)


class ShardMap:
    """Cumulative element counts of the shards of one dataset.

    ``offsets[s]`` is the byte where shard ``s``'s elements start in its object (a header
    before them, as in ``.npy`` files); plans give byte ranges of the objects.
    """

    def __init__(
        self,
        element_counts: npt.ArrayLike,
        itemsize: int,
        offsets: npt.ArrayLike | None = None,
    ) -> None:
        counts = np.asarray(element_counts, dtype=np.int64)
        self.itemsize = int(itemsize)
        self.counts = counts
        self.offsets = (
            np.zeros(counts.size, dtype=np.int64)
            if offsets is None
            else np.asarray(offsets, dtype=np.int64)
        )
        self.ends = np.cumsum(counts)
        self.starts = self.ends - counts
        self.total = int(self.ends[-1]) if counts.size else 0

    def shard_of(self, elements: npt.ArrayLike) -> Int64Array:
        """Index of the shard holding each global element index."""
        return np.searchsorted(self.ends, elements, side="right").astype(np.int64)

    def plan(
        self,
        starts: npt.ArrayLike,
        lengths: npt.ArrayLike,
        gap_bytes: int = 0,
        extra_waste_bytes: int = 0,
    ) -> ReadPlan:
        """Reads for spans ``[starts[i], starts[i] + lengths[i])`` packed in order into a buffer.

        Gaps of up to ``gap_bytes`` (one request's cost) are read across, smallest first,
        while they add up to at most the spans' own bytes plus ``extra_waste_bytes``.
        """
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), starts.shape)
        dest = np.cumsum(lengths) - lengths  # element offset of each span in the buffer
        ends = starts + lengths
        first = self.shard_of(starts)
        last = self.shard_of(np.maximum(ends - 1, starts))
        if (first == last).all() and (lengths > 0).all():
            # The common case (windows much smaller than shards): each span is one piece.
            shard, piece_start, piece_end, piece_dest = first, starts, ends, dest
        else:
            shard, piece_start, piece_end, piece_dest = self._split(starts, ends, dest, first, last)

        # Merge pieces of one shard whose gap is small. Global element positions increase with
        # the shard index, so a running maximum of ends never reaches into another shard.
        order = np.argsort(piece_start, kind="stable")
        shard, piece_start, piece_end, piece_dest = (
            shard[order],
            piece_start[order],
            piece_end[order],
            piece_dest[order],
        )
        # The cost model: a gap is worth fetching when it costs less than one more request
        # (``gap_bytes``: the store's request cost in bytes). Gaps are bridged smallest first,
        # and only while they add up to no more than the plan's own bytes: a plan of any order
        # and density (a rank's random share of a shuffled group, say) fetches at most twice
        # what it delivers.
        reach = np.maximum.accumulate(piece_end)
        gaps = piece_start[1:] - reach[:-1]
        same_shard = shard[1:] == shard[:-1]
        gap = gap_bytes // self.itemsize  # negative: not even touching pieces merge
        merge = same_shard & (gaps <= min(0, gap))  # overlapping or touching: free
        candidate = np.flatnonzero(same_shard & (gaps > 0) & (gaps <= gap))
        if candidate.size:
            budget = int((piece_end - piece_start).sum()) + extra_waste_bytes // self.itemsize
            by_cost = candidate[np.argsort(gaps[candidate], kind="stable")]
            affordable = np.cumsum(gaps[by_cost]) <= budget
            merge[by_cost[affordable]] = True
        new_read = np.ones(shard.size, dtype=bool)
        new_read[1:] = ~merge
        read_of_piece = np.cumsum(new_read) - 1
        heads = np.flatnonzero(new_read)
        read_shard = shard[heads]
        read_start = piece_start[heads]
        read_end = np.maximum.reduceat(piece_end, heads) if heads.size else piece_end[:0]

        # A read goes straight into the buffer when its pieces are back to back both in the
        # shard and in the buffer (always true for a single piece).
        offset = piece_dest - piece_start
        same_offset = np.ones(shard.size, dtype=bool)
        same_offset[1:] = (offset[1:] == offset[:-1]) & (piece_start[1:] == piece_end[:-1])
        direct = (
            np.logical_and.reduceat(same_offset | new_read, heads) if heads.size else new_read[:0]
        )
        read_dest = np.where(direct, piece_dest[heads], -1)

        indirect = ~direct[read_of_piece]
        size = self.itemsize
        shard_base = self.starts[read_shard]
        header = self.offsets[read_shard]
        return ReadPlan(
            read_shard=read_shard,
            read_start=(read_start - shard_base) * size + header,
            read_end=(read_end - shard_base) * size + header,
            read_dest=np.where(read_dest >= 0, read_dest * size, -1),
            piece_read=read_of_piece[indirect],
            piece_src=(piece_start - read_start[read_of_piece])[indirect] * size,
            piece_dest=piece_dest[indirect] * size,
            piece_length=(piece_end - piece_start)[indirect] * size,
            nbytes=int(lengths.sum()) * size,
        )

    def _split(
        self,
        starts: Int64Array,
        ends: Int64Array,
        dest: Int64Array,
        first: Int64Array,
        last: Int64Array,
    ) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
        """(shard, start, end, destination) of one piece per (span, shard it touches): spans
        crossing shard ends split in two or more, empty spans dropped."""
        pieces_per_span = last - first + 1
        span = np.repeat(np.arange(starts.size), pieces_per_span)
        step = np.arange(span.size) - np.repeat(
            np.cumsum(pieces_per_span) - pieces_per_span, pieces_per_span
        )
        shard = first[span] + step
        piece_start = np.maximum(starts[span], self.starts[shard])
        piece_end = np.minimum(ends[span], self.ends[shard])
        keep = piece_end > piece_start  # zero-length spans read nothing
        span, shard, piece_start, piece_end = (
            span[keep],
            shard[keep],
            piece_start[keep],
            piece_end[keep],
        )
        return shard, piece_start, piece_end, dest[span] + (piece_start - starts[span])


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Fixed windows of a dataset's element stream, not yet planned as byte ranges.

    Window ``i`` is elements ``[starts[i], starts[i] + length)`` of ``layout``'s shards
    (it may cross shard ends), laid out one after another in the buffer. A store that copies
    windows itself (``supports_windows``: local mapped files) takes
    them as they are, in one call; for any other, :meth:`plan` makes the byte ranges.
    """

    layout: ShardMap
    starts: Int64Array
    length: int
    #: The store's request cost in bytes, for :meth:`plan`'s merging.
    gap_bytes: int
    #: How the source plans these windows as byte ranges, when not by
    #: :meth:`ShardMap.plan` (a format whose layout merges reads its own way).
    planner: Callable[[], ReadPlan] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.starts.size) * self.length * self.layout.itemsize

    def plan(self) -> ReadPlan:
        """The windows as byte-range reads (see :meth:`ShardMap.plan`)."""
        if self.planner is not None:
            return self.planner()
        return self.layout.plan(self.starts, self.length, self.gap_bytes)
