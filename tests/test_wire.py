"""The HTTP/1.1 client of the remote stores' ranged GETs (``asyncbatch.stores._wire``),
against servers on 127.0.0.1 that answer with exactly the bytes each test writes."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

import asyncbatch as ab
from asyncbatch.stores._wire import ConnectTimeout, Pool, WireError

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test, run in a loop of its own."""

    @functools.wraps(test)
    def sync(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return sync


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def head(self, reader: asyncio.StreamReader) -> bytes:
        """The next request's head (b"" once the client closed the connection)."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        self.requests.append(head)
        return head


@asynccontextmanager
async def serving(
    handler: Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[Server]:
    server = Server(lambda r, w: handler(server, r, w))
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    async with listener:
        yield server


def pool(server: Server) -> Pool:
    return Pool(server.url, keep=4, connect_timeout=5)


async def body(response: object) -> bytes:
    pieces = []
    while piece := await response.read(7):  # type: ignore[attr-defined]
        pieces.append(piece)
    return b"".join(pieces)


async def keep_alive(
    server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    while head := await server.head(reader):
        payload = head.split(b" ")[1]  # the path, as the body
        writer.write(
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\nX-Goog-Generation: 7\r\n\r\n%s"
            % (len(payload), payload)
        )
        await writer.drain()


@run
async def test_a_connection_is_reused_once_its_body_was_read() -> None:
    async with serving(keep_alive) as server:
        wire = pool(server)
        for path in ("/a?x=1", "/bb", "/ccc"):
            response = await wire.request("GET", server.url + path, {"Range": "bytes=0-9"})
            assert (response.status, response.reason) == (206, "Partial Content")
            assert response.headers.get("x-goog-generation") == "7"
            assert response.content_length == len(path)
            assert await body(response) == path.encode()
            response.release()
        await wire.close()
    assert server.connections == 1
    assert b"GET /a?x=1 HTTP/1.1\r\n" in server.requests[0]
    assert f"Host: {server.url[7:]}\r\n".encode() in server.requests[0]
    assert b"Range: bytes=0-9\r\n" in server.requests[0]


@run
async def test_a_body_released_unread_closes_its_connection() -> None:
    async with serving(keep_alive) as server:
        wire = pool(server)
        (await wire.request("GET", server.url + "/unread")).release()
        response = await wire.request("GET", server.url + "/second")
        assert await body(response) == b"/second"
        response.release()
        await wire.close()
    assert server.connections == 2


@run
async def test_chunked_bodies_with_extensions_and_trailers() -> None:
    async def chunked(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await server.head(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"5;ext=1\r\nhello\r\n")
            await writer.drain()
            writer.write(b"1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n")
            await writer.drain()

    async with serving(chunked) as server:
        wire = pool(server)
        for _ in range(2):
            response = await wire.request("GET", server.url + "/")
            assert response.content_length is None
            assert await body(response) == b"hello world"
            response.release()
        await wire.close()
    assert server.connections == 1


@run
async def test_a_body_to_the_connections_end() -> None:
    async def until_close(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 100_000)
        await writer.drain()

    async with serving(until_close) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        assert await body(response) == b"x" * 100_000
        response.release()
        await wire.close()


@run
async def test_a_large_body_arrives_whole_through_the_buffer_bound() -> None:
    data = bytes(range(256)) * (40 * 1024)  # 10 MiB, beyond HIGH_WATER

    async def large(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data))
        writer.write(data)
        await writer.drain()

    async with serving(large) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        await asyncio.sleep(0.2)  # the whole body offered before any is read
        pieces = []
        while piece := await response.read(1 << 20):
            pieces.append(piece)
        assert b"".join(pieces) == data
        response.release()
        await wire.close()


@run
async def test_an_idle_connection_the_server_closed_is_replaced_unseen() -> None:
    async def one_each(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)  # then closes, as a server's idle timeout does

    async with serving(one_each) as server:
        wire = pool(server)
        for _ in range(3):
            response = await wire.request("GET", server.url + "/")
            assert await body(response) == b"ok"
            response.release()
            await asyncio.sleep(0.2)
        await wire.close()
    assert server.connections == 3


@run
async def test_an_interim_answer_is_skipped() -> None:
    async def interim(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
        await writer.drain()

    async with serving(interim) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        assert response.status == 200 and await body(response) == b"abc"
        response.release()
        await wire.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "is not a length"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000, "longer than 64 KiB"),
    ],
)
@run
async def test_an_answer_that_is_not_http_is_a_wire_error(answer: bytes, error: str) -> None:
    async def bad(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the client gives up on the connection

    async with serving(bad) as server:
        wire = pool(server)
        with pytest.raises(WireError, match=error):
            await wire.request("GET", server.url + "/")
        await wire.close()


@run
async def test_a_bad_chunk_is_a_wire_error_and_a_broken_body_an_os_error() -> None:
    async def broken(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = await server.head(reader)
        if b"/chunk" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly5")
        await writer.drain()

    async with serving(broken) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/chunk")
        with pytest.raises(WireError, match="bad chunk size"):
            await body(response)
        response.close()
        response = await wire.request("GET", server.url + "/short")
        with pytest.raises(ConnectionResetError, match="closed the connection"):
            await body(response)
        response.close()
        await wire.close()


@run
async def test_an_answer_cut_off_mid_head_is_not_sent_again() -> None:
    async def cut(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")
        await writer.drain()

    async with serving(cut) as server:
        wire = pool(server)
        with pytest.raises(ConnectionResetError):
            await wire.request("GET", server.url + "/")
        await wire.close()
    assert server.connections == 1


@run
async def test_close_ends_every_connection_even_one_in_use() -> None:
    closed = asyncio.Event()

    async def hold(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        await reader.read()  # the client's end
        closed.set()

    async with serving(hold) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        assert await response.read() == b"partial"
        await wire.close()
        await asyncio.wait_for(closed.wait(), 5)
        with pytest.raises(RuntimeError, match="closed"):
            await wire.request("GET", server.url + "/")


@run
async def test_headers_that_would_break_the_framing_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        Pool("http://127.0.0.1:1", keep=1, connect_timeout=1, headers={"X": "a\r\nEvil: 1"})
    with pytest.raises(ValueError, match="not an http"):
        Pool("ftp://127.0.0.1", keep=1, connect_timeout=1)


@run
async def test_a_refused_connection_is_the_os_error() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    wire = Pool(f"http://127.0.0.1:{port}", keep=1, connect_timeout=5)
    with pytest.raises(ConnectionRefusedError):
        await wire.request("GET", f"http://127.0.0.1:{port}/")
    await wire.close()


@run
async def test_no_connection_within_the_connect_timeout() -> None:
    # A listener whose accept queue is full drops further SYNs: connecting hangs.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        waiting = []
        for _ in range(4):
            extra = socket.socket()
            extra.setblocking(False)
            extra.connect_ex(("127.0.0.1", port))
            waiting.append(extra)
        try:
            wire = Pool(f"http://127.0.0.1:{port}", keep=1, connect_timeout=0.3)
            with pytest.raises(ConnectTimeout, match="no connection"):
                await wire.request("GET", f"http://127.0.0.1:{port}/")
            await wire.close()
        finally:
            for extra in waiting:
                extra.close()


def test_the_http_store_refuses_headers_that_would_break_a_request() -> None:
    from asyncbatch.stores import open_store

    with pytest.raises(ab.ConfigError, match="storage_options headers: header 'X-Token'"):
        open_store("http://127.0.0.1:1/data", {"headers": {"X-Token": "a\r\nHost: evil"}})
