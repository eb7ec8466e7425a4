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

Parsing is strict where leniency lets a server desynchronise the connection (RFC 9112):
lengths and chunk sizes are ASCII digits only, header names are tokens, an answer framed both
ways is read chunked and its connection closed, a 101 (no request asks to switch protocols)
is an error, and whatever is malformed closes the connection rather than pooling it. Every
byte of a body is copied a bounded number of times, however it is chunked; one read with
``read_into`` copies what arrived straight into the caller's buffer.

Errors are the OS's (``ConnectionResetError``, ``ssl.SSLError``, ``socket.gaierror``) and
:class:`WireError` for what is not HTTP (:class:`HeaderError`, a header that cannot be sent,
is one); :class:`ConnectTimeout` when no connection came within the connect timeout. Timing
the answer and its body is the caller's, as for aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

#: The most bytes a response's status line and headers may take (and its trailers).
MAX_HEAD = 64 * 1024
#: Bytes buffered on a connection beyond which it stops reading from the socket.
HIGH_WATER = 4 * 1024 * 1024
#: The most interim (1xx) answers taken before the final one: each costs a parse, and a
#: server sending them without end would hold the request (and a core) until its timeout.
MAX_INTERIM = 16

#: The end of a line: LF, the CR before it stripped (RFC 9112 2.2 allows a bare LF).
_LINE_END = re.compile(rb"\n")
#: The blank line that ends a head, after its last line's LF.
_HEAD_END = re.compile(rb"\n\r?\n")
#: A chunk's size: hex digits, no sign, prefix or separator; 16 digits at most (64 bits).
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
#: A header name as RFC 9110 5.1 has it (a token).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: What a header value must not hold: CTLs but HTAB, and what Latin-1 cannot encode.
_NOT_SENDABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f\u0100-\U0010ffff]")


class WireError(ConnectionError):
    """The server's bytes are not an HTTP/1.1 answer (a malformed head, a bad chunk)."""


class HeaderError(WireError, ValueError):
    """A header that cannot be sent: a name that is not a token, a value with a line break,
    NUL, other control character or one beyond Latin-1. The message names the header and the
    reason, never the value (it may be a credential). A ``ValueError`` for headers given in
    configuration; a :class:`WireError` for those of a request, often echoed from a server
    (an ETag), so that it fails as that request."""


class ConnectTimeout(TimeoutError):
    """No connection to the endpoint within the connect timeout."""


