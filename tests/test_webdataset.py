"""WebDataset tar shards read in place: shards written by the webdataset library itself, and
every sample's every field compared with what its own reader yields, through local files,
moto's S3 server and the Range HTTP server; sidecar indexes and scans; bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import shutil
import struct
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, s3_options
from faults import fault_server

import asyncbatch as ab
from asyncbatch._cli import main
from asyncbatch._errors import ConfigError, FormatError, ResumeStateError
from asyncbatch.formats import _webdataset_index
from asyncbatch.formats._webdataset_index import (
    BLOCK,
    ShardIndex,
    SidecarSummary,
    scan_shard,
    sidecar_url,
)
from asyncbatch.formats._webdataset_shards import expand_braces
from asyncbatch.stores import open_store
from asyncbatch.stores._base import Store

wds = pytest.importorskip("webdataset")

_names = itertools.count()
SAMPLES = 230
PER_SHARD = 80  # 3 shards: 80, 80, 70


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A real RGB PNG (zlib-compressed scanlines), made without an imaging library."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (height, width * 3), dtype=np.uint8)
    raw = b"".join(b"\0" + row.tobytes() for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def jpeg_bytes(seed: int) -> bytes | None:
    """A real JPEG made with PIL, when PIL is installed."""
    try:
        from PIL import Image
    except ImportError:
        return None
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def make_samples(count: int = SAMPLES, seed: int = 0) -> list[dict[str, Any]]:
    """Samples of a few hundred bytes: random bytes, a label, JSON, an empty field, a PNG."""
    rng = np.random.default_rng(seed)
    images = [png_bytes(4 + i, 3 + i % 2, i) for i in range(4)]
    jpeg = jpeg_bytes(seed)
    samples = []
    for i in range(count):
        sample: dict[str, Any] = {
            "__key__": f"sample{i:06d}",
            "bin": rng.bytes(int(rng.integers(0, 600))),
            "cls": str(i % 10).encode(),
            "json": f'{{"i": {i}, "text": "caption {i}"}}'.encode(),
            "empty.txt": b"",
            "seg.png": images[i % len(images)],
        }
        if jpeg is not None:
            sample["jpg"] = jpeg
        samples.append(sample)
    return samples


def write_shards(
    folder: Path, samples: Sequence[dict[str, Any]], per_shard: int = PER_SHARD
) -> list[Path]:
    """The samples into ``folder/shard-NNNNNN.tar`` by webdataset's own ShardWriter."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    return sorted(folder.glob("shard-*.tar"))


