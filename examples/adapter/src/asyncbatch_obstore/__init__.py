"""An asyncbatch store over obstore (the Rust ``object_store`` crate): S3, GCS and Azure.

URLs are ``obstore+s3://bucket/key`` (also ``obstore+gs://`` and ``obstore+az://``). The
transport implements asyncbatch's read-only capabilities: ``get_versioned_ranges`` (ranged
reads that take the pinned version and tell the one they read) and ``stat``, plus ``list``
and ``close``; asyncbatch stacks its guards over it (exact lengths, typed errors, retries
with its own policy, version pinning), so this module only translates. Every ranged read
carries ``If-Match`` with the pinned ETag and reports the ETag it got, which the stack
compares with the pin, so bytes of two versions of one object never mix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import obstore
from obstore import exceptions as obe
from obstore.store import AzureStore, GCSStore, ObjectStore, S3Store

from asyncbatch import ConfigError, ShardChangedError
from asyncbatch.stores import ObjectInfo

if TYPE_CHECKING:
    from obstore import GetOptions  # in the type stubs only

__all__ = ["ObstoreTransport", "obstore_store"]

#: s3fs-style ``storage_options`` keys and the S3 config keys they mean.
_S3_ALIASES = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "region_name": "region",
    "anon": "skip_signature",
}
_STORES: dict[str, Any] = {"s3": S3Store, "gs": GCSStore, "az": AzureStore}


def _s3_config(options: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, value in options.items():
        if key == "client_kwargs":  # s3fs nests the endpoint and region here
            config.update(_s3_config(value))
        else:
            config[_S3_ALIASES.get(key, key)] = value
    return config


class ObstoreTransport:
    """Objects of one scheme, one obstore client per bucket (made on first use)."""

    #: A request costs about as much as this many bytes: merge ranges closer than this.
    coalesce_gap = 256 * 1024

    def __init__(self, scheme: str, storage_options: Mapping[str, Any], max_inflight: int):
        self.scheme = scheme
        self._kind = scheme.partition("+")[2]
        if self._kind not in _STORES:
            raise ConfigError(f"obstore store: unknown scheme {scheme!r}")
        options = dict(storage_options)
        self._client_options = {"timeout": "30s", **options.pop("client_options", {})}
        self._config = _s3_config(options) if self._kind == "s3" else options
        endpoint = str(self._config.get("endpoint", ""))
        if endpoint.startswith("http://"):
            self._client_options.setdefault("allow_http", True)
        self._stores: dict[str, ObjectStore] = {}
        self._limit = asyncio.Semaphore(max_inflight)

    def _locate(self, url: str) -> tuple[ObjectStore, str]:
        parts = urlsplit(url)
        bucket, path = parts.netloc, parts.path.lstrip("/")
        store = self._stores.get(bucket)
        if store is None:
            # asyncbatch retries (its RetryPolicy, the same for every store): obstore does not.
            retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=30)}
            try:
                store = _STORES[self._kind](
                    bucket,
                    config=self._config,
                    client_options=self._client_options,
                    retry_config=retry,
                )
            except obe.BaseError as exc:
                raise ConfigError(f"obstore store for {url}: {exc}") from exc
            self._stores[bucket] = store
        return store, path

    async def stat(self, url: str) -> ObjectInfo:
        store, path = self._locate(url)
        try:
            meta = await obstore.head_async(store, path)
        except obe.BaseError as exc:
            raise _builtin(exc) from exc
        return ObjectInfo(meta["size"], meta["e_tag"] or meta["version"])

    async def get_versioned_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], version: str | None
    ) -> tuple[Sequence[bytes | memoryview], str | None]:
        # One request per range, in parallel: obstore's own get_ranges would merge ranges up
        # to 1 MiB apart, fetching bytes asyncbatch's planner chose to skip.
        store, path = self._locate(url)
        got = await asyncio.gather(
            *(self._get(store, url, path, s, e, version) for s, e in zip(starts, ends, strict=True))
        )
        seen = {tag for _, tag in got if tag is not None}
        if len(seen) > 1:  # replaced between two of these requests (none pinned yet)
            raise ShardChangedError(f"{url} changed while read: ETags {sorted(seen)}", url)
        return [data for data, _ in got], next(iter(seen), None)

    async def _get(
        self, store: ObjectStore, url: str, path: str, start: int, end: int, version: str | None
    ) -> tuple[bytes | memoryview, str | None]:
        """Bytes ``[start, end)`` and the ETag of the object they came from."""
        if end <= start:
            return b"", None
        options: GetOptions = {"range": (start, end)}
        if version is not None:
            options["if_match"] = version
        async with self._limit:
            try:
                result = await obstore.get_async(store, path, options=options)
                data = memoryview(await result.bytes_async())
            except obe.PreconditionError as exc:
                raise ShardChangedError(
                    f"{url} changed: its ETag is no longer {version}", url, start, end
                ) from exc
            except obe.BaseError as exc:
                if "range" in str(exc).lower() and "not satisfiable" in str(exc).lower():
                    return b"", None  # starts past the end: the stack reports the short read
                raise _builtin(exc) from exc
        meta = result.meta
        return data, meta["e_tag"] or meta["version"]

    async def list(self, url: str) -> list[str]:
        store, path = self._locate(url.rstrip("/") + "/")
        prefix = path.rstrip("/")
        bucket = urlsplit(url).netloc
        try:
            found = await obstore.list_with_delimiter_async(store, prefix or None)
        except obe.BaseError as exc:
            raise _builtin(exc) from exc
        return sorted(f"{self.scheme}://{bucket}/{meta['path']}" for meta in found["objects"])

    async def close(self) -> None:
        self._stores.clear()


def _builtin(exc: obe.BaseError) -> Exception:
    """obstore's error as the built-in exception asyncbatch's stack maps to a typed one."""
    if isinstance(exc, obe.NotFoundError):
        return FileNotFoundError(str(exc))
    if isinstance(exc, obe.PermissionDeniedError | obe.UnauthenticatedError):
        return PermissionError(str(exc))
    if isinstance(exc, obe.UnknownConfigurationKeyError | obe.InvalidPathError):
        return ConfigError(str(exc))
    return ConnectionError(str(exc))  # a transport failure: retried by asyncbatch's policy


def obstore_store(
    scheme: str, storage_options: Mapping[str, Any], *, max_inflight: int = 64, **_: Any
) -> ObstoreTransport:
    """The factory asyncbatch calls for ``obstore+s3://``, ``obstore+gs://``, ``obstore+az://``."""
    return ObstoreTransport(scheme, storage_options, max_inflight)
