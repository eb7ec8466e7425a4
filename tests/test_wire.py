"""The HTTP/1.1 client of the remote stores' ranged GETs (``asyncbatch.stores._wire``),
against servers on 127.0.0.1 that answer with exactly the bytes each test writes."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from servers import RangeHTTPServer

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


def answering(
    raw: bytes,
) -> Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A handler that answers every request on a connection with ``raw``."""

    async def answer(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await server.head(reader):
            writer.write(raw)
            await writer.drain()

    return answer


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


@run
async def test_a_switch_of_protocols_nobody_asked_for_is_a_wire_error() -> None:
    """A 101 to a plain GET: what follows it is another protocol's bytes, never read as an
    answer (it was taken as an interim one, and the 200 after it read)."""
    answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"
    answer += b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"
    async with serving(answering(answer)) as server:
        wire = pool(server)
        with pytest.raises(WireError, match="101 Switching Protocols"):
            await wire.request("GET", server.url + "/")
        assert not wire._idle and not wire._open
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


# Hostile servers: each answer below is one a review reproduced against the client.


def one_byte_chunks(data: bytes) -> bytes:
    return b"".join(b"1\r\n%c\r\n" % byte for byte in data) + b"0\r\n\r\n"


@pytest.mark.parametrize("size", [None, 4096, 7])
@run
async def test_a_body_in_one_byte_chunks_costs_no_more_than_its_bytes(size: int | None) -> None:
    # All buffered before any is read: each chunk used to copy the rest of what was buffered.
    import tracemalloc

    from asyncbatch.stores._wire import Headers, Response, _Connection

    data = bytes(range(256)) * 64  # 16 KiB of body, 96 KiB on the wire
    wired = one_byte_chunks(data)
    conn = _Connection()
    for at in range(0, len(wired), size or len(wired)):  # pieces as they came off the socket
        conn.data_received(wired[at : at + (size or len(wired))])
    headers = Headers({"transfer-encoding": "chunked"})
    wire = Pool("http://127.0.0.1:1", keep=1, connect_timeout=1)
    response = Response(wire, conn, "", 200, "OK", headers, "GET", True)
    got, at = bytearray(len(data)), 0
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        while piece := await response.read():
            got[at : at + len(piece)] = piece
            at += len(piece)
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert (bytes(got), at) == (data, len(data))
    assert response.complete
    # Nothing the size of the buffered rest (96 KiB) was ever copied: a chunk costs its size.
    assert peak < 16 * 1024


@pytest.mark.timeout(20)  # about 1 s here; 30 s and more when each chunk copied the rest
@run
async def test_a_large_body_in_one_byte_chunks_through_a_socket() -> None:
    data = bytes(range(256)) * 1024  # 256 KiB

    async def chunked(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(one_byte_chunks(data))
        await writer.drain()
        await reader.read()

    async with serving(chunked) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        await asyncio.sleep(0.5)  # the 1.5 MiB on the wire buffered before any is read
        pieces = []
        while piece := await response.read(1 << 20):
            pieces.append(piece)
        assert b"".join(pieces) == data
        response.release()
        await wire.close()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64])
@run
async def test_a_head_and_chunks_split_anywhere_read_the_same(size: int) -> None:
    from asyncbatch.stores._wire import _Connection, _parse_head

    answer = (
        b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;x=y\r\nabc\r\n2\nde\n0\r\nT: 1\n\r\nHTTP/1.1 204 No Content\n\nrest"
    )
    conn = _Connection()
    for at in range(0, len(answer), size):
        conn.data_received(answer[at : at + size])

    def take(count: int) -> bytes:
        taken = b""
        while len(taken) < count:
            taken += conn.take(count - len(taken))
        return taken

    status, _, headers, keep = _parse_head(await conn.head())
    assert (status, keep) == (200, True)
    assert headers == {"a": "1", "b": "2", "transfer-encoding": "chunked"}
    assert [await conn.line(), take(3), await conn.line()] == [b"3;x=y", b"abc", b""]
    assert [await conn.line(), take(1), take(1), await conn.line()] == [b"2", b"d", b"e", b""]
    assert [await conn.line(), await conn.line(), await conn.line()] == [b"0", b"T: 1", b""]
    assert _parse_head(await conn.head())[0] == 204
    assert (take(4), conn.buffered, conn.offset, conn.pieces) == (b"rest", 0, 0, deque())


