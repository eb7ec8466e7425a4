"""Storage faults injected by a real server: exact bytes after retries, or the right typed
error after exactly the right number of requests. HTTP reads go through the fault server in
front of files; S3 reads through it as a proxy in front of moto."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BUCKET, expected_windows, s3_options
from faults import OK, Fault, FaultServer, fault_server
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncbatch as ab
from asyncbatch._errors import (
    ConfigError,
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    RangeNotSupportedError,
    RetriesExhaustedError,
    ShardChangedError,
    ShortReadError,
    StoreError,
    StoreTimeoutError,
    ThrottledError,
)
from asyncbatch.stores import open_store
from asyncbatch.stores._base import ObjectInfo, ReadsTail, Store
from asyncbatch.stores._http import HttpStore
from asyncbatch.stores._local import LocalStore
from asyncbatch.stores._stack import RetryingStore, TransportStore

#: Tiny backoffs: every fault costs milliseconds. The timeouts stay far above what a busy
#: 2-core machine takes to answer (a CI run once took over 1 s for one GET), and an injected
#: stall lasts until the client gives up, so only stalls ever time out; each costs 3 s.
FAST = ab.RetryPolicy(
    max_attempts=4,
    base_delay=0.001,
    max_delay=0.005,
    deadline=30,
    connect_timeout=3.0,
    first_byte_timeout=3.0,
    idle_timeout=3.0,
)
#: Longer than any timeout here: the server waits until the client hangs up.
FOREVER = 60.0
SIZE = 200_000
DATA = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
_names = itertools.count()


@pytest.fixture(scope="module")
def files_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    with fault_server(tmp_path_factory.mktemp("fault-files")) as server:
        yield server


@pytest.fixture(scope="module")
def s3_proxy(s3_endpoint: str) -> Iterator[FaultServer]:
    with fault_server(upstream=s3_endpoint) as server:
        yield server


@dataclass
class Remote:
    """One way to reach an object through the fault server: HTTP files or S3 via proxy."""

    kind: str
    server: FaultServer
    upstream: str = ""

    def put(self, data: bytes) -> str:
        """Write (or replace) an object behind the server's back; its URL."""
        name = f"obj-{next(_names)}"
        self.replace(self.url_of(name), data)
        return self.url_of(name)

    def url_of(self, name: str) -> str:
        if self.kind == "http":
            return f"{self.server.url}/{name}"
        return f"s3://{BUCKET}/faults/{name}"

    def replace(self, url: str, data: bytes) -> None:
        if self.kind == "http":
            assert self.server.root is not None
            (self.server.root / url.rsplit("/", 1)[1]).write_bytes(data)
        else:
            import s3fs

            s3fs.S3FileSystem(**s3_options(self.upstream), skip_instance_cache=True).pipe(url, data)

    def store(self, policy: ab.RetryPolicy = FAST, max_inflight: int = 8) -> Store:
        options: dict[str, Any] = {}
        if self.kind == "s3":
            # One botocore session for all: each new one parses the service models again.
            options = {**s3_options(self.server.url), "session": _botocore_session()}
        return open_store(self.url_of("x"), options, max_inflight=max_inflight, retry=policy)


@functools.cache
def _botocore_session() -> Any:
    from aiobotocore.session import AioSession

    return AioSession()


@pytest.fixture(params=["http", "s3"])
def remote(request: pytest.FixtureRequest) -> Remote:
    if request.param == "http":
        server: FaultServer = request.getfixturevalue("files_server")
        remote = Remote("http", server)
    else:
        server = request.getfixturevalue("s3_proxy")
        remote = Remote("s3", server, request.getfixturevalue("s3_endpoint"))
    server.reset()
    return remote


async def _read(store: Store, url: str, start: int, end: int) -> bytes:
    buffer = bytearray(end - start)
    try:
        await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
    finally:
        await store.close()
    return bytes(buffer)


def read(remote: Remote, url: str, start: int, end: int, **store: Any) -> bytes:
    return asyncio.run(_read(remote.store(**store), url, start, end))


