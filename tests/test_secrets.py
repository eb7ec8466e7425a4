"""No secret is ever written out: a marked value in every credential slot (storage options,
URL userinfo, presigned and SAS query strings, GCS tokens, headers) never appears in an
error's text or repr, anywhere in its chain of causes and contexts, in a warning, a log
record, or the repr of a config, dataset or loader.

Each case drives a real failure (moto S3 checking credentials, the Range HTTP server, Azurite,
fake-gcs-server, a closed port, a port that never accepts) with one attempt and short timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET
from servers import RangeHTTPServer, free_port, moto_server

import asyncbatch as ab
from asyncbatch.stores import open_store

MARK = "SECRET-MARK-7f3a"
#: One attempt, short timeouts: every case fails in well under a second or two.
ONCE = ab.RetryPolicy(
    max_attempts=1,
    connect_timeout=0.3,
    first_byte_timeout=1.0,
    idle_timeout=1.0,
    refused_deadline=0.1,
)
#: Query parameters of presigned S3 and GCS URLs and Azure SAS URLs.
SIGNED = (
    f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={MARK}%2F20250101%2Fus-east-1"
    f"&X-Amz-Security-Token={MARK}&X-Amz-Signature={MARK}&X-Goog-Signature={MARK}"
    f"&sv=2023-01-03&sp=r&se=2030-01-01T00%3A00%3A00Z&sig={MARK}%2B%3D"
)
TOKENS = np.arange(2_000, dtype=np.uint16)


def chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception it chains, by ``__cause__`` and ``__context__``."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop()
        if exc is not None and all(exc is not seen for seen in found):
            found.append(exc)
            todo += [exc.__cause__, exc.__context__]
    return found


def texts_of(error: BaseException) -> list[str]:
    """What an error can show of itself: text, repr, notes and attributes of each exception
    in its chain, and the whole traceback as Python prints it."""
    texts = ["".join(traceback.format_exception(error))]
    for exc in chain(error):
        texts += [str(exc), repr(exc), *getattr(exc, "__notes__", [])]
        if isinstance(exc, ab.AsyncBatchError):  # our own attributes (url, detail, attempts)
            texts.append(repr(vars(exc)))
    return texts


@contextlib.contextmanager
def watched(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """Collect the warnings and log records (root and ``asyncbatch`` at DEBUG) raised
    within: their texts are appended to the list yielded when the block ends."""
    texts: list[str] = []
    caplog.clear()
    with (
        caplog.at_level(logging.DEBUG),
        caplog.at_level(logging.DEBUG, logger="asyncbatch"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        yield texts
    texts += [str(w.message) for w in caught]
    form = logging.Formatter("%(name)s %(levelname)s %(message)s")
    texts += [form.format(record) for record in caplog.records if _ours_or_shown(record)]


def _ours_or_shown(record: logging.LogRecord) -> bool:
    """asyncbatch's records at any level, and everyone's from INFO up (botocore's own DEBUG
    records print the signed request, credentials included: that is botocore's choice)."""
    return record.name.split(".")[0] == "asyncbatch" or record.levelno >= logging.INFO


def assert_hidden(texts: list[str], secrets: tuple[str, ...] = (MARK,)) -> None:
    leaked = [text for text in texts if any(secret in text for secret in secrets)]
    assert not leaked, "a secret shows in:\n" + "\n---\n".join(leaked)


def raised(
    call: Callable[[], object],
    caplog: pytest.LogCaptureFixture,
    secrets: tuple[str, ...] = (MARK,),
) -> BaseException:
    """The error ``call()`` raises, with the ``secrets`` checked to show nowhere."""
    with watched(caplog) as texts:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any error: its texts are what is checked
            error = exc
        else:
            pytest.fail("no error raised")
    assert_hidden(texts + texts_of(error), secrets)
    return error


async def _touch(url: str, options: dict[str, Any], read: bool) -> None:
    store = open_store(url, options, retry=ONCE)
    try:
        if read:  # a ranged GET (on the wire pool where the URL allows)
            buffer = bytearray(4)
            await store.read_ranges(url, starts=[0], ends=[4], buffers=[memoryview(buffer)])
        else:
            await store.size(url)
    finally:
        await store.close()


def touch(url: str, options: dict[str, Any] | None = None, read: bool = False) -> None:
    """Ask a store for ``url``'s size, or (``read``) its first bytes."""
    asyncio.run(_touch(url, options or {}, read))


@pytest.fixture(scope="module")
def dead() -> str:
    """An endpoint where nothing listens (a port bound, then closed)."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def silent() -> Iterator[str]:
    """An endpoint that never accepts: its backlog is full, so a connect waits forever."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    endpoint = f"127.0.0.1:{server.getsockname()[1]}"
    filler = socket.create_connection(server.getsockname(), timeout=1)
    try:
        yield endpoint
    finally:
        filler.close()
        server.close()


@pytest.fixture(scope="module")
def s3_checking() -> Iterator[str]:
    """A moto server that checks every request's credentials."""
    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as url:
        yield url


def s3_secrets(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": MARK, "secret": MARK, "token": MARK}


# -- S3 ---------------------------------------------------------------------------------------


def test_s3_rejected_credentials(s3_checking: str, caplog: pytest.LogCaptureFixture) -> None:
    options = s3_secrets(s3_checking)
    error = raised(lambda: ab.open_dataset("s3://data/tokens", options, retry=ONCE), caplog)
    assert isinstance(error, ab.PermissionDeniedError)
    raised(lambda: touch("s3://data/tokens", options), caplog)
    raised(lambda: touch("s3://data/tokens", options, read=True), caplog)


@pytest.mark.parametrize("where", ["dead", "silent"])
def test_s3_unreachable(where: str, request: pytest.FixtureRequest, caplog: Any) -> None:
    endpoint = f"http://{request.getfixturevalue(where)}"
    options = s3_secrets(endpoint)
    error = raised(lambda: ab.open_dataset("s3://data/tokens", options, retry=ONCE), caplog)
    assert isinstance(error, ab.StoreError)
    raised(lambda: touch("s3://data/tokens", options, read=True), caplog)


def test_s3_endpoint_with_a_password(dead: str, caplog: pytest.LogCaptureFixture) -> None:
    options = {**s3_secrets(f"http://user:{MARK}@{dead}")}
    raised(lambda: touch("s3://data/tokens", options), caplog)


# -- HTTP: presigned URLs, userinfo, headers -------------------------------------------------------


def http_urls(endpoint: str) -> list[str]:
    return [
        f"http://{endpoint}/missing.bin?{SIGNED}",
        f"http://user:{MARK}@{endpoint}/missing.bin",
        f"http://{MARK}@{endpoint}/missing.bin?sig={MARK}",
    ]


@pytest.mark.parametrize("read", [False, True], ids=["stat", "read"])
def test_http_not_found(
    http_root: tuple[Path, RangeHTTPServer], read: bool, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = http_root[1].url.split("//")[1]
    for url in http_urls(endpoint):
        error = raised(lambda url=url: touch(url, read=read), caplog)  # type: ignore[misc]
        assert isinstance(error, ab.NotFoundError), error
        assert "127.0.0.1" in str(error) and "missing.bin" in str(error)


@pytest.mark.parametrize("where", ["dead", "silent"])
@pytest.mark.parametrize("read", [False, True], ids=["stat", "read"])
def test_http_unreachable(
    where: str, read: bool, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    for url in http_urls(request.getfixturevalue(where)):
        error = raised(lambda url=url: touch(url, read=read), caplog)  # type: ignore[misc]
        assert isinstance(error, ab.StoreError), error
        if where == "silent":
            assert "no connection within" in str(error), error


def test_http_open_dataset(dead: str, caplog: pytest.LogCaptureFixture) -> None:
    for url in http_urls(dead):
        raised(lambda url=url: ab.open_dataset(url, retry=ONCE), caplog)  # type: ignore[misc]


def test_a_header_that_cannot_be_sent(http_root: Any, caplog: pytest.LogCaptureFixture) -> None:
    # The header check is _wire.check_headers': it must not quote the value it refuses.
    url = f"{http_root[1].url}/missing.bin"
    options = {"headers": {"X-Request-Tag": f"{MARK}\r\nX-Injected: 1"}}
    error = raised(lambda: touch(url, options), caplog)
    assert isinstance(error, ab.ConfigError)


# -- Azure ------------------------------------------------------------------------------------


def azure_secrets(endpoint: str) -> dict[str, Any]:
    from asyncbatch.stores._azure_auth import DEV_ACCOUNT

    sas = f"sv=2023-01-03&sp=r&se=2030-01-01T00%3A00%3A00Z&sig={MARK}"
    return {"account_name": DEV_ACCOUNT, "sas_token": sas, "endpoint": endpoint}


def test_azure_rejected_sas(azurite_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    options = azure_secrets(azurite_endpoint)
    error = raised(lambda: touch("az://data/tokens", options), caplog)
    assert isinstance(error, ab.PermissionDeniedError), error
    raised(lambda: touch("az://data/tokens", options, read=True), caplog)
    raised(lambda: ab.open_dataset("az://data/tokens", options, retry=ONCE), caplog)


@pytest.mark.parametrize("where", ["dead", "silent"])
def test_azure_unreachable(where: str, request: pytest.FixtureRequest, caplog: Any) -> None:
    from asyncbatch.stores._azure_auth import DEV_ACCOUNT

    endpoint = f"http://{request.getfixturevalue(where)}/{DEV_ACCOUNT}"
    options = azure_secrets(endpoint)
    error = raised(lambda: touch("az://data/tokens", options), caplog)
    assert isinstance(error, ab.StoreError), error
    raised(lambda: touch("az://data/tokens", options, read=True), caplog)


@pytest.mark.parametrize("where", ["dead", "azurite_endpoint"])
def test_azure_endpoint_with_a_password(
    where: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    # The userinfo alone, without its scheme (an endpoint named by its host): no ``://``
    # for a scrubber to see, so the store itself must name the host without it.
    endpoint = request.getfixturevalue(where).removeprefix("http://")
    options = azure_secrets(f"http://user:{MARK}@{endpoint}")
    if where == "azurite_endpoint":  # rejected credentials: a wrong account key
        del options["sas_token"]
        options["account_key"] = "AAAA"
    raised(lambda: touch("az://data/tokens", options), caplog)


def test_azure_malformed_credentials(dead: str, caplog: pytest.LogCaptureFixture) -> None:
    from asyncbatch.stores._azure_auth import DEV_ACCOUNT

    endpoint = f"http://{dead}/{DEV_ACCOUNT}"
    for options in (
        {"account_name": DEV_ACCOUNT, "account_key": MARK, "endpoint": endpoint},
        {"account_name": DEV_ACCOUNT, "sas_token": f"?{MARK}", "endpoint": endpoint},
        {"connection_string": f"AccountName=a;AccountKey={MARK};BlobEndpoint={endpoint}"},
    ):
        raised(lambda options=options: touch("az://data/tokens", options), caplog)  # type: ignore[misc]


# -- GCS --------------------------------------------------------------------------------------


def service_account(token_uri: str) -> dict[str, str]:
    return {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": "0",
        "private_key": f"-----BEGIN PRIVATE KEY-----\n{MARK}\n-----END PRIVATE KEY-----\n",
        "client_email": "reader@p.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }


def test_gcs_tokens_of_the_wrong_form(
    gcs_endpoint: str, dead: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = service_account(f"http://{dead}/token")
    url = f"gs://{BUCKET}/tokens"
    for token in (json.dumps(key), f"ya29.{MARK}", MARK, key):
        options = {"endpoint_url": gcs_endpoint, "token": token}
        error = raised(lambda options=options: touch(url, options), caplog)  # type: ignore[misc]
        assert isinstance(error, ab.ConfigError), error
    assert "looks like a key's JSON" in str(
        raised(lambda: touch(url, {"token": json.dumps(key)}), caplog)
    )


@pytest.mark.parametrize("where", ["dead", "http"])
def test_gcs_token_requests_that_fail(
    gcs_endpoint: str,
    where: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A well-formed key whose token endpoint refuses connections, or answers 404.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    if where == "dead":
        token_uri = f"http://{request.getfixturevalue('dead')}/token?sig={MARK}"
    else:
        token_uri = f"{request.getfixturevalue('http_root')[1].url}/token?sig={MARK}"
    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=1024)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    key = {**service_account(token_uri), "private_key": pem}
    options = {"endpoint_url": gcs_endpoint, "token": key}
    body = pem.splitlines()[3]  # a line of the key's base64
    error = raised(lambda: touch(f"gs://{BUCKET}/tokens", options), caplog, (MARK, body))
    assert isinstance(error, ab.StoreError), error
    assert "token" in str(error)


def test_gcs_endpoint_with_a_password(dead: str, caplog: pytest.LogCaptureFixture) -> None:
    options = {"endpoint_url": f"http://user:{MARK}@{dead}", "token": "anon"}
    error = raised(lambda: touch("gs://bucket/tokens", options), caplog)
    assert isinstance(error, ab.StoreError), error


# -- reprs ------------------------------------------------------------------------------------


def test_reprs(http_root: tuple[Path, RangeHTTPServer], caplog: pytest.LogCaptureFixture) -> None:
    root, server = http_root
    ab.write_tokens(str(root / "secrets"), TOKENS, shard_size=1024)
    endpoint = server.url.split("//")[1]
    url = f"http://user:{MARK}@{endpoint}/secrets"
    options = {"headers": {"X-Api-Key": MARK}}
    every_slot = {
        "key": MARK,
        "secret": MARK,
        "token": MARK,
        "sas_token": MARK,
        "account_key": MARK,
        "endpoint_url": f"https://user:{MARK}@host?sig={MARK}",
        "client_kwargs": {"aws_secret_access_key": MARK},
        "headers": {"Authorization": MARK},
    }
    config = ab.LoaderConfig(batch_size=2, storage_options=every_slot)
    texts = [repr(config), str(config)]
    assert "batch_size=2" in repr(config) and "storage_options=" in repr(config)
    with watched(caplog) as logged:
        dataset = ab.open_dataset(url, options)
        with ab.Loader(dataset, batch_size=2, seq_len=16, storage_options=options) as loader:
            assert len(next(iter(loader))["tokens"]) == 2
            texts += [repr(dataset), str(dataset), repr(loader), repr(loader.config)]
        source = ab.LoaderDataset(dataset, batch_size=2, seq_len=16, storage_options=options)
        texts += [repr(source), repr(ab.mix([dataset, dataset]))]
    assert "127.0.0.1" in repr(dataset)
    assert_hidden(texts + logged)


class _QuotingTransport:
    """Another library's transport whose exceptions quote the signed URL they failed on, as
    aiohttp's and requests' do."""

    coalesce_gap = 0

    async def size(self, url: str) -> int:
        raise ValueError(f"cannot reach https://user:{MARK}@host/x?X-Amz-Signature={MARK}")

    async def read_ranges(self, url: str, *, starts: Any, ends: Any, buffers: Any) -> None:
        raise ConnectionResetError(f"reset by https://host/x?sig={MARK}&se=2030-01-01")

    async def write(self, url: str, data: Any) -> None:
        raise RuntimeError(f"PUT https://user:{MARK}@host/x failed")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("call", ["size", "read", "write"])
def test_a_transports_own_exception_is_chained_scrubbed(
    call: str, caplog: pytest.LogCaptureFixture
) -> None:
    ab.register_store(
        "quoting", lambda scheme, options, *, max_inflight: _QuotingTransport(), clobber=True
    )

    async def run() -> None:
        store = open_store("quoting://bucket/x", retry=ONCE)
        try:
            if call == "size":
                await store.size("quoting://bucket/x")
            elif call == "read":
                await store.read_ranges(
                    "quoting://bucket/x", starts=[0], ends=[4], buffers=[bytearray(4)]
                )
            else:
                await store.write("quoting://bucket/x", b"data")
        finally:
            await store.close()

    error = raised(lambda: asyncio.run(run()), caplog)
    assert isinstance(error, ab.StoreError)
    # What failed and how stays told: the exception's type and the scrubbed URL.
    assert any(
        kind in "".join(texts_of(error))
        for kind in ("ValueError", "ConnectionResetError", "RuntimeError")
    )
