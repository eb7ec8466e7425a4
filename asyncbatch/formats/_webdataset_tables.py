"""The source's view of WebDataset member indexes: per shard, each sample's byte range and
its selected fields' members, as arrays a batch gathers from with numpy.

A shard whose index opening scanned (or read from a version 1 sidecar) has its table from
the start. A shard with a sidecar has only its summary until a batch first reads it: its
sidecar's header and body are then fetched (one range read through the engine, like the
shards'), checked against the summary read at open, and kept in a cache of at most
``index_cache_bytes`` (least recently used tables dropped first, never those a batch is
using). Concurrent batches that need one sidecar share one fetch. A rank therefore fetches
the sidecars of the shards it reads, once while they fit the cache, and no others.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import FormatError, NotFoundError
from .._layout import ReadPlan
from ._base import OffLoop, Read, Step, Wait
from ._documents_index import Turns
from ._webdataset_index import ShardIndex, SidecarSummary

Int64Array = npt.NDArray[np.int64]

#: Bytes of sidecar tables one source keeps (``format_options={"index_cache_bytes": ...}``).
DEFAULT_INDEX_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True, eq=False)
class ShardTable:
    """Samples of one shard (or of all, joined), offsets local to their shard: per sample a
    row of ``rows``: its start and end, the data offset of the member of each selected
    field, their lengths, and its key's length (:func:`columns` names them); its key, UTF-8,
    in a row of ``keys``, padded with zeros. One gather of each takes a batch's samples."""

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
    return ShardTable(rows, padded(index.keys, key_lengths))


def padded(data: npt.NDArray[np.uint8], lengths: Int64Array) -> npt.NDArray[np.uint8]:
    """Strings ``data`` of ``lengths`` one after another as rows padded with zeros."""
    width = int(lengths.max()) if lengths.size else 0
    out = np.zeros((lengths.size, width), dtype=np.uint8)
    out[np.arange(width) < lengths[:, None]] = data
    return out


def joined(tables: list[ShardTable]) -> ShardTable:
    """The tables of consecutive shards as one (rows: their samples one after another)."""
    width = max((t.keys.shape[1] for t in tables), default=0)
    keys = np.zeros((sum(t.rows.shape[0] for t in tables), width), dtype=np.uint8)
    at = 0
    for t in tables:
        keys[at : at + t.keys.shape[0], : t.keys.shape[1]] = t.keys
        at += t.keys.shape[0]
    return ShardTable(np.concatenate([t.rows for t in tables]), keys)


@dataclass(frozen=True)
class LazyShard:
    """A shard whose table comes from its sidecar: file ``file`` of the source's plans."""

    file: int
    url: str
    summary: SidecarSummary
    column_of: Int64Array


class ShardTables:
    """The tables of shards numbered through a source: ``fixed`` ones in memory, ``lazy``
    ones fetched when first needed and cached within ``budget`` bytes."""

    def __init__(
        self,
        fixed: Mapping[int, ShardTable],
        lazy: Mapping[int, LazyShard],
        width: int,
        budget: int,
    ) -> None:
        self.fixed = dict(fixed)
        self.lazy = dict(lazy)
        #: With no sidecar to fetch, every shard's table joined: a batch gathers its rows at
        #: its global sample numbers.
        self.joined = None if lazy else joined([self.fixed[s] for s in range(len(self.fixed))])
        if self.joined is not None:
            self.fixed = {}
        self.width = width
        self.budget = budget
        self._cache: OrderedDict[int, ShardTable] = OrderedDict()
        self._cached_bytes = 0
        #: Fetches under way, settled by the batch that fetches them.
        self._loading: dict[int, Future[ShardTable]] = {}
        self._pid = os.getpid()
        self.turns = Turns()

    def load(self, shards: Int64Array) -> Generator[Step, Any, dict[int, ShardTable]]:
        """The tables of ``shards`` (unique), fetching the sidecars not cached; a fetch
        another batch started is waited for, not repeated."""
        if self._pid != os.getpid():  # a forked child: no one here settles the parent's
            self._loading, self._pid = {}, os.getpid()
        table: dict[int, ShardTable] = {}
        todo = shards.tolist()
        while todo:
            missing: list[int] = []
            waiting: dict[int, Future[ShardTable]] = {}
            for s in todo:
                found = self.fixed.get(s)
                if found is None:
                    found = self._cache.get(s)
                    if found is not None:
                        self._cache.move_to_end(s)
                if found is not None:
                    table[s] = found
                elif s in self._loading:
                    waiting[s] = self._loading[s]
                else:
                    missing.append(s)
            if missing:
                table.update((yield from self._fetch(missing)))
            if waiting:
                yield Wait(tuple(waiting.values()))
            todo = []
            for s, future in waiting.items():
                if future.cancelled():  # the batch fetching it was stopped: fetch it here
                    todo.append(s)
                    continue
                error = future.exception()
                if error is not None:
                    raise error
                table[s] = future.result()
        return table

    def _fetch(self, shards: list[int]) -> Generator[Step, Any, dict[int, ShardTable]]:
        futures: dict[int, Future[ShardTable]] = {s: Future() for s in shards}
        self._loading.update(futures)
        try:
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

            def parse() -> dict[int, ShardTable]:
                got = {}
                for s, one, at, size in zip(
                    shards, lazy, dest.tolist(), sizes.tolist(), strict=True
                ):
                    # A copy: the buffer is the engine's, and goes back to its pool.
                    data = bytes(buffer[at : at + size])
                    index = ShardIndex.from_body(data, one.summary, one.url)
                    got[s] = shard_table(index, one.column_of, self.width, one.url)
                return got

            got: dict[int, ShardTable] = yield OffLoop(parse)
        except BaseException as exc:
            # Stopped (cancelled, or the generator closed): the waiters fetch it themselves.
            for s, future in futures.items():
                del self._loading[s]
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            raise
        for s, one in got.items():
            del self._loading[s]
            futures[s].set_result(one)
            self._cache[s] = one
            self._cached_bytes += one.nbytes
        while self._cached_bytes > self.budget and len(self._cache) > len(got):
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes
        return got