class Headers(dict[str, str]):
    """A response's headers, by lower-case name (repeated ones joined by ``, ``)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


class _Connection(asyncio.Protocol):
    """One connection: the pieces received and not yet read, and whether it ended.

    Reads move ``offset`` through the first piece rather than slicing off its rest, so that a
    body in many small chunks costs its bytes, not its bytes times what is buffered.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pieces: collections.deque[bytes] = collections.deque()
        #: Bytes of ``pieces[0]`` already read.
        self.offset = 0
        #: Bytes received and not yet read.
        self.buffered = 0
        #: The pool holding this connection idle; bytes or an end arriving then retire it.
        self.idle_in: Pool | None = None
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
        if self.idle_in is not None or self.ended:
            # Bytes nobody asked for (a 408, junk) on an idle connection: the next answer
            # could not be told from them, and holding them would cost up to HIGH_WATER per
            # idle connection. (Ended: retired, and TLS still handing over what it decrypted.)
            self._retire()
            return
        self.pieces.append(data)
        self.buffered += len(data)
        self.answered = True
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        if self.idle_in is not None:
            self._retire()
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        if self.idle_in is not None:
            self._retire()
        if not self.lost.done():
            self.lost.set_result(None)
        self._wake()

    def _retire(self) -> None:
        """Out of the pool that holds it idle, and closed."""
        pool, self.idle_in = self.idle_in, None
        self.ended = True
        if pool is not None:
            pool._forget(self)

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
        piece, start = self.pieces[0], self.offset
        if start == 0 and len(piece) <= most:
            self.pieces.popleft()  # the common case of a large read: the piece as it came
        elif start + most < len(piece):
            self.offset = start + most
            piece = piece[start : self.offset]
        else:
            self.pieces.popleft()
            self.offset = 0
            piece = piece[start:]
        self.buffered -= len(piece)
        return piece

    def take_into(self, view: memoryview) -> int:
        """Copy up to ``len(view)`` bytes of what arrived (some must have) into ``view``, with
        no piece made of them; how many."""
        piece, start = self.pieces[0], self.offset
        count = min(len(view), len(piece) - start)
        view[:count] = memoryview(piece)[start : start + count]
        self._advance(count)
        return count

    def _advance(self, count: int) -> None:
        """Past ``count`` bytes of the first piece (no further than its end)."""
        self.buffered -= count
        self.offset += count
        if self.offset == len(self.pieces[0]):
            self.pieces.popleft()
            self.offset = 0

    async def _until(self, end: re.Pattern[bytes], most: int, what: str) -> bytes:
        """The bytes before the next match of ``end`` (3 bytes long at most), read with it; a
        :class:`WireError` once more than ``most`` came without one.

        The match is looked for in place in the first piece; only what spans pieces is
        gathered, at most ``most`` bytes of it, so a read costs what it returns.
        """
        held = bytearray()  # the start of what spans pieces
        searched = 0  # bytes of ``held`` searched without a match
        while True:
            while self.pieces:
                piece, start = self.pieces[0], self.offset
                if not held:
                    found = end.search(piece, start, start + most + 3)
                    if found is not None:
                        self._advance(found.end() - start)
                        return piece[start : found.start()]
                    base = 0
                    held += memoryview(piece)[start : start + most + 1]
                else:
                    base = len(held)
                    held += memoryview(piece)[start : start + most + 1 - base]
                    # A match may begin in what was held before: look back the longest
                    # ending's length less one (3 bytes, LF CR LF).
                    found = end.search(held, max(0, searched - 2))
                    if found is not None:
                        self._advance(found.end() - base)
                        return bytes(held[: found.start()])
                if len(held) > most:
                    raise WireError(f"{what} longer than {_size(most)}")
                searched = len(held)
                self._advance(len(held) - base)
            await self.more()

    async def line(self) -> bytes:
        """The next line, without its LF or CRLF."""
        line = await self._until(_LINE_END, MAX_HEAD, "a line of the answer is")
        return line[:-1] if line.endswith(b"\r") else line

    async def head(self) -> bytes:
        """The status line and headers, up to and without the blank line ending them (the
        last line's CR, if any, kept)."""
        return await self._until(_HEAD_END, MAX_HEAD, "the answer's headers are")

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
        # Bytes left in the current chunk; -1: not chunked, -2: the last chunk was read (a
        # size from the server is never negative: only hex digits are taken).
        self._chunk = -1
        self._crlf = False  # a chunk's closing CRLF is still to read
        length = headers.get("content-length")
        coding = headers.get("transfer-encoding")
        self.content_length: int | None = None
        if method == "HEAD" or status in (204, 304):
            self._remaining: int | None = 0
        elif coding is not None:
            if coding.rpartition(",")[2].strip(" \t").lower() == "chunked":
                self._remaining, self._chunk = None, 0
            else:  # not chunked last: to the connection's end (RFC 9112 6.3)
                self._remaining, self._keep = None, False
            if length is not None:
                # Framed both ways: a proxy on the path may have read it the other way, so
                # what follows on this connection cannot be trusted (RFC 9112 6.3).
                self._keep = False
        elif length is not None:
            self._remaining = self.content_length = _content_length(length)
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
            line = await conn.line()
            # Hex digits, then optional whitespace before a ";ext" (ignored); nothing
            # int() would also take (a sign, "0x", "_", spaces ahead).
            size = line.partition(b";")[0].rstrip(b" \t")
            if _CHUNK_SIZE.fullmatch(size) is None:
                raise WireError(f"bad chunk size {line[:20]!r}")
            self._chunk = int(size, 16)
            if self._chunk == 0:
                left = MAX_HEAD  # trailers, up to the blank line: no more than a head
                while trailer := await conn.line():
                    left -= len(trailer) + 2
                    if left < 0:
                        raise WireError(f"the answer's trailers are longer than {_size(MAX_HEAD)}")
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

    async def read_into(self, view: memoryview) -> int:
        """The next bytes of the body copied into ``view`` (a non-empty byte-format view; at
        most its length): how many, 0 at its end. A body framed by ``Content-Length`` is
        copied from the pieces that arrived, never sliced into a new one first (the head and
        the body's start often come as one piece)."""
        conn = self._conn
        remaining = self._remaining
        if conn is None or remaining is None or self._chunk >= 0:
            piece = await self.read(len(view))
            view[: len(piece)] = piece
            return len(piece)
        if remaining == 0:
            return 0
        if not conn.pieces:
            await conn.more()
        count = conn.take_into(view[: min(len(view), remaining)])
        self._remaining = remaining - count
        return count

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
            check_headers(headers)  # an ETag echoed back may hold what the server put in it
            lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1")
        while self._idle:
            conn = self._idle.pop()
            conn.idle_in = None
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
            for _ in range(MAX_INTERIM + 1):
                head = await conn.head()
                status, reason, headers, keep = _parse_head(head)
                if status >= 200:
                    return Response(self, conn, url, status, reason, headers, method, keep)
                if status == 101:  # no request asks to switch: what follows is not HTTP
                    raise WireError("101 Switching Protocols to a request that asked for none")
            raise WireError(f"more than {MAX_INTERIM} interim answers (1xx) to one request")
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
            conn.idle_in = self
            self._idle.append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()

    def _forget(self, conn: _Connection) -> None:
        """``conn``, idle, received bytes or its end: never to be used again."""
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)
        self._drop(conn)

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
    """Refuse, as a :class:`HeaderError`, a header whose name is not a token (RFC 9110 5.1)
    or whose value holds a control character but HTAB (a line break would end the header
    and start another) or a character Latin-1 cannot encode."""
    for name, value in headers.items():
        if _TOKEN.fullmatch(name) is None or _NOT_SENDABLE.search(value) is not None:
            raise _unsendable(name, value)


