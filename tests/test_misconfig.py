"""Misconfiguration fails fast, once, with the fix named: each mistake a new user makes,
against real servers (moto S3, the Range HTTP server, a TLS server with a self-signed
certificate, a closed port), through ``open_dataset`` and through a ``Loader``.

The time bounds are the requirement itself (no retry for what retrying cannot fix; refused
connections retried for a few seconds at most), not speed figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, s3_options
from servers import RangeHTTPServer, free_port, http_server, moto_server, self_signed_certificate

import asyncbatch as ab
from asyncbatch.stores import open_store

#: Errors that no retry can fix come from the first attempt; retried, they would take the
#: default policy's 30 s. The bound sits far from both so a loaded machine cannot fail it.
AT_ONCE = 10.0
#: Refused connections are retried for 3 s (RetryPolicy.refused_deadline), not 30.
REFUSED_BUDGET = 15.0
SEQ_LEN = 16
TOKENS = np.arange(4_000, dtype=np.uint16)

Entry = Callable[[str, dict[str, Any]], object]


def through_open_dataset(url: str, options: dict[str, Any]) -> object:
    return ab.open_dataset(url, options)


def through_loader(url: str, options: dict[str, Any]) -> object:
    with ab.Loader(url, batch_size=4, seq_len=SEQ_LEN, storage_options=options) as loader:
        return next(iter(loader))


@pytest.fixture(params=[through_open_dataset, through_loader], ids=["open_dataset", "Loader"])
def entry(request: pytest.FixtureRequest) -> Entry:
    """Each way a user opens a URL: ``open_dataset``, and a ``Loader`` given the URL."""
    function: Entry = request.param
    return function


def fails(
    expected: type[BaseException], call: Callable[[], object], within: float
) -> BaseException:
    """The error ``call()`` raises, checked to be ``expected`` and to come within ``within``."""
    began = time.monotonic()
    with pytest.raises(expected) as caught:
        call()
    elapsed = time.monotonic() - began
    assert elapsed < within, f"{type(caught.value).__name__} after {elapsed:.1f} s"
    return caught.value


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere botocore looks (and no instance metadata service asked)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="module")
def s3_dataset(s3_endpoint: str) -> ab.Dataset:
    """A tokens dataset in moto S3, opened with good credentials."""
    url = f"s3://{BUCKET}/misconfig/tokens"
    ab.write_tokens(url, TOKENS, storage_options=s3_options(s3_endpoint))
    return ab.open_dataset(url, s3_options(s3_endpoint))


# -- credentials ---------------------------------------------------------------------------


@pytest.mark.usefixtures("no_aws_credentials")
def test_no_credentials_fail_at_once_naming_the_fix(entry: Entry, s3_endpoint: str) -> None:
    url = f"s3://{BUCKET}/misconfig/tokens"
    error = fails(ab.CredentialsError, lambda: entry(url, {"endpoint_url": s3_endpoint}), AT_ONCE)
    message = str(error)
    assert url in message and "key=" in message and "secret=" in message
    assert message.count("no AWS credentials") == 1
    assert isinstance(error, PermissionError)


@pytest.mark.usefixtures("no_aws_credentials")
def test_no_credentials_while_a_loader_reads(s3_dataset: ab.Dataset, s3_endpoint: str) -> None:
    # Opened with credentials, read without: the loader's first read fails, not retried.
    dataset = dataclasses.replace(s3_dataset, storage_options={"endpoint_url": s3_endpoint})

    def read() -> object:
        with ab.Loader(dataset, batch_size=4, seq_len=SEQ_LEN) as loader:
            return next(iter(loader))

    error = fails(ab.CredentialsError, read, AT_ONCE)
    assert s3_dataset.url in str(error)


@pytest.fixture(scope="module")
def s3_with_auth() -> Iterator[tuple[str, str]]:
    """A moto server that checks credentials (after the two requests creating a user and
    its key): its URL and that user's access key id."""
    import boto3

    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="2") as url:
        iam = boto3.client(
            "iam",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]["AccessKeyId"]
        yield url, key


@pytest.mark.parametrize("mistake", ["unknown-key", "wrong-secret"])
def test_rejected_credentials_are_not_retried(
    entry: Entry, s3_with_auth: tuple[str, str], mistake: str
) -> None:
    endpoint, known_key = s3_with_auth
    key, code = ("AKIAUNKNOWN", "InvalidAccessKeyId")
    if mistake == "wrong-secret":
        key, code = (known_key, "SignatureDoesNotMatch")
    options = {"endpoint_url": endpoint, "key": key, "secret": "wrong"}
    url = "s3://data/tokens"
    error = fails(ab.CredentialsError, lambda: entry(url, options), AT_ONCE)
    message = str(error)
    assert url in message and code in message and "check key, secret and profile" in message


