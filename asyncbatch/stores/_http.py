"""HTTP(S) transport: byte ranges read on keep-alive connections of
:mod:`~asyncbatch.stores._wire` (HEADs, tails and URLs with credentials in them over aiohttp),
one attempt per call, status- and ``Content-Range``-checked, each phase under its own
timeout.

fsspec's HTTP filesystem has no read timeout, accepts bodies that end early and returns the
whole object when a server ignores ``Range``; this transport reads ranges with aiohttp
directly. One ``ClientSession`` and one :class:`~asyncbatch.stores._wire.Pool` per server per
transport, created lazily in the loop that reads; they hold up to ``max_inflight``
connections, exactly the requests the transport lets run at once, so no request waits for a
connection (or times out doing so). It offers
:class:`~asyncbatch.stores._base.ResumesRanges`: the registry's stack (``stack.py``) retries
each range for its missing tail, pins each object at its first ETag and passes the pin in,
which this transport sends as ``If-Match``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from typing import Any, overload

import aiohttp
from yarl import URL

from .._errors import ConfigError, ShortReadError, StoreError, StoreTimeoutError
from .._redact import stand_in
from ._base import Buffer, ObjectInfo, Progress
from ._fsspec_store import FsspecStore
from ._ranged import (
    CHUNK,
    REMOTE_COALESCE_GAP,
    TailAnswer,
    changed,
    connection_error,
    fail,
    host_of,
    if_match,
    paced,
    parse_retry_after,
    receive_range,
    receive_tail,
    status_error,
    tail_from,
)
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._validate import check_options
from ._wire import ConnectTimeout, Pool, Response, check_headers

#: URLs whose pool and request URL are kept (each costs yarl ~50 µs to parse once).
_TARGETS = 16384

#: How to trust another certificate: aiohttp verifies against OpenSSL's default paths.
TLS_HINT = "set SSL_CERT_FILE to a CA bundle holding its issuer before starting Python"


def client_session(
    max_inflight: int,
    connect_timeout: float,
    *,
    headers: Mapping[str, str] | None = None,
    tls: ssl.SSLContext | bool = True,
    **options: Any,
) -> aiohttp.ClientSession:
    """An aiohttp session as the remote stores use one: ``max_inflight`` connections in all
    (none capped per host), only the connect phase timed (each store times headers and body
    itself), bodies as sent (``Accept-Encoding: identity``); ``options`` go to the session."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_inflight, limit_per_host=0, ssl=tls),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,
        headers={**(headers or {}), "Accept-Encoding": "identity"},
        **options,
    )


@overload
async def send_request(
    session: aiohttp.ClientSession,
    method: str,
    target: str | URL,
    headers: Mapping[str, str],
    retry: RetryPolicy,
    broken: Callable[[BaseException], StoreError],
    url: str,
    start: int | None = None,
    end: int | None = None,
    data: Buffer | bytes | None = None,
) -> aiohttp.ClientResponse: ...


@overload
async def send_request(
    session: Pool,
    method: str,
    target: str | URL,
    headers: Mapping[str, str],
    retry: RetryPolicy,
    broken: Callable[[BaseException], StoreError],
    url: str,
    start: int | None = None,
    end: int | None = None,
    data: Buffer | bytes | None = None,
) -> Response: ...


