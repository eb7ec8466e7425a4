"""The source's view of WebDataset member indexes: per shard, each sample's byte range and
its selected fields' members, as arrays a batch gathers from with numpy.

A shard whose index opening scanned (or read from a version 1 sidecar) has its table from
the start. A shard with a sidecar has only its summary until a batch first reads it: its
sidecar's header and body are then fetched (one range read through the engine, like the
shards'), checked against the summary read at open, and kept in a cache of at most
``index_cache_bytes`` (least recently used tables dropped first, never those a batch is
using). Concurrent batches that need one sidecar share one fetch. A rank therefore fetches
the sidecars of the shards it reads, once while they fit the cache, and no others.

Every table held lies in one :class:`TablePool`, so a batch finds its samples' rows with
one gather whichever shards they lie in: no Python per shard or per sample on that path.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import FormatError, NotFoundError
from .._layout import ReadPlan
from ._base import OffLoop, Read, Step
from ._documents_index import Turns
from ._fetch_cache import FetchCache
from ._webdataset_index import ShardIndex, SidecarSummary

Int64Array = npt.NDArray[np.int64]

#: Bytes of sidecar tables one source keeps (``format_options={"index_cache_bytes": ...}``).
DEFAULT_INDEX_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True, eq=False)
class ShardTable:
    """Samples of one shard, offsets local to it: per sample a row of ``rows``: its start and
    end, the data offset of the member of each selected field, their lengths, and its key's
    length (:func:`columns` names them); the keys, UTF-8, one after another in ``keys``."""

    rows: Int64Array
    keys: npt.NDArray[np.uint8]

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.keys.nbytes)


def columns(width: int) -> tuple[int, slice, slice, int]:
    """Where a table row holds a sample's start (its end follows), its members' offsets and
    lengths, and its key's length, for ``width`` selected fields."""
    return 0, slice(2, 2 + width), slice(2 + width, 2 + 2 * width), 2 + 2 * width


def shard_table(index: ShardIndex, column_of: Int64Array, width: int, url: str) -> ShardTable:
    """The table of ``index``: ``column_of[f]`` is the column of its field ``f`` (-1: not
    selected). Every sample must hold every column (opening checked it from the counts):
    else a FormatError naming ``url``."""
    samples = index.num_samples
    owner = np.repeat(np.arange(samples, dtype=np.int64), index.members)
    column = column_of[index.field] if column_of.size else np.zeros(0, dtype=np.int64)
    chosen = np.flatnonzero(column >= 0)
    member = np.full((samples, width), -1, dtype=np.int64)
    member[owner[chosen], column[chosen]] = chosen
    if (member < 0).any():
        raise FormatError(
            f"{url}: a sample lacks a field its counts say every sample holds: corrupt, or"
            " changed after it was opened; write it again with `asyncbatch index`"
        )
    key_lengths = np.diff(index.key_offsets)
    rows = np.concatenate(
        [
            index.starts[:, None],
            index.ends[:, None],
            index.offsets[member],
            index.lengths[member],
            key_lengths[:, None],
        ],
        axis=1,
    )
    keys = index.keys[int(index.key_offsets[0]) : int(index.key_offsets[-1])]
    return ShardTable(rows, keys)


