"""The built-in GCS store (``stores/gcs.py``) on fake-gcs-server: datasets written and read
exactly under every shuffle and resumed, Parquet prefixes opened from their footers, the
node cache and ``verify=``, listings, and the conformance suite. Requests are counted by the
fault server in front of the emulator, as a proxy."""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest
from conftest import BUCKET, expected_windows, gcs_options
from faults import Fault, FaultServer, fault_server
from servers import gcs_put

import asyncbatch as ab
from asyncbatch._errors import ConfigError, NotFoundError
from asyncbatch.stores import open_store
from asyncbatch.stores._base import ObjectInfo, ReadsTail
from asyncbatch.stores._gcs import GcsStore
from asyncbatch.stores._stack import RetryingStore, TransportStore
from asyncbatch.testing import StoreConformance, StoreKit

_names = itertools.count()


@pytest.fixture(scope="module")
def gcs_proxy(gcs_endpoint: str) -> Iterator[FaultServer]:
    with fault_server(upstream=gcs_endpoint) as server:
        yield server


@pytest.fixture
def proxy(gcs_proxy: FaultServer) -> FaultServer:
    gcs_proxy.reset()
    return gcs_proxy


def new_url(kind: str = "ds") -> str:
    return f"gs://{BUCKET}/gcs/{kind}-{next(_names):04d}"


def media_gets(proxy: FaultServer, name: str) -> list[str]:
    """The Range headers of the media GETs (ranged reads) of paths holding ``name``."""
    return [r for m, p, r in proxy.log if m == "GET" and name in p and r]


def metadata_gets(proxy: FaultServer, name: str) -> int:
    """GETs without a Range (metadata, listings) of paths holding ``name``."""
    return sum(m == "GET" and name in p and not r for m, p, r in proxy.log)


def test_the_registry_serves_gs_and_gcs(gcs_endpoint: str) -> None:
    for scheme in ("gs", "gcs"):
        store = open_store(f"{scheme}://{BUCKET}/x", gcs_options(gcs_endpoint))
        assert isinstance(store, RetryingStore) and isinstance(store.inner, TransportStore)
        assert isinstance(store.inner.transport, GcsStore)
        assert isinstance(store, ReadsTail)
        asyncio.run(store.close())


# -- datasets ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gcs_dataset(gcs_endpoint: str) -> tuple[ab.Dataset, npt.NDArray[np.uint16]]:
    tokens = np.random.default_rng(0).integers(0, 60_000, 12_011, dtype=np.uint16)
    url = new_url()
    ab.write_tokens(url, tokens, shard_size=3_001, storage_options=gcs_options(gcs_endpoint))
    return ab.open_dataset(url, gcs_options(gcs_endpoint)), tokens


def ids_of(loader: ab.Loader, count: int | None = None) -> list[list[int]]:
    return [b.global_indexes.tolist() for b in itertools.islice(loader, count)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_a_written_dataset_reads_exactly_and_resumes(
    gcs_dataset: tuple[ab.Dataset, npt.NDArray[np.uint16]], shuffle: bool | str
) -> None:
    dataset, tokens = gcs_dataset
    assert all(url.startswith(f"gs://{BUCKET}/") for url in dataset.shard_urls)
    kwargs: dict[str, Any] = dict(
        batch_size=8, seq_len=32, shuffle=shuffle, seed=4, prefetch=4, next_token=True
    )
    if shuffle == "block":
        kwargs.update(block_size=16, window=3)
    seen: list[int] = []
    with ab.Loader(dataset, **kwargs) as loader:
        for batch in loader:
            expected = expected_windows(tokens, batch.global_indexes, 32, next_token=True)
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
            seen += batch.global_indexes.tolist()
        full = ids_of(loader)  # the next epoch's order, for the resume below
    samples = (tokens.size - 1) // 32
    assert len(set(seen)) == len(seen) == samples // 8 * 8  # each once, bar the tail
    assert set(seen) <= set(range(samples))
    with ab.Loader(dataset, **kwargs) as loader:
        loader.set_epoch(1)
        first = ids_of(loader, 5)
        state = loader.state_dict()
    with ab.Loader(dataset, **kwargs) as loader:
        loader.load_state_dict(state)
        rest = ids_of(loader)
    assert first + rest == full


@pytest.mark.timeout(60)
def test_async_loader_and_verify_levels(
    gcs_dataset: tuple[ab.Dataset, npt.NDArray[np.uint16]],
) -> None:
    dataset, tokens = gcs_dataset

    async def read(verify: Literal["size", "block", "full"]) -> int:
        count = 0
        async with ab.AsyncLoader(dataset, batch_size=8, seq_len=50, verify=verify) as loader:
            async for batch in loader:
                expected = expected_windows(tokens, batch.global_indexes, 50)
                np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
                count += 1
        return count

    levels: list[Literal["size", "block", "full"]] = ["size", "block", "full"]
    for verify in levels:
        assert asyncio.run(read(verify)) == tokens.size // 50 // 8


@pytest.mark.timeout(60)
def test_second_epoch_through_the_node_cache_asks_gcs_nothing(
    gcs_endpoint: str, proxy: FaultServer, tmp_path: Path
) -> None:
    tokens = np.arange(20_000, dtype=np.uint16)
    url = new_url("cached")
    ab.write_tokens(url, tokens, shard_size=6_000, storage_options=gcs_options(gcs_endpoint))
    cache = ab.DiskCache(tmp_path / "cache", block_size=16 * 1024)
    options = gcs_options(proxy.url)
    name = url.rsplit("/", 1)[1]
    with ab.Loader(url, batch_size=4, seq_len=100, storage_options=options, cache=cache) as loader:
        asked: list[list[str]] = []
        for _epoch in range(2):
            before = len(proxy.log)
            for batch in loader:
                expected = expected_windows(tokens, batch.global_indexes, 100)
                np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
            asked.append([p for _, p, _ in proxy.log[before:] if name in p])
    assert asked[0] and asked[1] == []  # the second epoch came from the cache alone
    assert cache.hits > 0


@pytest.mark.timeout(60)
def test_a_parquet_prefix_opens_from_footers_only(gcs_endpoint: str, proxy: FaultServer) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = new_url("parquet")
    total = 0
    for index, rows in enumerate([100, 0, 250, 40]):
        table = pa.table({"id": np.arange(total, total + rows, dtype=np.int64)})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, row_group_size=64)
        gcs_put(gcs_endpoint, f"{root}/part-{index}.parquet", buffer.getvalue())
        total += rows
    options = gcs_options(proxy.url)
    dataset = ab.open_dataset(root, options)
    name = root.rsplit("/", 1)[1]
    parquet = [(m, p, r) for m, p, r in proxy.log if name in p and p.endswith(".parquet")]
    # The listing told each file's size and generation: one ranged GET per footer, and no
    # metadata GET (stat) or suffix request.
    assert len(parquet) == 4
    assert all(m == "GET" and r and not r.startswith("bytes=-") for m, p, r in parquet)
    with ab.Loader(dataset, batch_size=16, shuffle=False, drop_last=False) as loader:
        ids = [i for batch in loader for i in batch["id"].tolist()]
    assert ids == list(range(total))