@run
async def test_bytes_arriving_on_an_idle_connection_close_it() -> None:
    pooled = asyncio.Event()
    junk = asyncio.Event()
    gone = asyncio.Event()

    async def chatty(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if server.connections > 1:
            await reader.read()
            return
        await pooled.wait()
        try:
            for _ in range(64):  # 4 MiB unasked for, as long as the client takes it
                writer.write(b"x" * 65536)
                junk.set()
                await writer.drain()
            await reader.read()  # b"" once the client closed it
        except ConnectionError:  # or a reset
            pass
        gone.set()

    async with serving(chatty) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        assert await body(response) == b"ok"
        response.release()
        (idle,) = wire._idle
        pooled.set()
        await asyncio.wait_for(junk.wait(), 5)
        await asyncio.wait_for(gone.wait(), 5)
        assert idle.buffered < 256 * 1024  # not HIGH_WATER's worth held
        assert not wire._idle and not wire._open
        response = await wire.request("GET", server.url + "/")
        assert await body(response) == b"ok"
        response.release()
        await wire.close()
    assert server.connections == 2


@run
async def test_a_flood_of_interim_answers_is_a_wire_error() -> None:
    async def flood(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 10_000)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async with serving(flood) as server:
        wire = pool(server)
        with pytest.raises(WireError, match="interim answers"):
            await wire.request("GET", server.url + "/")
        assert not wire._open
        await wire.close()


@run
async def test_a_bare_lf_ends_a_header_line() -> None:
    answer = b'HTTP/1.1 200 OK\nETag: "a"\nX-Evil: 1\r\nContent-Length: 2\n\nok'
    async with serving(answering(answer)) as server:
        wire = pool(server)
        for _ in range(2):
            async with asyncio.timeout(5):
                response = await wire.request("GET", server.url + "/")
                assert response.headers == {"etag": '"a"', "x-evil": "1", "content-length": "2"}
                assert await body(response) == b"ok"
            response.release()
        await wire.close()
    assert server.connections == 1


@run
async def test_a_reflected_etag_cannot_add_a_header_to_the_next_request() -> None:
    answer = b'HTTP/1.1 200 OK\r\nETag: "a"\nX-Evil: 1\r\nContent-Length: 2\r\n\r\nok'
    async with serving(answering(answer)) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        etag = response.headers.get("etag")
        assert await body(response) == b"ok"
        response.release()
        assert etag is not None
        try:
            response = await wire.request("GET", server.url + "/", {"If-Match": etag})
            response.release()
        except WireError:
            pass
        await wire.close()
    for request in server.requests:
        assert b"\nX-Evil" not in request


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"If-Match": '"a"\nX-Evil: 1'}, "header 'If-Match' .*line break .*at position 3"),
        ({"If-Match": '"a"\r'}, "header 'If-Match' .*line break .*at position 3"),
        ({"X-Amz-Date": "2024\x00"}, "header 'X-Amz-Date' .*NUL at position 4"),
        ({"X-Token": "a\x01b"}, "header 'X-Token' .*control character .*at position 1"),
        ({"X-Token": "a\u2019b"}, "header 'X-Token' .*not Latin-1 at position 1"),
        ({"X-Bad Name": "v"}, "header 'X-Bad' .*name .* at position 5"),
        ({"X-Bad:Name": "v"}, "header 'X-Bad' .*name .* at position 5"),
        ({"": "v"}, "an empty header name"),
    ],
)
@run
async def test_every_request_header_is_checked_before_it_is_sent(
    headers: dict[str, str], reason: str
) -> None:
    from asyncbatch.stores._wire import HeaderError

    async with serving(keep_alive) as server:
        wire = pool(server)
        with pytest.raises(HeaderError, match=reason) as caught:
            await wire.request("GET", server.url + "/", headers)
        assert isinstance(caught.value, WireError)  # a request that failed, retried as one
        with pytest.raises(HeaderError, match=reason):
            Pool(server.url, keep=1, connect_timeout=1, headers=headers)
        await wire.close()
    assert server.requests == []


def test_a_refused_header_value_is_never_quoted() -> None:
    from asyncbatch.stores import open_store
    from asyncbatch.stores._wire import check_headers

    secret = "Bearer s3cr3t-t0ken"
    for value in (f"{secret}\n", f"{secret}\x7f", f"{secret}\r\nX: y"):
        with pytest.raises(ValueError, match="'Authorization'") as caught:
            check_headers({"Authorization": value})
        with pytest.raises(ab.ConfigError, match="'Authorization'") as configured:
            open_store("http://127.0.0.1:1/data", {"headers": {"Authorization": value}})
        for error in (caught.value, configured.value):
            seen: BaseException | None = error
            while seen is not None:
                assert "s3cr3t" not in str(seen) and "s3cr3t" not in repr(seen)
                seen = seen.__cause__ or seen.__context__