def reference(paths: Sequence[str]) -> list[dict[str, Any]]:
    """What webdataset's own reader yields for these shards, in order: its
    ``tarfile_samples`` (``url_opener``, then ``tar_file_expander`` and ``group_by_keys``),
    with the files opened (and closed) here."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    with contextlib.ExitStack() as stack:
        sources = [{"url": p, "stream": stack.enter_context(open(p, "rb"))} for p in paths]
        return list(group_by_keys(tar_file_expander(sources)))


def shards_in(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, paths: Sequence[Path]
) -> tuple[str, dict[str, Any], list[str]]:
    """The local shards ``paths`` put in ``store``: (URL to open, storage options, the
    shards' URLs in order). Over HTTP, which cannot list, the URL is a brace pattern."""
    name = f"wds-{next(_names)}"
    if store == "local":
        return str(paths[0].parent), {}, [str(p) for p in paths]
    if store == "s3":
        import s3fs

        options = s3_options(request.getfixturevalue("s3_endpoint"))
        fs = s3fs.S3FileSystem(**options)
        root = f"s3://{BUCKET}/{name}"
        for path in paths:
            fs.pipe(f"{root}/{path.name}", path.read_bytes())
        return root, options, [f"{root}/{p.name}" for p in paths]
    base, server = request.getfixturevalue("http_root")
    (base / name).mkdir()
    for path in paths:
        shutil.copy(path, base / name / path.name)
    last = len(paths) - 1
    pattern = f"{server.url}/{name}/shard-{{000000..{last:06d}}}.tar"
    return pattern, {}, [f"{server.url}/{name}/{p.name}" for p in paths]


def check_batch(
    batch: ab.Batch,
    expected: Sequence[dict[str, Any]],
    shard_urls: Sequence[str] | None = None,
    fields: Sequence[str] | None = None,
) -> None:
    """Every field of every sample equals webdataset's; ``__url__`` too (or, read from
    another store, the shard's URL there)."""
    names = (
        list(fields) if fields is not None else [k for k in expected[0] if not k.startswith("__")]
    )
    assert list(batch) == ["__key__", "__url__", *names]
    keys, urls = batch["__key__"].to_pylist(), batch["__url__"].to_pylist()
    columns = {name: batch[name].to_pylist() for name in names}
    for k, i in enumerate(batch.global_indexes.tolist()):
        want = expected[i]
        assert keys[k] == want["__key__"]
        if shard_urls is None:
            assert urls[k] == want["__url__"]
        else:
            assert urls[k] in shard_urls
        for name in names:
            assert columns[name][k] == want[name], (i, name)
            assert batch[name][k] == want[name]


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    return make_samples()


@pytest.fixture
def local_shards(tmp_path: Path, samples: list[dict[str, Any]]) -> list[Path]:
    return write_shards(tmp_path / "shards", samples)


@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("store", ["local", "s3", "http"])
def test_every_sample_once_per_epoch_every_store(
    store: str,
    shuffle: Any,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    local_shards: list[Path],
) -> None:
    if store != "local" and shuffle is False:
        pytest.skip("the orders are store-independent: the shuffles per remote store")
    expected = reference([str(p) for p in local_shards])
    assert len(expected) == SAMPLES
    url, options, shard_urls = shards_in(store, request, tmp_path, local_shards)
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.format == "webdataset"
    assert dataset.shard_urls == shard_urls
    assert dataset.manifest.total_elements == SAMPLES
    extra = {"window": 2, "block_size": 16} if shuffle == "block" else {}
    urls = None if store == "local" else shard_urls
    with ab.Loader(dataset, batch_size=32, shuffle=shuffle, drop_last=False, **extra) as loader:
        seen = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = []
            for batch in loader:
                check_batch(batch, expected, urls)
                ids.extend(batch.global_indexes.tolist())
            assert sorted(ids) == list(range(SAMPLES))
            seen.append(ids)
    if shuffle is False:
        assert seen[0] == list(range(SAMPLES))
    else:
        assert seen[0] != seen[1]


@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("world", [1, 3])
def test_ranks_split_every_epoch_exactly(
    local_shards: list[Path], samples: list[dict[str, Any]], shuffle: Any, world: int
) -> None:
    expected = reference([str(p) for p in local_shards])
    dataset = ab.open_dataset(str(local_shards[0].parent))
    extra = {"window": 2, "block_size": 8} if shuffle == "block" else {}
    parts = []
    for rank in range(world):
        args = dict(batch_size=10, shuffle=shuffle, drop_last=False, seed=5, **extra)
        with ab.Loader(dataset, rank=rank, world_size=world, **args) as loader:
            ids = []
            for batch in loader:
                check_batch(batch, expected)
                ids.extend(batch.global_indexes.tolist())
            parts.append(ids)
    union = [i for part in parts for i in part]
    assert len(set(union)) == len(union)  # none twice
    # Every sample, bar the uneven tail tail="drop" leaves out (fewer than one per rank).
    assert len(union) == SAMPLES - SAMPLES % world
    assert set(range(SAMPLES)) >= set(union)


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_resume_mid_epoch_continues_exactly(
    local_shards: list[Path], tmp_path: Path, shuffle: Any
) -> None:
    dataset = ab.open_dataset(str(local_shards[0].parent))
    extra = {"window": 2, "block_size": 8} if shuffle == "block" else {}
    args: dict[str, Any] = dict(batch_size=7, shuffle=shuffle, seed=11, prefetch=3, **extra)
    with ab.Loader(dataset, **args) as loader:
        full = [(b.global_indexes.tolist(), b["bin"].to_pylist()) for b in loader]
    for stop in (1, 9):
        with ab.Loader(dataset, **args) as loader:
            it = iter(loader)
            head = [next(it) for _ in range(stop)]
            state = loader.state_dict()
        with ab.Loader(dataset, **args) as loader:
            loader.load_state_dict(state)
            rest = list(loader)
        got = [(b.global_indexes.tolist(), b["bin"].to_pylist()) for b in head + rest]
        assert got == full
    # Other shards of the same shape are other data: the state is refused.
    other = write_shards(tmp_path / "other", make_samples(seed=1))
    other_dataset = ab.open_dataset(str(other[0].parent))
    with ab.Loader(other_dataset, **args) as loader, pytest.raises(ResumeStateError):
        loader.load_state_dict(state)


def test_a_state_of_other_bytes_of_the_same_layout_is_refused_where_listed(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two datasets of the same members at the same places, other bytes in them: the
    listing's ETags tell them apart (the indexes cannot)."""
    samples = make_samples(30)
    one = write_shards(tmp_path / "one", samples, per_shard=12)
    for sample in samples:
        sample["bin"] = bytes(len(sample["bin"]))
    two = write_shards(tmp_path / "two", samples, per_shard=12)
    first, options, _ = shards_in("s3", request, tmp_path, one)
    second, _, _ = shards_in("s3", request, tmp_path, two)
    a, b = ab.open_dataset(first, options), ab.open_dataset(second, options)
    for x, y in zip(a.arrays["wds_indexes"], b.arrays["wds_indexes"], strict=True):
        np.testing.assert_array_equal(x.offsets, y.offsets)
    assert a.fingerprint() != b.fingerprint()
    args: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=1)
    with ab.Loader(a, **args) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with ab.Loader(b, **args) as loader, pytest.raises(ResumeStateError):
        loader.load_state_dict(state)


def test_workers_read_each_sample_once(local_shards: list[Path]) -> None:
    expected = reference([str(p) for p in local_shards])
    folder = str(local_shards[0].parent)
    source = ab.LoaderDataset(folder, batch_size=16, shuffle=True, drop_last=False)
    ids = []
    for batch in source.dataloader(num_workers=2):
        check_batch(batch, expected)
        ids.extend(batch.global_indexes.tolist())
    assert sorted(ids) == list(range(SAMPLES))


# ---------------------------------------------------------------------------------------------
# The index: sidecars and scans


def packed(dataset: ab.Dataset) -> list[bytes]:
    """Each shard's index as its sidecar holds it (whole), or its summary (opened lazily)."""
    return [
        e.pack() if isinstance(e, ShardIndex) else e.packed for e in dataset.arrays["wds_indexes"]
    ]


class Counted:
    """A real store with every read that reaches it logged: each is one request."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.reads: list[tuple[str, int, int]] = []

    async def size(self, url: str) -> int:
        return await self.inner.size(url)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Any]
    ) -> None:
        self.reads.extend((url, a, b) for a, b in zip(starts, ends, strict=True))
        await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)

    async def close(self) -> None:
        await self.inner.close()


def test_a_scan_reads_each_shard_in_large_ranges(
    local_shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = 64 << 10
    monkeypatch.setattr(_webdataset_index, "SCAN_CHUNK", chunk)

    async def scan(url: str, size: int) -> tuple[ShardIndex, list[tuple[str, int, int]]]:
        counted = Counted(open_store(url))
        try:
            return await scan_shard(counted, url, size), counted.reads  # type: ignore[arg-type]
        finally:
            await counted.close()

    for path in local_shards:
        size = path.stat().st_size
        index, reads = asyncio.run(scan(str(path), size))
        # Ranges one after another from the start, each a whole chunk but the last (which
        # ends at the end-of-archive blocks, or the shard's end); the next one starts at the
        # first header the one before did not hold whole (past the end: data skipped).
        starts, ends = [a for _, a, _ in reads], [b for _, _, b in reads]
        assert starts[0] == 0 and all(
            b - a == chunk for a, b in zip(starts, ends[:-1], strict=False)
        )
        assert all(ends[i] - 4 * BLOCK <= starts[i + 1] for i in range(len(reads) - 1))
        assert len(reads) <= size // (chunk - 4 * BLOCK) + 1
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers() if m.isreg()]
        assert index.offsets.tolist() == [m.offset_data for m in members]
        assert index.lengths.tolist() == [m.size for m in members]


def test_a_scan_skips_the_data_of_large_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_webdataset_index, "SCAN_CHUNK", 4096)
    big = [{"__key__": f"k{i}", "bin": bytes([i]) * 50_000, "cls": b"1"} for i in range(4)]
    (path,) = write_shards(tmp_path / "big", big)
    counted = Counted(open_store(str(path)))

    async def scan() -> ShardIndex:
        try:
            return await scan_shard(counted, str(path), path.stat().st_size)  # type: ignore[arg-type]
        finally:
            await counted.close()

    index = asyncio.run(scan())
    assert index.num_samples == 4
    fetched = sum(b - a for _, a, b in counted.reads)
    assert fetched < path.stat().st_size / 4  # the images' bytes are jumped over


def test_a_scans_index_is_kept_in_the_node_cache(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    local_shards: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without sidecars, the first process of a node to open the shards through the cache
    # scans them; the next ones (other ranks) find each shard's index there, scan nothing
    # and read no byte of the shards: one HEAD each, for the version the index is kept under.
    url, options, _ = shards_in("http", request, tmp_path, local_shards)
    server = request.getfixturevalue("http_root")[1]
    cache = tmp_path / "cache"
    first = ab.open_dataset(url, options, cache=str(cache))
    gets, heads = server.requests, server.heads

    async def no_scan(*args: Any) -> ShardIndex:
        raise AssertionError("scanned again")

    monkeypatch.setattr(_webdataset_index, "scan_shard", no_scan)  # scanned_index's call
    again = ab.open_dataset(url, options, cache=ab.DiskCache(str(cache)))
    monkeypatch.undo()
    assert server.requests == gets
    assert server.heads - heads == len(local_shards)
    assert again.fingerprint() == first.fingerprint()
    assert packed(again) == packed(first)
    # An entry that is not an index (damaged on disk) is scanned again, never trusted.
    damaged = 0
    for entry in cache.glob("objects/*/1"):  # block 1 of an index entry: the index itself
        if entry.with_name("0").stat().st_size == 8:
            entry.write_bytes(b"\0" * entry.stat().st_size)
            damaged += 1
    assert damaged == len(local_shards)
    rescanned = ab.open_dataset(url, options, cache=str(cache))
    assert rescanned.fingerprint() == first.fingerprint()


@pytest.mark.parametrize("store", ["local", "s3", "http"])
def test_sidecars_and_scan_give_identical_batches(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, local_shards: list[Path]
) -> None:
    url, options, shard_urls = shards_in(store, request, tmp_path, local_shards)
    if store == "http":
        server = request.getfixturevalue("http_root")[1]
        gets, heads = server.requests, server.heads
    scanned = ab.open_dataset(url, options)
    assert scanned.manifest.metadata["sidecars"] == 0
    if store == "http":
        # Per shard (beside the sidecar asked for, not found, which the server does not
        # count): its size, and one range of it all (a shard under 8 MiB), never a request
        # per header.
        assert server.requests - gets == len(local_shards)
        assert server.heads - heads == len(local_shards)
    if store == "http":  # the Range server is read-only: index the files it serves
        base = request.getfixturevalue("http_root")[0]
        folder = base / shard_urls[0].rsplit("/", 2)[1]
        report = ab.index_webdataset(str(folder))
    else:
        report = ab.index_webdataset(url, options)
    assert report.shards == len(local_shards) and report.samples == SAMPLES
    if store == "http":
        before = server.requests + server.heads
    indexed = ab.open_dataset(url, options)
    if store == "http":
        # Opening reads the sidecars only: one request each (a suffix range).
        assert server.requests + server.heads - before == len(local_shards)
    assert indexed.manifest.metadata["sidecars"] == len(local_shards)
    assert indexed.fingerprint() == scanned.fingerprint()
    # The scan made whole indexes; the sidecars gave their summaries only, which agree.
    assert all(isinstance(entry, ShardIndex) for entry in scanned.arrays["wds_indexes"])
    assert all(isinstance(entry, SidecarSummary) for entry in indexed.arrays["wds_indexes"])
    assert [e.summary().packed for e in scanned.arrays["wds_indexes"]] == [
        e.packed for e in indexed.arrays["wds_indexes"]
    ]
    args: dict[str, Any] = dict(batch_size=24, shuffle=True, seed=2, drop_last=False)
    with ab.Loader(scanned, **args) as one, ab.Loader(indexed, **args) as two:
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(a.global_indexes, b.global_indexes)
            for name in a:
                assert a[name].to_pylist() == b[name].to_pylist()


def test_sidecar_layout_round_trips(local_shards: list[Path]) -> None:
    report = ab.index_webdataset([str(p) for p in local_shards])
    assert report.sidecars == tuple(sidecar_url(str(p)) for p in local_shards)
    for path in local_shards:
        data = Path(sidecar_url(str(path))).read_bytes()
        index = ShardIndex.parse(data, "x")
        assert data[:8] == b"ABTARIDX" and index.size == path.stat().st_size
        assert index.pack() == data
        with tarfile.open(path) as tar:
            first = next(m for m in tar.getmembers() if m.isreg())
        assert int(index.starts[0]) == first.offset  # the first header (pax included)
        assert set(index.fields) == {k for k in make_samples(1)[0] if k != "__key__"}


def test_sidecars_read_lazily_within_a_cache_bound(
    local_shards: list[Path], tmp_path: Path
) -> None:
    """Sidecar tables fetched as batches need them: every sample once per epoch, its bytes
    webdataset's, with the cache holding every table or none (each group then fetches its
    own again), in DataLoader workers and beside scanned shards in a mixture."""
    expected = reference([str(p) for p in local_shards])
    folder = str(local_shards[0].parent)
    ab.index_webdataset(folder)
    dataset = ab.open_dataset(folder)
    assert all(isinstance(e, SidecarSummary) for e in dataset.arrays["wds_indexes"])
    requests = {}
    for budget in (None, 0):
        options = {} if budget is None else {"index_cache_bytes": budget}
        args: dict[str, Any] = dict(batch_size=16, shuffle=False, drop_last=False, prefetch=1)
        with ab.Loader(dataset, format_options=options, **args) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                ids = []
                for batch in loader:
                    check_batch(batch, expected)
                    ids.extend(batch.global_indexes.tolist())
                assert sorted(ids) == list(range(SAMPLES))
            requests[budget] = loader.statistics().requests
    # Kept, each sidecar is fetched once in all; dropped, again in the second epoch.
    assert requests[0] > requests[None]
    with pytest.raises(ConfigError, match="index_cache_bytes"):
        ab.Loader(dataset, batch_size=4, format_options={"index_cache_bytes": -1})
    source = ab.LoaderDataset(dataset, batch_size=16, shuffle="block", drop_last=False)
    ids = []
    for batch in source.dataloader(num_workers=2):
        check_batch(batch, expected)
        ids.extend(batch.global_indexes.tolist())
    assert sorted(ids) == list(range(SAMPLES))
    other = write_shards(tmp_path / "other", make_samples(25, seed=4), per_shard=10)
    blend = ab.mix([dataset, str(other[0].parent)])
    both = expected + reference([str(p) for p in other])
    with ab.Loader(blend, batch_size=8, shuffle=True, drop_last=False) as loader:
        ids = []
        for batch in loader:
            check_batch(batch, both)
            ids.extend(batch.global_indexes.tolist())
    assert sorted(ids) == list(range(SAMPLES + 25))


def test_exact_shuffle_is_one_request_per_sample(local_shards: list[Path]) -> None:
    dataset = ab.open_dataset(str(local_shards[0].parent))
    with ab.Loader(dataset, batch_size=16, shuffle=True, coalesce_gap=0, drop_last=False) as loader:
        assert sum(b.batch_size for b in loader) == SAMPLES
        stats = loader.statistics()
    assert stats.requests <= SAMPLES


def test_block_shuffle_is_one_request_per_block(local_shards: list[Path]) -> None:
    dataset = ab.open_dataset(str(local_shards[0].parent))
    block = 10
    args: dict[str, Any] = dict(batch_size=10, shuffle="block", block_size=block, window=2)
    with ab.Loader(dataset, drop_last=False, coalesce_gap=4096, **args) as loader:
        assert sum(b.batch_size for b in loader) == SAMPLES
        stats = loader.statistics()
    blocks = -(-SAMPLES // block)
    assert stats.requests <= blocks + len(local_shards)  # a block across two shards: two


def test_a_rank_fetches_only_the_sidecars_of_the_shards_it_reads(
    request: pytest.FixtureRequest, tmp_path: Path, samples: list[dict[str, Any]]
) -> None:
    """4 ranks under a block shuffle, over moto's S3 behind a proxy that logs each request:
    opening reads each sidecar's summary only (one suffix range), no shard; a rank then
    fetches the rest of the sidecars of the shards it reads, each once over two epochs,
    and no other."""
    paths = write_shards(tmp_path / "ranks", samples, per_shard=29)  # 8 shards
    url, options, shard_urls = shards_in("s3", request, tmp_path, paths)
    ab.index_webdataset(url, options)
    ab.index_webdataset([str(p) for p in paths])  # the same sidecars, here to measure
    sidecar_paths = [sidecar_url(u).split("://", 1)[1] for u in shard_urls]
    # A sidecar's header and body: all but its summary (the field names, counts and the
    # header again) and its 16-byte trailer.
    body = []
    for p in paths:
        index = ShardIndex.parse(Path(sidecar_url(str(p))).read_bytes(), "x")
        names = sum(len(f) for f in index.fields)
        summary = 16 * len(index.fields) + 4 * (len(index.fields) + 1) + names + 64
        body.append(Path(sidecar_url(str(p))).stat().st_size - summary - 16)
    with fault_server(upstream=request.getfixturevalue("s3_endpoint")) as proxy:
        options = s3_options(proxy.url)

        def gets(suffix: str) -> list[tuple[str, str]]:
            return [
                (p.lstrip("/"), r) for m, p, r in proxy.log if m == "GET" and p.endswith(suffix)
            ]

        for rank in range(4):
            proxy.reset()
            dataset = ab.open_dataset(url, options)
            opened = gets(".abidx")
            assert sorted(p for p, _ in opened) == sorted(sidecar_paths)  # one request each
            assert all(r.startswith("bytes=") for _, r in opened)
            assert proxy.sent("GET", ".abidx") <= len(paths) * _webdataset_index.SUMMARY_PROBE
            assert not gets(".tar")
            ends = np.cumsum([s.elements for s in dataset.manifest.shards])
            proxy.reset()
            read: list[set[int]] = []
            args: dict[str, Any] = dict(batch_size=8, block_size=29, window=1, seed=3)
            with ab.Loader(
                dataset, rank=rank, world_size=4, shuffle="block", drop_last=False, **args
            ) as loader:
                for epoch in range(2):
                    loader.set_epoch(epoch)
                    ids = np.concatenate([b.global_indexes for b in loader])
                    read.append(set(np.searchsorted(ends, ids, side="right").tolist()))
            assert len(read[0]) < len(paths)  # a rank's blocks lie in some shards only
            touched = sorted(read[0] | read[1])
            fetched = gets(".abidx")
            assert sorted(p for p, _ in fetched) == [sidecar_paths[s] for s in touched]
            # Each the sidecar's header and body: its index's arrays, not its summary.
            assert proxy.sent("GET", ".abidx") == sum(body[s] for s in touched)


def test_requests_over_s3_exact_and_block_shuffles(
    request: pytest.FixtureRequest, tmp_path: Path, local_shards: list[Path]
) -> None:
    url, options, _ = shards_in("s3", request, tmp_path, local_shards)
    dataset = ab.open_dataset(url, options)
    args: dict[str, Any] = dict(batch_size=32, shuffle=True, drop_last=False, coalesce_gap=0)
    with ab.Loader(dataset, **args) as loader:
        assert sum(b.batch_size for b in loader) == SAMPLES
        stats = loader.statistics()
    assert 0 < stats.requests <= SAMPLES  # one ranged GET per sample, or fewer
    # Blocks of consecutive samples: one GET each (two where a block crosses a shard's end),
    # at the store's own request cost.
    block = 20
    args = dict(batch_size=20, shuffle="block", block_size=block, window=2, drop_last=False)
    with ab.Loader(dataset, **args) as loader:
        assert sum(b.batch_size for b in loader) == SAMPLES
        stats = loader.statistics()
    assert stats.requests <= -(-SAMPLES // block) + len(local_shards)
    assert stats.bytes_fetched <= sum(p.stat().st_size for p in local_shards)


def test_columns_fetch_only_their_members(local_shards: list[Path]) -> None:
    expected = reference([str(p) for p in local_shards])
    folder = str(local_shards[0].parent)
    fetched = {}
    for columns in (None, ["cls"], ["json", "cls"]):
        options = None if columns is None else {"columns": columns}
        dataset = ab.open_dataset(folder, options=options)
        with ab.Loader(dataset, batch_size=20, shuffle=True, drop_last=False) as loader:
            for batch in loader:
                check_batch(batch, expected, fields=columns)
            fetched[str(columns)] = loader.statistics().bytes_fetched
    # A label's member is its header and a byte or two; a whole sample is ~3 KiB and more.
    assert fetched["['cls']"] < fetched["None"] / 4
    assert fetched["['cls']"] <= SAMPLES * (2 * BLOCK + 16)
    with pytest.raises(ConfigError, match=r"columns=\['txt'\].*'bin', 'cls'"):
        ab.open_dataset(folder, options={"columns": ["txt"]})
    with pytest.raises(ConfigError, match="unknown options"):
        ab.open_dataset(folder, options={"nulls": "fill"})


def test_samples_with_other_fields(tmp_path: Path) -> None:
    samples = make_samples(30)
    for i in (4, 17):
        del samples[i]["json"]
    paths = write_shards(tmp_path / "s", samples, per_shard=10)
    folder = str(paths[0].parent)
    expected = reference([str(p) for p in paths])
    for sidecars in (False, True):
        if sidecars:  # the summaries' counts tell; the sidecar read whole names the sample
            ab.index_webdataset(folder)
        with pytest.raises(
            ConfigError, match=r"shard-000000.tar: sample 'sample000004' has no 'json'"
        ):
            ab.open_dataset(folder)
        dataset = ab.open_dataset(folder, options={"columns": ["bin", "cls"]})
        assert dataset.manifest.metadata["sidecars"] == (len(paths) if sidecars else 0)
        with ab.Loader(dataset, batch_size=8, shuffle=True, drop_last=False) as loader:
            for batch in loader:
                check_batch(batch, expected, fields=["bin", "cls"])


def tar_of(path: Path, members: Sequence[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def index_samples(urls: Sequence[str]) -> list[dict[str, Any]]:
    """The samples the shards' headers walked in memory group into: key, shard, fields."""
    out = []
    for url in urls:
        data = Path(url).read_bytes()
        walk = _webdataset_index.TarWalk(url, len(data))
        walk.feed(data, 0)
        assert walk.done
        index = walk.index()
        members = np.cumsum(np.append(0, index.members))
        for s in range(index.num_samples):
            fields = index.field[members[s] : members[s + 1]].tolist()
            out.append(
                {
                    "__key__": index.key(s),
                    "__url__": url,
                    "fields": {index.fields[f] for f in fields},
                }
            )
    return out


