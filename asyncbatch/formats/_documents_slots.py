"""The boundary-slot table of a paged per-shard document index: where documents start inside
each block of a shard's tokens, addressed directly by token position, so that a packed window
reads a few dozen bytes of index instead of a page of offsets.

Layout (after a paged index file's top level, described by the manifest entry's ``slots``):
a 36-byte header (``ABDXSL01``, then little-endian ``B``, ``k`` as uint32, the widths of the
two counts as uint8, two bytes of padding, the number of blocks and of overflow entries as
uint64), then one fixed-size *slot* per block of ``B`` tokens of the shard (``B`` a power of
two; block ``b`` is the shard's elements ``[bB, min((b+1)B, E))``), then the *overflow area*
(uint16). Slot ``b`` (``S`` bytes) holds:

* ``before``: the documents starting before the block (uint32, uint64 when the shard holds
  2^32 documents or more), which numbers the documents starting in it;
* ``count`` (uint8, uint16 when ``k`` ≥ 255): the documents starting inside the block;
* the *area*, ``max(2k, 16)`` bytes: the first ``count`` of them hold the documents' starts,
  uint16 positions from the block's start, ascending (empty documents repeat a position).
  A block with more than ``k`` starts has ``count`` = the largest value of its width, and
  its area begins with an *overflow pointer*: the first overflow entry (uint64), the count
  (uint32) and the low 32 bits of the xxh3-64 of those entries' bytes seeded with ``b``;
* the low 32 bits of the xxh3-64, seeded with ``b``, of the slot's other bytes (so a slot
  read from another place fails it).

Documents that start at the shard's last element (empty documents at its end) start in no
block. A window's boundaries need the slots of the blocks it overlaps: one range of
contiguous slots, and for an overflowing block one more range.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._errors import ConfigError

Int64Array = npt.NDArray[np.int64]

SLOT_MAGIC = b"ABDXSL01"
SLOT_HEADER = struct.Struct("<IIBBxxQQ")
SLOT_HEADER_BYTES = len(SLOT_MAGIC) + SLOT_HEADER.size
CHECKSUM_BYTES = 4
#: An overflowing block's pointer, at the start of its slot's area.
OVERFLOW_POINTER = np.dtype([("first", "<u8"), ("count", "<u4"), ("checksum", "<u4")])
#: The block sizes the writers try, and the window they cost them for (a block size is
#: chosen at write time, when the readers' ``seq_len`` is not known).
BLOCK_CHOICES = tuple(2**k for k in range(8, 16))
REFERENCE_WINDOW = 2048
#: Starts a slot holds: this quantile of the starts per block (the rest overflow).
SLOT_QUANTILE = 0.999
#: Bytes a cached slot is counted for beyond its starts: the Python objects that hold it
#: (the slot, its array, its key and its place in the cache), so that ``index_cache_bytes``
#: bounds the memory, not only the arrays'.
SLOT_OVERHEAD = 320


def slot_checksum(data: Any, block: int) -> int:
    """The low 32 bits of the xxh3-64 of ``data`` seeded with the block's number."""
    return xxhash.xxh3_64_intdigest(data, seed=block) & 0xFFFFFFFF


