"""GCS transport: ``gs://`` (and ``gcs://``) over the JSON API, credentials from
google-auth (:mod:`~asyncbatch.stores._gcs_auth`).

Why not obstore's ``GCSStore`` (Rust ``object_store``), the obvious candidate, faster on the
emulator (``benchmarks/bench_gcs.py``: its HTTP runs in Rust threads, off the GIL): its
errors tell the status only in their text and carry no ``Retry-After``, so a throttled read
cannot wait as long as GCS asks; a ranged GET can send an ETag (``If-Match``) or ask for one
generation (a 404 once the object is replaced, which cannot be told from a deleted one), not
``ifGenerationMatch``; its timeout bounds a whole request, not the pauses of a body; and a
broken body is resumed only by streaming it from Python chunk by chunk, which gives back
much of the speed. Its ranged GETs go on keep-alive connections of
:mod:`~asyncbatch.stores._wire` (80 µs of client CPU per window where aiohttp cost 140),
every other request over aiohttp. The GCS store is the HTTP store's twin and shares
:mod:`~asyncbatch.stores._ranged` with it and with S3: every range checked against
``Content-Range``, a broken body resumed from its missing tail, connect / first-byte / idle
timeouts, one attempt per call (the registry's stack retries under the
:class:`~asyncbatch.stores._retry.RetryPolicy`; aiohttp retries nothing), typed errors.

Versions are generations. ``stat`` reads an object's size and generation (one metadata
GET); a ranged read is ``GET .../o/KEY?alt=media`` with ``Range``, sends the pinned
generation as ``ifGenerationMatch`` (a 412 is a :class:`~asyncbatch._errors.ShardChangedError`)
and reports the ``x-goog-generation`` of the answer, which the stack compares with the pin
(an emulator or proxy that ignores the precondition is caught too). A tail is one suffix
GET (``Range: bytes=-N``: the size from ``Content-Range``, the generation from its header).
A listing (``delimiter=/``, page by page) tells every object's size and generation, so a
Parquet prefix opens from its footers only. Writes are single-request media uploads.

``storage_options``: ``token`` (see :mod:`~asyncbatch.stores._gcs_auth`), ``access``
(``read_only``, ``read_write``: the default, ``full_control``), ``project`` and
``requester_pays`` (``True`` bills ``project``; a string bills that project), and
``endpoint_url`` (an emulator, a private endpoint); without it ``STORAGE_EMULATOR_HOST``
names an emulator (then no credentials are sent unless ``token`` says otherwise).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from .._errors import (
    BucketNotFoundError,
    ConfigError,
    CredentialsError,
    NotFoundError,
    ShardChangedError,
    ShortReadError,
    StoreError,
)
from .._redact import stand_in
from ._base import Buffer, ObjectInfo, Progress
from ._gcs_auth import SCOPES, GcsCredentials, check_token
from ._http import TLS_HINT, client_session, send_request
from ._ranged import (
    CHUNK,
    REMOTE_COALESCE_GAP,
    TailAnswer,
    connection_error,
    fail,
    host_of,
    parse_retry_after,
    receive_range,
    receive_tail,
    status_error,
    tail_from,
)
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._validate import check_options
from ._wire import Pool, Response

#: Where GCS is, without an endpoint option or ``STORAGE_EMULATOR_HOST``.
GOOGLE_ENDPOINT = "https://storage.googleapis.com"
#: The storage options this store takes.
OPTIONS = ("access", "endpoint_url", "project", "requester_pays", "token")
#: Objects per page of a listing (the API's maximum).
_PAGE = 1000
#: Object URLs kept built (a dataset's shards, each with its pinned generation).
_URLS = 16384
#: Bytes of an error body read at most (GCS's JSON errors are a few hundred).
_ERROR_BODY = 64 * 1024
#: Bucket names: 3-63 characters (222 with dots), lower-case letters, digits, ``-_.``.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def split_url(url: str) -> tuple[str, str]:
    """``gs://bucket/key`` → ``(bucket, key)``; a bucket name GCS would refuse is a
    :class:`ConfigError` here, before any request."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket) or any(len(part) > 63 for part in bucket.split(".")):
        raise ConfigError(
            f"invalid bucket name {bucket!r} in {url}: bucket names are 3 to 63 (222 with dots)"
            " lower-case letters, digits, dots, hyphens and underscores, starting and ending"
            " with a letter or digit"
        )
    return bucket, key