def test_grouping_is_webdataset_s_own(tmp_path: Path) -> None:
    """Keys with their folders, metadata and extensionless members skipped, a key seen again
    later and a key across two shards: as many samples, with the same keys and fields, as
    webdataset yields."""
    folder = tmp_path / "g"
    folder.mkdir()
    tar_of(
        folder / "a.tar",
        [
            ("__meta__", b"m"),
            ("dir/x.cls", b"1"),
            ("dir/x.seg.PNG", b"p"),
            ("README", b"no extension"),
            ("y.cls", b"2"),
            ("__skip__/z.cls", b"meta"),
            ("dir/x.cls", b"3"),  # the key again: another sample
            ("w.v1/k.cls", b"4"),  # a dot in the folder part
            ("split.cls", b"5"),
        ],
    )
    tar_of(folder / "b.tar", [("split.seg.png", b"6"), ("last.cls", b"7")])
    urls = [str(folder / "a.tar"), str(folder / "b.tar")]
    expected = reference(urls)
    got = index_samples(urls)
    assert [(s["__key__"], s["__url__"]) for s in got] == [
        (s["__key__"], s["__url__"]) for s in expected
    ]
    assert [s["fields"] for s in got] == [
        {k for k in s if not k.startswith("__")} for s in expected
    ]
    # Samples with other fields: the batch's fields must be in every sample.
    with pytest.raises(ConfigError, match=r"a.tar: sample 'y' has no 'seg.png' field"):
        ab.open_dataset(urls)
    with pytest.raises(ConfigError, match=r"b.tar: sample 'split' has no 'cls' field"):
        ab.open_dataset(urls, options={"columns": ["cls"]})


