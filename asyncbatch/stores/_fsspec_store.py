"""Transport over any other fsspec filesystem (memory, GCS, Azure, a registered class, ...).

Async filesystems are used natively: one ``asynchronous=True`` instance per store, created
lazily in the loop that reads, never fsspec's own loop thread. Sync filesystems run in a
bounded thread pool. A thin transport: the registry's stack (``stack.py``) checks every
range's length, pins versions and retries under the
:class:`~asyncbatch.stores._retry.RetryPolicy`. S3 and HTTP have transports of their own
(``s3.py``, ``http.py``) that resume broken bodies and send the pin as ``If-Match``.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from .._errors import ConfigError, StoreError
from ._base import Buffer, ObjectInfo
from ._ranged import REMOTE_COALESCE_GAP, run_all
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._stack import map_error

#: Fields of ``info()`` that identify an object's version, most specific first.
_VERSION_FIELDS = ("ETag", "etag", "generation", "version_id", "md5", "mtime", "LastModified")


class FsspecStore:
    """Transport for every fsspec protocol; ``max_inflight`` bounds the requests in flight."""

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
        #: What the async filesystem's ``set_session()`` returned (an aiohttp session, an
        #: aiobotocore client): closed with the store.
        self._connection: Any = None
        self._limit: asyncio.Semaphore | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._opening = asyncio.Lock()

    @property
    def max_inflight(self) -> int:
        """Requests this transport keeps in flight at most."""
        return self._max_inflight

    async def _filesystem(self) -> Any:
        if self._fs is None:
            # The groups of a run start together: one of them creates the filesystem (and
            # its client session), the others wait for it, so no session is made twice and
            # lost unclosed.
            async with self._opening:
                if self._fs is None:
                    self._fs = await self._create()
        return self._fs

    async def _create(self) -> Any:
        """A new filesystem (async: its client session set up) and the bound on its calls."""
        if self.is_async:
            fs = self._cls(
                asynchronous=True,
                loop=asyncio.get_running_loop(),
                skip_instance_cache=True,
                **self._options,
            )
            # s3fs and fsspec's HTTP call it set_session, gcsfs _set_session (its async
            # interface); adlfs has neither: it connects in __init__.
            setup = getattr(fs, "set_session", None) or getattr(fs, "_set_session", None)
            self._connection = None if setup is None else await setup()
        else:
            fs = self._cls(skip_instance_cache=True, **self._options)
            self._pool = ThreadPoolExecutor(
                min(self._max_inflight, 32), thread_name_prefix="asyncbatch-fsspec"
            )
        self._limit = asyncio.Semaphore(self._max_inflight)
        return fs

    async def _call(self, url: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``fs._method`` (async) or ``fs.method`` (sync, in a thread); typed errors."""
        fs = await self._filesystem()
        assert self._limit is not None
        try:
            async with self._limit:
                if self.is_async:
                    return await getattr(fs, f"_{method}")(*args, **kwargs)
                loop = asyncio.get_running_loop()
                call = getattr(fs, method)
                return await loop.run_in_executor(self._pool, lambda: call(*args, **kwargs))
        except Exception as exc:  # mapped here too: S3's and HTTP's listings come this way
            raise map_error(exc, url) from exc

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

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        """The listing with each file's size and version as :meth:`stat` reads them from
        ``info()`` (``ls`` with details holds the same fields); None for a folder."""
        fs = await self._filesystem()
        entries = await self._call(url, "ls", url, detail=True)
        found: builtins.list[tuple[str, ObjectInfo | None]] = []
        for entry in entries:
            name = fs.unstrip_protocol(entry["name"])
            if entry.get("type") == "directory" or entry.get("size") is None:
                found.append((name, None))
                continue
            version = next((entry[key] for key in _VERSION_FIELDS if entry.get(key)), None)
            info = ObjectInfo(int(entry["size"]), None if version is None else str(version))
            found.append((name, info))
        return sorted(found, key=lambda item: item[0])

    async def get_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int]
    ) -> Sequence[bytes]:
        """One ``cat_file`` per range, concurrently (the stack checks the lengths)."""
        reads = [
            asyncio.ensure_future(self._call(url, "cat_file", url, start=start, end=end))
            for start, end in zip(starts, ends, strict=True)
        ]
        await run_all(reads)  # the first failure cancels the rest
        return [read.result() for read in reads]

    async def write(self, url: str, data: Buffer | bytes) -> None:
        await self._call(url, "pipe_file", url, bytes(data))

    async def close(self) -> None:
        fs, self._fs = self._fs, None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        connection, self._connection = self._connection, None
        if fs is None or not self.is_async:
            return
        # fsspec HTTP: an aiohttp session; s3fs: an aiobotocore client; gcsfs: an aiohttp
        # session; adlfs: azure-storage-blob's aio client, made in __init__.
        for held in (connection, getattr(fs, "service_client", None)):
            close = getattr(held, "close", None)
            if close is not None:
                closing = close()
                if inspect.isawaitable(closing):
                    await closing


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