def test_missing_s3_object_says_its_status_once(s3_endpoint: str) -> None:
    # A HEAD's error has no body: botocore's code is the status again ("HTTP 404 404").
    url = f"s3://{BUCKET}/misconfig/missing"

    async def size() -> int:
        store = open_store(url, s3_options(s3_endpoint))
        try:
            return await store.size(url)
        finally:
            await store.close()

    with pytest.raises(ab.NotFoundError) as caught:
        asyncio.run(size())
    assert str(caught.value) == f"not found (HTTP 404): {url}"


def test_a_missing_bucket_is_named_when_opening(entry: Entry, s3_endpoint: str) -> None:
    url = "s3://no-such-bucket/corpus"
    error = fails(ab.BucketNotFoundError, lambda: entry(url, s3_options(s3_endpoint)), AT_ONCE)
    assert isinstance(error, ab.NotFoundError)
    assert "the bucket 'no-such-bucket' does not exist (NoSuchBucket)" in str(error)
    assert "aws s3 mb s3://no-such-bucket" in str(error) and url in str(error)


def test_a_missing_bucket_is_named_when_writing(s3_endpoint: str) -> None:
    url = "s3://no-such-bucket/corpus"
    call = lambda: ab.write_tokens(url, TOKENS, storage_options=s3_options(s3_endpoint))  # noqa: E731
    error = fails(ab.BucketNotFoundError, call, AT_ONCE)
    assert str(error).startswith("the bucket 'no-such-bucket' does not exist (NoSuchBucket)")
    assert str(error).endswith(": s3://no-such-bucket/corpus/shard-00000.bin")


@pytest.mark.parametrize("call", ["stat", "list", "list_info", "read_tail", "read_ranges"])
def test_a_missing_bucket_is_named_by_every_call(s3_endpoint: str, call: str) -> None:
    url = "s3://no-such-bucket/corpus/shard-00000.bin"

    async def main() -> None:
        store = open_store(url, s3_options(s3_endpoint))
        try:
            if call == "read_tail":
                await store.read_tail(url, 8)
            elif call == "read_ranges":
                buffer = memoryview(bytearray(8))
                await store.read_ranges(url, starts=[0], ends=[8], buffers=[buffer])
            else:
                await getattr(store, call)(url)
        finally:
            await store.close()

    with pytest.raises(ab.BucketNotFoundError, match="the bucket 'no-such-bucket' does not exist"):
        asyncio.run(main())


def test_a_missing_key_in_a_bucket_is_not_called_a_missing_bucket(s3_endpoint: str) -> None:
    url = f"s3://{BUCKET}/misconfig/no-such-prefix"
    error = fails(ab.NotFoundError, lambda: ab.open_dataset(url, s3_options(s3_endpoint)), AT_ONCE)
    assert not isinstance(error, ab.BucketNotFoundError) and "bucket" not in str(error)


# -- URLs and options ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "fixed"),
    [
        ("S3://bucket/tokens", "s3://bucket/tokens"),
        ("Https://host/tokens", "https://host/tokens"),
        ("s3:/bucket/tokens", "s3://bucket/tokens"),
        ("http:/host/tokens", "http://host/tokens"),
        ("s3:bucket/tokens", "s3://bucket/tokens"),
        ("file:/data/tokens", "file:///data/tokens"),
    ],
)
def test_malformed_urls_are_refused_with_the_fix(entry: Entry, url: str, fixed: str) -> None:
    error = fails(ab.ConfigError, lambda: entry(url, {}), AT_ONCE)
    assert url in str(error) and f"use {fixed}" in str(error)


def test_unknown_scheme_suggests_the_closest() -> None:
    error = fails(ab.UnknownSchemeError, lambda: ab.open_dataset("s4://bucket/tokens"), AT_ONCE)
    assert "'s4' (did you mean 's3'?)" in str(error)


def test_writers_refuse_malformed_urls(tmp_path: Path) -> None:
    with pytest.raises(ab.ConfigError, match="use s3://bucket/tokens"):
        ab.write_tokens("s3:/bucket/tokens", TOKENS)
    # A path with a colon that no scheme claims is still a path.
    ab.write_tokens(str(tmp_path / "odd:name"), TOKENS)
    assert ab.open_dataset(str(tmp_path / "odd:name")).manifest.total_elements == len(TOKENS)


def test_invalid_bucket_name_is_a_config_error(entry: Entry, s3_endpoint: str) -> None:
    url = "s3://no!such_bucket/tokens"
    error = fails(ab.ConfigError, lambda: entry(url, s3_options(s3_endpoint)), AT_ONCE)
    assert "'no!such_bucket'" in str(error) and url in str(error)
    assert "lower-case letters, digits, dots and hyphens" in str(error)


@pytest.mark.parametrize(
    ("url", "options", "suggested", "listed"),
    [
        ("s3://b/k", {"endpoint": "http://127.0.0.1:9"}, "endpoint_url", "anon"),
        ("http://127.0.0.1:9/k", {"header": {}}, "headers", "headers"),
        ("/data/tokens", {"max_open_file": 8}, "max_open_files", "mmap"),
    ],
    ids=["s3", "http", "local"],
)
def test_unknown_storage_option_names_the_closest(
    entry: Entry, url: str, options: dict[str, Any], suggested: str, listed: str
) -> None:
    error = fails(ab.ConfigError, lambda: entry(url, options), AT_ONCE)
    message = str(error)
    (given,) = options
    assert f"did you mean {suggested!r} for {given!r}?" in message
    assert listed in message.split("known: ")[1]


