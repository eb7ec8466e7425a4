"""A fault-injecting HTTP server for the tests: aiohttp on 127.0.0.1, port 0, its own thread.

Two modes: in front of a directory of files (serving HEAD, GET, single byte ranges, ETags and
``If-Match`` itself), or as a proxy in front of another server (moto's S3). Each test
schedules faults with :meth:`FaultServer.inject`: the next matching requests get the given
faults in order (``None``: behave), later ones ``default``. The server counts requests and
the body bytes it answers per method and path, in total, and the peak of requests in flight
at once, so tests assert exact attempt numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")

#: S3-style error bodies, so botocore parses the codes it would get from AWS.
S3_CODES = {
    301: "PermanentRedirect",
    403: "AccessDenied",
    404: "NoSuchKey",
    412: "PreconditionFailed",
    429: "TooManyRequests",
    500: "InternalError",
    503: "SlowDown",
}

#: Response headers a proxy must not copy: the server sets its own framing.
_HOP_BY_HOP = {
    "connection",
    "content-length",
    "date",
    "keep-alive",
    "server",
    "transfer-encoding",
}


@dataclass(frozen=True)
class Fault:
    """What to do to one request; fields combine (e.g. a delay, then a reset)."""

    status: int | None = None  # answer with this error status and an S3-style XML body
    retry_after: float | None = None  # with ``status``: a Retry-After header (seconds)
    delay: float = 0.0  # wait this long before the headers ...
    jitter: float = 0.0  # ... plus a random part up to this
    stall: float = 0.0  # after the headers, send nothing for this long
    reset_after: int | None = None  # send this many body bytes, then reset the connection
    truncate_after: int | None = None  # send this many body bytes, then close it cleanly
    chunked: bool = False  # chunked body (no Content-Length; a truncated one lacks its end)
    ignore_range: bool = False  # answer a range request with 200 and the whole object
    etag: str | None = None  # report this ETag (the object seems to have changed)
    #: set these response headers (another version: GCS's ``x-goog-generation``)
    headers: tuple[tuple[str, str], ...] = ()
    ignore_if_match: bool = False  # drop If-Match: answer whatever version is there now
    version_id: str | None = None  # report this x-amz-version-id (S3: another version)
    drip: tuple[int, float] | None = None  # (bytes, seconds): send the body this slowly


OK = None  #: In a schedule: a request served as it should be.


class FaultServer:
    """The server; use :func:`fault_server` to run one for a block."""

    def __init__(self, root: Path | None = None, upstream: str | None = None) -> None:
        if (root is None) == (upstream is None):
            raise ValueError("give either root (files) or upstream (proxy)")
        self.root = None if root is None else root.resolve()
        self.upstream = upstream
        self.url = ""
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path) -> count
        self.body_bytes: Counter[tuple[str, str]] = Counter()  # (method, path) -> bytes sent
        self.total = 0
        #: (method, path, Range header) of every request, in order.
        self.log: list[tuple[str, str, str]] = []
        #: The headers of every request, in order.
        self.headers: list[dict[str, str]] = []
        self.inflight = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._schedule: list[Fault | None] = []
        self._default: Fault | None = None
        self._methods: tuple[str, ...] = ("GET",)
        self._path: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: aiohttp.ClientSession | None = None

    # -- what tests call ------------------------------------------------------------------

    def inject(
        self,
        *faults: Fault | None,
        default: Fault | None = None,
        methods: tuple[str, ...] = ("GET",),
        path: str | None = None,
    ) -> None:
        """The next requests of ``methods`` (to paths containing ``path``) get ``faults`` in
        order, then ``default``; replaces any earlier schedule."""
        with self._lock:
            self._schedule = list(faults)
            self._default = default
            self._methods = methods
            self._path = path

    def reset(self) -> None:
        """No faults, counters at zero."""
        self.inject()
        with self._lock:
            self.requests.clear()
            self.body_bytes.clear()
            self.log.clear()
            self.headers.clear()
            self.total = self.peak = 0

    def pending(self) -> int:
        """Scheduled faults not yet served."""
        with self._lock:
            return len(self._schedule)

    def count(self, method: str = "GET", path: str | None = None) -> int:
        """Requests of ``method`` so far (to paths containing ``path``)."""
        with self._lock:
            return sum(
                n
                for (m, p), n in self.requests.items()
                if m == method and (path is None or path in p)
            )

    def sent(self, method: str = "GET", path: str | None = None) -> int:
        """Body bytes answered to ``method`` so far (to paths containing ``path``)."""
        with self._lock:
            return sum(
                n
                for (m, p), n in self.body_bytes.items()
                if m == method and (path is None or path in p)
            )

    # -- serving ----------------------------------------------------------------------------

    def _take(self, request: web.Request) -> Fault:
        with self._lock:
            self.requests[(request.method, request.path)] += 1
            self.log.append((request.method, request.path, request.headers.get("Range", "")))
            self.headers.append(dict(request.headers))
            self.total += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            if request.method not in self._methods or (
                self._path is not None and self._path not in request.path
            ):
                return Fault()
            if self._schedule:
                return self._schedule.pop(0) or Fault()
            return self._default or Fault()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._take(request)
        try:
            if fault.delay or fault.jitter:
                try:
                    await _sleep_while_connected(
                        request, fault.delay + random.uniform(0, fault.jitter)
                    )
                except ConnectionResetError:
                    raise asyncio.CancelledError from None  # nobody is left to answer
            if fault.status is not None:
                return _error(request, fault.status, fault.retry_after)
            if self.root is not None:
                status, headers, body = self._file(request, fault)
            else:
                status, headers, body = await self._proxy(request, fault)
            if fault.etag is not None:
                for key in [k for k in headers if k.lower() == "etag"]:
                    headers[key] = fault.etag
            for name, value in fault.headers:
                for key in [k for k in headers if k.lower() == name.lower()]:
                    del headers[key]
                headers[name] = value
            if fault.version_id is not None:
                for key in [k for k in headers if k.lower() == "x-amz-version-id"]:
                    del headers[key]
                headers["x-amz-version-id"] = fault.version_id
            with self._lock:
                self.body_bytes[(request.method, request.path)] += len(body)
            return await _send(request, status, headers, body, fault)
        finally:
            with self._lock:
                self.inflight -= 1

    def _file(self, request: web.Request, fault: Fault) -> tuple[int, dict[str, str], bytes]:
        assert self.root is not None
        path = (self.root / request.path.lstrip("/")).resolve()
        if self.root not in path.parents or not path.is_file():
            return 404, {}, b""
        stat = path.stat()
        etag = f'"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"'
        if_match = request.headers.get("If-Match")
        if if_match is not None and not fault.ignore_if_match and if_match not in ("*", etag):
            return 412, {}, b""
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        if path.suffix == ".html":  # index pages, for listings
            headers["Content-Type"] = "text/html"
        data = path.read_bytes()
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return 200, headers, b""
        match = _RANGE.match(request.headers.get("Range", ""))
        if match is None or fault.ignore_range:
            return 200, headers, data
        if match.group(1):
            start = int(match.group(1))
            end = min(len(data), int(match.group(2)) + 1 if match.group(2) else len(data))
        else:  # a suffix range: the last N bytes
            start, end = max(0, len(data) - int(match.group(2) or 0)), len(data)
        if start >= len(data):
            headers["Content-Range"] = f"bytes */{len(data)}"
            return 416, headers, b""
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return 206, headers, data[start:end]

    async def _proxy(self, request: web.Request, fault: Fault) -> tuple[int, dict[str, str], bytes]:
        assert self._client is not None and self.upstream is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        if fault.ignore_range:
            headers.pop("Range", None)
        # No body sent for none received: aiohttp would add a Content-Type, which Azure's
        # Shared Key signs.
        body = await request.read()
        if fault.ignore_if_match:
            headers = {k: v for k, v in headers.items() if k.lower() != "if-match"}
        async with self._client.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD":
                out["Content-Length"] = upstream.headers.get("Content-Length", "0")
            return upstream.status, out, body

    # -- running ----------------------------------------------------------------------------

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="test-fault-server", daemon=True
        )
        self._thread.start()
        if not ready.wait(30) or not self.url:
            raise RuntimeError("fault server did not start")

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._stopped = asyncio.Event()
        try:
            loop.run_until_complete(self._serve(ready))
        finally:
            ready.set()
            loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=256)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession(auto_decompress=False) as client:
                self._client = client
                ready.set()
                await self._stopped.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)


def _error(request: web.Request, status: int, retry_after: float | None) -> web.Response:
    code = S3_CODES.get(status, "Error")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected {status}</Message>"
        "<RequestId>fault</RequestId></Error>"
    ).encode()
    headers = {"Content-Type": "application/xml"}
    if retry_after is not None:
        headers["Retry-After"] = f"{retry_after:g}"
    return web.Response(
        status=status, body=b"" if request.method == "HEAD" else body, headers=headers
    )


async def _send(
    request: web.Request, status: int, headers: dict[str, str], body: bytes, fault: Fault
) -> web.StreamResponse:
    """Send ``body`` the way ``fault`` says: stalled, dripped, truncated or reset."""
    response = web.StreamResponse(status=status, headers=headers)
    if request.method == "HEAD":
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await response.prepare(request)  # the client may have closed it meanwhile
        return response
    if fault.chunked:
        response.enable_chunked_encoding()
    else:
        response.content_length = len(body)
    cut = fault.reset_after if fault.reset_after is not None else fault.truncate_after
    try:
        await response.prepare(request)
        if fault.stall:
            await _sleep_while_connected(request, fault.stall)
        part = body if cut is None else body[:cut]
        step, pause = fault.drip or (len(part) or 1, 0.0)
        for at in range(0, len(part), step):
            await response.write(part[at : at + step])
            if pause:
                await asyncio.sleep(pause)
        if cut is None:
            await response.write_eof()
            return response
        transport = request.transport
        if transport is not None:
            if fault.reset_after is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:  # linger 0: close() sends RST, not FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            else:
                transport.close()  # FIN: the body simply ends early
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        pass  # the client gave up (a timeout on its side): nothing more to send
    # The connection is gone; stop aiohttp from finishing the response on it.
    raise asyncio.CancelledError


async def _sleep_while_connected(request: web.Request, seconds: float) -> None:
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client went away")
        await asyncio.sleep(min(0.01, max(0.0, stop - time.monotonic())))


@contextlib.contextmanager
def fault_server(root: Path | None = None, upstream: str | None = None) -> Iterator[FaultServer]:
    """A running :class:`FaultServer` in front of ``root`` or ``upstream``."""
    server = FaultServer(root, upstream)
    server.start()
    try:
        yield server
    finally:
        server.stop()
