"""Storage faults on GCS, injected by the fault server as a proxy in front of fake-gcs-server:
exact bytes after retries (a broken body asked again only for its missing tail), or the right
typed error after exactly the right number of requests; generations sent as preconditions
and compared with the pin."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, expected_windows, gcs_options
from faults import OK, Fault, FaultServer, fault_server
from servers import free_port, gcs_put, running

import asyncbatch as ab
from asyncbatch._errors import (
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    RangeNotSupportedError,
    RetriesExhaustedError,
    ShardChangedError,
    StoreError,
    StoreTimeoutError,
    ThrottledError,
)
from asyncbatch.stores import open_store
from asyncbatch.stores._base import ObjectInfo, ReadsTail, Store

#: Tiny backoffs; timeouts of 2 s, so a stall costs 2 s (the only faults that wait them out).
FAST = ab.RetryPolicy(
    max_attempts=4,
    base_delay=0.001,
    max_delay=0.005,
    deadline=30,
    connect_timeout=2.0,
    first_byte_timeout=2.0,
    idle_timeout=2.0,
)
FOREVER = 60.0
SIZE = 200_000
DATA = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
_names = itertools.count()


@pytest.fixture(scope="module")
def gcs_proxy(gcs_endpoint: str) -> Iterator[FaultServer]:
    with fault_server(upstream=gcs_endpoint) as server:
        yield server


@pytest.fixture
def proxy(gcs_proxy: FaultServer) -> FaultServer:
    gcs_proxy.reset()
    return gcs_proxy


def put(endpoint: str, data: bytes = DATA) -> str:
    """A new object (named so that no other's name holds it); its URL."""
    url = f"gs://{BUCKET}/faults/g{next(_names):05d}"
    gcs_put(endpoint, url, data)
    return url


def name_of(url: str) -> str:
    return "/" + url.rsplit("/", 1)[1]


def gets(proxy: FaultServer, url: str) -> list[str]:
    """The Range headers of the media GETs of ``url``, in order."""
    return [r for m, p, r in proxy.log if m == "GET" and p.endswith(name_of(url)) and r]


def store_of(proxy: FaultServer, policy: ab.RetryPolicy = FAST) -> Store:
    return open_store(f"gs://{BUCKET}/x", gcs_options(proxy.url), max_inflight=8, retry=policy)


async def _read(store: Store, url: str, start: int, end: int) -> bytes:
    buffer = bytearray(end - start)
    try:
        await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
    finally:
        await store.close()
    return bytes(buffer)


def read(proxy: FaultServer, url: str, start: int, end: int, **kwargs: Any) -> bytes:
    return asyncio.run(_read(store_of(proxy, **kwargs), url, start, end))


# -- faults that are retried -------------------------------------------------------------

RETRIED = {
    "503": Fault(status=503),
    "500": Fault(status=500),
    "408": Fault(status=408),
    "429": Fault(status=429, retry_after=0.01),
    "stall": Fault(stall=FOREVER),
    "slow-headers": Fault(delay=FOREVER),
    "reset": Fault(reset_after=5_000),
    "truncated": Fault(truncate_after=5_000),
    "truncated-chunked": Fault(truncate_after=5_000, chunked=True),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", list(RETRIED))
def test_retried_fault_then_exact_bytes(gcs_endpoint: str, proxy: FaultServer, fault: str) -> None:
    url = put(gcs_endpoint)
    proxy.inject(RETRIED[fault], OK)
    start, end = 1_000, 150_000
    assert read(proxy, url, start, end) == DATA[start:end]
    ranges = gets(proxy, url)
    assert len(ranges) == 2
    if fault.startswith(("reset", "truncated")):
        # Only the missing tail is asked for again.
        first = int(ranges[1].removeprefix("bytes=").split("-")[0])
        assert start < first <= start + 5_000
        assert ranges[1].endswith(f"-{end - 1}")
    else:
        assert ranges == [f"bytes={start}-{end - 1}"] * 2


@pytest.mark.timeout(30)
def test_persistent_503_costs_exactly_max_attempts(gcs_endpoint: str, proxy: FaultServer) -> None:
    url = put(gcs_endpoint)
    proxy.inject(default=Fault(status=503))
    policy = ab.RetryPolicy(max_attempts=5, base_delay=0.001, max_delay=0.002)
    with pytest.raises(RetriesExhaustedError) as caught:
        read(proxy, url, 10, 20_010, policy=policy)
    assert len(gets(proxy, url)) == 5
    message = str(caught.value)
    assert url in message and "bytes [10, 20010)" in message
    assert "after 5 attempts, each: HTTP 503" in message
    assert isinstance(caught.value.__cause__, ThrottledError)


@pytest.mark.timeout(30)
def test_retry_after_is_honoured(gcs_endpoint: str, proxy: FaultServer) -> None:
    url = put(gcs_endpoint)
    proxy.inject(Fault(status=429, retry_after=0.4), OK)
    began = time.monotonic()
    assert read(proxy, url, 0, 100) == DATA[:100]
    assert time.monotonic() - began >= 0.4
    assert len(gets(proxy, url)) == 2


@pytest.mark.timeout(30)
def test_slow_drip_completes_where_a_stall_of_the_same_length_times_out(
    gcs_endpoint: str, proxy: FaultServer
) -> None:
    url = put(gcs_endpoint)
    one = ab.RetryPolicy(max_attempts=1, first_byte_timeout=3.0, idle_timeout=1.0)
    # 8 pieces 0.2 s apart under a 1 s idle timeout: always moving.
    proxy.inject(Fault(drip=(12_500, 0.2)))
    assert read(proxy, url, 0, 100_000, policy=one) == DATA[:100_000]
    proxy.inject(Fault(stall=2.0))
    with pytest.raises(RetriesExhaustedError) as caught:
        read(proxy, url, 0, 100_000, policy=one)
    assert isinstance(caught.value.__cause__, StoreTimeoutError)
    assert "stalled" in str(caught.value)


@pytest.mark.timeout(30)
def test_a_slow_upload_that_keeps_moving_completes() -> None:
    """An upload is bounded by its pauses, not its length: 48 MiB read by the server at
    ~10 MiB/s (~5 s, never a pause past 0.1 s) under 1 s connect and first-byte timeouts."""
    from aiohttp import web

    from asyncbatch.stores._gcs import GcsStore

    received: list[bytes] = []

    async def upload(request: web.Request) -> web.Response:
        while chunk := await request.content.read(1 << 20):
            received.append(chunk)
            await asyncio.sleep(0.1)
        return web.json_response({"name": "obj", "generation": "1"})

    async def main() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post(f"/upload/storage/v1/b/{BUCKET}/o", upload)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        policy = ab.RetryPolicy(connect_timeout=1.0, first_byte_timeout=1.0, idle_timeout=1.0)
        endpoint = f"http://127.0.0.1:{port}"
        store = GcsStore("gs", {"endpoint_url": endpoint, "token": "anon"}, retry=policy)
        try:
            await store.write(f"gs://{BUCKET}/obj", DATA * 252)
        finally:
            await store.close()
            await runner.cleanup()

    asyncio.run(main())
    assert b"".join(received) == DATA * 252


# -- faults that are not -----------------------------------------------------------------

NOT_RETRIED: dict[str, tuple[Fault, type[StoreError]]] = {
    "401": (Fault(status=401), CredentialsError),
    "403": (Fault(status=403), PermissionDeniedError),
    "404": (Fault(status=404), NotFoundError),
    "ignored-range": (Fault(ignore_range=True), RangeNotSupportedError),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", list(NOT_RETRIED))
def test_fault_not_retried(gcs_endpoint: str, proxy: FaultServer, fault: str) -> None:
    url = put(gcs_endpoint)
    injected, error = NOT_RETRIED[fault]
    proxy.inject(default=injected, path=name_of(url))
    with pytest.raises(error) as caught:
        read(proxy, url, 100, 5_000)
    assert type(caught.value) is error
    assert url in str(caught.value) and "bytes [100, 5000)" in str(caught.value)
    assert len(gets(proxy, url)) == 1
    if fault == "401":
        assert "GOOGLE_APPLICATION_CREDENTIALS" in str(caught.value)


@pytest.mark.timeout(30)
def test_range_past_the_end_is_a_short_read(gcs_endpoint: str, proxy: FaultServer) -> None:
    url = put(gcs_endpoint)
    with pytest.raises(ab.ShortReadError, match=r"bytes \[199990, 200100\)"):
        read(proxy, url, SIZE - 10, SIZE + 100)
    with pytest.raises(ab.ShortReadError, match=r"bytes \[300000, 300010\)"):  # a 416
        read(proxy, url, 300_000, 300_010)
    assert len(gets(proxy, url)) == 2


@pytest.mark.timeout(30)
def test_connection_refused_is_retried_and_typed() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url = f"gs://{BUCKET}/faults/none"
    store = open_store(url, gcs_options(dead), retry=FAST)
    with pytest.raises(RetriesExhaustedError, match="each: connection refused") as caught:
        asyncio.run(_read(store, url, 5, 10))
    assert url in str(caught.value) and "bytes [5, 10)" in str(caught.value)


# -- generations -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_an_object_replaced_after_pinning_is_shard_changed(
    gcs_endpoint: str, proxy: FaultServer
) -> None:
    url = put(gcs_endpoint)

    async def main() -> tuple[ObjectInfo, str, str]:
        store = store_of(proxy)
        buffer = memoryview(bytearray(100))
        try:
            info = await store.stat(url)  # type: ignore[attr-defined]
            await store.read_ranges(url, starts=[0], ends=[100], buffers=[buffer])
            gcs_put(gcs_endpoint, url, DATA[::-1])
            # The emulator ignores ifGenerationMatch: the answer's generation tells.
            with pytest.raises(ShardChangedError) as changed:
                await store.read_ranges(url, starts=[100], ends=[200], buffers=[buffer])
            # GCS itself answers 412 to the precondition; named with both generations.
            proxy.inject(Fault(status=412))
            with pytest.raises(ShardChangedError) as refused:
                await store.read_ranges(url, starts=[200], ends=[300], buffers=[buffer])
            return info, str(changed.value), str(refused.value)
        finally:
            await store.close()

    info, changed, refused = asyncio.run(main())
    assert info.size == SIZE and info.version and info.version.isdigit()
    assert url in changed and info.version in changed
    now = asyncio.run(GcsMetadata(gcs_endpoint).generation(url))
    assert refused == (
        f"the object changed since it was pinned: generation {info.version} when first read,"
        f" {now} now: {url}"
    )
    # Not retried: one GET each.
    assert len(gets(proxy, url)) == 3


class GcsMetadata:
    """Generations straight from the emulator."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def generation(self, url: str) -> str | None:
        store = open_store(url, gcs_options(self.endpoint))
        try:
            return (await store.stat(url)).version  # type: ignore[attr-defined,no-any-return]
        finally:
            await store.close()


@pytest.mark.timeout(30)
def test_a_proxy_that_rewrites_the_generation_is_shard_changed(
    gcs_endpoint: str, proxy: FaultServer
) -> None:
    url = put(gcs_endpoint)
    proxy.inject(OK, Fault(headers=(("X-Goog-Generation", "42"),)))

    async def main() -> None:
        store = store_of(proxy)
        buffer = memoryview(bytearray(100))
        try:
            await store.read_ranges(url, starts=[0], ends=[100], buffers=[buffer])
            with pytest.raises(ShardChangedError, match=r"version \d+ when first seen, 42 now"):
                await store.read_ranges(url, starts=[100], ends=[200], buffers=[buffer])
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["503", "truncated"])
def test_a_tail_read_is_one_request_retried_and_pinned(
    gcs_endpoint: str, proxy: FaultServer, fault: str
) -> None:
    url = put(gcs_endpoint)
    proxy.inject(RETRIED[fault], OK)

    async def main() -> tuple[bytes | bytearray, ObjectInfo]:
        store = store_of(proxy)
        try:
            assert isinstance(store, ReadsTail)
            got = await store.read_tail(url, 100_000)
            gcs_put(gcs_endpoint, url, DATA[::-1])
            with pytest.raises(ShardChangedError):  # pinned by the tail read
                await store.read_tail(url, 10)
            return got
        finally:
            await store.close()

    tail, info = asyncio.run(main())
    assert (bytes(tail), info.size) == (DATA[-100_000:], SIZE)
    assert gets(proxy, url) == ["bytes=-100000", "bytes=-100000", "bytes=-10"]


@pytest.mark.timeout(60)
def test_a_loader_over_faulty_gcs_is_byte_exact(gcs_endpoint: str, proxy: FaultServer) -> None:
    tokens = np.random.default_rng(1).integers(0, 60_000, 30_011, dtype=np.uint16)
    url = f"gs://{BUCKET}/faults/e2e-{next(_names)}"
    ab.write_tokens(url, tokens, shard_size=6_002, storage_options=gcs_options(gcs_endpoint))
    faults = [
        OK,
        Fault(status=503),
        OK,
        Fault(reset_after=50),
        Fault(truncate_after=10, chunked=True),
        OK,
        Fault(status=429, retry_after=0),
        Fault(truncate_after=30),
    ]
    proxy.inject(*faults, path="shard-")
    seen = 0
    with ab.Loader(
        url,
        batch_size=8,
        seq_len=64,
        next_token=True,
        shuffle=True,
        prefetch=4,
        max_inflight=4,
        retry=FAST,
        storage_options=gcs_options(proxy.url),
    ) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 64, True)
            )
            seen += len(batch.global_indexes)
    assert seen == (tokens.size - 1) // 64 // 8 * 8
    assert proxy.pending() == 0  # every fault was served


@pytest.mark.timeout(60)
def test_an_object_replaced_mid_epoch_stays_refused(gcs_endpoint: str) -> None:
    from test_faults import _changed_data_stays_refused

    tokens = np.random.default_rng(3).integers(0, 60_000, 4000, dtype=np.uint16)
    url, options = f"gs://{BUCKET}/faults/changed-{next(_names)}", gcs_options(gcs_endpoint)
    dataset = ab.write_tokens(url, tokens, shard_size=1000, storage_options=options)

    def replace_shards() -> None:
        for shard in dataset.shard_urls:  # a new generation, other bytes of the same size
            gcs_put(gcs_endpoint, shard, bytes(1000))

    _changed_data_stays_refused(url, options, replace_shards, shuffle=True)


def test_a_listing_item_without_its_size_is_a_store_error_naming_the_url() -> None:
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Listing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps({"items": [{"name": "data/a.parquet", "generation": "1"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Listing)
    with running(server, "test-listing-server"):
        url = "gs://bucket/data"
        options = gcs_options(f"http://127.0.0.1:{server.server_port}")

        async def main() -> None:
            store = open_store(url, options, retry=FAST)
            try:
                await store.list_info(url)  # type: ignore[attr-defined]
            finally:
                await store.close()

        with pytest.raises(ab.StoreError, match="unreadable listing item .*a.parquet") as e:
            asyncio.run(main())
        assert e.value.url == url