# -- endpoints -----------------------------------------------------------------------------

#: ``.invalid`` is reserved (RFC 2606): it never resolves, and resolvers say so locally.
UNRESOLVABLE = "http://nonexistent.invalid:9"


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_unresolvable_host_fails_at_once(entry: Entry, kind: str) -> None:
    if kind == "http":
        url, options = f"{UNRESOLVABLE}/tokens", {}
    else:
        url, options = "s3://bucket/tokens", {**s3_options(UNRESOLVABLE)}
    error = fails(ab.EndpointError, lambda: entry(url, options), AT_ONCE)
    message = str(error)
    assert url in message and "nonexistent.invalid:9 does not resolve" in message
    assert isinstance(error, ConnectionError)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RangeHTTPServer, Path]]:
    """The Range server over TLS with a self-signed certificate, serving a tokens dataset
    under ``/tokens``; and the certificate's file."""
    root = tmp_path_factory.mktemp("tls-root")
    certificate, key = self_signed_certificate(tmp_path_factory.mktemp("tls-certificate"))
    ab.write_tokens(str(root / "tokens"), TOKENS)
    ab.write_tokens(str(root / "bucket" / "tokens"), TOKENS)  # s3://bucket/tokens, path-style
    with http_server(root, tls=(certificate, key)) as server:
        yield server, certificate


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_untrusted_certificate_fails_at_once(
    entry: Entry, tls_server: tuple[RangeHTTPServer, Path], kind: str
) -> None:
    server, _ = tls_server
    endpoint = server.url.replace("http://", "https://")
    if kind == "http":
        url, options, fix = f"{endpoint}/tokens", {}, "SSL_CERT_FILE"
    else:
        url, options, fix = "s3://bucket/tokens", s3_options(endpoint), "client_kwargs"
    error = fails(ab.EndpointError, lambda: entry(url, options), AT_ONCE)
    message = str(error)
    assert url in message and "TLS certificate" in message and "failed verification" in message
    assert fix in message


def test_the_named_tls_fix_works(tls_server: tuple[RangeHTTPServer, Path]) -> None:
    server, certificate = tls_server
    url = f"{server.url.replace('http://', 'https://')}/tokens"
    code = f"import asyncbatch; print(asyncbatch.open_dataset({url!r}).manifest.total_elements)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "SSL_CERT_FILE": str(certificate)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(TOKENS))


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_connection_refused_gives_up_within_seconds(entry: Entry, kind: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # bound, then closed: nothing listens
    if kind == "http":
        url, options = f"{dead}/tokens", {}
    else:
        url, options = "s3://bucket/tokens", s3_options(dead)
    error = fails(ab.RetriesExhaustedError, lambda: entry(url, options), REFUSED_BUDGET)
    message = str(error)
    assert url in message and message.count("connection refused by") == 1
    assert dead.split("//")[1] in message.split("refused by")[1]  # the endpoint
    assert "(refused connections are retried for 3 s), each: connection refused by" in message
    attempts: list[str] = error.attempts  # type: ignore[attr-defined]
    assert len(attempts) >= 2 and len(set(attempts)) == 1


def test_connection_refused_while_a_loader_reads(tmp_path: Path) -> None:
    # The server answered the open, then went away: the loader's reads give up within seconds.
    ab.write_tokens(str(tmp_path / "tokens"), TOKENS)
    with http_server(tmp_path) as server:
        dataset = ab.open_dataset(f"{server.url}/tokens")

    def read() -> object:
        with ab.Loader(dataset, batch_size=4, seq_len=SEQ_LEN) as loader:
            return next(iter(loader))

    error = fails(ab.RetriesExhaustedError, read, REFUSED_BUDGET)
    assert dataset.url in str(error) and "connection refused" in str(error)


@pytest.mark.parametrize("fix", ["client_kwargs", "AWS_CA_BUNDLE"])
def test_the_named_s3_tls_fixes_work(
    tls_server: tuple[RangeHTTPServer, Path], monkeypatch: pytest.MonkeyPatch, fix: str
) -> None:
    """Both fixes the S3 error names reach the signed GETs as they reach botocore (the Range
    server stands in for S3: it ignores the signatures)."""
    server, certificate = tls_server
    options = s3_options(server.url.replace("http://", "https://"))
    if fix == "client_kwargs":
        options["client_kwargs"] = {"verify": str(certificate)}
    else:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(certificate))
    assert ab.open_dataset("s3://bucket/tokens", options).manifest.total_elements == len(TOKENS)
    batch = through_loader("s3://bucket/tokens", options)
    assert isinstance(batch, ab.Batch)
