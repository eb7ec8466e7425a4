"""The S3 store's signed GETs (``stores/s3_signed.py``): signatures botocore would compute,
accepted by a server that checks them, and the same bytes and typed errors as botocore's
``get_object`` (each store is run both ways: ``sign_gets`` True and False)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import BUCKET, s3_options
from faults import Fault, FaultServer, fault_server
from servers import moto_server

import asyncbatch as ab
from asyncbatch.errors import (
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    ShardChangedError,
    StoreError,
    ThrottledError,
)
from asyncbatch.stores.s3 import S3Store
from asyncbatch.stores.s3_signed import SignedGets, sign_v4
from asyncbatch.stores.stack import stacked

FAST = ab.RetryPolicy(
    max_attempts=2,
    base_delay=0.001,
    max_delay=0.005,
    deadline=30,
    connect_timeout=3.0,
    first_byte_timeout=3.0,
    idle_timeout=3.0,
)
DATA = bytes(range(256)) * 400
_names = itertools.count()


def put(options: dict[str, Any], bucket: str = BUCKET, **put_options: Any) -> str:
    """A new object holding ``DATA``; its URL."""
    import s3fs

    url = f"s3://{bucket}/signed/obj-{next(_names)}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe(url, DATA, **put_options)
    return url


async def _read(
    transport: S3Store, url: str, start: int, end: int, tail: int
) -> tuple[bytes, bytes]:
    store = stacked(transport, FAST)  # as open_store stacks it
    buffer = bytearray(end - start)
    try:
        await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
        last, _ = await store.read_tail(url, tail)
        # Which path the store took: a test of the signed path must not pass on botocore's.
        bucket = url.removeprefix("s3://").split("/")[0]
        gets = transport._signed
        signed = isinstance(gets, SignedGets) and gets._buckets.get(bucket) is not None
        assert signed == transport.sign_gets
    finally:
        await store.close()
    return bytes(buffer), bytes(last)


def read(
    options: dict[str, Any], url: str, *, signed: bool = True, start: int = 1000, end: int = 70_000
) -> bytes:
    """Bytes ``[start, end)`` of ``url`` and (checked here) its last 100 bytes, read by a new
    store through the signed path or botocore's."""
    store = S3Store("s3", options, max_inflight=8, retry=FAST)
    store.sign_gets = signed
    data, last = asyncio.run(_read(store, url, start, end, 100))
    return data


def error_of(options: dict[str, Any], url: str, *, signed: bool) -> StoreError:
    with pytest.raises(StoreError) as caught:
        read(options, url, signed=signed)
    return caught.value


# -- the signature ------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//token+/="])
@pytest.mark.parametrize("query", ["", "versionId=3%2Fa~b"])
def test_the_signature_is_botocores(token: str | None, query: str) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import ReadOnlyCredentials

    path = "/bucket/a%20key/with~odd%2Bchars.parquet"
    url = f"http://127.0.0.1:9000{path}" + (f"?{query}" if query else "")
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token, None)
    request = AWSRequest("GET", url, headers={"x-amz-request-payer": "requester"})
    S3SigV4Auth(credentials, "s3", "eu-west-3").add_auth(request)
    stamp = request.headers["X-Amz-Date"]
    import calendar
    import time

    now = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    ours = {"x-amz-request-payer": "requester"}
    sign_v4(
        ours,
        host="127.0.0.1:9000",
        path=path,
        query=query,
        access_key="AKIDEXAMPLE",
        secret_key="wJalrXUtnFEMI/K7MDENG",
        token=token,
        region="eu-west-3",
        now=now,
    )
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours.get("x-amz-security-token") == token


# -- against a server that checks signatures -----------------------------------------------


@pytest.fixture(scope="module")
def checking_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """moto checking credentials and signatures (after the three requests that create a user,
    its key and its policy): its URL and the user's storage options."""
    import boto3

    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="3") as url:
        iam = boto3.client(
            "iam",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="reader", PolicyName="all-s3", PolicyDocument=json.dumps(policy)
        )
        options = {
            "endpoint_url": url,
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
        }
        import s3fs

        s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir("checked")
        yield url, options


def test_a_server_checking_signatures_accepts_them(
    checking_s3: tuple[str, dict[str, Any]],
) -> None:
    _, options = checking_s3
    url = put(options, bucket="checked")
    assert read(options, url) == DATA[1000:70_000]


def test_a_version_in_the_url_is_signed_and_read(checking_s3: tuple[str, dict[str, Any]]) -> None:
    import s3fs

    _, options = checking_s3
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True, version_aware=True)
    fs.call_s3(
        "put_bucket_versioning", Bucket="checked", VersioningConfiguration={"Status": "Enabled"}
    )
    url = put(options, bucket="checked")
    version = fs.info(url)["VersionId"]
    put_again = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    put_again.pipe(url, b"x" * len(DATA))  # a newer version: the URL's must be the one read
    versioned = {**options, "version_aware": True}
    assert read(versioned, f"{url}?versionId={version}") == DATA[1000:70_000]


@pytest.mark.parametrize("mistake", ["unknown-key", "wrong-secret"])
def test_rejected_credentials_are_the_same_error_both_ways(
    checking_s3: tuple[str, dict[str, Any]], mistake: str
) -> None:
    _, options = checking_s3
    url = put(options, bucket="checked")
    key, code = ("AKIAUNKNOWN", "InvalidAccessKeyId")
    if mistake == "wrong-secret":
        key, code = (options["key"], "SignatureDoesNotMatch")
    wrong = {**options, "key": key, "secret": "wrong"}
    signed, botocore = (error_of(wrong, url, signed=flag) for flag in (True, False))
    assert isinstance(signed, CredentialsError)
    assert code in str(signed) and "check key, secret and profile" in str(signed)
    assert (type(signed), str(signed)) == (type(botocore), str(botocore))


