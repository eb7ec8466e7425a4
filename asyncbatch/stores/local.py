"""Local and HPC filesystem store: ``os.preadv`` straight into the caller's buffers.

Reads run in a bounded thread pool, never on the event loop. Open file descriptors are kept
in a small LRU so that thousands of shards do not exhaust the process's descriptor limit.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote, urlsplit

import aiofiles
import aiofiles.os

from ..errors import ConfigError, NotFoundError, StoreError, describe_range
from .base import Buffer, check_length

#: Ranges one pool job reads before the batch is split across more threads.
RANGES_PER_JOB = 128


def local_path(url: str) -> str:
    """Filesystem path of a ``file://`` URL or a plain path."""
    if url.startswith("file://"):
        return unquote(urlsplit(url).path)
    return url


class LocalStore:
    """Store for local paths and ``file://`` URLs."""

    # A read syscall costs about as much as copying ~10 KB from the page cache: merging
    # neighbours further apart than that moves more bytes than it saves in calls.
    coalesce_gap = 16 * 1024

    def __init__(self, max_threads: int = 8, max_open_files: int = 128) -> None:
        self._max_open_files = max_open_files
        self._fds: OrderedDict[str, list[int]] = OrderedDict()  # url -> [fd, readers]
        self._fds_lock = threading.Lock()
        self._threads = max_threads
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="asyncbatch-local")
        self._closed = False

    async def size(self, url: str) -> int:
        try:
            return (await aiofiles.os.stat(local_path(url))).st_size
        except FileNotFoundError as exc:
            raise NotFoundError(f"not found: {url}", url) from exc

    async def list(self, url: str) -> list[str]:
        path = local_path(url)
        try:
            names = await aiofiles.os.listdir(path)
        except FileNotFoundError as exc:
            raise NotFoundError(f"not found: {url}", url) from exc
        return sorted(os.path.join(url, name) for name in names)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        await self.read_many([url] * len(starts), starts, ends, buffers)

    async def read_many(
        self,
        urls: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        buffers: Sequence[Buffer],
    ) -> None:
        """Ranges of several files, ``urls[i]`` for range ``i``, in few thread-pool jobs.

        Ranges of one file should be neighbours in the lists: the file is looked up once
        per run of equal URLs.
        """
        loop = asyncio.get_running_loop()
        count = len(starts)
        jobs = max(1, min(self._threads, count // RANGES_PER_JOB))
        if jobs == 1:
            await loop.run_in_executor(self._pool, self._read_sync, urls, starts, ends, buffers)
            return
        step = -(-count // jobs)
        await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._pool,
                    self._read_sync,
                    urls[i : i + step],
                    starts[i : i + step],
                    ends[i : i + step],
                    buffers[i : i + step],
                )
                for i in range(0, count, step)
            )
        )

    def _read_sync(
        self,
        urls: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        buffers: Sequence[Buffer],
    ) -> None:
        preadv = os.preadv
        url, fd = "", -1
        try:
            for range_url, start, end, buffer in zip(urls, starts, ends, buffers, strict=True):
                if range_url != url:
                    if fd >= 0:
                        self._release(url)
                        fd = -1
                    url = range_url
                    fd = self._acquire(url)
                try:
                    got = preadv(fd, (buffer,), start)
                    # POSIX allows a partial read; continue until done or end of file.
                    while got < end - start:
                        more = preadv(fd, (buffer[got:],), start + got)
                        if more == 0:
                            break
                        got += more
                except OSError as exc:
                    where = describe_range(url, start, end)
                    raise StoreError(f"read failed: {where}: {exc}", url, start, end) from exc
                if got != end - start:
                    check_length(url, start, end, got)
        finally:
            if fd >= 0:
                self._release(url)

    def _acquire(self, url: str) -> int:
        """A descriptor for ``url``, held open until the matching :meth:`_release`."""
        with self._fds_lock:
            if self._closed:
                raise StoreError(f"store closed while reading {url}", url)
            entry = self._fds.get(url)
            if entry is not None:
                entry[1] += 1
                self._fds.move_to_end(url)
                return entry[0]
        try:
            fd = os.open(local_path(url), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFoundError(f"not found: {url}", url) from exc
        except OSError as exc:
            raise StoreError(f"cannot open {url}: {exc}", url) from exc
        with self._fds_lock:
            if self._closed:  # close() ran while this thread was opening the file
                os.close(fd)
                raise StoreError(f"store closed while reading {url}", url)
            entry = self._fds.get(url)
            if entry is not None:  # another thread opened it meanwhile
                os.close(fd)
                entry[1] += 1
                return entry[0]
            self._fds[url] = [fd, 1]
            self._evict_idle()
        return fd

    def _release(self, url: str) -> None:
        with self._fds_lock:
            entry = self._fds.get(url)
            if entry is not None:
                entry[1] -= 1
                self._evict_idle()

    def _evict_idle(self) -> None:
        """Close least recently used descriptors no read holds; called with the lock held."""
        excess = len(self._fds) - self._max_open_files
        if excess <= 0:
            return
        for url in [u for u, (_, refs) in self._fds.items() if refs == 0][:excess]:
            os.close(self._fds.pop(url)[0])

    async def write(self, url: str, data: Buffer | bytes) -> None:
        path = local_path(url)
        parent = os.path.dirname(path)
        if parent:
            await aiofiles.os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        async with aiofiles.open(tmp, "wb") as file:
            await file.write(data)
        await aiofiles.os.replace(tmp, path)

    async def close(self) -> None:
        with self._fds_lock:
            if self._closed:
                return
            self._closed = True
            fds = [fd for fd, _ in self._fds.values()]
            self._fds.clear()
        self._pool.shutdown(wait=True)
        for fd in fds:
            try:
                os.close(fd)
            except OSError as exc:  # pragma: no cover - already closed
                if exc.errno != errno.EBADF:
                    raise


def local_store(
    scheme: str, storage_options: Mapping[str, Any], *, max_inflight: int
) -> LocalStore:
    """Registry factory: a :class:`LocalStore`; options ``max_open_files``, ``max_threads``."""
    options = dict(storage_options)
    threads = int(options.pop("max_threads", min(max_inflight, 8)))
    max_open = int(options.pop("max_open_files", 128))
    if options:
        raise ConfigError(f"unknown storage_options for local files: {sorted(options)}")
    return LocalStore(max_threads=threads, max_open_files=max_open)