def path_of(url: str) -> str:
    """The path the fault server sees for ``url`` (S3: path-style, bucket first)."""
    rest = url.split("://", 1)[1]
    return "/" + (rest if url.startswith("s3://") else rest.split("/", 1)[1])


# -- faults that are retried -------------------------------------------------------------

RETRIED = {
    "503-slowdown": Fault(status=503),
    "500": Fault(status=500),
    "429": Fault(status=429, retry_after=0.01),
    "stall": Fault(stall=FOREVER),
    "slow-headers": Fault(delay=FOREVER),
    "reset": Fault(reset_after=5_000),
    "truncated": Fault(truncate_after=5_000),
    "truncated-chunked": Fault(truncate_after=5_000, chunked=True),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", list(RETRIED))
def test_retried_fault_then_exact_bytes(remote: Remote, fault: str) -> None:
    url = remote.put(DATA)
    remote.server.inject(RETRIED[fault], OK)
    start, end = 1_000, 150_000
    assert read(remote, url, start, end) == DATA[start:end]
    assert remote.server.count("GET", path_of(url)) == 2
    ranges = [r for m, p, r in remote.server.log if m == "GET" and p == path_of(url)]
    if fault.startswith(("reset", "truncated")):
        # Only the missing tail is asked for again.
        first = int(ranges[1].removeprefix("bytes=").split("-")[0])
        assert start < first <= start + 5_000
        assert ranges[1].endswith(f"-{end - 1}")
    else:
        assert ranges == [f"bytes={start}-{end - 1}"] * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("attempts", [1, 5])
def test_persistent_503_costs_exactly_max_attempts(remote: Remote, attempts: int) -> None:
    # s3fs retries in _call_s3 and botocore underneath: neither may multiply ours.
    url = remote.put(DATA)
    remote.server.inject(default=Fault(status=503))
    policy = ab.RetryPolicy(max_attempts=attempts, base_delay=0.001, max_delay=0.002)
    with pytest.raises(RetriesExhaustedError) as caught:
        read(remote, url, 10, 20_010, policy=policy)
    assert remote.server.count("GET", path_of(url)) == attempts
    message = str(caught.value)
    assert url in message and "bytes [10, 20010)" in message
    # The cause every attempt shared is said once, with the count (the URL taken out: its
    # port may hold "503" too).
    assert message.replace(url, "").count("503") == 1
    assert f"after {attempts} attempts, each: HTTP 503" in message or attempts == 1
    assert len(set(caught.value.attempts)) == 1  # type: ignore[attr-defined]
    assert isinstance(caught.value.__cause__, ThrottledError)
    assert len(caught.value.attempts) == attempts  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_different_causes_are_listed_per_attempt(remote: Remote) -> None:
    url = remote.put(DATA)
    remote.server.inject(Fault(status=503), default=Fault(status=500))
    policy = ab.RetryPolicy(max_attempts=2, base_delay=0.001, max_delay=0.002)
    with pytest.raises(RetriesExhaustedError) as caught:
        read(remote, url, 0, 100, policy=policy)
    message = str(caught.value)
    assert "after 2 attempts: #1 HTTP 503" in message and "; #2 HTTP 500" in message


@pytest.mark.timeout(30)
def test_retry_after_is_honoured(remote: Remote) -> None:
    url = remote.put(DATA)
    remote.server.inject(Fault(status=429, retry_after=0.4), OK)
    began = time.monotonic()
    assert read(remote, url, 0, 100) == DATA[:100]
    assert time.monotonic() - began >= 0.4
    assert remote.server.count("GET", path_of(url)) == 2


@pytest.mark.timeout(30)
def test_deadline_stops_retrying(remote: Remote) -> None:
    url = remote.put(DATA)
    remote.server.inject(default=Fault(status=500))
    policy = ab.RetryPolicy(max_attempts=1000, base_delay=0.1, max_delay=0.1, deadline=0.3)
    with pytest.raises(RetriesExhaustedError, match="deadline"):
        read(remote, url, 0, 100, policy=policy)
    # Attempts ~50 ms apart on average for 0.3 s: far below max_attempts.
    assert 1 <= remote.server.count("GET", path_of(url)) < 100


# -- faults that are not -----------------------------------------------------------------

NOT_RETRIED: dict[str, tuple[Fault, type[StoreError]]] = {
    "401": (Fault(status=401), CredentialsError),
    "403": (Fault(status=403), PermissionDeniedError),
    "404": (Fault(status=404), NotFoundError),
    "ignored-range": (Fault(ignore_range=True), RangeNotSupportedError),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", list(NOT_RETRIED))
def test_fault_not_retried(remote: Remote, fault: str) -> None:
    url = remote.put(DATA)
    injected, error = NOT_RETRIED[fault]
    remote.server.inject(default=injected)
    with pytest.raises(error) as caught:
        read(remote, url, 100, 5_000)
    assert type(caught.value) is error
    assert url in str(caught.value) and "bytes [100, 5000)" in str(caught.value)
    assert remote.server.count("GET", path_of(url)) == 1


@pytest.mark.timeout(30)
def test_range_past_the_end_is_a_short_read(remote: Remote) -> None:
    url = remote.put(DATA)
    with pytest.raises(ShortReadError, match=r"bytes \[199990, 200100\)"):
        read(remote, url, SIZE - 10, SIZE + 100)
    with pytest.raises(ShortReadError, match=r"bytes \[300000, 300010\)"):  # a 416
        read(remote, url, 300_000, 300_010)
    assert remote.server.count("GET", path_of(url)) == 2


@pytest.mark.timeout(30)
def test_whole_object_200_is_accepted_only_for_the_whole_object(remote: Remote) -> None:
    url = remote.put(DATA)
    remote.server.inject(default=Fault(ignore_range=True))
    assert read(remote, url, 0, SIZE) == DATA
    with pytest.raises(RangeNotSupportedError, match="ignored Range"):
        read(remote, url, 0, SIZE - 1)


@pytest.mark.timeout(30)
def test_slow_drip_completes_where_a_stall_of_the_same_length_times_out(remote: Remote) -> None:
    url = remote.put(DATA)
    one = ab.RetryPolicy(max_attempts=1, first_byte_timeout=3.0, idle_timeout=1.0)
    # 10 pieces 0.2 s apart (2 s in all) under a 1 s idle timeout: always moving.
    remote.server.inject(Fault(drip=(10_000, 0.2)))
    assert read(remote, url, 0, 100_000, policy=one) == DATA[:100_000]
    remote.server.inject(Fault(stall=2.0))
    with pytest.raises(RetriesExhaustedError) as caught:
        read(remote, url, 0, 100_000, policy=one)
    assert isinstance(caught.value.__cause__, StoreTimeoutError)
    assert remote.server.count("GET", path_of(url)) == 2


@pytest.mark.timeout(30)
def test_a_moving_body_outlasts_the_bound_on_a_whole_call(remote: Remote) -> None:
    url = remote.put(DATA)
    # connect + first byte + idle = 3.5 s bounds a call the stack cannot see into; this body
    # takes ~4.5 s but never pauses for 1.5 s: the transport's idle timeout is what counts.
    policy = ab.RetryPolicy(
        max_attempts=1, connect_timeout=1.0, first_byte_timeout=1.0, idle_timeout=1.5
    )
    remote.server.inject(Fault(drip=(20_000, 0.9)))
    began = time.monotonic()
    assert read(remote, url, 0, 100_000, policy=policy) == DATA[:100_000]
    assert time.monotonic() - began > 3.5
    assert remote.server.count("GET", path_of(url)) == 1


@pytest.mark.timeout(30)
def test_connection_refused_is_retried_and_typed(remote: Remote) -> None:
    from servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    if remote.kind == "http":
        url = f"{dead}/obj"
        store = open_store(url, max_inflight=2, retry=FAST)
    else:
        url = f"s3://{BUCKET}/faults/none"
        store = open_store(url, s3_options(dead), retry=FAST)
    refused = "after 4 attempts, each: connection refused"
    with pytest.raises(RetriesExhaustedError, match=refused) as caught:
        asyncio.run(_read(store, url, 5, 10))
    assert url in str(caught.value) and "bytes [5, 10)" in str(caught.value)
    assert isinstance(caught.value.__cause__, StoreError)


# -- pinning -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_object_replaced_after_pinning_is_shard_changed(remote: Remote) -> None:
    url = remote.put(DATA)

    async def main() -> None:
        store = remote.store()
        try:
            size = await store.size(url)  # pins the ETag
            assert size == SIZE
            buffer = memoryview(bytearray(100))
            await store.read_ranges(url, starts=[0], ends=[100], buffers=[buffer])
            remote.replace(url, DATA[::-1])
            # The store's If-Match gets a 412: not retried, named with both versions.
            with pytest.raises(ShardChangedError) as caught:
                await store.read_ranges(url, starts=[100], ends=[200], buffers=[buffer])
            message = str(caught.value)
            assert url in message and message.count('"') >= 4  # two quoted ETags
        finally:
            await store.close()

    asyncio.run(main())
    assert remote.server.count("GET", path_of(url)) == 2


@pytest.mark.timeout(30)
def test_different_etag_in_a_response_is_shard_changed(remote: Remote) -> None:
    # A server that ignores If-Match but reports the new version.
    url = remote.put(DATA)
    remote.server.inject(OK, Fault(etag='"another-version"'))

    async def main() -> None:
        store = remote.store()
        buffer = memoryview(bytearray(100))
        try:
            await store.read_ranges(url, starts=[0], ends=[100], buffers=[buffer])
            with pytest.raises(ShardChangedError, match='"another-version"'):
                await store.read_ranges(url, starts=[100], ends=[200], buffers=[buffer])
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["503-slowdown", "truncated"])
def test_a_tail_read_is_one_request_retried_and_pinned(remote: Remote, fault: str) -> None:
    url = remote.put(DATA)
    remote.server.inject(RETRIED[fault], OK)

    async def main() -> tuple[bytes | bytearray, ObjectInfo]:
        store = remote.store()
        try:
            assert isinstance(store, ReadsTail)
            got = await store.read_tail(url, 100_000)
            remote.replace(url, DATA[::-1])
            # Pinned by the tail read: the next one's If-Match gets a 412.
            with pytest.raises(ShardChangedError):
                await store.read_tail(url, 10)
            return got
        finally:
            await store.close()

    tail, info = asyncio.run(main())
    assert (bytes(tail), info.size) == (DATA[-100_000:], SIZE)
    assert info.version is not None
    ranges = [r for m, p, r in remote.server.log if m == "GET" and p == path_of(url)]
    # The whole tail asked again after a broken body: the object's size was not known yet.
    assert ranges == ["bytes=-100000", "bytes=-100000", "bytes=-10"]
    assert remote.server.count("HEAD", path_of(url)) <= 1  # only to name the new version


def test_local_file_resized_or_replaced_is_shard_changed(tmp_path: Path) -> None:
    for name in "abc":
        (tmp_path / name).write_bytes(DATA)

    async def head(store: LocalStore, name: str) -> bytes:
        buffer = bytearray(100)
        path = str(tmp_path / name)
        await store.read_ranges(path, starts=[0], ends=[100], buffers=[memoryview(buffer)])
        return bytes(buffer)

    async def main() -> None:
        store = LocalStore(max_open_files=1)  # one descriptor kept: others are reopened
        try:
            assert await head(store, "a") == DATA[:100]
            with (tmp_path / "a").open("ab") as file:  # grows in place, under the descriptor
                file.write(b"more")
            with pytest.raises(ShardChangedError, match=r"/a was inode \d+, 200000 bytes"):
                await head(store, "a")
            assert await head(store, "b") == DATA[:100]
            assert await head(store, "c") == DATA[:100]  # b's descriptor is closed
            (tmp_path / "new").write_bytes(DATA)
            os.replace(tmp_path / "new", tmp_path / "b")  # the same bytes, another file
            with pytest.raises(ShardChangedError, match="the file changed since it was opened"):
                await head(store, "b")
        finally:
            await store.close()

    asyncio.run(main())


def _changed_data_stays_refused(
    url: str, options: dict[str, Any], replace_shards: Any, **loader_args: Any
) -> None:
    """Every shard replaced by other bytes of its size after the first batch: the run fails
    with ShardChangedError, and so does every later run of that loader (a Loader and a
    LoaderDataset) until the dataset is opened again, which then reads the new bytes."""
    args: dict[str, Any] = dict(
        batch_size=4, seq_len=16, prefetch=2, storage_options=options, **loader_args
    )
    source = ab.LoaderDataset(url, **args)
    runner = asyncio.Runner()  # one loop across the steps, as an evaluation job has

    async def drain(loader: ab.AsyncLoader) -> None:
        async for _ in loader:
            pass

    with ab.Loader(url, **args) as loader, runner:
        first = next(loader)
        batches = iter(source)
        next(batches)
        async_loader = runner.run(ab.AsyncLoader(url, **args).open())
        runner.run(anext(async_loader))
        replace_shards()
        for run in (loader, batches, async_loader):
            with pytest.raises(ShardChangedError, match="open the dataset again") as caught:
                if isinstance(run, ab.AsyncLoader):
                    runner.run(drain(run))
                else:
                    for _ in run:
                        pass
            assert caught.value.url.startswith(url)
        # Before, a new run pinned the new bytes and delivered them in the same epoch.
        with pytest.raises(ShardChangedError):
            next(loader)
        with pytest.raises(ShardChangedError):
            next(iter(source))
        with pytest.raises(ShardChangedError):
            runner.run(anext(async_loader))
        loader.set_epoch(1)
        with pytest.raises(ShardChangedError):
            next(loader)
        runner.run(async_loader.aclose())
    with ab.Loader(ab.open_dataset(url, options), **args) as again:
        batch = next(again)
    assert batch.global_indexes.tolist() == first.global_indexes.tolist()
    assert not torch.equal(batch["tokens"], first["tokens"])


def test_a_local_shard_replaced_mid_epoch_stays_refused(tmp_path: Path) -> None:
    tokens = np.random.default_rng(2).integers(0, 60_000, 4000, dtype=np.uint16)
    url = str(tmp_path / "ds")
    dataset = ab.write_tokens(url, tokens, shard_size=1000)

    def replace_shards() -> None:
        for shard in dataset.shard_urls:  # os.replace: a new inode, the same size
            Path(f"{shard}.new").write_bytes(Path(shard).read_bytes()[::-1])
            os.replace(f"{shard}.new", shard)

    # One descriptor kept open: a shard read again is reopened, and its pin checked.
    _changed_data_stays_refused(url, {"max_open_files": 1}, replace_shards, shuffle=True)


@pytest.mark.timeout(60)
def test_an_s3_object_replaced_mid_epoch_stays_refused(s3_endpoint: str) -> None:
    import s3fs

    tokens = np.random.default_rng(3).integers(0, 60_000, 4000, dtype=np.uint16)
    url, options = f"s3://{BUCKET}/changed-{next(_names)}", s3_options(s3_endpoint)
    dataset = ab.write_tokens(url, tokens, shard_size=1000, storage_options=options)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)

    def replace_shards() -> None:
        for shard in dataset.shard_urls:  # a new ETag, the same size
            fs.pipe(shard, fs.cat(shard)[::-1])

    _changed_data_stays_refused(url, options, replace_shards, shuffle=True)