def _endpoint(option: object) -> str:
    """The API's root URL: the option, else ``STORAGE_EMULATOR_HOST``, else Google's."""
    if option is not None:
        if not isinstance(option, str) or not option.startswith(("http://", "https://")):
            raise ConfigError(
                f"storage_options endpoint_url={option!r} must be an http:// or https:// URL"
                " (e.g. http://127.0.0.1:4443 for an emulator)"
            )
        return option.rstrip("/")
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host:
        return (host if "://" in host else f"http://{host}").rstrip("/")
    return GOOGLE_ENDPOINT


class GcsStore:
    """Transport for ``gs://`` and ``gcs://`` URLs (see the module's docstring)."""

    coalesce_gap = REMOTE_COALESCE_GAP

    def __init__(
        self,
        protocol: str = "gs",
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_inflight: int = 64,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        options = dict(storage_options or {})
        check_options("GCS", options, OPTIONS)
        self.protocol = protocol
        self.max_inflight = max_inflight
        self.retry = retry
        emulated = "endpoint_url" not in options and bool(os.environ.get("STORAGE_EMULATOR_HOST"))
        self.endpoint = _endpoint(options.get("endpoint_url"))
        access = options.get("access", "read_write")
        if access not in SCOPES:
            raise ConfigError(
                f"storage_options access={access!r} is not one of {', '.join(SCOPES)}"
            )
        check_token(options.get("token"))
        self._credentials = GcsCredentials(
            options.get("token"),
            access=access,
            emulator=emulated,
            timeout=retry.connect_timeout + retry.first_byte_timeout,
        )
        self._billing = self._billed_project(options.get("project"), options.get("requester_pays"))
        self._session: aiohttp.ClientSession | None = None
        #: Keep-alive connections for the ranged reads (:mod:`~asyncbatch.stores._wire`).
        self._wire: Pool | None = None
        self._closed = False
        self._limit: asyncio.Semaphore | None = None
        self._urls: dict[tuple[str, ...], URL] = {}
        #: False once the endpoint answered a suffix range with other bytes.
        self._suffix_ranges = True

    @staticmethod
    def _billed_project(project: object, requester_pays: object) -> str | None:
        """The ``userProject`` of every request (requester-pays buckets), or None."""
        if project is not None and not isinstance(project, str):
            raise ConfigError(f"storage_options project={project!r} must be a project id")
        if requester_pays in (None, False):
            return None
        if isinstance(requester_pays, str):
            return requester_pays
        if requester_pays is True and project:
            return project
        raise ConfigError(
            f"storage_options requester_pays={requester_pays!r} needs the project to bill:"
            " pass project='my-project' with requester_pays=True, or requester_pays='my-project'"
        )

    # -- requests ---------------------------------------------------------------------------

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._limit is None:
            if self._closed:  # a request that outlived the store: no session left behind
                raise RuntimeError("this GCS store is closed")
            self._session = client_session(
                self.max_inflight,
                self.retry.connect_timeout,
                cookie_jar=aiohttp.DummyCookieJar(),  # GCS sets none: no cookie work per request
            )
            self._limit = asyncio.Semaphore(self.max_inflight)
        return self._session, self._limit

    def _pool(self) -> Pool:
        if self._wire is None:
            if self._closed:
                raise RuntimeError("this GCS store is closed")
            self._wire = Pool(
                self.endpoint, keep=self.max_inflight, connect_timeout=self.retry.connect_timeout
            )
        return self._wire

    def _object_url(self, url: str, **query: str) -> URL:
        """``.../b/BUCKET/o/KEY?query`` for ``url`` (and the billed project), built once per
        URL and query: yarl takes ~50 µs to build one, a fifth of a request's CPU."""
        key = (url, *(f"{k}={v}" for k, v in query.items()))
        found = self._urls.get(key)
        if found is None:
            bucket, name = split_url(url)
            if not name:
                raise ConfigError(f"no object named in {url}: gs://bucket/path/to/object")
            if self._billing is not None:
                query["userProject"] = self._billing
            path = f"{self.endpoint}/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"
            if query:
                path += "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
            if len(self._urls) >= _URLS:
                self._urls.clear()
            found = self._urls[key] = URL(path, encoded=True)
        return found

    async def _request(
        self,
        method: str,
        target: URL,
        url: str,
        headers: Mapping[str, str] | None = None,
        start: int | None = None,
        end: int | None = None,
        data: bytes | None = None,
        wire: bool = False,
    ) -> aiohttp.ClientResponse | Response:
        """Send a request and wait for its headers; an error status raises its typed error.
        ``wire``: on the pool of :mod:`~asyncbatch.stores._wire` (a GET without a body)."""
        session: aiohttp.ClientSession | Pool = self._pool() if wire else self._client()[0]
        sent = self._credentials.ready()
        if sent is None:
            sent = await self._credentials.headers(url)
        if headers:
            sent = {**sent, **headers}
        if data is not None:
            sent = {**sent, "Content-Length": str(len(data))}

        def broken(exc: BaseException) -> StoreError:
            return connection_error(exc, host_of(self.endpoint), url, start, end, tls_hint=TLS_HINT)

        response = await send_request(
            session, method, target, sent, self.retry, broken, url, start, end, data
        )
        if response.status >= 400:
            raise await self._error(response, url, start, end)
        return response

    async def _error(
        self,
        response: aiohttp.ClientResponse | Response,
        url: str,
        start: int | None,
        end: int | None,
    ) -> StoreError:
        """The typed error of an error answer (its JSON message in the text)."""
        status, reason = response.status, response.reason or ""
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        try:
            async with asyncio.timeout(self.retry.idle_timeout):
                body = await response.content.read(_ERROR_BODY)
        except (aiohttp.ClientError, OSError, TimeoutError):
            body = b""
        finally:
            response.close()
        message = _message(body)
        if status == 412:
            sent = URL(str(response.url)).query.get("ifGenerationMatch", "?")
            return self._changed(url, sent, await self._generation(url))
        if status == 401:
            detail = (
                f"{host_of(self.endpoint)} rejected the credentials (HTTP 401"
                f"{': ' + message if message else ''}): check GOOGLE_APPLICATION_CREDENTIALS,"
                " `gcloud auth application-default login` or storage_options token="
            )
            return fail(CredentialsError, detail, url, start, end)
        if status == 404:
            return await self._not_found(url, start, end, message)
        if message and status != 416:
            reason = f"{reason}: {message}" if reason else message
        error = status_error(status, reason, url, start, end, retry_after=retry_after)
        if status == 408:  # GCS's request timeout: its guidelines say to retry it
            error.retryable = True  # type: ignore[attr-defined]
        return error

    async def _not_found(
        self, url: str, start: int | None, end: int | None, message: str
    ) -> StoreError:
        """A 404: the bucket's, if it does not exist (asked of GCS), else the object's."""
        bucket, _ = split_url(url)
        missing = "bucket does not exist" in message
        if not missing:
            session, _ = self._client()
            target = URL(
                f"{self.endpoint}/storage/v1/b/{quote(bucket, safe='')}", encoded=True
            ).with_query({"fields": "name"})
            try:
                headers = await self._credentials.headers(url)
                async with asyncio.timeout(self.retry.first_byte_timeout):
                    async with session.get(target, headers=headers) as response:
                        missing = response.status == 404
            except (aiohttp.ClientError, OSError, TimeoutError, StoreError):
                pass  # only decorates an error being raised
        if missing:
            return fail(
                BucketNotFoundError,
                f"the bucket {bucket!r} does not exist (HTTP 404): check the bucket's name",
                url,
                start,
                end,
            )
        return fail(NotFoundError, "not found (HTTP 404)", url, start, end)

    def _changed(self, url: str, pinned: str, now: str | None) -> ShardChangedError:
        error = fail(
            ShardChangedError,
            f"the object changed since it was pinned: generation {pinned} when first read,"
            f" {now or 'another generation'} now",
            url,
        )
        assert isinstance(error, ShardChangedError)
        return error

    async def _generation(self, url: str) -> str | None:
        """The object's generation now (for error messages; None if it cannot tell); asked
        outside the bound on requests in flight, which the failed request still holds."""
        try:
            return (await self._metadata(url)).version
        except StoreError:
            return None

    # -- the transport ----------------------------------------------------------------------

    async def stat(self, url: str) -> ObjectInfo:
        """Size and generation from the object's metadata."""
        _, limit = self._client()
        async with limit:
            return await self._metadata(url)

    async def _metadata(self, url: str) -> ObjectInfo:
        """``stat`` outside the bound on requests in flight."""
        target = self._object_url(url, fields="size,generation")
        response = await self._request("GET", target, url)
        body = await self._body(response, "metadata", url)
        try:
            meta = json.loads(body)
            return ObjectInfo(int(meta["size"]), str(meta["generation"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise fail(StoreError, f"unreadable object metadata {body[:200]!r}", url) from exc

    async def _body(
        self, response: aiohttp.ClientResponse | Response, what: str, url: str
    ) -> bytes:
        """The whole body of a small answer (metadata, a listing page), then released; one
        cut off is a retryable :class:`StoreError` chained to a scrubbed stand-in of
        aiohttp's error (raised outside the ``except``: not its context either)."""
        try:
            async with asyncio.timeout(self.retry.idle_timeout):
                return await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = fail(StoreError, f"{what} cut off ({exc!r})", url, retryable=True)
            cause = stand_in(exc)
        finally:
            response.release()
        raise error from cause

    async def read_range(
        self,
        url: str,
        *,
        start: int,
        end: int,
        buffer: Buffer,
        progress: Progress,
        version: str | None,
    ) -> None:
        """One GET of the range's missing tail ``[start + progress.got, end)``, the pinned
        generation sent as ``ifGenerationMatch``."""
        _, limit = self._client()
        first = start + progress.got
        if version is None:
            target = self._object_url(url, alt="media")
        else:
            target = self._object_url(url, alt="media", ifGenerationMatch=version)
        async with limit:
            response = await self._request(
                "GET", target, url, {"Range": f"bytes={first}-{end - 1}"}, start, end, wire=True
            )
            progress.version = response.headers.get("x-goog-generation") or None
            await receive_range(
                response, buffer, progress, self.retry.idle_timeout, url, start, end, first
            )

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes with the size and generation, from one
        ``Range: bytes=-length`` GET. An empty object (416) costs a metadata GET instead."""
        answer = None
        if length > 0 and self._suffix_ranges:
            answer = await self._get_tail(url, length)
            if answer is not None and answer.tail is None:
                self._suffix_ranges = False
        return await tail_from(self, url, length, answer)

    async def _get_tail(self, url: str, length: int) -> TailAnswer | None:
        """One suffix GET; None for a 416."""
        _, limit = self._client()
        target = self._object_url(url, alt="media")
        async with limit:
            try:
                response = await self._request("GET", target, url, {"Range": f"bytes=-{length}"})
            except ShortReadError:  # 416
                return None
            answer = None
            generation = response.headers.get("x-goog-generation") or None
            content_range = response.headers.get("Content-Range") or ""
            if content_range.endswith("/0") and not response.content_length:
                # An empty object (fake-gcs-server answers "bytes 0--1/0"): no bytes, size 0.
                response.release()
                return TailAnswer(bytearray(), 0, generation)
            try:
                answer = await receive_tail(
                    lambda: response.content.read(CHUNK),
                    url,
                    length,
                    response.status,
                    content_range,
                    response.content_length,
                    generation,
                    self.retry.idle_timeout,
                )
            finally:
                if answer is not None and answer.tail is not None:
                    response.release()
                else:
                    response.close()
        return answer

    async def list(self, url: str) -> builtins.list[str]:
        """URLs of the objects and folders directly under the prefix ``url``, sorted."""
        return [name for name, _ in await self.list_info(url)]

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        """The listing with each object's size and generation (None for a folder), page by
        page. A prefix with nothing under it is a :class:`NotFoundError` (the object itself,
        if ``url`` names one, is listed alone)."""
        bucket, key = split_url(url)
        prefix = key.rstrip("/") + "/" if key.rstrip("/") else ""
        found: builtins.list[tuple[str, ObjectInfo | None]] = []
        token: str | None = None
        base = f"{self.protocol}://{bucket}/"
        while True:
            query = {
                "prefix": prefix,
                "delimiter": "/",
                "maxResults": str(_PAGE),
                "fields": "items(name,size,generation),prefixes,nextPageToken",
            }
            if token:
                query["pageToken"] = token
            page = await self._list_page(bucket, query, url)
            for item in page.get("items") or []:
                try:
                    name = str(item["name"])
                    info = ObjectInfo(int(item["size"]), str(item["generation"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise fail(StoreError, f"unreadable listing item {item!r:.200}", url) from exc
                if name != prefix:  # else a folder's own placeholder object
                    found.append((base + name, info))
            found.extend((base + str(p).rstrip("/"), None) for p in page.get("prefixes") or [])
            token = page.get("nextPageToken")
            if not token:
                break
        if not found and key:
            try:
                return [(url, await self.stat(url))]
            except NotFoundError:
                raise fail(NotFoundError, "nothing under this prefix", url) from None
        return sorted(found, key=lambda item: item[0])

    async def _list_page(self, bucket: str, query: dict[str, str], url: str) -> dict[str, Any]:
        if self._billing is not None:
            query["userProject"] = self._billing
        target = URL(
            f"{self.endpoint}/storage/v1/b/{quote(bucket, safe='')}/o", encoded=True
        ).with_query(query)
        _, limit = self._client()
        async with limit:
            response = await self._request("GET", target, url)
            body = await self._body(response, "listing", url)
        try:
            page: dict[str, Any] = json.loads(body)
        except ValueError as exc:
            raise fail(StoreError, f"unreadable listing {body[:200]!r}", url) from exc
        return page

    async def write(self, url: str, data: Buffer | bytes) -> None:
        """Write ``data`` as the whole object (one media upload)."""
        bucket, key = split_url(url)
        if not key or key.endswith("/"):
            raise ConfigError(f"cannot write an object without a name: {url}")
        query = {"uploadType": "media", "name": key}
        if self._billing is not None:
            query["userProject"] = self._billing
        target = URL(
            f"{self.endpoint}/upload/storage/v1/b/{quote(bucket, safe='')}/o", encoded=True
        ).with_query(query)
        headers = {"Content-Type": "application/octet-stream"}
        _, limit = self._client()
        async with limit:
            response = await self._request("POST", target, url, headers, data=bytes(data))
            response.close()

    async def close(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        pool, self._wire = self._wire, None
        if pool is not None:
            await pool.close()
        if session is not None:
            await session.close()


def _message(body: bytes) -> str:
    """The message of a GCS JSON error body (``{"error": {"message": ...}}``), else ''."""
    try:
        error = json.loads(body).get("error")
        return " ".join(str(error.get("message") or "").split())
    except (ValueError, AttributeError, TypeError):
        return ""


def gcs_store(
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> GcsStore:
    """Registry factory: a :class:`GcsStore` (needs ``pip install 'asyncbatch[gcs]'``)."""
    try:
        import google.auth  # noqa: F401
        import google.auth.transport.requests  # noqa: F401
    except ImportError as exc:
        msg = f"the {scheme!r} store needs a package: {exc}; pip install 'asyncbatch[gcs]'"
        raise ConfigError(msg) from exc
    return GcsStore(scheme, storage_options, max_inflight=max_inflight, retry=retry)