def _unsendable(name: str, value: str) -> HeaderError:
    """Why the header cannot be sent, naming it but never quoting its value."""
    if not name:
        return HeaderError("an empty header name cannot be sent")
    bad = _TOKEN.match(name)
    if bad is None or bad.end() < len(name):
        at = 0 if bad is None else bad.end()
        # What of the name comes before the fault: a whole "Name: value" given as a name
        # must not bring its value into the message.
        return HeaderError(
            f"header {name[:at]!r} cannot be sent: its name has {_character(name[at])}"
            f" at position {at} (names are RFC 9110 tokens)"
        )
    found = _NOT_SENDABLE.search(value)
    assert found is not None
    return HeaderError(
        f"header {name!r} cannot be sent: its value has {_character(found.group())}"
        f" at position {found.start()}"
    )


def _character(char: str) -> str:
    """``char`` as an error message names it."""
    if char in "\r\n":
        return "a line break (CR or LF)"
    if char == "\0":
        return "a NUL"
    if ord(char) > 0xFF:
        return "a character that is not Latin-1"
    if ord(char) < 0x20 or char == "\x7f":
        return f"a control character (0x{ord(char):02x})"
    return repr(char)


def _content_length(value: str) -> int:
    """A ``Content-Length`` as RFC 9110 8.6 has it: ASCII digits (18 at most, so that it is
    a length and not a bignum), or a list of equal ones (the header repeated)."""
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    parts = [part.strip(" \t") for part in value.split(",")]
    if all(part.isascii() and part.isdigit() and len(part) <= 18 for part in parts):
        lengths = {int(part) for part in parts}
        if len(lengths) == 1:
            return lengths.pop()
    raise WireError(f"Content-Length {value[:40]!r} is not a length")


def _parse_head(head: bytes) -> tuple[int, str, Headers, bool]:
    """Status, reason, headers and whether the connection stays open after the body.

    Lines end with CRLF or a bare LF (RFC 9112 2.2); a CR or NUL anywhere else is refused,
    as a line break that one parser sees and another not would let a value hide a header.
    """
    text = head.decode("latin-1")
    if text.endswith("\r"):  # the last line's CR, before the blank line
        text = text[:-1]
    text = text.replace("\r\n", "\n")
    suspect = "\r" in text or "\0" in text  # then each line is looked at
    lines = text.split("\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if (
        not version.startswith("HTTP/1.")
        or len(code) != 3
        or not (code.isascii() and code.isdigit())
        or (suspect and ("\r" in lines[0] or "\0" in lines[0]))
    ):
        raise WireError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = Headers()
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if (
            not colon
            or _TOKEN.fullmatch(name) is None  # RFC 9110 5.1: a token, nothing around it
            or (suspect and ("\r" in line or "\0" in line))
        ):
            raise WireError(f"not a header line: {line[:80]!r}")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    connection = (headers.get("connection") or "").lower()
    keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
    return int(code), reason, headers, keep


def _size(count: int) -> str:
    return f"{count // 1024} KiB" if count % 1024 == 0 else f"{count} bytes"


def _why(error: BaseException | None) -> str:
    return "" if error is None else f" ({type(error).__name__}: {error})"
