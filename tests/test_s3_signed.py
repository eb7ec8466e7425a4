"""The S3 store's signed GETs (``stores/s3_signed.py``): signatures botocore would compute,
accepted by a server that checks them, and the same bytes and typed errors as botocore's
``get_object`` (each store is run both ways: ``sign_gets`` True and False)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import BUCKET, s3_options
from faults import OK, Fault, FaultServer, fault_server
from servers import moto_server

import asyncbatch as ab
from asyncbatch._errors import (
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    ShardChangedError,
    StoreError,
    ThrottledError,
)
from asyncbatch.stores import _s3 as s3
from asyncbatch.stores._s3 import S3Store
from asyncbatch.stores._s3_signed import SignedGets, sign_v4
from asyncbatch.stores._stack import stacked

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


def test_another_signature_version_goes_through_botocore_with_one_warning(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3, "_warned", set())  # warned once per process: not by another test
    options = {**s3_options(s3_endpoint), "config_kwargs": {"signature_version": "s3"}}
    url = put(s3_options(s3_endpoint))

    async def go() -> bytes:
        transport = S3Store("s3", options, max_inflight=8, retry=FAST)
        store = stacked(transport, FAST)
        buffer = bytearray(100)
        try:
            await store.read_ranges(url, starts=[5], ends=[105], buffers=[memoryview(buffer)])
            assert transport._signed is False
        finally:
            await store.close()
        return bytes(buffer)

    with pytest.warns(ab.SlowPathWarning) as warned:
        for _ in range(3):  # three stores (a loader's epochs, say): one warning
            assert asyncio.run(go()) == DATA[5:105]
    slow = [w for w in warned if issubclass(w.category, ab.SlowPathWarning)]
    assert len(slow) == 1
    assert "go through botocore's get_object" in str(slow[0].message)
    assert "signature_version='s3'" in str(slow[0].message)


def test_a_bucket_in_another_region_goes_through_botocore_with_a_warning(
    s3_endpoint: str, proxy: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect (the bucket is in another region than the client signs for): botocore
    follows it from then on, and the store says so once."""
    monkeypatch.setattr(s3, "_warned", set())
    url = put(s3_options(s3_endpoint))
    proxy.reset()
    proxy.inject(Fault(status=301), OK)
    store = S3Store("s3", s3_options(proxy.url), max_inflight=8, retry=FAST)
    with pytest.warns(ab.SlowPathWarning, match="answered PermanentRedirect") as warned:
        data, _ = asyncio.run(_read_any(store, url, 1000, 70_000))
    assert data == DATA[1000:70_000]
    assert len([w for w in warned if issubclass(w.category, ab.SlowPathWarning)]) == 1
    assert "client_kwargs={'region_name': ...}" in str(warned[0].message)


async def _read_any(transport: S3Store, url: str, start: int, end: int) -> tuple[bytes, bytes]:
    """``[start, end)`` and the last 100 bytes, whichever path the store takes."""
    store = stacked(transport, FAST)
    buffer = bytearray(end - start)
    try:
        await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
        last, _ = await store.read_tail(url, 100)
    finally:
        await store.close()
    return bytes(buffer), bytes(last)


def test_an_invalid_bucket_name_is_the_same_config_error_both_ways(s3_endpoint: str) -> None:
    url = "s3://bad:bucket/signed/key"  # a name botocore refuses before sending
    messages = []
    for signed in (True, False):
        with pytest.raises(ab.ConfigError) as caught:
            read(s3_options(s3_endpoint), url, signed=signed)
        messages.append(str(caught.value))
    assert "invalid bucket name 'bad:bucket'" in messages[0]
    assert messages[0] == messages[1]


# -- credentials, as botocore finds them ---------------------------------------------------