# -- the pool, the policy, the plumbing -------------------------------------------------


@pytest.mark.timeout(30)
def test_requests_in_flight_never_exceed_the_pool(files_server: FaultServer) -> None:
    files_server.reset()
    remote = Remote("http", files_server)
    url = remote.put(DATA)
    files_server.inject(default=Fault(delay=0.02, jitter=0.02))
    starts = list(range(0, 60_000, 1_000))

    async def main() -> list[bytes]:
        store = remote.store(max_inflight=4)
        assert isinstance(store, RetryingStore) and isinstance(store.inner, TransportStore)
        transport = store.inner.transport
        assert isinstance(transport, HttpStore)
        buffers = [bytearray(1_000) for _ in starts]
        try:
            await store.read_ranges(
                url,
                starts=starts,
                ends=[s + 1_000 for s in starts],
                buffers=[memoryview(b) for b in buffers],
            )
            assert transport._session is not None and transport._session.connector is not None
            assert transport._session.connector.limit == 4
        finally:
            await store.close()
        return [bytes(b) for b in buffers]

    assert b"".join(asyncio.run(main())) == DATA[:60_000]
    assert files_server.peak == 4
    assert files_server.count("GET") == len(starts)


@pytest.mark.timeout(30)
def test_a_failed_range_cancels_its_siblings(remote: Remote) -> None:
    url = remote.put(DATA)
    remote.server.inject(Fault(status=403), default=Fault(delay=10.0))
    patient = ab.RetryPolicy(first_byte_timeout=20.0)

    async def main() -> None:
        store = remote.store(policy=patient)
        buffers = [memoryview(bytearray(100)) for _ in range(3)]
        try:
            with pytest.raises(PermissionDeniedError):
                await store.read_ranges(
                    url, starts=[0, 1000, 2000], ends=[100, 1100, 2100], buffers=buffers
                )
            # Before the store closes: the other two requests were abandoned, not left
            # running (asyncio.gather would leave them waiting their 10 s).
            for _ in range(300):
                if remote.server.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            assert remote.server.inflight == 0
        finally:
            await store.close()

    began = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - began < 5


