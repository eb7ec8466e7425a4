"""HTTP/1.1 requests on keep-alive connections of one endpoint: the ranged GETs of the
remote stores, for a fraction of aiohttp's client CPU per request.

A GET through aiohttp costs the client 65-90 µs here (its request and response objects,
multidicts, yarl, timers, tracing hooks); a range read needs one write of the request, a
parse of the status line and headers, and the body's pieces as they arrive. This is that,
over asyncio's transports (TLS included):

- bodies framed by ``Content-Length``, chunked, or by the connection's end;
- a connection reused once its response was read to its end (and the server did not say
  ``Connection: close``), closed otherwise;
- a GET or HEAD that finds its reused connection closed by the server before any byte of
  an answer is sent once more on a new connection (as browsers and urllib3 do): a server
  may close an idle connection at any time;
- redirects are not followed, nothing is retried beyond that, no proxy is used.

Errors are the OS's (``ConnectionResetError``, ``ssl.SSLError``, ``socket.gaierror``) and
:class:`WireError` for what is not HTTP; :class:`ConnectTimeout` when no connection came
within the connect timeout. Timing the answer and its body is the caller's, as for aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

#: The most bytes a response's status line and headers may take.
MAX_HEAD = 64 * 1024
#: Bytes buffered on a connection beyond which it stops reading from the socket.
HIGH_WATER = 4 * 1024 * 1024


class WireError(ConnectionError):
    """The server's bytes are not an HTTP/1.1 answer (a malformed head, a bad chunk)."""


class ConnectTimeout(TimeoutError):
    """No connection to the endpoint within the connect timeout."""


class Headers(dict[str, str]):
    """A response's headers, by lower-case name (repeated ones joined by ``, ``)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


class _Connection(asyncio.Protocol):
    """One connection: the pieces received and not yet read, and whether it ended."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pieces: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.ended = False
        self.error: BaseException | None = None
        self.paused = False
        #: Whether a byte arrived since the last request was sent.
        self.answered = False
        self.waiter: asyncio.Future[None] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.pieces.append(data)
        self.buffered += len(data)
        self.answered = True
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        if not self.lost.done():
            self.lost.set_result(None)
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> None:
        """Wait for more bytes; a :class:`ConnectionResetError` once none can come."""
        if not self.ended:
            if self.paused and self.transport is not None:
                self.paused = False
                self.transport.resume_reading()
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            if self.pieces:
                return
        raise ConnectionResetError(f"the server closed the connection{_why(self.error)}")

    def take(self, most: int) -> bytes:
        """Up to ``most`` bytes of what arrived (some must have)."""
        piece = self.pieces.popleft()
        if len(piece) > most:
            self.pieces.appendleft(piece[most:])
            piece = piece[:most]
        self.buffered -= len(piece)
        return piece

    async def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            if self.pieces:
                joined = b"".join(self.pieces)
                self.pieces.clear()
                self.pieces.append(joined)
                at = joined.find(b"\r\n")
                if at >= 0:
                    self.take(at + 2)
                    return joined[:at]
                if len(joined) > MAX_HEAD:
                    raise WireError("a line of the answer is longer than 64 KiB")
            await self.more()

    async def head(self) -> bytes:
        """The status line and headers, up to and without the blank line ending them."""
        searched = 0
        while True:
            if self.pieces:
                joined = b"".join(self.pieces)
                self.pieces.clear()
                self.pieces.append(joined)
                at = joined.find(b"\r\n\r\n", max(0, searched - 3))
                if at >= 0:
                    self.take(at + 4)
                    return joined[:at]
                if len(joined) > MAX_HEAD:
                    raise WireError("the answer's headers are longer than 64 KiB")
                searched = len(joined)
            await self.more()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # no TLS goodbye to wait for: the pool is done with it

    @property
    def reusable(self) -> bool:
        return not self.ended and not self.pieces and self.transport is not None