# -- listings and writes -----------------------------------------------------------------


def test_listing_tells_sizes_generations_and_folders(gcs_endpoint: str) -> None:
    root = new_url("list")
    for name, size in [("b", 3), ("a", 10), ("sub/c", 1), ("sub/d/e", 2)]:
        gcs_put(gcs_endpoint, f"{root}/{name}", b"x" * size)

    async def main() -> tuple[Any, ...]:
        store = open_store(root, gcs_options(gcs_endpoint))
        try:
            assert isinstance(store, RetryingStore)
            info = await store.list_info(root)
            plain = await store.list(f"{root}/")
            sub = await store.list(f"{root}/sub")
            single = await store.list(f"{root}/a")
            with pytest.raises(NotFoundError, match="nothing under this prefix"):
                await store.list(f"{root}/none")
            # The listing pinned each object: a replaced one is refused at its next read.
            return info, plain, sub, single, await store.size(f"{root}/a")
        finally:
            await store.close()

    info, plain, sub, single, size = asyncio.run(main())
    assert [(url.rsplit("/", 1)[1], i and i.size) for url, i in info] == [
        ("a", 10),
        ("b", 3),
        ("sub", None),
    ]
    assert all(i is None or (isinstance(i, ObjectInfo) and i.version) for _, i in info)
    assert plain == [u for u, _ in info]
    assert sub == [f"{root}/sub/c", f"{root}/sub/d"]
    assert single == [f"{root}/a"] and size == 10


def test_a_listing_of_many_pages(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncbatch.stores import _gcs as gcs

    monkeypatch.setattr(gcs, "_PAGE", 2)
    root = new_url("pages")
    for index in range(5):
        gcs_put(gcs_endpoint, f"{root}/{index}", b"x")

    async def main() -> list[str]:
        store = GcsStore("gs", gcs_options(gcs_endpoint))
        try:
            return await store.list(root)
        finally:
            await store.close()

    assert asyncio.run(main()) == [f"{root}/{index}" for index in range(5)]


def test_writes_replace_objects_and_refuse_bad_names(gcs_endpoint: str) -> None:
    url = new_url("write")

    async def main() -> tuple[bytes, bytes]:
        store = open_store(url, gcs_options(gcs_endpoint))
        try:
            await store.write(url, b"first")
            await store.write(url, memoryview(b"second!"))  # our own write: pinned again
            buffer = bytearray(7)
            await store.read_ranges(url, starts=[0], ends=[7], buffers=[memoryview(buffer)])
            with pytest.raises(ConfigError, match="without a name"):
                await store.write(f"gs://{BUCKET}/", b"x")
            with pytest.raises(
                ab.BucketNotFoundError, match="bucket 'no-such-bucket' does not exist"
            ):
                await store.write("gs://no-such-bucket/x", b"x")
            tail, _ = await store.read_tail(url, 3)  # type: ignore[attr-defined]
            return bytes(buffer), bytes(tail)
        finally:
            await store.close()

    assert asyncio.run(main()) == (b"second!", b"nd!")


# -- the conformance suite ---------------------------------------------------------------


class TestGcsStore(StoreConformance):
    """Through the fault server as a proxy, which denies an object by answering 403."""

    @pytest.fixture
    def store_kit(
        self, gcs_endpoint: str, proxy: FaultServer, request: pytest.FixtureRequest
    ) -> StoreKit:
        prefix = f"{BUCKET}/conformance/{request.node.name.replace('[', '-').strip(']')}"
        options = gcs_options(proxy.url)
        return StoreKit(
            open=lambda: open_store(f"gs://{prefix}", options),
            url=lambda name: f"gs://{prefix}/{name}",
            put=lambda name, data: gcs_put(gcs_endpoint, f"gs://{prefix}/{name}", data),
            deny=lambda name: proxy.inject(default=Fault(status=403), path=f"/{name}"),
        )