@pytest.mark.parametrize(
    ("framing", "error"),
    [
        (b"Transfer-Encoding: chunked\r\n\r\n-2\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n0\r\n\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n+2\r\nab\r\n0\r\n\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n1_0\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n 2\r\nab\r\n0\r\n\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n%s\r\n" % (b"f" * 17), "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n\xd9\xa2\r\n", "bad chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n0\r\n" + b"X: y\r\n" * 20_000, "trailers"),
        (b"Content-Length: \xb2\r\n\r\n", "is not a length"),
        (b"Content-Length: 2\r\nContent-Length: 3\r\n\r\nab", "is not a length"),
        (b"Content-Length: 2, 3\r\n\r\nab", "is not a length"),
        (b"Content-Length: 2 2\r\n\r\nab", "is not a length"),
        (b"Content-Length: 0x2\r\n\r\nab", "is not a length"),
        (b"Content-Length: %s\r\n\r\nab" % (b"9" * 30), "is not a length"),
        (b"X: a\rb\r\nContent-Length: 2\r\n\r\nab", "not a header line"),
        (b"X: a\x00b\r\nContent-Length: 2\r\n\r\nab", "not a header line"),
        # Names that are not tokens: a proxy may read them another way (RFC 9110 5.1).
        (b"Content Length: 2\r\n\r\nab", "not a header line"),
        (b"Content-Length\x0c: 2\r\n\r\nab", "not a header line"),
        (b"(X): 1\r\nContent-Length: 2\r\n\r\nab", "not a header line"),
        (b"\xe9: 1\r\nContent-Length: 2\r\n\r\nab", "not a header line"),
    ],
)
@run
async def test_malformed_framing_is_a_wire_error_and_never_pooled(
    framing: bytes, error: str
) -> None:
    answer = b"HTTP/1.1 200 OK\r\n" + framing
    async with serving(answering(answer)) as server:
        wire = pool(server)
        async with asyncio.timeout(10):
            with pytest.raises(WireError, match=error):
                response = await wire.request("GET", server.url + "/")
                try:
                    await body(response)
                finally:
                    response.release()
        assert not wire._idle and not wire._open
        await wire.close()


@pytest.mark.parametrize("code", [b"\xb200", b"2\xb30", b"\xd9\xa2\xd9\xa0\xd9\xa0"])
@run
async def test_a_status_code_is_three_ascii_digits(code: bytes) -> None:
    async def bad(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 %s OK\r\nContent-Length: 0\r\n\r\n" % code)
        await writer.drain()
        await reader.read()

    async with serving(bad) as server:
        wire = pool(server)
        with pytest.raises(WireError, match="not an HTTP/1.1 status line"):
            await wire.request("GET", server.url + "/")
        await wire.close()


@run
async def test_repeated_equal_content_lengths_are_one() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 02\r\n\r\nok"
    async with serving(answering(answer)) as server:
        wire = pool(server)
        for _ in range(2):
            response = await wire.request("GET", server.url + "/")
            assert response.content_length == 2 and await body(response) == b"ok"
            response.release()
        await wire.close()
    assert server.connections == 1


@run
async def test_a_chunked_answer_with_a_length_is_read_chunked_and_not_reused() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    async with serving(answering(answer)) as server:
        wire = pool(server)
        for _ in range(2):
            response = await wire.request("GET", server.url + "/")
            assert await body(response) == b"hello"
            response.release()
        await wire.close()
    assert server.connections == 2


def test_a_pin_that_cannot_be_sent_is_not_retried(
    http_root: tuple[Path, RangeHTTPServer],
) -> None:
    # A version pinned from a server's answer (an ETag with a control character in it)
    # cannot be sent as If-Match: the request never leaves, and sending it again cannot help.
    from asyncbatch.stores import open_store

    root, server = http_root
    (root / "pinned.bin").write_bytes(bytes(range(100)))
    url = f"{server.url}/pinned.bin"

    async def read() -> None:
        store = open_store(url, pins={url: '"a\x01b"'})
        try:
            await store.read_ranges(url, starts=[0], ends=[10], buffers=[bytearray(10)])
        finally:
            await store.close()

    before = server.requests
    with pytest.raises(ab.StoreError, match="request not sent: header 'If-Match'") as caught:
        asyncio.run(read())
    assert not isinstance(caught.value, ab.RetriesExhaustedError)
    assert server.requests == before


@pytest.mark.parametrize("split", [None, 1, 5, 4096])
@run
async def test_read_into_copies_a_body_into_the_callers_buffer_and_stops_at_its_length(
    split: int | None,
) -> None:
    """A ``Content-Length`` body read with ``read_into`` (head and body in one write, or in
    pieces of ``split`` bytes) arrives whole into the caller's buffer, never past its length
    (the next answer's bytes stay on the connection, which is reused); a chunked body is read
    into it the same way."""
    data = bytes(range(256)) * 40

    async def answer(
        server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n"
        for reply in (raw, chunked):
            await server.head(reader)
            for at in range(0, len(reply), split or len(reply)):
                writer.write(reply[at : at + (split or len(reply))])
                await writer.drain()

    async with serving(answer) as server:
        wire = pool(server)
        response = await wire.request("GET", server.url + "/")
        into = bytearray(len(data) + 100)
        view, got = memoryview(into), 0
        while count := await response.read_into(view[got : got + 3000]):
            got += count
        assert (got, bytes(into[:got]), response.complete) == (len(data), data, True)
        response.release()
        response = await wire.request("GET", server.url + "/")
        small = bytearray(8)
        count = await response.read_into(memoryview(small))
        assert bytes(small[:count]) == b"abcde"[:count]
        response.close()
        assert server.connections == 1
        await wire.close()