@pytest.mark.timeout(30)
def test_http_listing_reads_index_pages(files_server: FaultServer) -> None:
    files_server.reset()
    root = files_server.root
    assert root is not None
    (root / "index.html").write_text('<html><a href="a.npy">a</a> <a href="b.npy">b</a></html>')

    async def main() -> list[str]:
        store = HttpStore()
        try:
            with pytest.raises(NotFoundError):
                await store.list(f"{files_server.url}/no-such-dir/")
            return await store.list(f"{files_server.url}/index.html")
        finally:
            await store.close()

    listed = asyncio.run(main())
    assert [u.rsplit("/", 1)[1] for u in listed] == ["a.npy", "b.npy"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 2.5),
        ("base_delay", -1),
        ("max_delay", 0),
        ("deadline", float("inf")),
        ("connect_timeout", 0),
        ("first_byte_timeout", "1"),
        ("idle_timeout", True),
        ("refused_deadline", 0),
    ],
)
def test_bad_policy_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"RetryPolicy.{field} "):
        ab.RetryPolicy(**{field: value})
    with pytest.raises(ConfigError, match="retry must be"):
        ab.Loader("unused", batch_size=1, seq_len=1, retry=3)  # type: ignore[arg-type]


def test_factories_get_the_policy_only_if_they_take_it() -> None:
    seen: list[Any] = []

    def new_style(scheme: str, options: Any, *, max_inflight: int, retry: Any) -> Any:
        seen.append(retry)
        return LocalStore()

    def old_style(scheme: str, options: Any, *, max_inflight: int) -> Any:
        seen.append("old")
        return LocalStore()

    ab.register_store("retrynew", new_style)
    ab.register_store("retryold", old_style)
    for url in ("retrynew://x", "retryold://x"):
        asyncio.run(open_store(url, retry=FAST).close())
    assert seen == [FAST, "old"]