def _clear_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("source", ["environment", "profile", "credential_process"])
def test_credentials_are_found_where_botocore_finds_them(
    checking_s3: tuple[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    source: str,
) -> None:
    """The signed GETs sign with the credentials the client would: from the environment, a
    profile, or a ``credential_process`` (refreshable: asked again as they near expiry)."""
    endpoint, options = checking_s3
    url = put(options, bucket="checked")
    _clear_aws_env(monkeypatch)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    given: dict[str, Any] = {"endpoint_url": endpoint}
    if source == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    elif source == "profile":
        (tmp_path / "credentials").write_text(
            f"[reader]\naws_access_key_id = {options['key']}\n"
            f"aws_secret_access_key = {options['secret']}\n"
        )
        given["profile"] = "reader"
    else:
        # Credentials that expire in 5 minutes: botocore refreshes them whenever they are
        # used within 10 minutes of expiry, so every signature asks the process again.
        script = tmp_path / "process.py"
        calls = tmp_path / "calls"
        script.write_text(
            "import datetime, json\n"
            f"open({str(calls)!r}, 'a').write('x')\n"
            "now = datetime.datetime.now(datetime.timezone.utc)\n"
            "expiry = now + datetime.timedelta(minutes=5)\n"
            f"print(json.dumps({{'Version': 1, 'AccessKeyId': {options['key']!r},"
            f" 'SecretAccessKey': {options['secret']!r}, 'Expiration': expiry.isoformat()}}))\n"
        )
        (tmp_path / "config").write_text(
            f"[profile process]\ncredential_process = {sys.executable} {script}\n"
        )
        given["profile"] = "process"
    assert read(given, url) == DATA[1000:70_000]
    if source == "credential_process":
        # Loaded once, then refreshed for the range and for the tail.
        assert len((tmp_path / "calls").read_text()) >= 3


# -- where the GETs go, as botocore resolves it ---------------------------------------------


@pytest.mark.parametrize(
    ("client", "config", "bucket"),
    [
        ({"endpoint_url": "http://127.0.0.1:9"}, {}, "bucket-a"),
        ({"endpoint_url": "http://localhost:9/prefix"}, {}, "bucket-a"),
        ({"endpoint_url": "http://localhost:9"}, {"s3": {"addressing_style": "virtual"}}, "b-1"),
        ({"region_name": "eu-west-3"}, {}, "bucket-a"),
        ({"region_name": "eu-west-3"}, {}, "dotted.bucket"),
        ({"region_name": "us-east-1"}, {"s3": {"addressing_style": "path"}}, "bucket-a"),
        ({"region_name": "us-west-2"}, {"use_fips_endpoint": True}, "bucket-a"),
        ({"region_name": "us-west-2"}, {"use_dualstack_endpoint": True}, "bucket-a"),
        ({"region_name": "eu-west-3"}, {}, "arn:aws:s3:us-west-2:123456789012:accesspoint/ap"),
    ],
)
def test_gets_go_where_botocores_would(
    client: dict[str, Any], config: dict[str, Any], bucket: str
) -> None:
    """Each bucket's URL and signing region are those of the request the client's own
    ``get_object`` sends (seen here by a ``before-send`` handler; nothing is sent)."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    key = "dir/a key+~.bin"

    async def main() -> tuple[str, str, str, str]:
        session = AioSession()
        options = {"aws_access_key_id": "AKID", "aws_secret_access_key": "secret", **client}
        async with session.create_client("s3", config=AioConfig(**config), **options) as s3:
            sent: list[Any] = []

            def capture(request: Any, **_: Any) -> Any:
                sent.append(request)
                raise RuntimeError("not sent")

            s3.meta.events.register("before-send.s3.GetObject", capture)
            with pytest.raises(RuntimeError, match="not sent"):
                await s3.get_object(Bucket=bucket, Key=key)
            s3.meta.events.unregister("before-send.s3.GetObject", capture)
            gets = SignedGets(
                s3,
                _no_credentials,
                max_inflight=1,
                connect_timeout=1,
                verify=True,
                proxies={},
                slow=_never_slow,
            )
            where = await gets._bucket(bucket)
            await gets.close()
        assert where is not None and where.region is not None
        theirs = sent[0].headers["Authorization"].decode()
        scope = theirs.split("Credential=AKID/", 1)[1].split(",", 1)[0]
        ours = f"{scope.split('/')[0]}/{where.region}/s3/aws4_request"
        return where.base + quote(key, safe="/~"), sent[0].url, ours, scope

    ours_url, their_url, ours_scope, their_scope = asyncio.run(main())
    assert ours_url == their_url
    assert ours_scope == their_scope


async def _no_credentials() -> Any:
    return None


def _never_slow(reason: str) -> None:
    raise AssertionError(f"slow path taken: {reason}")


# -- proxies and TLS as the client has them ------------------------------------------------


@pytest.mark.parametrize("given", ["config", "environment"])
def test_gets_go_through_the_clients_proxy_both_ways(
    s3_endpoint: str, proxy: FaultServer, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    url = put(s3_options(s3_endpoint))
    options: dict[str, Any] = s3_options(s3_endpoint)  # the proxy is not the endpoint
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    if given == "config":
        options["config_kwargs"] = {"proxies": {"http": proxy.url}}
    else:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
    for signed in (True, False):
        proxy.reset()
        assert read(options, url, signed=signed) == DATA[1000:70_000]
        assert proxy.count("GET") == 2  # the range and the tail


# -- the answer's version against the pin ---------------------------------------------------


async def _pinned_read(
    transport: S3Store, url: str, between: Any = None, start: int = 1000, end: int = 70_000
) -> bytes:
    """A stat (which pins the ETag), ``between()``, then a range read."""
    store = stacked(transport, FAST)
    buffer = bytearray(end - start)
    try:
        await store.stat(url)
        if between is not None:
            await asyncio.to_thread(between)
        await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
    finally:
        await store.close()
    return bytes(buffer)


def _replace(options: dict[str, Any], url: str) -> None:
    import s3fs

    s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe(url, DATA[::-1])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "botocore"])
@pytest.mark.parametrize("case", ["ignores If-Match", "rewrites the ETag", "resumed body"])
def test_an_answer_from_another_version_is_refused(
    s3_endpoint: str, proxy: FaultServer, signed: bool, case: str
) -> None:
    """A proxy or server that ignores If-Match answers from the object's new version; the
    ETag it answers with is compared with the pin on every answer (the resumed tail of a
    broken body too), and the bytes are refused."""
    import s3fs

    upstream = s3_options(s3_endpoint)
    url = put(upstream)
    pinned = s3fs.S3FileSystem(**upstream, skip_instance_cache=True).info(url)["ETag"]
    proxy.reset()
    between = None
    if case == "ignores If-Match":
        proxy.inject(default=Fault(ignore_if_match=True))
        between = lambda: _replace(upstream, url)  # noqa: E731
    elif case == "rewrites the ETag":
        proxy.inject(default=Fault(etag='"0123456789abcdef0123456789abcdef"'))
    else:
        # The object changes; the first answer claims the pinned ETag and breaks off after
        # 5,000 bytes; the retry of the missing tail answers from the new version.
        proxy.inject(
            Fault(ignore_if_match=True, etag=pinned, reset_after=5_000),
            Fault(ignore_if_match=True),
        )
        between = lambda: _replace(upstream, url)  # noqa: E731
    transport = S3Store("s3", s3_options(proxy.url), max_inflight=8, retry=FAST)
    transport.sign_gets = signed
    with pytest.raises(ShardChangedError) as caught:
        asyncio.run(_pinned_read(transport, url, between))
    message = str(caught.value)
    assert url in message and f"ETag {pinned} when first read" in message
    assert proxy.pending() == 0
    ranges = [r for m, _, r in proxy.log if m == "GET"]
    if case == "resumed body":
        assert ranges[0] == "bytes=1000-69999" and ranges[1].startswith("bytes=6000-")


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "botocore"])
def test_an_answer_from_another_version_id_is_refused(
    s3_endpoint: str, proxy: FaultServer, signed: bool
) -> None:
    """A URL pinned by ``versionId``: an answer from another version is refused."""
    import s3fs

    upstream = s3_options(s3_endpoint)
    fs = s3fs.S3FileSystem(**upstream, skip_instance_cache=True, version_aware=True)
    if not fs.exists("versioned"):
        fs.mkdir("versioned")
        fs.call_s3(
            "put_bucket_versioning",
            Bucket="versioned",
            VersioningConfiguration={"Status": "Enabled"},
        )
    url = put(upstream, bucket="versioned")
    version = fs.info(url)["VersionId"]
    proxy.reset()
    proxy.inject(default=Fault(version_id="another-version"))
    options = {**s3_options(proxy.url), "version_aware": True}
    with pytest.raises(ShardChangedError) as caught:
        read(options, f"{url}?versionId={version}", signed=signed)
    message = str(caught.value)
    assert f"asked for version {version}, the answer is from version another-version" in message


@pytest.mark.timeout(60)
def test_a_loader_refuses_an_object_changed_behind_a_proxy_that_ignores_if_match(
    s3_endpoint: str, proxy: FaultServer
) -> None:
    import numpy as np
    import s3fs

    upstream = s3_options(s3_endpoint)
    tokens = np.random.default_rng(3).integers(0, 60_000, 40_000, dtype=np.uint16)
    url = f"s3://{BUCKET}/signed/changed-{next(_names)}"
    dataset = ab.write_tokens(url, tokens, shard_size=10_000, storage_options=upstream)
    fs = s3fs.S3FileSystem(**upstream, skip_instance_cache=True)
    proxy.reset()
    proxy.inject(default=Fault(ignore_if_match=True))
    delivered = 0
    args = {"batch_size": 4, "seq_len": 32, "prefetch": 1, "coalesce_gap": 0}
    loader = ab.Loader(url, storage_options=s3_options(proxy.url), **args)
    with loader, pytest.raises(ShardChangedError, match="when first read"):  # noqa: PT012
        for _ in loader:
            delivered += 1
            if delivered == 2:
                for shard in dataset.shard_urls:  # a new ETag, the same size
                    fs.pipe(shard, fs.cat(shard)[::-1])
    assert delivered <= 2 + 2  # at most what was read ahead before the change
