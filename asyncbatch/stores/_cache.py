"""The node-local cache as a store: :class:`CachedStore` reads any store's objects in whole
blocks through a :class:`~asyncbatch.stores._disk_cache.DiskCache`, and implements the same
protocol, so it stacks over any transport (``open_store(..., cache=)`` puts it there).

It knows nothing of the store below but the protocol: ``stat`` (size and pinned version, see
:class:`~asyncbatch.stores._base.Versioned`) keys the entries, ``read_ranges`` fetches the
missing blocks. A loader's stores share what they have stat'ed (``seen``), so a later run
(the next epoch) reads its hits without asking the store anything; an object is stat'ed
again only when a block of it must be fetched, and a version other than the one first seen
is then a :class:`~asyncbatch._errors.ShardChangedError`: one loader reads one version.
It offers ``discard`` (``supports_discard``), which the checks above it call when bytes it
served fail their checksum, so a corrupt entry is read again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ChecksumError, describe_range
from ._base import Buffer, Conversion, ObjectInfo, Store
from ._counting import ReadCounts
from ._disk_cache import DiskCache, Piece
from ._local import LocalStore
from ._ranged import changed

#: The most bytes of blocks one read holds at once (it fetches, writes and copies them out,
#: then goes on with the next ones).
CHUNK_BYTES = 64 * 2**20


class _Abandoned(Exception):
    """The read fetching a block failed or was cancelled: its waiters fetch it themselves."""


class CachedStore:
    """A store that reads whole blocks through a :class:`DiskCache`, over any store.

    Each object is stat'ed once per store (its size and version; the store below pins that
    version). From a cached block only the bytes asked for are read, straight into the
    caller's buffers; missing blocks are fetched whole from the store below, neighbours in
    one range, written to the cache and copied out. A block one read of this store is
    fetching is waited for by the others, not fetched again. Objects whose store reports no
    version are read straight from it (warned once).
    """

    def __init__(
        self,
        inner: Store,
        cache: DiskCache,
        counts: ReadCounts | None = None,
        seen: dict[str, ObjectInfo] | None = None,
        check: Callable[[str, int, Buffer], str | None] | None = None,
    ) -> None:
        self.inner = inner
        self.cache = cache
        #: A loader's own count of the blocks it found in the cache and missed.
        self.counts = counts
        #: Size and version of every object the loader has stat'ed, kept across its runs.
        self.seen = {} if seen is None else seen
        #: Checks fetched blocks against the manifest's checksums before they are kept
        #: (``check(url, start, data)``: what does not match, or None).
        self.check = check
        # Merging two reads saves no request here (a miss fetches whole blocks whatever the
        # reads), only calls: as for local files, merge across small gaps only.
        self.coalesce_gap = min(inner.coalesce_gap, LocalStore.coalesce_gap)
        #: A group of reads in one call (the hits read in one thread job); no conversion,
        #: no windows: the engine plans byte ranges, and casts after.
        self.supports_read_into = True
        self.supports_convert = False
        self.supports_windows = False
        self.supports_discard = True
        self._infos: dict[str, asyncio.Future[ObjectInfo]] = {}
        self._pending: dict[tuple[str, int], asyncio.Future[Buffer]] = {}

    async def stat(self, url: str) -> ObjectInfo:
        """What the loader first saw of ``url``; asks the store only the first time."""
        info = self.seen.get(url)
        if info is None:
            info = self.seen[url] = await self._stat_now(url)
        return info

    async def _stat_now(self, url: str) -> ObjectInfo:
        """The store's answer for ``url``, asked once per store (every caller waits for it)."""
        future = self._infos.get(url)
        if future is None:
            future = self._infos[url] = asyncio.ensure_future(self._stat(url))
        try:
            return await asyncio.shield(future)
        except BaseException:
            if future.done() and self._infos.get(url) is future:
                self._infos.pop(url)  # failed: the next call asks again
            raise

    async def _stat(self, url: str) -> ObjectInfo:
        return await self.inner.stat(url)

    async def size(self, url: str) -> int:
        return (await self.stat(url)).size

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The store's tail read, not cached (one request either way: a footer read at open);
        its size and version join what the loader has seen, and must match it."""
        tail, info = await self.inner.read_tail(url, length)
        self._told(url, info)
        return tail, info

    async def list_info(self, url: str) -> list[tuple[str, ObjectInfo | None]]:
        """The store's listing; each object's size and version join what the loader has
        seen, and must match it."""
        found = await self.inner.list_info(url)
        for name, info in found:
            if info is not None:
                self._told(name, info)
        return found

    def _told(self, url: str, info: ObjectInfo) -> None:
        """The store told ``url``'s size and version just now (a tail read, a listing): a
        miss fetching its blocks need not ask again (:meth:`_stat_now`)."""
        known = self.seen.setdefault(url, info)
        if known.version != info.version:
            raise changed(url, known.version or "?", info.version)
        if url not in self._infos:
            told: asyncio.Future[ObjectInfo] = asyncio.get_running_loop().create_future()
            told.set_result(info)
            self._infos[url] = told

    async def write(self, url: str, data: Buffer | bytes) -> None:
        self._infos.pop(url, None)
        self.seen.pop(url, None)
        await self.inner.write(url, data)
        self._infos.pop(url, None)  # a new version: stat it again
        self.seen.pop(url, None)

    async def close(self) -> None:
        infos, self._infos = list(self._infos.values()), {}
        for future in infos:
            future.cancel()
        await asyncio.gather(*infos, return_exceptions=True)
        await self.inner.close()

    async def discard(self, url: str, start: int, end: int) -> None:
        info = await self.stat(url)
        if info.version is None or end <= start:
            return
        size = self.cache.block_size
        blocks = range(start // size, -(-end // size))
        directory = self.cache.object_dir(url, info.version)
        await asyncio.to_thread(self.cache.remove, directory, blocks)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        info = await self.stat(url)
        if info.version is None:
            self.cache.warn_once(
                "version",
                f"{url}: its store reports no version (ETag), so the cache could not tell a"
                " changed object from the one it holds; such objects are read without it",
            )
        if info.version is None or any(end > info.size for end in ends):
            # Past the end: the store below raises the error naming the range.
            await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            return
        size = self.cache.block_size
        # The pieces of the ranges, by block: (offset in the block, length, buffer, offset in it).
        pieces: dict[int, list[Piece]] = {}
        for start, end, buffer in zip(starts, ends, buffers, strict=True):
            _cut(pieces, start, end, buffer, size)
        needed = sorted(pieces)
        # CHUNK_BYTES of blocks at a time: a shuffled read touching a thousand blocks must
        # not hold them all in memory at once.
        per_chunk = max(1, CHUNK_BYTES // size)
        for first in range(0, len(needed), per_chunk):
            await self._fill(url, info, needed[first : first + per_chunk], pieces)

    async def read_into(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
        convert: Conversion | None = None,
    ) -> None:
        """A whole group's reads (the engine's buffer path): the hits of every object are
        read in one job on a thread, so a group costs one hop however many objects it
        touches; whatever is left goes through :meth:`read_ranges`' path."""
        assert convert is None, "the cache converts nothing (supports_convert is False)"
        view = memoryview(dest)  # type: ignore[arg-type]
        rows: dict[int, list[int]] = {}
        for row, object_index in enumerate(which.tolist()):
            rows.setdefault(object_index, []).append(row)
        size = self.cache.block_size
        jobs: list[tuple[str, ObjectInfo, dict[int, list[Piece]]]] = []
        direct: list[tuple[str, list[int]]] = []
        for object_index, picked in rows.items():
            url = urls[object_index]
            info = await self.stat(url)
            lows = starts[picked].tolist()
            highs = ends[picked].tolist()
            if info.version is None or max(highs) > info.size:
                direct.append((url, picked))
                continue
            pieces: dict[int, list[Piece]] = {}
            for start, end, at in zip(lows, highs, dest_offsets[picked].tolist(), strict=True):
                buffer = view[at : at + end - start]
                _cut(pieces, start, end, buffer, size)
            jobs.append((url, info, pieces))
        wanted = [
            (self.cache.object_dir(url, info.version or ""), url, info, pieces)
            for url, info, pieces in jobs
        ]
        found = await asyncio.to_thread(self._read_hits, wanted)
        for (_, url, info, pieces), hits in zip(wanted, found, strict=True):
            hit_bytes = sum(length for b in hits for _, length, _, _ in pieces[b])
            self.cache.count(hits=len(hits), hit_bytes=hit_bytes)
            if self.counts is not None:  # counted on the loop's thread, as the misses are
                self.counts.cache_hits += len(hits)
            left = sorted(b for b in pieces if b not in hits)
            per_chunk = max(1, CHUNK_BYTES // size)
            for first in range(0, len(left), per_chunk):
                await self._fill(url, info, left[first : first + per_chunk], pieces)
        for url, picked in direct:  # no version, or past the end: as read_ranges does
            lows, highs = starts[picked].tolist(), ends[picked].tolist()
            ats = dest_offsets[picked].tolist()
            buffers = [view[at : at + h - lo] for lo, h, at in zip(lows, highs, ats, strict=True)]
            await self.read_ranges(url, starts=lows, ends=highs, buffers=buffers)

    def _read_hits(
        self, wanted: list[tuple[str, str, ObjectInfo, dict[int, list[Piece]]]]
    ) -> list[set[int]]:
        """On a thread: the blocks of each object read from the cache's files (not those
        another read of this store is fetching right now: :meth:`_fill` waits for them)."""
        cache, size = self.cache, self.cache.block_size
        found: list[set[int]] = []
        for directory, url, info, pieces in wanted:
            blocks = [
                (b, min(size, info.size - b * size), pieces[b])
                for b in pieces
                if (url, b) not in self._pending
            ]
            found.append(cache.read(directory, blocks))
        return found

    async def _fill(
        self, url: str, info: ObjectInfo, blocks: list[int], pieces: dict[int, list[Piece]]
    ) -> None:
        """Copy the pieces of ``blocks`` out: from the cache's files, from a block another
        read of this store is fetching, or from the store below."""
        done: set[int] = set()
        while len(done) < len(blocks):
            todo = [b for b in blocks if b not in done]
            waiting = {b: self._pending[url, b] for b in todo if (url, b) in self._pending}
            mine = [b for b in todo if b not in waiting]
            if mine:
                await self._read_or_fetch(url, info, mine, pieces)
                done.update(mine)
            for block, future in waiting.items():
                try:
                    data = await asyncio.shield(future)
                except _Abandoned:  # found on disk, or failed: this loop's next round
                    continue
                _copy_out(data, pieces[block])
                done.add(block)

    async def _read_or_fetch(
        self, url: str, info: ObjectInfo, blocks: list[int], pieces: dict[int, list[Piece]]
    ) -> None:
        assert info.version is not None
        cache, size = self.cache, self.cache.block_size
        loop = asyncio.get_running_loop()
        futures = {b: loop.create_future() for b in blocks}
        for block, future in futures.items():
            self._pending[url, block] = future
        try:
            directory = cache.object_dir(url, info.version)
            # Hits: only the pieces asked for are read, straight into their buffers.
            wanted = [(b, min(size, info.size - b * size), pieces[b]) for b in blocks]
            hits = await asyncio.to_thread(cache.read, directory, wanted)
            hit_bytes = sum(length for b in hits for _, length, _, _ in pieces[b])
            cache.count(hits=len(hits), hit_bytes=hit_bytes)
            if self.counts is not None:
                self.counts.cache_hits += len(hits)
            missing = [b for b in blocks if b not in hits]
            if not missing:
                return
            # Fetching: the store must still hold the version the entries are keyed by (and
            # is pinned to it from here on).
            now = await self._stat_now(url)
            if now.version != info.version:
                raise changed(url, info.version, now.version)
            # Misses: whole blocks, neighbours in one range, then cached and copied out.
            runs: list[list[int]] = []
            for block in missing:
                if runs and runs[-1][-1] == block - 1:
                    runs[-1].append(block)
                else:
                    runs.append([block])
            starts = [run[0] * size for run in runs]
            ends = [min(info.size, (run[-1] + 1) * size) for run in runs]
            buffers = [memoryview(bytearray(e - s)) for s, e in zip(starts, ends, strict=True)]
            await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            if self.check is not None:  # never keep (or hand on) bytes the manifest denies
                for start, end, buffer in zip(starts, ends, buffers, strict=True):
                    problem = self.check(url, start, buffer)
                    if problem is not None:
                        raise ChecksumError(
                            f"{problem} does not match the manifest's checksum, fetched"
                            f" for the cache: {describe_range(url, start, end)}",
                            url,
                            start,
                            end,
                        )
            fetched: dict[int, Buffer] = {}
            for run, buffer in zip(runs, buffers, strict=True):
                for i, block in enumerate(run):
                    fetched[block] = data = buffer[i * size : (i + 1) * size]
                    futures[block].set_result(data)
                    _copy_out(data, pieces[block])
            cache.count(misses=len(missing), fetched=sum(len(b) for b in buffers))
            if self.counts is not None:
                self.counts.cache_misses += len(missing)
            await asyncio.to_thread(cache.store, directory, fetched)
        finally:
            for block, future in futures.items():
                if not future.done():
                    future.set_exception(_Abandoned())
                    future.exception()  # retrieved: waiters see it, nobody else need
                if self._pending.get((url, block)) is future:
                    del self._pending[url, block]

    async def read_windows(self, *args: Any, **kwargs: Any) -> bool:
        """Declined (``supports_windows`` is False): the engine plans byte ranges."""
        return False

    # Last: within the class, ``list`` names this method from here on.
    async def list(self, url: str) -> list[str]:
        return await self.inner.list(url)


def _cut(pieces: dict[int, list[Piece]], start: int, end: int, buffer: Buffer, size: int) -> None:
    """Add the pieces of range ``[start, end)`` (landing in ``buffer``) to ``pieces``, by
    block of ``size`` bytes: (offset in the block, length, buffer, offset in the buffer)."""
    at = start
    while at < end:
        block = at // size
        stop = min(end, (block + 1) * size)
        pieces.setdefault(block, []).append((at - block * size, stop - at, buffer, at - start))
        at = stop


def _copy_out(block: Buffer, pieces: list[Piece]) -> None:
    for offset, length, buffer, at in pieces:
        buffer[at : at + length] = block[offset : offset + length]