@pytest.mark.timeout(60)
def test_loader_uses_its_policy(files_server: FaultServer) -> None:
    files_server.reset()
    root = files_server.root
    assert root is not None
    tokens = np.arange(5_000, dtype=np.uint16)
    ab.write_tokens(str(root / "plumbed"), tokens, shard_size=2_000)
    url = f"{files_server.url}/plumbed"
    files_server.inject(Fault(status=503), Fault(status=503), methods=("HEAD",))
    dataset = ab.open_dataset(url, retry=FAST)  # the manifest's HEAD: 2 failures, then OK
    assert files_server.count("HEAD") == 3
    policy = ab.RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.001)
    files_server.reset()
    files_server.inject(default=Fault(status=503))
    with (
        ab.Loader(
            dataset, batch_size=1, seq_len=10, shuffle=False, prefetch=1, retry=policy
        ) as loader,
        pytest.raises(RetriesExhaustedError, match="after 3 attempts"),
    ):
        next(loader)
    assert files_server.count("GET") == 3


@pytest.mark.timeout(60)
def test_loader_dataset_opens_under_its_policy(files_server: FaultServer) -> None:
    files_server.reset()
    root = files_server.root
    assert root is not None
    ab.write_tokens(str(root / "plumbed-workers"), np.arange(500, dtype=np.uint16))
    files_server.inject(default=Fault(status=503), methods=("HEAD",))
    policy = ab.RetryPolicy(max_attempts=1)
    with pytest.raises(RetriesExhaustedError, match="after 1 attempt"):
        ab.LoaderDataset(
            f"{files_server.url}/plumbed-workers", batch_size=1, seq_len=10, retry=policy
        )
    assert files_server.count("HEAD") == 1


