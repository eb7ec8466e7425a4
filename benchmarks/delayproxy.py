"""A TCP proxy that delays every request by a fixed time and counts HTTP requests.

It stands in front of a local HTTP server (s3rver in ``bench_remote.py``) to give it the
latency of a remote one. Bytes from the client to the server are held for ``delay`` seconds
(each piece from the moment it arrives, in order) and then forwarded; bytes from the server
back to the client pass at once, with 1 MiB reads and flow control, so a response streams at
full speed. A request on a kept-alive connection therefore waits ``delay`` longer, as over a
link with that much extra latency one way; opening a connection costs no extra delay.

The client→server stream is parsed as HTTP/1.1 (request line, headers, then a body of
``Content-Length`` bytes or a chunked one) to count the requests and their methods.

As a library: ``with running_proxy(upstream, delay=0.010) as proxy:`` starts it as a separate
process (``python delayproxy.py``: it shares no event loop or GIL with the code measured),
``proxy.url`` is its address and ``proxy.counts()`` the counters so far.

As a script: ``python benchmarks/delayproxy.py http://127.0.0.1:9000 [--delay-ms 10]
[--port 0]`` runs it in the foreground and prints the counters on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import mmap
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import stop_process

READ_SIZE = 2**20
#: Pause reading from the server while this much is waiting to be sent to the client.
HIGH_WATER = 8 * 2**20
MAX_HEAD = 64 * 1024

# Counter slots in the shared array.
REQUESTS, GETS, RANGE_GETS, HEADS, PUTS, OTHERS, CONNECTIONS, UP_BYTES, DOWN_BYTES = range(9)
SLOTS = 9


@dataclass(frozen=True)
class Counts:
    """Counters of a proxy since it started (or between two readings, by subtraction)."""

    requests: int = 0
    gets: int = 0
    range_gets: int = 0
    heads: int = 0
    puts: int = 0
    others: int = 0
    connections: int = 0
    up_bytes: int = 0
    down_bytes: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return (
            self.requests,
            self.gets,
            self.range_gets,
            self.heads,
            self.puts,
            self.others,
            self.connections,
            self.up_bytes,
            self.down_bytes,
        )


class RequestCounter:
    """Follows one client→server HTTP/1.1 stream and counts its requests."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self.head = bytearray()
        self.body_left = 0  # bytes of a Content-Length body still to skip
        self.chunked = False  # inside a chunked body
        self.chunk_line = bytearray()
        self.trailer = False  # after the last chunk: skipping trailers up to an empty line
        self.lost = False  # the stream did not parse: stop counting this connection

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view) and not self.lost:
            if self.body_left:
                step = min(self.body_left, len(view))
                self.body_left -= step
                view = view[step:]
            elif self.chunked:
                view = self._chunked(view)
            else:
                view = self._head(view)

    def _head(self, view: memoryview) -> memoryview:
        start = max(0, len(self.head) - 3)
        self.head += view
        end = self.head.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self.head) > MAX_HEAD:
                self.lost = True
            return view[len(view) :]
        rest = len(self.head) - (end + 4)
        head = bytes(self.head[:end])
        self.head.clear()
        self._count(head)
        return view[len(view) - rest :]

    def _count(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        method = lines[0].split(b" ", 1)[0].upper()
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        counters = self.counters
        counters[REQUESTS] += 1
        if method == b"GET":
            counters[GETS] += 1
            if b"range" in headers:
                counters[RANGE_GETS] += 1
        elif method == b"HEAD":
            counters[HEADS] += 1
        elif method == b"PUT":
            counters[PUTS] += 1
        else:
            counters[OTHERS] += 1
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self.chunked = True
        else:
            try:
                self.body_left = int(headers.get(b"content-length", b"0"))
            except ValueError:
                self.lost = True

    def _chunked(self, view: memoryview) -> memoryview:
        # Reads one chunk-size line (or trailer line); chunk data is skipped via body_left.
        newline = bytes(view[:4096]).find(b"\n")
        if newline < 0:
            self.chunk_line += view
            if len(self.chunk_line) > MAX_HEAD:
                self.lost = True
            return view[len(view) :]
        self.chunk_line += view[: newline + 1]
        line = bytes(self.chunk_line).strip()
        self.chunk_line.clear()
        view = view[newline + 1 :]
        if self.trailer:
            if not line:
                self.chunked = self.trailer = False
            return view
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            self.lost = True
            return view
        if size == 0:
            self.trailer = True
        else:
            self.body_left = size + 2  # the data and its CRLF
        return view


class Upstream(asyncio.Protocol):
    """The proxy's connection to the server: passes what it sends straight to the client."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.client.counters[DOWN_BYTES] += len(data)
        client = self.client.transport
        if client is None or client.is_closing():
            return
        client.write(data)  # past HIGH_WATER, Client.pause_writing pauses this reader

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_closed()


class Client(asyncio.Protocol):
    """One client connection: delays its bytes to the server, counts its requests."""

    def __init__(self, host: str, port: int, delay: float, counters: Any) -> None:
        self.host, self.port, self.delay = host, port, delay
        self.counters = counters
        self.parser = RequestCounter(counters)
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None
        self.pending: collections.deque[tuple[float, bytes]] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)
        self.counters[CONNECTIONS] += 1
        self.loop = asyncio.get_running_loop()
        self.connecting = self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, upstream = await self.loop.create_connection(
                lambda: Upstream(self), self.host, self.port
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        assert upstream.transport is not None
        if self.transport is None or self.transport.is_closing():
            upstream.transport.close()  # the client left while we connected
            return
        self.upstream = upstream
        upstream.transport.set_write_buffer_limits(high=HIGH_WATER)
        self._flush()

    def data_received(self, data: bytes) -> None:
        self.counters[UP_BYTES] += len(data)
        self.parser.feed(data)
        self.pending.append((self.loop.time() + self.delay, data))
        self._schedule()

    def eof_received(self) -> bool:
        self.eof = True
        self._schedule()
        return True  # keep the transport open for the response

    def _schedule(self) -> None:
        if self.timer is None and self.pending:
            self.timer = self.loop.call_at(self.pending[0][0], self._flush)
        elif self.timer is None and self.eof:
            self._flush()

    def _flush(self) -> None:
        self.timer = None
        upstream = self.upstream.transport if self.upstream is not None else None
        if upstream is None:
            return  # _connect flushes once connected
        now = self.loop.time()
        while self.pending and self.pending[0][0] <= now:
            upstream.write(self.pending.popleft()[1])
        if self.pending:
            self.timer = self.loop.call_at(self.pending[0][0], self._flush)
        elif self.eof and upstream.can_write_eof():
            upstream.write_eof()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def upstream_closed(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.pending.clear()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        elif not self.connecting.done():
            self.connecting.cancel()


async def serve(
    upstream: str, delay: float, counters: Any, port: int = 0, verbose: bool = False
) -> None:
    """Run the proxy until SIGTERM or SIGINT; print ``listening <port>`` once it listens."""
    parsed = urllib.parse.urlsplit(upstream)
    host, up_port = parsed.hostname or "127.0.0.1", parsed.port or 80
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Client(host, up_port, delay, counters), "127.0.0.1", port, backlog=1024
    )
    bound: int = server.sockets[0].getsockname()[1]
    print(f"listening {bound}", flush=True)
    if verbose:
        print(f"proxy http://127.0.0.1:{bound} -> {upstream}, +{delay * 1e3:g} ms", file=sys.stderr)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def read_counts(path: Path) -> Counts:
    """The counters of the proxy started with ``--counters path`` (from any process)."""
    with open(path, "rb") as file:
        data = file.read(8 * SLOTS)
    return Counts(*memoryview(data).cast("q").tolist())


class Proxy:
    """A running proxy process: its URL and its counters (also in the file ``counters_path``)."""

    def __init__(self, url: str, delay: float, counters: memoryview, counters_path: Path) -> None:
        self.url = url
        self.delay = delay
        self.counters_path = counters_path
        self._counters = counters

    def counts(self) -> Counts:
        return Counts(*self._counters.tolist())


@contextlib.contextmanager
def running_proxy(upstream: str, delay: float = 0.010) -> Iterator[Proxy]:
    """Run the proxy in front of ``upstream`` as a separate process (its own GIL and loop).

    The counters live in a small memory-mapped file that both processes map.
    """
    with tempfile.NamedTemporaryFile(prefix="delayproxy-", suffix=".counters") as file:
        file.write(bytes(8 * SLOTS))
        file.flush()
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            upstream,
            "--delay-ms",
            repr(delay * 1e3),
            "--counters",
            file.name,
        ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        mapped = mmap.mmap(file.fileno(), 8 * SLOTS)
        counters = memoryview(mapped).cast("q")
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # returns "" if the process ends first
            if not line.startswith("listening "):
                process.wait(10)
                raise RuntimeError(f"the delay proxy did not start (status {process.poll()})")
            url = f"http://127.0.0.1:{int(line.split()[1])}"
            yield Proxy(url, delay, counters, Path(file.name))
        finally:
            stop_process(process)
            if process.stdout is not None:
                process.stdout.close()
            counters.release()
            mapped.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="the server's URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="delay per request (ms)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    parser.add_argument(
        "--counters", type=Path, default=None, help="file of 8-byte counters to update in place"
    )
    args = parser.parse_args()
    start = time.monotonic()
    if args.counters is None:
        counters: Any = [0] * SLOTS
        mapped = None
    else:
        with open(args.counters, "r+b") as file:
            mapped = mmap.mmap(file.fileno(), 8 * SLOTS)
        counters = memoryview(mapped).cast("q")
    try:
        verbose = mapped is None
        asyncio.run(serve(args.upstream, args.delay_ms / 1e3, counters, args.port, verbose))
    finally:
        if mapped is None:
            print(f"{Counts(*counters)} in {time.monotonic() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