async def send_request(
    session: aiohttp.ClientSession | Pool,
    method: str,
    target: str | URL,
    headers: Mapping[str, str],
    retry: RetryPolicy,
    broken: Callable[[BaseException], StoreError],
    url: str,
    start: int | None = None,
    end: int | None = None,
    data: Buffer | bytes | None = None,
) -> aiohttp.ClientResponse | Response:
    """Send a request and wait for its headers, within the connect and first-byte timeouts
    (an upload's body in pieces, each moving the bound on); no connection in time, or no
    headers, is a :class:`StoreTimeoutError`, a broken connection ``broken(exc)``. Redirects
    are not followed; the status is the caller's to check.

    aiohttp's exceptions quote the request URL, SAS or signature included: the error chains
    a scrubbed stand-in (:func:`~asyncbatch._redact.stand_in`), raised outside the
    ``except`` so that the original is not its ``__context__`` either."""
    wait = retry.connect_timeout + retry.first_byte_timeout
    try:
        async with asyncio.timeout(wait) as deadline:
            if isinstance(session, Pool):
                assert data is None
                return await session.request(method, str(target), headers)
            body = None if data is None else paced(data, deadline, wait, CHUNK)
            return await session.request(
                method, target, headers=headers, data=body, allow_redirects=False
            )
    except (aiohttp.ConnectionTimeoutError, ConnectTimeout) as exc:
        detail = f"no connection within {retry.connect_timeout:g} s"
        error, cause = fail(StoreTimeoutError, detail, url, start, end), stand_in(exc)
    except TimeoutError as exc:
        detail = f"no response headers within {wait:g} s"
        error, cause = fail(StoreTimeoutError, detail, url, start, end), stand_in(exc)
    except (aiohttp.ClientError, OSError) as exc:
        error, cause = broken(exc), stand_in(exc)
    raise error from cause


