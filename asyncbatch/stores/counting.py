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

from ..layout import ShardMap
from .base import (
    Buffer,
    Conversion,
    ObjectInfo,
    ReadsInto,
    ReadsIntoConverted,
    ReadsWindows,
    Store,
    Versioned,
    fetch_tail,
    list_with_info,
)


@dataclass
class ReadCounts:
    """Cumulative counts of one loader's reads; each field is written by one thread only."""

    requests: int = 0
    bytes_fetched: int = 0
    #: Blocks the node-local cache served, and blocks it had to fetch.
    cache_hits: int = 0
    cache_misses: int = 0


class CountingStore:
    """Forwards every call to ``inner`` and counts its byte-range reads in ``counts``."""

    def __init__(self, inner: Store, counts: ReadCounts) -> None:
        self.inner = inner
        self.counts = counts
        self.coalesce_gap = inner.coalesce_gap
        self._versioned: Versioned | None = inner if isinstance(inner, Versioned) else None

    async def size(self, url: str) -> int:
        return await self.inner.size(url)

    async def list(self, url: str) -> list[str]:
        return await self.inner.list(url)

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        return await list_with_info(self.inner, url)

    async def stat(self, url: str) -> ObjectInfo:
        """The store's size and version of ``url``; no version if it cannot tell one."""
        if self._versioned is not None:
            return await self._versioned.stat(url)
        return ObjectInfo(await self.inner.size(url), None)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        self.counts.requests += len(starts)
        self.counts.bytes_fetched += sum(ends) - sum(starts)
        await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """One request, whether the store below reads tails itself or stats and reads a
        range (a stat is never counted)."""
        self.counts.requests += 1
        tail, info = await fetch_tail(self.inner, url, length)
        self.counts.bytes_fetched += len(tail)
        return tail, info

    async def write(self, url: str, data: Buffer | bytes) -> None:
        await self.inner.write(url, data)

    async def close(self) -> None:
        await self.inner.close()


class CountingBufferStore(CountingStore):
    """A :class:`CountingStore` over a store that also reads into one caller's buffer."""

    def __init__(self, inner: Store, counts: ReadCounts) -> None:
        super().__init__(inner, counts)
        # Checked once here: a protocol isinstance per group read costs microseconds.
        assert isinstance(inner, ReadsInto)
        self._into = inner

    async def read_into(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> None:
        self.counts.requests += int(starts.size)
        self.counts.bytes_fetched += int(ends.sum() - starts.sum())
        await self._into.read_into(urls, which, starts, ends, dest, dest_offsets)


class CountingConvertingStore(CountingBufferStore):
    """A :class:`CountingBufferStore` over a store that also converts as it reads."""

    def __init__(self, inner: Store, counts: ReadCounts) -> None:
        super().__init__(inner, counts)
        assert isinstance(inner, ReadsIntoConverted)
        self._converting = inner

    async def read_into_converted(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
        convert: Conversion,
    ) -> None:
        self.counts.requests += int(starts.size)
        self.counts.bytes_fetched += int(ends.sum() - starts.sum())
        await self._converting.read_into_converted(
            urls, which, starts, ends, dest, dest_offsets, convert
        )


class CountingWindowsStore(CountingConvertingStore):
    """A :class:`CountingConvertingStore` over a store that also copies windows itself: each
    window counts as one read."""

    def __init__(self, inner: Store, counts: ReadCounts) -> None:
        super().__init__(inner, counts)
        assert isinstance(inner, ReadsWindows)
        self._windows = inner

    async def read_windows(
        self,
        urls: Sequence[str],
        layout: ShardMap,
        starts: npt.NDArray[np.int64],
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        if not await self._windows.read_windows(urls, layout, starts, window, dest, convert):
            return False
        self.counts.requests += int(starts.size)
        self.counts.bytes_fetched += int(starts.size) * window * layout.itemsize
        return True


def counting(store: Store, counts: ReadCounts) -> Store:
    """``store`` with its reads counted in ``counts``, keeping its ``read_into`` (and
    ``read_into_converted``, ``read_windows``) if it has them."""
    if isinstance(store, ReadsWindows) and isinstance(store, ReadsIntoConverted):
        return CountingWindowsStore(store, counts)
    if isinstance(store, ReadsIntoConverted):
        return CountingConvertingStore(store, counts)
    if isinstance(store, ReadsInto):
        return CountingBufferStore(store, counts)
    return CountingStore(store, counts)