class Response:
    """The answer to a request: status, headers, and its body read piece by piece."""

    __slots__ = (
        "_chunk",
        "_conn",
        "_crlf",
        "_keep",
        "_pool",
        "_remaining",
        "content_length",
        "headers",
        "reason",
        "status",
        "url",
    )

    def __init__(
        self,
        pool: Pool,
        conn: _Connection,
        url: str,
        status: int,
        reason: str,
        headers: Headers,
        method: str,
        keep: bool,
    ) -> None:
        self._pool, self.url = pool, url
        self._conn: _Connection | None = conn
        self.status, self.reason, self.headers = status, reason, headers
        self._keep = keep
        self._chunk = -1  # bytes left in the current chunk; -1: not chunked
        self._crlf = False  # a chunk's closing CRLF is still to read
        length = headers.get("content-length")
        self.content_length: int | None = None
        if method == "HEAD" or status in (204, 304):
            self._remaining: int | None = 0
        elif "chunked" in (headers.get("transfer-encoding") or "").lower():
            self._remaining, self._chunk = None, 0
        elif length is not None:
            if not length.isdigit():
                raise WireError(f"Content-Length {length!r} is not a length")
            self._remaining = self.content_length = int(length)
        else:
            self._remaining, self._keep = None, False  # to the connection's end

    @property
    def content(self) -> Response:
        """The body, as aiohttp names it (``await response.content.read(n)``)."""
        return self

    async def read(self, most: int = -1) -> bytes:
        """The next piece of the body, up to ``most`` bytes (-1: any); ``b""`` at its end."""
        conn = self._conn
        if conn is None:
            return b""
        most = most if most > 0 else 1 << 62
        if self._chunk >= 0:
            return await self._read_chunked(conn, most)
        if self._remaining is not None:
            if self._remaining == 0:
                return b""
            if not conn.pieces:
                await conn.more()
            piece = conn.take(min(most, self._remaining))
            self._remaining -= len(piece)
            return piece
        if not conn.pieces:  # to the end of the connection
            if conn.ended:
                return b""
            with contextlib.suppress(ConnectionResetError):
                await conn.more()
            if not conn.pieces:
                return b""
        return conn.take(most)

    async def _read_chunked(self, conn: _Connection, most: int) -> bytes:
        if self._chunk == 0:
            if self._crlf:
                if await conn.line():
                    raise WireError("a chunk is longer than its size says")
                self._crlf = False
            size = (await conn.line()).split(b";", 1)[0].strip()
            try:
                self._chunk = int(size, 16)
            except ValueError:
                raise WireError(f"bad chunk size {size[:20]!r}") from None
            if self._chunk == 0:
                while await conn.line():  # trailers, up to the blank line
                    pass
                self._chunk = -2  # done
                return b""
            self._crlf = True
        if self._chunk < 0:
            return b""
        if not conn.pieces:
            await conn.more()
        piece = conn.take(min(most, self._chunk))
        self._chunk -= len(piece)
        return piece

    def at_eof(self) -> bool:
        """Whether the body was read to its end (as aiohttp's ``content.at_eof()``)."""
        return self.complete

    async def readany(self) -> bytes:
        """The next piece of the body as it arrived; ``b""`` at its end."""
        return await self.read()

    @property
    def complete(self) -> bool:
        """Whether the body was read to its end."""
        return self._remaining == 0 or self._chunk == -2

    def release(self) -> None:
        """Done with the answer: its connection back to the pool if the body was read to its
        end (and may be reused), else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._keep and self.complete and conn.reusable:
                self._pool._reuse(conn)
            else:
                self._pool._drop(conn)

    def close(self) -> None:
        """Done with the answer, its connection closed (whatever of the body is unread)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._drop(conn)


class Pool:
    """Keep-alive connections to the endpoint of ``base`` (``scheme://host[:port]``).

    It holds no more idle connections than ``keep``; a request finding none idle opens one
    (callers bound how many run at once). ``tls``: the context for ``https`` (None: the
    default, verifying against OpenSSL's default paths, as aiohttp does).
    """

    def __init__(
        self,
        base: str,
        *,
        keep: int,
        connect_timeout: float,
        headers: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {base!r}")
        self._host = parts.hostname
        self._tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        default = 443 if self._tls is not None else 80
        self._port = parts.port or default
        self._prefix = f"{parts.scheme}://{parts.netloc}"
        # As written in the URL (a signature may cover it), without a default port.
        host = parts.netloc.rpartition("@")[2].removesuffix(f":{default}")
        fixed = {"Host": host}
        fixed |= {"Accept-Encoding": "identity", **(headers or {})}
        check_headers(fixed)
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._keep = keep
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    async def request(
        self, method: str, url: str, headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send ``method url`` (an absolute URL on this pool's endpoint) and read the answer's
        status and headers."""
        if not url.startswith(self._prefix):
            raise ValueError(f"{url} is not on {self._prefix}")
        target = url[len(self._prefix) :] or "/"
        lines = [f"{method} {target} HTTP/1.1\r\n{self._fixed}"]
        if headers:
            lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1")
        while self._idle:
            conn = self._idle.pop()
            if not conn.reusable:
                self._drop(conn)
                continue
            try:
                return await self._exchange(conn, request, url, method)
            except ConnectionResetError:
                if conn.answered or method not in ("GET", "HEAD"):
                    raise
                # Closed by the server while idle, before a byte of an answer: once more on
                # a new connection (this one is dropped).
        return await self._exchange(await self._connect(), request, url, method)

    async def _exchange(self, conn: _Connection, request: bytes, url: str, method: str) -> Response:
        try:
            assert conn.transport is not None
            conn.answered = False
            conn.transport.write(request)
            while True:
                head = await conn.head()
                status, reason, headers, keep = _parse_head(head)
                if status >= 200:
                    return Response(self, conn, url, status, reason, headers, method, keep)
        except BaseException:
            self._drop(conn)
            raise

    async def _connect(self) -> _Connection:
        if self._closed:
            raise RuntimeError("this connection pool is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    _Connection,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection to {self._prefix}") from exc
        self._open.add(conn)
        return conn

    def _reuse(self, conn: _Connection) -> None:
        if len(self._idle) < self._keep and not self._closed:
            self._idle.append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()

    async def close(self) -> None:
        """Close every connection, and wait until each is gone."""
        self._closed = True
        conns = list(self._open)
        self._idle.clear()
        self._open.clear()
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([conn.lost for conn in conns], timeout=1.0)


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse a header whose name or value would break the request's framing."""
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"header {name!r}: {value!r} cannot be sent (a newline or colon)")


def _parse_head(head: bytes) -> tuple[int, str, Headers, bool]:
    """Status, reason, headers and whether the connection stays open after the body."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise WireError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = Headers()
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise WireError(f"not a header line: {line[:80]!r}")
        name, value = name.lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    connection = (headers.get("connection") or "").lower()
    keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
    return int(code), reason, headers, keep


def _why(error: BaseException | None) -> str:
    return "" if error is None else f" ({type(error).__name__}: {error})"
