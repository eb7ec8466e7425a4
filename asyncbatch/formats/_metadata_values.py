"""Metadata values kept as the metadata stream keeps them, and the reads of some of them.

A *value file pair* per shard: ``.meta.idx`` (``M + 1`` little-endian int64 byte offsets,
0 first, the data file's size last, never decreasing) and ``.meta.bin`` (the ``M`` values,
encoded by a codec, back to back). Both the metadata stream format
(:mod:`asyncbatch.formats._metadata`) and documents with per-document metadata
(:mod:`asyncbatch.formats._documents_metadata`) read values through :class:`ValueFiles`: a
caller names *groups* of values (a file, a first value ``lo`` and a number of values), the
index entries ``lo .. lo + count`` of every group are read by range, checked, and the values'
bytes read by range; ranges of one file merge as token reads do (overlapping, or closer than
the store's gap). Nothing is read whole unless that is what the ranges merge to.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import FormatError
from .._layout import ReadPlan, ShardMap
from ._base import Read, Step
from ._metadata_codecs import decode_values

# torch is imported inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.

#: Byte offsets in a metadata index file: little-endian int64.
INDEX_DTYPE = np.dtype("<i8")
#: A merge gap below any distance: every range is read on its own.
NEVER_MERGE = -(2**62)
Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Groups:
    """Groups of values read together: per group its file, first value ``lo``, number of
    values ``count`` and where its ``count + 1`` index entries start in the index buffer;
    the merge gap used."""

    file: Int64Array
    lo: Int64Array
    count: Int64Array
    entry_at: Int64Array
    gap: int

    @property
    def first_item(self) -> Int64Array:
        """Where each group's values start among all values read (groups back to back)."""
        return np.cumsum(self.count) - self.count


@dataclass(frozen=True)
class Fetched:
    """The bytes of the values of some groups, each value's offsets in them, and where each
    value starts in its data file (for errors)."""

    groups: Groups
    data: npt.NDArray[np.uint8]
    offsets: Int64Array
    file_offsets: Int64Array