class TablePool:
    """The tables of the shards held, one after another in one array (and their keys in
    another), so that a batch's rows are one gather at ``base[shard] + sample``.

    Tables are appended; a dropped one leaves a hole until the next append that does not
    fit, which copies the tables held into arrays with room for half as many again: the
    pool takes at most 1.5 times the bytes of the most it held at once (a cache's budget,
    bar the tables batches hold). Gathers copy: a batch's rows stay valid after its tables
    are dropped."""

    def __init__(self, shards: int, width: int) -> None:
        #: A shard's first row in :attr:`rows`; -1 when its table is not held.
        self.base = np.full(shards, -1, dtype=np.int64)
        #: The rows of the tables held, and where each row's key starts in :attr:`keys`.
        self.rows = np.empty((0, width), dtype=np.int64)
        self.key_at = np.empty(0, dtype=np.int64)
        self.keys = np.empty(0, dtype=np.uint8)
        self._samples = np.zeros(shards, dtype=np.int64)
        self._key_base = np.zeros(shards, dtype=np.int64)
        self._key_bytes = np.zeros(shards, dtype=np.int64)
        self._rows_used = self._keys_used = 0

    def add(self, shard: int, table: ShardTable) -> None:
        """Hold ``table`` as the table of ``shard``."""
        self.drop(shard)
        count, size = table.rows.shape[0], table.keys.size
        if self._rows_used + count > self.rows.shape[0] or self._keys_used + size > self.keys.size:
            self._compact(count, size)
        at, key_at = self._rows_used, self._keys_used
        self.rows[at : at + count] = table.rows
        self.keys[key_at : key_at + size] = table.keys
        lengths = table.rows[:, -1]
        self.key_at[at : at + count] = key_at + np.cumsum(lengths) - lengths
        self.base[shard], self._samples[shard] = at, count
        self._key_base[shard], self._key_bytes[shard] = key_at, size
        self._rows_used, self._keys_used = at + count, key_at + size

    def drop(self, shard: int) -> None:
        """Let go of the table of ``shard`` (if held)."""
        self.base[shard] = -1

    def _compact(self, count: int, size: int) -> None:
        """Copy the tables held to new arrays with room for ``count`` rows and ``size`` key
        bytes more, and as much again as half of all."""
        held = np.flatnonzero(self.base >= 0)
        samples, key_bytes = self._samples[held], self._key_bytes[held]
        rows_needed, keys_needed = int(samples.sum()) + count, int(key_bytes.sum()) + size
        rows = np.empty((rows_needed + rows_needed // 2, self.rows.shape[1]), dtype=np.int64)
        keys = np.empty(keys_needed + keys_needed // 2, dtype=np.uint8)
        key_at = np.empty(rows.shape[0], dtype=np.int64)
        old_rows = _ranges(self.base[held], samples)
        old_keys = _ranges(self._key_base[held], key_bytes)
        used, key_used = old_rows.size, old_keys.size
        rows[:used] = self.rows[old_rows]
        keys[:key_used] = self.keys[old_keys]
        new_base = np.cumsum(samples) - samples
        new_key_base = np.cumsum(key_bytes) - key_bytes
        shift = np.repeat(new_key_base - self._key_base[held], samples)
        key_at[:used] = self.key_at[old_rows] + shift
        self.rows, self.keys, self.key_at = rows, keys, key_at
        self.base[held], self._key_base[held] = new_base, new_key_base
        self._rows_used, self._keys_used = used, key_used

    def pick(
        self, shards: Int64Array, samples: Int64Array
    ) -> tuple[Int64Array, npt.NDArray[np.uint8], Int64Array]:
        """The rows of samples ``samples`` (local) of ``shards`` (all held), their keys one
        after another, and the keys' offsets."""
        at = self.base[shards] + samples
        rows = self.rows[at]
        lengths = rows[:, -1]
        offsets = np.zeros(at.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        picks = _ranges(self.key_at[at], lengths)
        return rows, self.keys[picks], offsets


def _ranges(starts: Int64Array, lengths: Int64Array) -> Int64Array:
    """Positions ``[starts[i], starts[i] + lengths[i])`` of every ``i``, one after another."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class LazyShard:
    """A shard whose table comes from its sidecar: file ``file`` of the source's plans."""

    file: int
    url: str
    summary: SidecarSummary
    column_of: Int64Array


@dataclass(frozen=True)
class _Held:
    """What the cache keeps of a table: its bytes (the table is in the pool)."""

    nbytes: int


class ShardTables:
    """The tables of ``shards`` shards numbered through a source, in one :class:`TablePool`:
    ``fixed`` ones from the start, ``lazy`` ones fetched when first needed and held within
    ``budget`` bytes (a :class:`~._fetch_cache.FetchCache` of them)."""

    def __init__(
        self,
        fixed: Mapping[int, ShardTable],
        lazy: Mapping[int, LazyShard],
        width: int,
        budget: int,
        shards: int,
    ) -> None:
        self.lazy = dict(lazy)
        self.width = width
        self.pool = TablePool(shards, columns(width)[3] + 1)
        for s, table in fixed.items():
            self.pool.add(s, table)
        #: Whether each shard's table comes from its sidecar.
        self.is_lazy = np.zeros(shards, dtype=bool)
        self.is_lazy[list(self.lazy)] = True
        self.cache: FetchCache[int, _Held] = FetchCache(budget, self._dropped)
        self.turns = Turns()

    def load(self, shards: Int64Array) -> Generator[Step, Any, list[int]]:
        """Have the tables of ``shards`` (unique) in the pool, fetching the sidecars not
        cached (a fetch another batch started is waited for, not repeated); returns those
        held, to :meth:`release` once the batch's rows are picked. Pick them before the
        next step: a table not held may be dropped by another batch's fetch."""
        lazy = shards[self.is_lazy[shards]]
        if (self.pool.base[lazy] >= 0).all():  # all in the pool: nothing to fetch or hold
            self.cache.touch(lazy.tolist())
            return []
        held: list[int] = lazy.tolist()
        yield from self.cache.obtain(held, self._fetch, hold=True)
        return held

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into a worker process: the fetched tables stay behind, as the cache's do.
        return dict(self.__dict__, turns=Turns())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.pool.base[self.is_lazy] = -1

    def _dropped(self, shard: int, _: _Held) -> None:
        self.pool.drop(shard)

    def release(self, held: list[int]) -> None:
        """Let go of tables :meth:`load` held."""
        self.cache.release(held)

    def _fetch(self, shards: list[int]) -> Generator[Step, Any, dict[int, _Held]]:
        lazy = [self.lazy[s] for s in shards]
        sizes = np.array([one.summary.fetch_bytes for one in lazy], dtype=np.int64)
        dest = np.cumsum(sizes) - sizes
        none = np.zeros(0, dtype=np.int64)
        files = np.array([one.file for one in lazy], dtype=np.int64)
        plan = ReadPlan(
            files, np.zeros_like(sizes), sizes, dest, none, none, none, none, int(sizes.sum())
        )
        try:
            buffer = yield Read(plan)
        except NotFoundError as exc:
            raise FormatError(
                f"{exc.url or ', '.join(one.url for one in lazy)}: a sidecar index found at"
                " open is missing; open the dataset again"
            ) from exc

        def parse() -> list[ShardTable]:
            got = []
            for one, at, size in zip(lazy, dest.tolist(), sizes.tolist(), strict=True):
                # A copy: the buffer is the engine's, and goes back to its pool.
                data = bytes(buffer[at : at + size])
                index = ShardIndex.from_body(data, one.summary, one.url)
                got.append(shard_table(index, one.column_of, self.width, one.url))
            return got

        tables: list[ShardTable] = yield OffLoop(parse)
        for s, table in zip(shards, tables, strict=True):
            self.pool.add(s, table)
        return {s: _Held(table.nbytes) for s, table in zip(shards, tables, strict=True)}