def test_a_field_twice_in_a_sample_is_refused_as_webdataset_does(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    tar_of(path, [("k.cls", b"1"), ("k.txt", b"a"), ("k.cls", b"2")])
    with pytest.raises(ValueError, match="duplicate"):
        reference([str(path)])
    with pytest.raises(FormatError, match=r"dup.tar: sample 'k' holds field 'cls' twice"):
        ab.open_dataset(str(path))


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_and_non_ascii_names(tmp_path: Path, fmt: int) -> None:
    """Names past the 100 bytes of a header: a pax ``path``, a GNU ``././@LongLink``, or the
    ustar prefix field; names outside ASCII (pax only)."""
    folder = "d" * 60 + "/" + "e" * 50  # over 100 bytes with the base name: a long name
    members = []
    for i in range(5):
        base = f"{folder}/key{i:03d}" if fmt != tarfile.USTAR_FORMAT else f"{folder}/k{i}"
        if fmt == tarfile.PAX_FORMAT:
            base += "-é"
        members += [(f"{base}.cls", str(i).encode()), (f"{base}.txt", b"t" * (i * 100))]
    path = tmp_path / "long.tar"
    tar_of(path, members, fmt)
    expected = reference([str(path)])
    assert len(expected) == 5
    dataset = ab.open_dataset(str(path), format="webdataset")
    with ab.Loader(dataset, batch_size=2, shuffle=True, drop_last=False) as loader:
        for batch in loader:
            check_batch(batch, expected)


def test_a_name_longer_than_a_scan_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_webdataset_index, "SCAN_CHUNK", 1024)
    folder = "/".join(["f" * 200] * 15)  # a pax header's data of 3 KiB: more than a read
    path = tmp_path / "deep.tar"
    tar_of(path, [(f"{folder}/k{i}.{ext}", bytes([i]) * 700) for i in range(3) for ext in "ab"])
    expected = reference([str(path)])
    dataset = ab.open_dataset(str(path))
    assert dataset.manifest.total_elements == 3
    with ab.Loader(dataset, batch_size=2, shuffle=False, drop_last=False) as loader:
        for batch in loader:
            check_batch(batch, expected)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_a_truncated_shard_names_the_shard_and_key(local_shards: list[Path]) -> None:
    path = local_shards[1]
    with tarfile.open(path) as tar:
        member = [m for m in tar.getmembers() if m.isreg()][40]
    with open(path, "r+b") as f:
        f.truncate(member.offset_data + max(1, member.size // 2))
    with pytest.raises(
        FormatError, match=r"shard-000001.tar: truncated: the member at bytes \[\d+, \d+\)"
    ):
        ab.open_dataset(str(path.parent))
    with pytest.raises(FormatError, match=member.name.split(".")[0]):
        ab.open_dataset(str(path.parent))


def test_a_file_that_is_not_a_tar(tmp_path: Path) -> None:
    path = tmp_path / "noise.tar"
    path.write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(
        FormatError,
        match=r"noise.tar: bytes \[0, 512\).*bad tar header checksum \(not a tar file\)",
    ):
        ab.open_dataset(str(path))
    corrupt = tmp_path / "c" / "corrupt.tar"
    corrupt.parent.mkdir()
    tar_of(corrupt, [("a.cls", b"1"), ("b.cls", b"2")])
    data = bytearray(corrupt.read_bytes())
    data[1024 + 10] ^= 0xFF  # the second member's header
    corrupt.write_bytes(bytes(data))
    with pytest.raises(
        FormatError, match=r"bytes \[1024, 1536\) \(after sample key 'a.cls'\).*corrupt"
    ):
        ab.open_dataset(str(corrupt))


def test_gzip_shards_are_refused_with_what_to_do(tmp_path: Path, local_shards: list[Path]) -> None:
    for name in ("x.tar.gz", "x.tgz"):
        with pytest.raises(ConfigError, match=r"gzip.*random\s+access.*uncompressed \.tar"):
            ab.open_dataset(str(tmp_path / name))
    folder = tmp_path / "gz"
    folder.mkdir()
    (folder / "a.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ConfigError, match="a.tar.gz: a gzip-compressed tar"):
        ab.open_dataset(str(folder))
    with pytest.raises(ConfigError, match="gzip"):
        ab.open_dataset([str(local_shards[0]), str(folder / "a.tar.gz")])


def test_a_sidecar_that_disagrees_with_its_shard(tmp_path: Path) -> None:
    samples = make_samples(40)
    (path,) = write_shards(tmp_path / "one", samples, per_shard=100)
    original = path.read_bytes()
    ab.index_webdataset(str(path))
    # The same size (tar pads to 10 KiB records, a member to 512 bytes), another member size.
    samples[7]["cls"] = b"77"
    (again,) = write_shards(tmp_path / "two", samples, per_shard=100)
    assert again.stat().st_size == path.stat().st_size
    shutil.copy(again, path)
    dataset = ab.open_dataset(str(path))
    assert dataset.manifest.metadata["sidecars"] == 1
    with (
        ab.Loader(dataset, batch_size=8, shuffle=False) as loader,
        pytest.raises(
            FormatError,
            match=r"shard-000000.tar: sample 'sample000007', field 'cls': bytes \[\d+, \d+\) are"
            r" not the member's tar header the index says \(its size field",
        ),
    ):
        list(loader)
    # Another size: refused when the shard is first read (or at open, where a listing tells it).
    more = make_samples(60)
    (longer,) = write_shards(tmp_path / "three", more, per_shard=100)
    shutil.copy(longer, path)
    with (
        ab.Loader(ab.open_dataset(str(path)), batch_size=8) as loader,
        pytest.raises(FormatError, match=r"size mismatch: .*shard-000000.tar has \d+ bytes"),
    ):
        list(loader)
    # A sidecar whose own bytes are damaged: in its summary (read at open), in its body
    # (read when a batch first reads its shard), in its trailer.
    path.write_bytes(original)
    side = Path(sidecar_url(str(path)))
    good = side.read_bytes()
    for at, when in ((len(good) - 16 - 64 - 2, "open"), (100, "read"), (len(good) - 3, "open")):
        data = bytearray(good)
        data[at] ^= 1
        side.write_bytes(bytes(data))
        expected = "checksum does not match" if at != len(good) - 3 else "without its summary"
        with pytest.raises(FormatError, match=rf"shard-000000.tar.abidx: .*{expected}"):
            dataset = ab.open_dataset(str(path))
            assert when == "read"
            with ab.Loader(dataset, batch_size=8) as loader:
                list(loader)
    side.write_bytes(b"not an index at all")
    with pytest.raises(FormatError, match="not an asyncbatch tar index"):
        ab.open_dataset(str(path))
    # A sidecar whose digests hold but whose arrays do not fit the shard: when it is read.
    index = ShardIndex.parse(good, "x")
    wrong = dataclasses.replace(index, ends=index.ends + path.stat().st_size)
    side.write_bytes(wrong.pack())
    with (
        ab.Loader(ab.open_dataset(str(path)), batch_size=8) as loader,
        pytest.raises(FormatError, match=r"abidx: corrupt tar index \(a sample past the shard"),
    ):
        list(loader)
    # A sidecar of version 1 (written before summaries) is still read, whole, at open.
    side.write_bytes(pack_v1(index))
    dataset = ab.open_dataset(str(path))
    assert isinstance(dataset.arrays["wds_indexes"][0], ShardIndex)
    with ab.Loader(dataset, batch_size=8, shuffle=False, drop_last=False) as loader:
        for batch in loader:
            check_batch(batch, reference([str(path)]))


def test_a_sidecar_changed_or_gone_after_the_open(tmp_path: Path) -> None:
    """The rest of a sidecar is fetched after the open: one rewritten since (another index
    of the same size) or deleted is a FormatError naming it, never another shard's offsets."""
    paths = write_shards(tmp_path / "s", make_samples(40), per_shard=20)
    ab.index_webdataset(str(paths[0].parent))
    dataset = ab.open_dataset(str(paths[0].parent))
    side = Path(sidecar_url(str(paths[1])))
    side.write_bytes(Path(sidecar_url(str(paths[0]))).read_bytes())  # shard 0's, same size
    args: dict[str, Any] = dict(batch_size=8, shuffle=False, drop_last=False)
    with (
        ab.Loader(dataset, **args) as loader,
        pytest.raises(FormatError, match=r"shard-000001.tar.abidx: bytes \[0, 64\) are not the"),
    ):
        list(loader)
    side.unlink()
    with (
        ab.Loader(dataset, **args) as loader,
        pytest.raises(FormatError, match=r"shard-000001.tar.abidx"),
    ):
        list(loader)


def pack_v1(index: ShardIndex) -> bytes:
    """``index`` as a version 1 sidecar: no summary, the field names closing the body."""
    names = [n.encode() for n in index.fields]
    name_offsets = np.cumsum([0, *(len(n) for n in names)]).astype("<u4")
    body = b"".join(
        (
            index.starts.astype("<u8").tobytes(),
            index.ends.astype("<u8").tobytes(),
            index.key_offsets.astype("<u8").tobytes(),
            index.offsets.astype("<u8").tobytes(),
            index.lengths.astype("<u8").tobytes(),
            index.members.astype("<u4").tobytes(),
            name_offsets.tobytes(),
            index.field.astype("<u4").tobytes(),
            index.keys.tobytes(),
            b"".join(names),
        )
    )
    from asyncbatch._checksums import digest

    header = struct.pack(
        "<8sIIQQQQQQ",
        b"ABTARIDX",
        1,
        len(names),
        index.size,
        index.num_samples,
        index.offsets.size,
        index.keys.size,
        int(name_offsets[-1]),
        digest(body),
    )
    return header + body


def test_a_sidecar_of_another_size_is_refused_at_open_where_listed(
    request: pytest.FixtureRequest, tmp_path: Path, local_shards: list[Path]
) -> None:
    url, options, shard_urls = shards_in("s3", request, tmp_path, local_shards[:1])
    ab.index_webdataset(url, options)
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.pipe(shard_urls[0], local_shards[1].read_bytes()[:-10240])  # another size
    with pytest.raises(
        FormatError, match=r"shard-000000.tar: \d+ bytes, but its index .* was made"
    ):
        ab.open_dataset(url, options)


# ---------------------------------------------------------------------------------------------
# URLs and the command


def test_brace_patterns_expand_as_braceexpand_does() -> None:
    braceexpand = pytest.importorskip("braceexpand")
    patterns = [
        "s3://b/laion/{000000..000012}.tar",
        "s3://b/{a,b}/{0..3}.tar",
        "x/{9..11}.tar",
        "x/{1..10..3}-{c..a}.tar",
        "x/{a,{b,c}1}.tar",
        "x/{lone}.tar",
        "x/{001..3}.tar",
        "plain.tar",
    ]
    for pattern in patterns:
        assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern)), pattern


def test_open_a_glob_a_brace_pattern_and_a_list(local_shards: list[Path]) -> None:
    folder = local_shards[0].parent
    urls = [str(p) for p in local_shards]
    for url in (
        str(folder / "shard-*.tar"),
        str(folder / "shard-{000000..000002}.tar"),
        urls,
    ):
        dataset = ab.open_dataset(url)
        assert dataset.shard_urls == urls and dataset.manifest.total_elements == SAMPLES
    assert ab.open_dataset(str(folder), format="webdataset").shard_urls == urls


def test_the_index_command(local_shards: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(local_shards[0].parent)
    assert main(["index", "--no-progress", folder]) == 0
    out = capsys.readouterr().out
    assert f"shards    {len(local_shards)}" in out and f"samples   {SAMPLES}" in out
    assert all(Path(sidecar_url(str(p))).exists() for p in local_shards)
    assert ab.open_dataset(folder).manifest.metadata["sidecars"] == len(local_shards)
    assert main(["inspect", folder]) == 0
    out = capsys.readouterr().out
    assert "format    webdataset" in out and f"sidecar indexes: {len(local_shards)} of" in out
    assert "  cls\n" in out and "  seg.png\n" in out
    assert main(["index", "--no-progress", folder + "/missing.tar"]) == 1
    assert "missing.tar" in capsys.readouterr().err
    assert main(["index", str(local_shards[0]), str(local_shards[2])]) == 0  # a list
    captured = capsys.readouterr()
    assert "shards    2 " in captured.out and "indexing" in captured.err
    seen: list[tuple[int, int]] = []
    ab.index_webdataset(folder, progress=lambda done, shards: seen.append((done, shards)))
    assert seen == [(n, len(local_shards)) for n in range(len(local_shards) + 1)]


def sidecars(paths: Sequence[Path]) -> list[bytes]:
    return [Path(sidecar_url(str(p))).read_bytes() for p in paths]


def test_index_on_a_process_pool_writes_the_same_sidecars(local_shards: list[Path]) -> None:
    folder = str(local_shards[0].parent)
    ab.index_webdataset(folder)
    alone = sidecars(local_shards)
    seen: list[tuple[int, int]] = []
    report = ab.index_webdataset(
        folder, workers=2, progress=lambda done, shards: seen.append((done, shards))
    )
    assert sidecars(local_shards) == alone
    assert report.shards == len(local_shards) and report.samples == SAMPLES
    assert seen[0] == (0, len(local_shards)) and seen[-1] == (len(local_shards),) * 2


def test_index_on_ray_writes_the_same_sidecars(
    local_shards: list[Path], ray_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(local_shards[0].parent)
    ab.index_webdataset(folder)
    alone = sidecars(local_shards)
    for path in local_shards:
        Path(sidecar_url(str(path))).unlink()
    command = ["index", "--no-progress", "--engine", "ray", "--workers", "2", folder]
    assert main(command) == 0
    assert f"samples   {SAMPLES}" in capsys.readouterr().out
    assert sidecars(local_shards) == alone


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_index_workers_report_a_bad_shard_by_name(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    paths = write_shards(tmp_path / "ds", make_samples(30, seed=5), per_shard=10)
    paths[1].write_bytes(b"not a tar at all" * 64)
    with pytest.raises(FormatError, match=paths[1].name):
        ab.index_webdataset(str(tmp_path / "ds"), workers=2, engine=engine)
    with pytest.raises(ConfigError, match="engine='spark'"):
        ab.index_webdataset(str(tmp_path / "ds"), workers=2, engine="spark")


def test_a_mixture_of_two_webdatasets(tmp_path: Path) -> None:
    one = write_shards(tmp_path / "one", make_samples(40, seed=3), per_shard=15)
    two = write_shards(tmp_path / "two", make_samples(25, seed=4), per_shard=10)
    expected = reference([str(p) for p in one]) + reference([str(p) for p in two])
    blend = ab.mix([str(one[0].parent), str(two[0].parent)])
    with ab.Loader(blend, batch_size=8, shuffle=True, drop_last=False) as loader:
        ids = []
        for batch in loader:
            check_batch(batch, expected)
            ids.extend(batch.global_indexes.tolist())
    assert sorted(ids) == list(range(65))  # default weights: every sample of both once