@pytest.mark.timeout(60)
def test_loader_over_faulty_http_is_byte_exact(files_server: FaultServer) -> None:
    files_server.reset()
    root = files_server.root
    assert root is not None
    tokens = np.random.default_rng(1).integers(0, 60_000, 30_011, dtype=np.uint16)
    ab.write_tokens(str(root / "e2e"), tokens, shard_size=3_001 * 2)
    faults = [
        OK,
        Fault(status=503),
        OK,
        Fault(reset_after=50),
        Fault(truncate_after=10, chunked=True),
        OK,
        Fault(status=500),
        Fault(truncate_after=30),
    ]
    files_server.inject(*faults)
    seen = 0
    with ab.Loader(
        f"{files_server.url}/e2e",
        batch_size=8,
        seq_len=64,
        next_token=True,
        shuffle=True,
        prefetch=4,
        max_inflight=4,
        retry=FAST,
    ) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 64, True)
            )
            seen += len(batch.global_indexes)
    assert seen == (tokens.size - 1) // 64 // 8 * 8
    assert files_server.pending() == 0  # every fault was served


# -- random fault schedules --------------------------------------------------------------

FAULTS = st.one_of(
    st.none(),
    st.sampled_from([500, 503, 403, 404, 429]).map(lambda s: Fault(status=s, retry_after=0)),
    st.integers(0, 3_000).map(lambda n: Fault(reset_after=n)),
    st.tuples(st.integers(0, 3_000), st.booleans()).map(
        lambda t: Fault(truncate_after=t[0], chunked=t[1])
    ),
    st.just(Fault(stall=0.5)),
    st.just(Fault(ignore_range=True)),
    st.just(Fault(etag='"other"')),
    st.floats(0, 0.05).map(lambda d: Fault(delay=d, jitter=0.01)),
    st.just(Fault(drip=(700, 0.01))),
)


@pytest.mark.timeout(90)
@settings(max_examples=30, deadline=None)
@given(
    schedule=st.lists(FAULTS, max_size=5),
    start=st.integers(0, SIZE - 1),
    length=st.integers(1, 4_000),
)
def test_reads_under_random_faults_are_exact_or_typed(
    files_server: FaultServer, schedule: list[Fault | None], start: int, length: int
) -> None:
    files_server.reset()
    remote = Remote("http", files_server)
    url = remote.put(DATA)
    files_server.inject(*schedule)
    end = min(SIZE, start + length)
    began = time.monotonic()
    outcome: bytes | StoreError
    try:
        outcome = read(remote, url, start, end)
    except StoreError as exc:
        outcome = exc
    if isinstance(outcome, StoreError):
        assert url in str(outcome)
    else:
        assert outcome == DATA[start:end]
    assert files_server.count("GET") <= FAST.max_attempts
    assert time.monotonic() - began < 10