# -- errors and headers through the fault proxy --------------------------------------------


@pytest.fixture(scope="module")
def proxy(s3_endpoint: str) -> Iterator[FaultServer]:
    with fault_server(upstream=s3_endpoint) as server:
        yield server


def get_headers(proxy: FaultServer) -> list[dict[str, str]]:
    """The headers (names in lower case) of the GETs the proxy saw."""
    return [
        {name.lower(): value for name, value in headers.items()}
        for (method, _, _), headers in zip(proxy.log, proxy.headers, strict=True)
        if method == "GET"
    ]


def test_a_session_token_is_sent_and_signed(s3_endpoint: str, proxy: FaultServer) -> None:
    url = put(s3_options(s3_endpoint))
    proxy.reset()
    options = {**s3_options(proxy.url), "token": "session-token/+="}
    assert read(options, url) == DATA[1000:70_000]
    gets = get_headers(proxy)
    assert len(gets) == 2  # the range and the tail
    for headers in gets:
        assert headers["x-amz-security-token"] == "session-token/+="
        assert "x-amz-security-token" in headers["authorization"]


def test_anonymous_gets_are_unsigned(s3_endpoint: str, proxy: FaultServer) -> None:
    url = put(s3_options(s3_endpoint), ACL="public-read")  # moto refuses others' anonymous GETs
    proxy.reset()
    assert read({"endpoint_url": proxy.url, "anon": True}, url) == DATA[1000:70_000]
    gets = get_headers(proxy)
    assert gets and all("authorization" not in headers for headers in gets)


def test_requester_pays_is_sent(s3_endpoint: str, proxy: FaultServer) -> None:
    url = put(s3_options(s3_endpoint))
    proxy.reset()
    options = {**s3_options(proxy.url), "requester_pays": True}
    assert read(options, url) == DATA[1000:70_000]
    assert {headers.get("x-amz-request-payer") for headers in get_headers(proxy)} == {"requester"}


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault(status=503, retry_after=0.01), ThrottledError),
        (Fault(status=403), PermissionDeniedError),
        (Fault(status=500), StoreError),
        (Fault(status=412), ShardChangedError),
    ],
)
def test_error_answers_are_the_same_typed_errors_both_ways(
    s3_endpoint: str, proxy: FaultServer, fault: Fault, expected: type[StoreError]
) -> None:
    url = put(s3_options(s3_endpoint))
    errors = []
    for signed in (True, False):
        proxy.reset()
        proxy.inject(default=fault)
        errors.append(error_of(s3_options(proxy.url), url, signed=signed))
        assert proxy.count("GET") >= 1
    assert str(errors[0]) == str(errors[1])  # with the list of attempts, when retried
    # A retried error's last attempt is its cause.
    signed_error, botocore_error = (
        error.__cause__ if isinstance(error, RetriesExhaustedError) else error for error in errors
    )
    assert isinstance(signed_error, expected)
    assert type(signed_error) is type(botocore_error)
    assert str(signed_error) == str(botocore_error)
    retry_after = [getattr(error, "retry_after", None) for error in (signed_error, botocore_error)]
    assert retry_after[0] == retry_after[1] == (0.01 if expected is ThrottledError else None)


def test_a_missing_key_is_the_same_not_found_both_ways(s3_endpoint: str) -> None:
    url = f"s3://{BUCKET}/signed/missing"
    options = s3_options(s3_endpoint)
    signed, botocore = (error_of(options, url, signed=flag) for flag in (True, False))
    assert isinstance(signed, NotFoundError) and "NoSuchKey" in str(signed)
    assert str(signed) == str(botocore)


def test_no_credentials_is_the_same_error_both_ways(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = put(s3_options(s3_endpoint))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    options = {"endpoint_url": s3_endpoint}
    signed, botocore = (error_of(options, url, signed=flag) for flag in (True, False))
    assert isinstance(signed, CredentialsError) and "no AWS credentials" in str(signed)
    assert str(signed) == str(botocore)


def test_another_signature_version_goes_through_botocore(s3_endpoint: str) -> None:
    options = {**s3_options(s3_endpoint), "config_kwargs": {"signature_version": "s3"}}
    url = put(s3_options(s3_endpoint))
    transport = S3Store("s3", options, max_inflight=8, retry=FAST)
    store = stacked(transport, FAST)

    async def go() -> bytes:
        buffer = bytearray(100)
        try:
            await store.read_ranges(url, starts=[5], ends=[105], buffers=[memoryview(buffer)])
            assert transport._signed is False
        finally:
            await store.close()
        return bytes(buffer)

    assert asyncio.run(go()) == DATA[5:105]


def test_an_invalid_bucket_name_is_the_same_config_error_both_ways(s3_endpoint: str) -> None:
    url = "s3://bad:bucket/signed/key"  # a name botocore refuses before sending
    messages = []
    for signed in (True, False):
        with pytest.raises(ab.ConfigError) as caught:
            read(s3_options(s3_endpoint), url, signed=signed)
        messages.append(str(caught.value))
    assert "invalid bucket name 'bad:bucket'" in messages[0]
    assert messages[0] == messages[1]
