"""Store over any fsspec filesystem.

Async filesystems (s3fs, HTTP, gcsfs, ...) are used natively: one ``asynchronous=True``
instance per store, created lazily in the loop that reads, never fsspec's own loop thread.
Sync filesystems run in a bounded thread pool. Every range is length-checked: s3fs and
fsspec's HTTP return short data without error when a range runs past the end of an object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from ..errors import ConfigError, NotFoundError, StoreError, describe_range
from .base import Buffer, check_length

#: Gap below which neighbouring ranges are merged. With tens of requests in flight, one more
#: request costs about RTT / in-flight ≈ 10 ms / 64 ≈ 150 µs ≈ 150 KB at 1 GB/s: merging
#: across larger gaps moves more bytes than the request it saves.
REMOTE_COALESCE_GAP = 128 * 1024


class FsspecStore:
    """Store for every fsspec protocol; ``max_inflight`` bounds the requests in flight."""

    coalesce_gap = REMOTE_COALESCE_GAP

    def __init__(
        self, protocol: str, storage_options: Mapping[str, Any], *, max_inflight: int = 64
    ) -> None:
        self.protocol = protocol
        self._options = dict(storage_options)
        self._cls = fsspec.get_filesystem_class(protocol)
        self.is_async = bool(getattr(self._cls, "async_impl", False))
        self._max_inflight = max_inflight
        self._fs: Any = None
        self._limit: asyncio.Semaphore | None = None
        self._pool: ThreadPoolExecutor | None = None

    async def _filesystem(self) -> Any:
        if self._fs is None:
            if self.is_async:
                options = dict(self._options)
                if self.protocol in ("s3", "s3a"):
                    # aiobotocore pools 10 connections by default: as many as we keep in flight.
                    config = dict(options.get("config_kwargs") or {})
                    config.setdefault("max_pool_connections", self._max_inflight)
                    options["config_kwargs"] = config
                fs = self._cls(
                    asynchronous=True,
                    loop=asyncio.get_running_loop(),
                    skip_instance_cache=True,
                    **options,
                )
                await fs.set_session()
            else:
                fs = self._cls(skip_instance_cache=True, **self._options)
                self._pool = ThreadPoolExecutor(
                    min(self._max_inflight, 32), thread_name_prefix="asyncbatch-fsspec"
                )
            self._limit = asyncio.Semaphore(self._max_inflight)
            self._fs = fs
        return self._fs

    async def _call(self, url: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``fs._method`` (async) or ``fs.method`` (sync, in a thread); map errors."""
        fs = await self._filesystem()
        assert self._limit is not None
        try:
            async with self._limit:
                if self.is_async:
                    return await getattr(fs, f"_{method}")(*args, **kwargs)
                loop = asyncio.get_running_loop()
                call = getattr(fs, method)
                return await loop.run_in_executor(self._pool, lambda: call(*args, **kwargs))
        except FileNotFoundError as exc:
            raise NotFoundError(f"not found: {url}", url) from exc
        except StoreError:
            raise
        except Exception as exc:  # aiohttp and botocore errors are not all OSError
            raise StoreError(f"{method} failed: {url}: {exc!r}", url) from exc

    async def size(self, url: str) -> int:
        info = await self._call(url, "info", url)
        size = info.get("size")
        if size is None:
            raise StoreError(f"size unknown: {url} (the server reports no length)", url)
        return int(size)

    async def list(self, url: str) -> list[str]:
        fs = await self._filesystem()
        entries = await self._call(url, "ls", url, detail=False)
        return sorted(fs.unstrip_protocol(entry) for entry in entries)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        await asyncio.gather(
            *(
                self._read_one(url, start, end, buffer)
                for start, end, buffer in zip(starts, ends, buffers, strict=True)
            )
        )

    async def _read_one(self, url: str, start: int, end: int, buffer: Buffer) -> None:
        try:
            data = await self._call(url, "cat_file", url, start=start, end=end)
        except NotFoundError:
            raise
        except StoreError as exc:
            where = describe_range(url, start, end)
            raise StoreError(f"read failed: {where}: {exc}", url, start, end) from exc
        check_length(url, start, end, len(data))
        buffer[:] = data

    async def write(self, url: str, data: Buffer | bytes) -> None:
        await self._call(url, "pipe_file", url, bytes(data))

    async def close(self) -> None:
        fs, self._fs = self._fs, None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if fs is None or not self.is_async:
            return
        session = getattr(fs, "_session", None)
        if session is not None and hasattr(session, "close"):
            await session.close()  # fsspec HTTP: an aiohttp ClientSession
        s3 = getattr(fs, "_s3", None)
        if s3 is not None:
            await s3.__aexit__(None, None, None)  # s3fs: an aiobotocore client
            fs._s3 = None


def fsspec_store(
    scheme: str, storage_options: Mapping[str, Any], *, max_inflight: int
) -> FsspecStore:
    """Registry factory: an :class:`FsspecStore` for ``protocol``."""
    try:
        return FsspecStore(scheme, storage_options, max_inflight=max_inflight)
    except ImportError as exc:
        hint = {"s3": "s3", "s3a": "s3", "http": "http", "https": "http"}.get(scheme)
        extra = f"; pip install 'asyncbatch[{hint}]'" if hint else ""
        raise ConfigError(f"the {scheme!r} store needs a package: {exc}{extra}") from exc