@dataclass(frozen=True)
class SlotTable:
    """A shard's slot table, as its manifest entry (``slots``) describes it."""

    block: int
    starts: int
    before_bytes: int
    count_bytes: int
    blocks: int
    overflow: int

    @property
    def area_bytes(self) -> int:
        return max(2 * self.starts, OVERFLOW_POINTER.itemsize)

    @property
    def slot_bytes(self) -> int:
        return self.before_bytes + self.count_bytes + self.area_bytes + CHECKSUM_BYTES

    @property
    def marker(self) -> int:
        """``count`` of an overflowing block."""
        return int(2 ** (8 * self.count_bytes) - 1)

    @property
    def file_bytes(self) -> int:
        """The table's bytes in the index file: header, slots, overflow area."""
        return SLOT_HEADER_BYTES + self.blocks * self.slot_bytes + 2 * self.overflow

    def entry(self) -> dict[str, int]:
        return {
            "block_tokens": self.block,
            "starts": self.starts,
            "before_bytes": self.before_bytes,
            "count_bytes": self.count_bytes,
            "blocks": self.blocks,
            "overflow": self.overflow,
        }

    @classmethod
    def of_entry(cls, entry: Mapping[str, Any], elements: int) -> SlotTable:
        """The table a manifest entry describes for a shard of ``elements``; a ValueError
        saying what is wrong unless it is one the writers write."""
        values = [
            entry[key]
            for key in ("block_tokens", "starts", "before_bytes", "count_bytes", "blocks")
        ]
        values.append(entry["overflow"])
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"slots {dict(entry)} must be integers")
        table = cls(*values)
        table.check(elements)
        return table

    def check(self, elements: int) -> None:
        block, starts = self.block, self.starts
        if block < 1 or block > 2**16 or block & (block - 1):
            raise ValueError(f"slots: block_tokens {block} is not a power of two up to 65536")
        if self.before_bytes not in (4, 8) or self.count_bytes not in (1, 2):
            raise ValueError(
                f"slots: before_bytes {self.before_bytes} (4 or 8), count_bytes"
                f" {self.count_bytes} (1 or 2)"
            )
        if not 1 <= starts < self.marker:
            raise ValueError(f"slots: {starts} starts a slot, for counts of {self.count_bytes} B")
        if self.blocks != -(-elements // block) or self.overflow < 0:
            raise ValueError(
                f"slots: {self.blocks} blocks of {block} and {self.overflow} overflow entries"
                f" for a shard of {elements} elements"
            )


def _costs(counts: Int64Array, block: int) -> tuple[float, int]:
    """Index bytes a window of the reference width reads with blocks of ``block`` holding
    ``counts`` starts each (expected: the slots it overlaps, plus its share of the
    overflow), and the starts a slot holds."""
    blocks = counts.size
    starts = max(1, int(np.quantile(counts, SLOT_QUANTILE, method="higher")))
    table = SlotTable(block, min(starts, 2**16 - 2), 4, 1 if starts < 255 else 2, blocks, 0)
    overflow = int(counts[counts > table.starts].sum())
    per_slot = table.slot_bytes + 2 * overflow / blocks
    return (1 + (REFERENCE_WINDOW - 1) / block) * per_slot, table.starts


def _coarser(counts: Int64Array, factor: int) -> Int64Array:
    """Starts per block of ``factor`` times the blocks of ``counts``."""
    padded = np.zeros(-(-counts.size // factor) * factor, dtype=counts.dtype)
    padded[: counts.size] = counts
    summed: Int64Array = padded.reshape(-1, factor).sum(axis=1)
    return summed


def slot_table_bytes(
    local_offsets: Int64Array, *, block: int | None = None, starts: int | None = None
) -> bytes:
    """The slot table of a shard whose documents' local offsets are ``local_offsets``
    (checked by the caller): header, slots, overflow area. ``block`` (``B``) and ``starts``
    (``k``) None: chosen from the documents' lengths (the ``B`` of the fewest expected bytes
    a window of 2,048 tokens; ``k`` the 99.9th percentile of starts per block), and no table
    (``b""``) when it would not be smaller than the offsets it stands beside."""
    offsets = local_offsets
    documents, elements = offsets.size - 1, int(offsets[-1])
    if elements == 0:
        return b""
    # Documents starting at the shard's end (empty ones) start in no block.
    begins = offsets[: int(np.searchsorted(offsets[:-1], elements, side="left"))]
    auto = block is None
    if block is None:
        smallest = BLOCK_CHOICES[0]
        finest = np.bincount(begins // smallest, minlength=-(-elements // smallest))
        per_block = {b: _coarser(finest, b // smallest) for b in BLOCK_CHOICES}
        costs = {b: _costs(per_block[b], b) for b in BLOCK_CHOICES}
        block = min(BLOCK_CHOICES, key=lambda b: (costs[b][0], -b))
        if starts is None:
            starts = costs[block][1]
        counts = per_block[block]
    else:
        counts = np.bincount(begins // block, minlength=-(-elements // block))
    blocks = counts.size
    if starts is None:
        starts = max(1, int(np.quantile(counts, SLOT_QUANTILE, method="higher")))
    count_bytes = 1 if starts < 255 else 2
    starts = min(starts, 2**16 - 2)
    over = counts > starts
    if int(counts.max(initial=0)) >= 2**32:
        raise ConfigError(f"{int(counts.max())} documents start in one block of {block} tokens")
    before_bytes = 4 if documents < 2**32 else 8
    table = SlotTable(block, starts, before_bytes, count_bytes, blocks, int(counts[over].sum()))
    try:
        table.check(elements)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if auto and table.file_bytes >= 8 * (documents + 1):
        return b""
    size, area = table.slot_bytes, table.area_bytes
    head = before_bytes + count_bytes
    before = np.cumsum(counts) - counts
    block_of = begins // block
    relative = (begins - block_of * block).astype("<u2")
    rows = np.zeros((blocks, size), dtype=np.uint8)
    rows[:, :before_bytes] = before.astype(f"<u{before_bytes}").view(np.uint8).reshape(blocks, -1)
    count = np.where(over, table.marker, counts).astype(f"<u{count_bytes}")
    rows[:, before_bytes:head] = count.view(np.uint8).reshape(blocks, -1)
    positions = np.zeros((blocks, area // 2), dtype="<u2")
    # Start j of block b goes to entry b·(area/2) + (j - before[b]) of the flat positions.
    flat = np.arange(begins.size, dtype=np.int64)
    flat += (np.arange(blocks, dtype=np.int64) * (area // 2) - before)[block_of]
    if over.any():
        inside = ~over[block_of]
        positions.reshape(-1)[flat[inside]] = relative[inside]
        spilled = relative[~inside]  # the overflowing blocks' starts, in block order
    else:
        positions.reshape(-1)[flat] = relative
        spilled = relative[:0]
    area_view = positions.view(np.uint8)
    overflowing = np.flatnonzero(over)
    if overflowing.size:
        sizes = counts[overflowing]
        firsts = np.cumsum(sizes) - sizes
        pointers = np.zeros(overflowing.size, dtype=OVERFLOW_POINTER)
        pointers["first"], pointers["count"] = firsts, sizes
        raw = memoryview(spilled.tobytes())
        pointers["checksum"] = [
            slot_checksum(raw[2 * a : 2 * (a + n)], b)
            for a, n, b in zip(firsts.tolist(), sizes.tolist(), overflowing.tolist(), strict=True)
        ]
        area_view[overflowing, : OVERFLOW_POINTER.itemsize] = pointers.view(np.uint8).reshape(
            overflowing.size, -1
        )
    rows[:, head : head + area] = area_view
    every = memoryview(rows.reshape(-1).data)
    body = size - CHECKSUM_BYTES
    sums = np.array(
        [slot_checksum(every[b * size : b * size + body], b) for b in range(blocks)], dtype="<u4"
    )
    rows[:, body:] = sums.view(np.uint8).reshape(blocks, -1)
    header = SLOT_MAGIC + SLOT_HEADER.pack(
        block, starts, before_bytes, count_bytes, blocks, table.overflow
    )
    out: bytes = header + rows.tobytes() + spilled.tobytes()
    return out


def slot_table_of(data: bytes | memoryview, at: int, path: str) -> SlotTable:
    """The table whose header is at byte ``at`` of an index file's ``data`` (a ConfigError
    naming ``path`` unless it is one and fills the file's rest)."""
    raw = bytes(data[at : at + SLOT_HEADER_BYTES])
    if len(raw) != SLOT_HEADER_BYTES or raw[: len(SLOT_MAGIC)] != SLOT_MAGIC:
        raise ConfigError(f"index file {path!r}: bytes after its top level are no slot table")
    table = SlotTable(*SLOT_HEADER.unpack_from(raw, len(SLOT_MAGIC)))
    if len(data) - at != table.file_bytes:
        raise ConfigError(
            f"index file {path!r}: a slot table of {table.file_bytes} bytes, {len(data) - at} left"
        )
    return table


class Slot:
    """One block's document starts, checked: the documents starting before the block, and
    the local element where each of those starting inside it starts."""

    __slots__ = ("before", "starts")

    def __init__(self, before: int, starts: Int64Array) -> None:
        self.before = before
        self.starts = starts

    @property
    def nbytes(self) -> int:
        return int(self.starts.nbytes) + SLOT_OVERHEAD