class ValueFiles:
    """Value file pairs numbered one after another, ``counts[k]`` values and ``data_bytes[k]``
    bytes in pair ``k``; a source's plans name index file ``k`` as ``first_index_file + k``
    and data file ``k`` as ``first_data_file + k``."""

    def __init__(
        self,
        codec: Any,
        counts: Int64Array,
        data_bytes: Int64Array,
        index_urls: Sequence[str],
        data_urls: Sequence[str],
        first_index_file: int,
        first_data_file: int,
    ) -> None:
        self.codec = codec
        self.counts = np.asarray(counts, dtype=np.int64)
        self.data_bytes = np.asarray(data_bytes, dtype=np.int64)
        self.index_urls, self.data_urls = list(index_urls), list(data_urls)
        self.first_index_file, self.first_data_file = first_index_file, first_data_file
        #: Index files as one stream of int64 entries, data files as one of bytes.
        self.index_map = ShardMap(self.counts + 1, INDEX_DTYPE.itemsize)
        self.data_map = ShardMap(self.data_bytes, 1)

    def groups(self, file: Int64Array, lo: Int64Array, count: Int64Array, gap: int) -> Groups:
        """Groups of values ``lo .. lo + count - 1`` of files ``file``, read with merge gap
        ``gap`` (:data:`NEVER_MERGE`: every group's ranges on their own)."""
        entry_at = np.cumsum(count + 1) - (count + 1)
        return Groups(file, lo, count, entry_at, gap)

    def index_plan(self, groups: Groups) -> ReadPlan:
        """Index entries ``lo .. lo + count`` of each group, back to back in the buffer. Index
        and value reads are small beside the tokens: they may bridge one request's worth of
        gaps beyond their own bytes, so neighbouring groups share one read per file."""
        gap = groups.gap
        plan = self.index_map.plan(
            self.index_map.starts[groups.file] + groups.lo,
            groups.count + 1,
            gap,
            extra_waste_bytes=max(0, gap),
        )
        return replace(plan, read_shard=plan.read_shard + self.first_index_file)

    def data_plan(
        self, index: Int64Array, groups: Groups
    ) -> tuple[ReadPlan, Int64Array, Int64Array]:
        """Data reads of every group back to back, merged as the index reads; the offsets
        of all values read (``lo .. lo + count - 1`` of each group, in order) in the data
        buffer, and in their data files. Entries that decrease, leave the data file, or do
        not start at 0 (end at the file's size) where they are the first (last) of their file
        are a FormatError naming the index file and its bytes."""
        file, lo, count, entry_at = groups.file, groups.lo, groups.count, groups.entry_at
        index = index.astype(np.int64)
        firsts = index[entry_at]
        lasts = index[entry_at + count]
        group_of_entry = np.repeat(np.arange(count.size), count + 1)
        steps = np.diff(index)
        if entry_at.size > 1:
            steps[entry_at[1:] - 1] = 0  # from one group's entries to the next: no step
        size = self.data_bytes[file]
        bad = (
            (lasts > size)
            | (firsts < 0)
            | ((lo == 0) & (firsts != 0))
            | ((lo + count == self.counts[file]) & (lasts != size))
        )
        broken = np.flatnonzero(steps < 0)
        over = np.flatnonzero(bad)
        if broken.size or over.size:
            g = int(group_of_entry[broken[0]]) if broken.size else int(over[0])
            k = int(file[g])
            if broken.size:
                problem = "offsets that decrease"
            elif firsts[g] < 0 or lasts[g] > size[g]:
                problem = f"offsets outside the {int(size[g])} bytes of {self.data_urls[k]}"
            elif lo[g] == 0 and firsts[g] != 0:
                problem = f"a first offset of {int(firsts[g])}, not 0"
            else:
                problem = (
                    f"a last offset of {int(lasts[g])}, not the {int(size[g])} bytes of"
                    f" {self.data_urls[k]}"
                )
            width = INDEX_DTYPE.itemsize
            first, last = int(lo[g]), int(lo[g] + count[g])
            raise FormatError(
                f"{self.index_urls[k]}: bytes [{first * width}, {(last + 1) * width}):"
                f" metadata index entries {first}..{last} hold {problem}"
            )
        lengths = lasts - firsts
        dest = np.cumsum(lengths) - lengths
        # Value offsets in the data buffer: each group's entries shifted to its place, the
        # last entry of a group dropped (it is where the next group's first value starts).
        offsets = index - np.repeat(firsts - dest, count + 1)
        keep = np.ones(offsets.size, dtype=bool)
        keep[(entry_at + count)[:-1]] = False
        offsets = offsets[keep] if offsets.size else np.zeros(1, dtype=np.int64)
        file_offsets = index[keep] if index.size else np.zeros(1, dtype=np.int64)
        plan = self.data_map.plan(
            self.data_map.starts[file] + firsts,
            lengths,
            groups.gap,
            extra_waste_bytes=max(0, groups.gap),
        )
        plan = replace(plan, read_shard=plan.read_shard + self.first_data_file)
        return plan, offsets, file_offsets

    def fetch(self, groups: Groups) -> Generator[Step, Any, Fetched]:
        """The bytes of the values of ``groups``: their index entries read, checked, then
        their data (two rounds of reads; none for no group)."""
        empty = np.zeros(0, dtype=np.uint8)
        index_plan = self.index_plan(groups)
        index = (yield Read(index_plan)) if index_plan.nbytes else empty
        data_plan, offsets, file_offsets = self.data_plan(index.view(INDEX_DTYPE), groups)
        data = (yield Read(data_plan)) if data_plan.num_reads else empty
        return Fetched(groups, data, offsets, file_offsets)

    def decode(self, fetched: Fetched) -> Any:
        """Every value fetched, decoded, in order (groups back to back); a codec's error is a
        FormatError naming the data file and the bytes of the first value that does not
        decode alone (or, if each does, every data file read)."""
        try:
            return decode_values(self.codec, fetched.data, fetched.offsets)
        except Exception as exc:  # a codec's own error, whatever its type: name the files
            raise self._decode_error(fetched, exc) from exc

    def _decode_error(self, fetched: Fetched, error: Exception) -> FormatError:
        groups, offsets = fetched.groups, fetched.offsets
        file_of_item = np.repeat(groups.file, groups.count)
        for i in range(offsets.size - 1):
            try:
                decode_values(self.codec, fetched.data, offsets[i : i + 2])
            except Exception as exc:  # noqa: BLE001 - the codec's own error, named below
                k, start = int(file_of_item[i]), int(fetched.file_offsets[i])
                end = start + int(offsets[i + 1] - offsets[i])
                return FormatError(
                    f"{self.data_urls[k]}: bytes [{start}, {end}): metadata does not decode: {exc}"
                )
        urls = ", ".join(self.data_urls[k] for k in np.unique(groups.file).tolist())
        return FormatError(f"{urls}: metadata does not decode: {error}")


def take_values(values: Any, items: Int64Array) -> Any:
    """``values[items]``: a tensor gathered by numpy (torch's gather is ~100x slower here)."""
    import torch

    if isinstance(values, torch.Tensor):
        return torch.from_numpy(values.numpy()[items])
    return values[items]
