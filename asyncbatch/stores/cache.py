"""The node-local cache as a store: :class:`CachedStore` reads any store's objects in whole
blocks through a :class:`~asyncbatch.stores.disk_cache.DiskCache`, and implements the same
protocol, so it stacks over any transport (``open_store(..., cache=)`` puts it there).

It knows nothing of the store below but the protocol: ``stat`` (size and pinned version, see
:class:`~asyncbatch.stores.base.Versioned`) keys the entries, ``read_ranges`` fetches the
missing blocks. It offers ``discard`` (:class:`~asyncbatch.stores.base.Discards`), which the
engine calls when bytes it read fail their checksum, so a corrupt entry is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from .base import Buffer, ObjectInfo, Store, Versioned
from .disk_cache import DiskCache

#: The most bytes of blocks one read holds at once (it fetches, writes and copies them out,
#: then goes on with the next ones).
CHUNK_BYTES = 64 * 2**20


class _Abandoned(Exception):
    """The read fetching a block failed or was cancelled: its waiters fetch it themselves."""


class CachedStore:
    """A store that reads whole blocks through a :class:`DiskCache`, over any store.

    Each object is stat'ed once per store (its size and version; the store below pins that
    version). Blocks are loaded from disk; missing ones are fetched from the store below,
    neighbours in one range, written to the cache and copied out. Blocks being fetched by one
    read are waited for, not fetched again, by the others of this store. Objects whose store
    reports no version are read straight from it (warned once).
    """

    def __init__(self, inner: Store, cache: DiskCache) -> None:
        self.inner = inner
        self.cache = cache
        self.coalesce_gap = inner.coalesce_gap
        self._infos: dict[str, asyncio.Future[ObjectInfo]] = {}
        self._pending: dict[tuple[str, int], asyncio.Future[Buffer]] = {}

    async def stat(self, url: str) -> ObjectInfo:
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
        if isinstance(self.inner, Versioned):
            return await self.inner.stat(url)
        return ObjectInfo(await self.inner.size(url), None)

    async def size(self, url: str) -> int:
        return (await self.stat(url)).size

    async def write(self, url: str, data: Buffer | bytes) -> None:
        self._infos.pop(url, None)
        await self.inner.write(url, data)
        self._infos.pop(url, None)  # a new version: stat it again

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
        # (block, offset in it, length, buffer, offset in that): the pieces to copy out.
        pieces: list[tuple[int, int, int, Buffer, int]] = []
        for start, end, buffer in zip(starts, ends, buffers, strict=True):
            at = start
            while at < end:
                block = at // size
                stop = min(end, (block + 1) * size)
                pieces.append((block, at - block * size, stop - at, buffer, at - start))
                at = stop
        pieces.sort(key=lambda piece: piece[0])
        needed = sorted({piece[0] for piece in pieces})
        # Blocks are held CHUNK_BYTES at a time: a shuffled read touching a thousand blocks
        # must not hold them all at once.
        per_chunk = max(1, CHUNK_BYTES // size)
        next_piece = 0
        for first in range(0, len(needed), per_chunk):
            chunk = needed[first : first + per_chunk]
            blocks = await self._blocks(url, info, chunk)
            while next_piece < len(pieces) and pieces[next_piece][0] <= chunk[-1]:
                block, offset, length, buffer, at = pieces[next_piece]
                buffer[at : at + length] = blocks[block][offset : offset + length]
                next_piece += 1

    async def _blocks(self, url: str, info: ObjectInfo, needed: list[int]) -> dict[int, Buffer]:
        """The bytes of each block of ``needed``: waited for, loaded, or fetched."""
        got: dict[int, Buffer] = {}
        while len(got) < len(needed):
            todo = [b for b in needed if b not in got]
            waiting = {b: self._pending[url, b] for b in todo if (url, b) in self._pending}
            mine = [b for b in todo if b not in waiting]
            if mine:
                got.update(await self._load_or_fetch(url, info, mine))
            for block, future in waiting.items():
                with contextlib.suppress(_Abandoned):  # left to this loop's next round
                    got[block] = await asyncio.shield(future)
        return got

    async def _load_or_fetch(
        self, url: str, info: ObjectInfo, blocks: list[int]
    ) -> dict[int, Buffer]:
        assert info.version is not None
        cache, size = self.cache, self.cache.block_size
        loop = asyncio.get_running_loop()
        futures = {b: loop.create_future() for b in blocks}
        for block, future in futures.items():
            self._pending[url, block] = future
        try:
            directory = cache.object_dir(url, info.version)
            lengths = [min(size, info.size - b * size) for b in blocks]
            loaded = await asyncio.to_thread(cache.load, directory, blocks, lengths)
            found: dict[int, Buffer] = {
                b: memoryview(data)
                for b, data in zip(blocks, loaded, strict=True)
                if data is not None
            }
            for block, data in found.items():
                futures[block].set_result(data)
            cache.count(hits=len(found), hit_bytes=sum(len(d) for d in found.values()))
            missing = [b for b in blocks if b not in found]
            if not missing:
                return found
            # Neighbouring missing blocks are fetched as one range.
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
            fetched: dict[int, Buffer] = {}
            for run, buffer in zip(runs, buffers, strict=True):
                for i, block in enumerate(run):
                    fetched[block] = buffer[i * size : (i + 1) * size]
                    futures[block].set_result(fetched[block])
            cache.count(misses=len(missing), fetched=sum(len(b) for b in buffers))
            await asyncio.to_thread(cache.store, directory, fetched)
            return found | fetched
        finally:
            for block, future in futures.items():
                if not future.done():
                    future.set_exception(_Abandoned())
                    future.exception()  # retrieved: waiters see it, nobody else need
                if self._pending.get((url, block)) is future:
                    del self._pending[url, block]

    # Last: within the class, ``list`` names this method from here on.
    async def list(self, url: str) -> list[str]:
        return await self.inner.list(url)
