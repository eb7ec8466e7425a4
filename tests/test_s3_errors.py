"""S3 errors a user causes, as a user meets them: an expired or invalid session token (a
HEAD answered 400 with no body, GETs and listings with S3's token codes) is a
:class:`CredentialsError`, and a missing bucket a :class:`BucketNotFoundError` with one
cause at most, not the chain of every layer it crossed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import s3_options
from servers import running

import asyncbatch as ab
from asyncbatch.stores import open_store

#: No waiting between attempts: a typed error is not retried, a 400 neither.
QUICK = ab.RetryPolicy(
    max_attempts=2, base_delay=0.001, max_delay=0.005, deadline=30, connect_timeout=3.0
)


class TokenServer(ThreadingHTTPServer):
    """An S3 endpoint that refuses every request as AWS refuses a bad session token: 400,
    ``<Code>`` in the body of a GET (``code``; ``""``: no body), and a HEAD's bare 400."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Refuse)
        self.code = "ExpiredToken"
        #: (method, path with query) of every request, in order.
        self.log: list[tuple[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Refuse(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TokenServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_HEAD(self) -> None:
        self.server.log.append(("HEAD", self.path))
        self.send_response(400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.server.log.append(("GET", self.path))
        code = self.server.code
        body = b""
        if code:
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>The provided token has expired.</Message>"
                "<RequestId>test</RequestId></Error>"
            ).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def token_server() -> Iterator[TokenServer]:
    server = TokenServer()
    with running(server, "test-token-server"):
        yield server


@pytest.fixture
def refusing(token_server: TokenServer) -> TokenServer:
    token_server.code = "ExpiredToken"
    token_server.log.clear()
    return token_server


def with_token(endpoint: str, token: str | None = "expired") -> dict[str, Any]:
    options = s3_options(endpoint)
    if token is not None:
        options["token"] = token
    return options


async def _stat(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, options, retry=QUICK)
    try:
        await store.stat(url)
    finally:
        await store.close()


async def _read(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, options, retry=QUICK)
    try:
        buffer = bytearray(10)
        await store.read_ranges(url, starts=[5], ends=[15], buffers=[memoryview(buffer)])
    finally:
        await store.close()


async def _list(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, options, retry=QUICK)
    try:
        await store.list(url)
    finally:
        await store.close()


def test_a_head_refused_for_an_expired_token_is_a_credentials_error(
    refusing: TokenServer,
) -> None:
    # The HEAD's 400 has no body: one GET of a byte that follows tells why (botocore's
    # region redirector asks the bucket in between).
    with pytest.raises(ab.CredentialsError, match="ExpiredToken") as caught:
        asyncio.run(_stat("s3://bucket/shard.bin", with_token(refusing.url)))
    assert "session token" in str(caught.value) and "s3://bucket/shard.bin" in str(caught.value)
    assert refusing.log[0] == ("HEAD", "/bucket/shard.bin")
    assert [entry for entry in refusing.log if entry[0] == "GET"] == [("GET", "/bucket/shard.bin")]


def test_a_bare_400_to_a_head_with_a_session_token_names_the_token(
    refusing: TokenServer,
) -> None:
    refusing.code = ""  # nothing tells why, not even the GET
    with pytest.raises(ab.CredentialsError, match="session token") as caught:
        asyncio.run(_stat("s3://bucket/shard.bin", with_token(refusing.url)))
    assert "expired" in str(caught.value)
    # Without a session token nothing points at the credentials: the 400 stands as it is.
    with pytest.raises(ab.StoreError, match="400") as plain:
        asyncio.run(_stat("s3://bucket/shard.bin", with_token(refusing.url, None)))
    assert not isinstance(plain.value, ab.CredentialsError)


def test_a_session_token_from_the_environment_counts_too(
    refusing: TokenServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing.code = ""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "expired")
    with pytest.raises(ab.CredentialsError, match="session token"):
        asyncio.run(_stat("s3://bucket/shard.bin", {"endpoint_url": refusing.url}))


@pytest.mark.parametrize("code", ["ExpiredToken", "InvalidToken", "TokenRefreshRequired"])
def test_token_codes_of_gets_and_listings_are_credentials_errors(
    refusing: TokenServer, code: str
) -> None:
    refusing.code = code
    options = with_token(refusing.url)
    with pytest.raises(ab.CredentialsError, match=code):
        asyncio.run(_read("s3://bucket/shard.bin", options))
    with pytest.raises(ab.CredentialsError, match=code):
        asyncio.run(_list("s3://bucket/folder", options))


def test_a_listing_refused_as_a_bad_request_is_not_retried(refusing: TokenServer) -> None:
    # s3fs makes a listing's 400 an OSError(EINVAL), which reads as transient; S3's own
    # answer says the request is wrong: sending it again cannot help.
    refusing.code = "InvalidArgument"
    with pytest.raises(ab.StoreError, match="InvalidArgument") as caught:
        asyncio.run(_list("s3://bucket/folder", with_token(refusing.url, None)))
    assert not isinstance(caught.value, ab.RetriesExhaustedError)
    assert [method for method, _ in refusing.log] == ["GET"]


def test_opening_a_dataset_with_an_expired_token_says_so(refusing: TokenServer) -> None:
    with pytest.raises(ab.CredentialsError, match="ExpiredToken"):
        ab.open_dataset("s3://bucket/dataset", with_token(refusing.url))
    with pytest.raises(ab.CredentialsError, match="ExpiredToken"):  # a folder: listed
        ab.open_dataset("s3://bucket/dataset", with_token(refusing.url), format="parquet")


# -- a missing bucket ----------------------------------------------------------------------


def causes(error: BaseException) -> list[BaseException]:
    """The exceptions chained below ``error``: causes, and contexts not suppressed."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        below = todo.pop()
        for chained in (
            below.__cause__,
            None if below.__suppress_context__ else below.__context__,
        ):
            if chained is not None and chained is not error and chained not in found:
                found.append(chained)
                todo.append(chained)
    return found


async def _write(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, options, retry=QUICK)
    try:
        await store.write(url, b"x")
    finally:
        await store.close()


@pytest.mark.parametrize("how", ["open_dataset", "stat", "read", "list", "write"])
def test_a_missing_bucket_is_named_with_one_cause_at_most(s3_endpoint: str, how: str) -> None:
    url, options = "s3://no-such-bucket/x", s3_options(s3_endpoint)
    calls = {"stat": _stat, "read": _read, "list": _list, "write": _write}
    with pytest.raises(ab.BucketNotFoundError, match="'no-such-bucket' does not exist") as caught:
        if how == "open_dataset":
            ab.open_dataset(url, options)
        else:
            asyncio.run(calls[how](url, options))
    assert len(causes(caught.value)) <= 1, [repr(cause) for cause in causes(caught.value)]
