"""Store over any other fsspec filesystem (memory, GCS, Azure, ...).

Async filesystems are used natively: one ``asynchronous=True`` instance per store, created
lazily in the loop that reads, never fsspec's own loop thread. Sync filesystems run in a
bounded thread pool. Every range is length-checked and read under the store's
:class:`~asyncbatch.stores.retry.RetryPolicy` (OS and timeout errors are retried). S3 and
HTTP have their own stores (``s3.py``, ``http.py``), which check far more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from ..errors import ConfigError, NotFoundError, PermissionDeniedError, StoreError, describe_range
from .base import Buffer, ObjectInfo, check_length
from .ranged import REMOTE_COALESCE_GAP, fail
from .retry import DEFAULT_POLICY, RetryPolicy, with_retries

#: Fields of ``info()`` that identify an object's version, most specific first.
_VERSION_FIELDS = ("ETag", "etag", "generation", "version_id", "md5", "mtime", "LastModified")


class FsspecStore:
    """Store for every fsspec protocol; ``max_inflight`` bounds the requests in flight."""

    coalesce_gap = REMOTE_COALESCE_GAP

    def __init__(
        self,
        protocol: str,
        storage_options: Mapping[str, Any],
        *,
        max_inflight: int = 64,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        self.protocol = protocol
        self.retry = retry
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
                fs = self._cls(
                    asynchronous=True,
                    loop=asyncio.get_running_loop(),
                    skip_instance_cache=True,
                    **self._options,
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
        except PermissionError as exc:
            raise PermissionDeniedError(f"permission denied: {url}", url) from exc
        except StoreError:
            raise
        except (OSError, TimeoutError) as exc:  # a connection or an I/O error: may pass
            raise fail(StoreError, f"{method} failed: {exc!r}", url, retryable=True) from exc
        except Exception as exc:  # other errors (not all OSError) are not retried
            raise StoreError(f"{method} failed: {url}: {exc!r}", url) from exc

    async def size(self, url: str) -> int:
        return (await self.stat(url)).size

    async def stat(self, url: str) -> ObjectInfo:
        """Size and version from ``info()``: the first of the fields filesystems use for one
        (ETag, generation, mtime, ...); None if it reports none."""
        info = await self._call(url, "info", url)
        size = info.get("size")
        if size is None:
            raise StoreError(f"size unknown: {url} (the server reports no length)", url)
        version = next((info[key] for key in _VERSION_FIELDS if info.get(key)), None)
        return ObjectInfo(int(size), None if version is None else str(version))

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
        where = describe_range(url, start, end)

        async def attempt() -> bytes:
            try:
                data: bytes = await self._call(url, "cat_file", url, start=start, end=end)
            except StoreError as exc:
                if type(exc) is not StoreError:
                    raise  # typed: not found, permission denied
                error = StoreError(f"read failed: {where}: {exc}", url, start, end)
                error.detail = str(exc)  # type: ignore[attr-defined]
                error.retryable = getattr(exc, "retryable", False)  # type: ignore[attr-defined]
                raise error from exc
            return data

        data = await with_retries(
            self.retry, attempt, what=f"read of {where}", url=url, start=start, end=end
        )
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
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> FsspecStore:
    """Registry factory: an :class:`FsspecStore` for ``protocol``."""
    try:
        return FsspecStore(scheme, storage_options, max_inflight=max_inflight, retry=retry)
    except ImportError as exc:
        hint = {"s3": "s3", "s3a": "s3", "http": "http", "https": "http"}.get(scheme)
        extra = f"; pip install 'asyncbatch[{hint}]'" if hint else ""
        raise ConfigError(f"the {scheme!r} store needs a package: {exc}{extra}") from exc
