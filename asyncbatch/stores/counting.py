"""A store wrapper that counts what reaches the store below it: requests and bytes.

It sits right above the transport (below a cache, when there is one), so ``requests`` and
``bytes_fetched`` are what the object store or filesystem was asked for, whatever the layers
above serve from elsewhere. A request is one byte range; a store's retries are not counted.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .base import Buffer, Conversion, ObjectInfo, Store


@dataclass
class ReadCounts:
    """Cumulative counts of one loader's reads; each field is written by one thread only."""

    requests: int = 0
    bytes_fetched: int = 0
    #: Blocks the node-local cache served, and blocks it had to fetch.
    cache_hits: int = 0
    cache_misses: int = 0


class CountingStore:
    """Forwards every call to ``inner`` and counts its byte-range reads in ``counts``; can
    do what ``inner`` can (its ``supports_*`` flags)."""

    def __init__(self, inner: Store, counts: ReadCounts) -> None:
        self.inner = inner
        self.counts = counts
        self.coalesce_gap = inner.coalesce_gap
        self.supports_read_into = inner.supports_read_into
        self.supports_convert = inner.supports_convert
        self.supports_windows = inner.supports_windows
        self.supports_discard = inner.supports_discard

    async def size(self, url: str) -> int:
        return await self.inner.size(url)

    async def stat(self, url: str) -> ObjectInfo:
        return await self.inner.stat(url)

    async def list(self, url: str) -> list[str]:
        return await self.inner.list(url)

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        return await self.inner.list_info(url)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        self.counts.requests += len(starts)
        self.counts.bytes_fetched += sum(ends) - sum(starts)
        await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)

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
        self.counts.requests += int(starts.size)
        self.counts.bytes_fetched += int(ends.sum() - starts.sum())
        await self.inner.read_into(urls, which, starts, ends, dest, dest_offsets, convert)

    async def read_windows(
        self,
        urls: Sequence[str],
        ends: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        itemsize: int,
        starts: npt.NDArray[np.int64],
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        """Each window counts as one read."""
        inner = self.inner
        if not await inner.read_windows(
            urls, ends, offsets, itemsize, starts, window, dest, convert
        ):
            return False
        self.counts.requests += int(starts.size)
        self.counts.bytes_fetched += int(starts.size) * window * itemsize
        return True

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """One request, whether the store below reads tails itself or stats and reads a
        range (a stat is never counted)."""
        self.counts.requests += 1
        tail, info = await self.inner.read_tail(url, length)
        self.counts.bytes_fetched += len(tail)
        return tail, info

    async def write(self, url: str, data: Buffer | bytes) -> None:
        await self.inner.write(url, data)

    async def discard(self, url: str, start: int, end: int) -> None:
        await self.inner.discard(url, start, end)

    async def close(self) -> None:
        await self.inner.close()


def counting(store: Store, counts: ReadCounts) -> Store:
    """``store`` with its reads counted in ``counts``."""
    return CountingStore(store, counts)