class HttpStore:
    """Read-only transport for ``http://`` and ``https://`` URLs.

    ``storage_options``: ``headers`` (sent with every request). Listing (of a server's HTML
    index pages) goes through fsspec's HTTP filesystem; writing is not supported.
    """

    coalesce_gap = REMOTE_COALESCE_GAP

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_inflight: int = 64,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        options = dict(storage_options or {})
        check_options("HTTP", options, ("headers",))
        self._headers = dict(options.pop("headers", None) or {})
        try:
            check_headers(self._headers)
        except ValueError as exc:
            raise ConfigError(f"storage_options headers: {exc}") from exc
        self.max_inflight = max_inflight
        self.retry = retry
        self._session: aiohttp.ClientSession | None = None
        #: Each server's connections for the ranged GETs, and each URL's pool and request URL.
        self._pools: dict[str, Pool] = {}
        self._targets: dict[str, tuple[Pool, str] | None] = {}
        self._closed = False
        self._limit: asyncio.Semaphore | None = None
        self._lister: FsspecStore | None = None
        #: False once the server answered a suffix range with other bytes.
        self._suffix_ranges = True

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._limit is None:
            if self._closed:  # a request that outlived the store: no session left behind
                raise RuntimeError("this HTTP store is closed")
            self._session = client_session(
                self.max_inflight, self.retry.connect_timeout, headers=self._headers
            )
            self._limit = asyncio.Semaphore(self.max_inflight)
        return self._session, self._limit

    def _wire(self, url: str) -> tuple[Pool, str] | None:
        """The connections a GET of ``url`` goes on and the URL as sent (encoded); None for a
        URL with credentials in it (aiohttp sends them as ``Authorization``)."""
        if url in self._targets:
            return self._targets[url]
        if self._closed:
            raise RuntimeError("this HTTP store is closed")
        parsed = URL(url)
        found = None
        if parsed.user is None and parsed.password is None and parsed.is_absolute():
            origin = str(parsed.origin())
            pool = self._pools.get(origin)
            if pool is None:
                pool = self._pools[origin] = Pool(
                    origin,
                    keep=self.max_inflight,
                    connect_timeout=self.retry.connect_timeout,
                    headers=self._headers,
                )
            found = (pool, str(parsed))
        if len(self._targets) >= _TARGETS:
            self._targets.clear()
        self._targets[url] = found
        return found

    async def _request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        start: int | None = None,
        end: int | None = None,
        wire: bool = False,
    ) -> aiohttp.ClientResponse | Response:
        """Send a request and wait for its headers; map the error statuses. ``wire``: on the
        connections of :mod:`~asyncbatch.stores._wire` where the URL allows."""
        session: aiohttp.ClientSession | Pool = self._client()[0]
        target = url
        found = self._wire(url) if wire else None
        if found is not None:
            session, target = found

        def broken(exc: BaseException) -> StoreError:
            return connection_error(exc, host_of(url), url, start, end, tls_hint=TLS_HINT)

        response = await send_request(
            session, method, target, headers, self.retry, broken, url, start, end
        )
        if response.status >= 400:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            status, reason = response.status, response.reason or ""
            response.release()
            if status == 412:
                sent = headers.get("If-Match") or "?"
                raise changed(url, sent, await self._current_version(url))
            raise status_error(status, reason, url, start, end, retry_after=retry_after)
        return response

    async def _current_version(self, url: str) -> str | None:
        """The ETag the server reports now (for error messages; None if it cannot tell)."""
        try:
            session, _ = self._client()
            async with asyncio.timeout(self.retry.first_byte_timeout):
                async with session.head(url, allow_redirects=True) as response:
                    return response.headers.get("ETag")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def stat(self, url: str) -> ObjectInfo:
        """Size and ETag from a HEAD."""
        _, limit = self._client()
        async with limit:
            response = await self._request("HEAD", url, {})
            response.release()
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise fail(StoreError, "size unknown: the server sent no Content-Length", url)
        return ObjectInfo(int(length), response.headers.get("ETag") or None)

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes with the size and ETag, from one
        ``Range: bytes=-length`` GET. An empty object (416: it has no last bytes) costs a HEAD
        instead. A server that ignores or misreads suffix ranges costs a ranged read after it
        (the answer's headers tell the size), and from then on this transport asks it for
        sizes and ranges instead."""
        answer = None
        if length > 0 and self._suffix_ranges:
            answer = await self._get_tail(url, length)
            if answer is not None and answer.tail is None:
                self._suffix_ranges = False
        return await tail_from(self, url, length, answer)

    async def _get_tail(self, url: str, length: int) -> TailAnswer | None:
        """One suffix GET; None for a 416."""
        _, limit = self._client()
        async with limit:
            try:
                response = await self._request("GET", url, {"Range": f"bytes=-{length}"})
            except ShortReadError:  # 416
                return None
            answer = None
            try:
                answer = await receive_tail(
                    lambda: response.content.read(CHUNK),
                    url,
                    length,
                    response.status,
                    response.headers.get("Content-Range"),
                    response.content_length,
                    response.headers.get("ETag") or None,
                    self.retry.idle_timeout,
                )
            finally:
                if answer is not None and answer.tail is not None:
                    response.release()
                else:
                    response.close()  # a body left unread: its connection cannot be reused
        return answer

    async def list(self, url: str) -> list[str]:
        """The links of the page at ``url`` (fsspec's HTTP listing)."""
        if self._lister is None:
            options = {"headers": self._headers} if self._headers else {}
            self._lister = FsspecStore("http", options, max_inflight=self.max_inflight)
        return await self._lister.list(url)

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
        """One GET of the range's missing tail ``[start + progress.got, end)``."""
        _, limit = self._client()
        first = start + progress.got
        headers = {"Range": f"bytes={first}-{end - 1}"}
        condition = if_match(version)
        if condition is not None:
            headers["If-Match"] = condition
        async with limit:
            response = await self._request("GET", url, headers, start, end, wire=True)
            progress.version = response.headers.get("ETag") or None
            await receive_range(
                response, buffer, progress, self.retry.idle_timeout, url, start, end, first
            )

    async def close(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        lister, self._lister = self._lister, None
        pools, self._pools = list(self._pools.values()), {}
        self._targets.clear()
        for pool in pools:
            await pool.close()
        if session is not None:
            await session.close()
        if lister is not None:
            await lister.close()


def http_store(
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> HttpStore:
    """Registry factory: an :class:`HttpStore` (needs ``pip install 'asyncbatch[http]'``)."""
    return HttpStore(storage_options, max_inflight=max_inflight, retry=retry)
