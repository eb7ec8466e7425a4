"""The node-local cache: real servers, real files, real processes sharing and killed."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from cache_child import read_epoch
from conftest import WriteDataset, expected_windows
from servers import RangeHTTPServer

import asyncbatch as ab
from asyncbatch import _cli as cli
from asyncbatch._errors import ShardChangedError
from asyncbatch.stores import _cache as cached
from asyncbatch.stores import _s3 as s3_store
from asyncbatch.stores import open_store
from asyncbatch.stores._disk_cache import STALE_TEMP_SECONDS, cache_info

CHILD = Path(__file__).with_name("cache_child.py")
SEQ = 16
BLOCK = 4096
_names = itertools.count()


@pytest.fixture
def http_dataset(
    http_root: tuple[Path, RangeHTTPServer], tokens: npt.NDArray[np.uint16]
) -> tuple[str, Path, RangeHTTPServer]:
    """``(url, folder, server)`` of a dataset of 3 shards with 4 KiB checksum blocks."""
    root, server = http_root
    name = f"cache-{next(_names)}"
    ab.write_tokens(str(root / name), tokens, shard_size=16_000, checksum_block=BLOCK)
    return f"{server.url}/{name}", root / name, server


def check_epoch(loader: ab.Loader, tokens: npt.NDArray[np.uint16]) -> int:
    """Read one epoch, each batch compared with the source tokens; the batches read."""
    count = 0
    for batch in loader:
        expected = expected_windows(tokens, batch.global_indexes, SEQ)
        np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
        count += 1
    assert count == len(loader) > 0
    return count


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "objects").glob("*/*") if p.name.isdigit())


def temporaries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "objects").glob("*/*") if ".tmp-" in p.name)


def etag(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as r:
        return str(r.headers["ETag"])


def entry_dir(cache: ab.DiskCache, url: str) -> Path:
    return Path(cache.object_dir(url, etag(url)))


def check_entries(cache: ab.DiskCache, url: str, folder: Path) -> int:
    """Every entry of the dataset's objects holds the bytes of its block; their count."""
    found = 0
    for file in folder.iterdir():
        data = file.read_bytes()
        directory = entry_dir(cache, f"{url}/{file.name}")
        for entry in directory.glob("*") if directory.exists() else []:
            assert entry.name.isdigit(), f"left behind: {entry}"
            start = int(entry.name) * cache.block_size
            assert entry.read_bytes() == data[start : start + cache.block_size], entry
            found += 1
    return found


def run_child(mode: str, **args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), mode, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_result(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=90)
    assert process.returncode == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def uncached_digest(url: str) -> str:
    import hashlib

    return hashlib.sha256(read_epoch(url, None).tobytes()).hexdigest()


# --- reading through the cache ---------------------------------------------------------


def test_second_epoch_makes_no_get_request(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, _, server = http_dataset
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=tmp_path / "cache") as loader:
        before = server.requests
        check_epoch(loader, tokens)
        assert server.requests > before
        first = loader.statistics()
        assert first.requests == server.requests - before and first.cache_misses > 0
        before = server.requests
        check_epoch(loader, tokens)
        assert server.requests == before
        assert loader.cache is not None and loader.cache.hits > 0
        # statistics() counts what reached the server (nothing more in epoch 2) and the
        # blocks this loader found in the cache.
        second = loader.statistics()
        assert (second.requests, second.bytes_fetched) == (first.requests, first.bytes_fetched)
        # Nor a HEAD: the loader remembers each object's size and version across epochs.
        heads = server.heads
        check_epoch(loader, tokens)
        assert server.heads == heads
        assert second.cache_hits > first.cache_hits
        assert second.cache_misses == first.cache_misses
        assert second.bytes_delivered == 2 * first.bytes_delivered


def test_async_loader_reads_through_the_cache(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, _, server = http_dataset

    async def main() -> list[int]:
        gets = []
        async with ab.AsyncLoader(url, batch_size=4, seq_len=SEQ, cache=tmp_path) as loader:
            for _ in range(2):
                before = server.requests
                async for batch in loader:
                    expected = expected_windows(tokens, batch.global_indexes, SEQ)
                    np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
                gets.append(server.requests - before)
        return gets

    first, second = asyncio.run(main())
    assert first > 0 and second == 0


@pytest.mark.parametrize("store", ["s3"])
def test_second_epoch_from_s3_fetches_nothing(
    write_dataset: WriteDataset,
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, options = write_dataset(tokens, shard_size=16_000)
    cache = ab.DiskCache(tmp_path / "cache", block_size=BLOCK)
    sessions = []  # aiobotocore sessions the S3 store made (~10 ms of CPU each)
    new_session = s3_store._new_session
    monkeypatch.setattr(s3_store, "_new_session", lambda: sessions.append(1) or new_session())
    with ab.Loader(url, batch_size=4, seq_len=SEQ, storage_options=options, cache=cache) as loader:
        check_epoch(loader, tokens)
        fetched, misses, hits = cache.fetched_bytes, cache.misses, cache.hits
        assert fetched >= tokens.nbytes
        made = len(sessions)  # opening the dataset, then the first epoch
        assert made >= 1
        check_epoch(loader, tokens)
        assert (cache.fetched_bytes, cache.misses) == (fetched, misses)
        assert cache.hits > hits
        assert len(sessions) == made  # the second epoch asked S3 nothing, and made no session


def test_each_block_is_fetched_once_and_kept_across_caches(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, folder, server = http_dataset
    objects = sorted(folder.iterdir())  # the shards and the manifest
    total = sum(p.stat().st_size for p in objects)
    blocks = sum(-(-p.stat().st_size // BLOCK) for p in objects)
    cache = ab.DiskCache(tmp_path / "cache", block_size=BLOCK)
    before = server.requests
    with ab.Loader(url, batch_size=4, seq_len=SEQ, shuffle=True, cache=cache) as loader:
        check_epoch(loader, tokens)
    # Concurrent reads of one block wait for one fetch; neighbouring blocks share a request.
    assert (cache.misses, cache.fetched_bytes) == (blocks, total)
    assert 0 < server.requests - before <= blocks
    assert check_entries(cache, url, folder) == blocks
    # Another cache object on the same path (as another process): the disk holds it all.
    again = ab.DiskCache(tmp_path / "cache", block_size=BLOCK)
    before = server.requests
    with ab.Loader(url, batch_size=4, seq_len=SEQ, shuffle=True, cache=again) as loader:
        check_epoch(loader, tokens)
    assert server.requests == before
    # Only the bytes asked for are read from entries: every window, once.
    assert (again.misses, again.fetched_bytes) == (0, 0)
    assert again.hit_bytes >= len(tokens) // SEQ * SEQ * tokens.itemsize


def test_dataloader_workers_and_open_dataset_read_through_the_cache(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, _, server = http_dataset
    cache = tmp_path / "cache"
    dataset = ab.open_dataset(url, cache=cache)
    data = ab.LoaderDataset(dataset, batch_size=4, seq_len=SEQ, cache=cache)
    data = pickle.loads(pickle.dumps(data))  # as spawned DataLoader workers get it
    for _ in range(2):  # two worker processes share the cache; the second epoch's, too
        before = server.requests
        for batch in data.dataloader(num_workers=2):
            expected = expected_windows(tokens, batch.global_indexes, SEQ)
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
    assert server.requests == before
    before = server.requests
    assert ab.open_dataset(url, cache=cache).manifest == dataset.manifest
    assert server.requests == before


def test_objects_without_a_version_are_read_without_the_cache(
    tokens: npt.NDArray[np.uint16], tmp_path: Path
) -> None:
    url = f"memory://cache-{next(_names)}"  # fsspec's memory filesystem reports no version
    ab.write_tokens(url, tokens, shard_size=16_000)
    cache = ab.DiskCache(tmp_path / "cache", block_size=BLOCK)
    with (
        pytest.warns(ab.CacheWarning) as record,
        ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader,
    ):
        check_epoch(loader, tokens)
        check_epoch(loader, tokens)
    assert "no version" in only_cache_warning(record)
    assert cache.misses == cache.hits == 0 and not entries(tmp_path / "cache")


def test_arguments_are_checked_and_survive_pickling(tmp_path: Path) -> None:
    ab.write_tokens(str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16))
    with pytest.raises(ab.ConfigError, match="cache must be a path"):
        ab.Loader(str(tmp_path / "ds"), batch_size=2, seq_len=4, cache=123)
    with pytest.raises(ab.ConfigError, match="max_bytes must be a positive integer, got 0"):
        ab.DiskCache(tmp_path, max_bytes=0)
    with pytest.raises(ab.ConfigError, match="block_size must be a positive integer, got -1"):
        ab.DiskCache(tmp_path, block_size=-1)
    with pytest.raises(ab.ConfigError, match="max_bytes=10 holds not even one block"):
        ab.DiskCache(tmp_path, max_bytes=10, block_size=100)
    with pytest.raises(ab.ConfigError, match="cache path must be"):
        ab.DiskCache("")
    cache = ab.DiskCache(tmp_path / "c", max_bytes=10**6, block_size=1000)
    with ab.Loader(str(tmp_path / "ds"), batch_size=2, seq_len=4, cache=cache) as loader:
        copy = pickle.loads(pickle.dumps(loader))
        assert repr(copy.cache) == repr(cache)
        copy.close()
    with ab.Loader(str(tmp_path / "ds"), batch_size=2, seq_len=4, cache=tmp_path / "c") as loader:
        assert loader.cache is not None and loader.cache.path == str(tmp_path / "c")
        assert pickle.loads(pickle.dumps(loader.cache)).path == loader.cache.path


@pytest.mark.parametrize(
    ("shared", "dir_mode", "file_mode"), [(False, 0o700, 0o600), (True, 0o2770, 0o660)]
)
def test_the_cache_is_the_owners_unless_shared_with_the_group(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
    shared: bool,
    dir_mode: int,
    file_mode: int,
) -> None:
    url, _, _ = http_dataset
    cache = ab.DiskCache(tmp_path / "nodes" / "cache", shared=shared)
    assert pickle.loads(pickle.dumps(cache)).shared is shared
    old = os.umask(0o022)  # the usual umask would give 0755 and 0644
    try:
        with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
            check_epoch(loader, tokens)
    finally:
        os.umask(old)
    root = tmp_path / "nodes" / "cache"
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(dirs) > 2 and len(files) > 2
    assert {oct(p.stat().st_mode & 0o7777) for p in dirs} == {oct(dir_mode)}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(file_mode)}
    with pytest.raises(ab.ConfigError, match="shared must be True or False, got 'yes'"):
        ab.DiskCache(tmp_path, shared="yes")  # type: ignore[arg-type]


# --- processes sharing the cache, and killed -------------------------------------------


def test_two_processes_share_one_cache(
    http_dataset: tuple[str, Path, RangeHTTPServer], tmp_path: Path
) -> None:
    url, folder, _ = http_dataset
    expected = uncached_digest(url)
    # A cache smaller than the dataset: both processes also evict at once.
    limit = 8 * BLOCK
    args = {"url": url, "cache": str(tmp_path / "cache"), "block_size": BLOCK, "max_bytes": limit}
    children = [run_child("read", **args) for _ in range(2)]
    results = [child_result(child) for child in children]
    assert [r["sha256"] for r in results] == [expected, expected]
    assert [r["warnings"] for r in results] == [[], []]
    cache = ab.DiskCache(tmp_path / "cache", block_size=BLOCK)
    assert check_entries(cache, url, folder) > 0
    assert not temporaries(tmp_path / "cache")
    # Each process keeps the cache under max_bytes counting its own writes under way; the
    # other's, not yet on disk when it looked, may add a block or two.
    assert cache_info(tmp_path / "cache").bytes_used <= limit + 2 * BLOCK


def test_a_writer_killed_mid_write_leaves_no_wrong_entry(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    url = str(tmp_path / "ds")
    ab.write_tokens(url, tokens, shard_size=16_000)
    cache_path = tmp_path / "cache"
    marker = tmp_path / "writing"
    args = {"url": url, "cache": str(cache_path), "block_size": BLOCK, "marker": str(marker)}
    child = run_child("kill", **args)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    # The thread that touched the marker stopped half-way through a block; any other writer
    # was killed somewhere before finishing its block. None of them is an entry.
    temps = temporaries(cache_path)
    sizes = [temp.stat().st_size for temp in temps]
    assert BLOCK // 2 in sizes and all(size < BLOCK for size in sizes), sizes
    assert not any((temp.parent / temp.name.partition(".")[0]).exists() for temp in temps)
    # A fresh reader ignores the half-written file and reads exact bytes.
    cache = ab.DiskCache(cache_path, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
        check_epoch(loader, tokens)
    assert cache.misses > 0
    assert temporaries(cache_path) == temps  # young: maybe another process's writes
    # Once old, the next process that writes deletes them.
    old = time.time() - STALE_TEMP_SECONDS - 60
    for temp in temps:
        os.utime(temp, (old, old))
    entries(cache_path)[0].unlink()
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache_path) as loader:
        check_epoch(loader, tokens)
    assert not temporaries(cache_path)


# --- eviction --------------------------------------------------------------------------


def read_blocks(cache: ab.DiskCache, url: str, *blocks: int) -> None:
    """Read whole blocks of ``url`` through the cache (one read_ranges call)."""

    data = Path(url).read_bytes()

    async def main() -> None:
        store = open_store(url, cache=cache)
        try:
            size = cache.block_size
            buffers = [memoryview(bytearray(size)) for _ in blocks]
            starts = [b * size for b in blocks]
            await store.read_ranges(
                url, starts=starts, ends=[s + size for s in starts], buffers=buffers
            )
            for start, buffer in zip(starts, buffers, strict=True):
                assert bytes(buffer) == data[start : start + size]
        finally:
            await store.close()

    asyncio.run(main())


def test_any_ranges_read_exact_bytes_a_few_blocks_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "object")
    data = np.random.default_rng(2).bytes(25_500)
    Path(url).write_bytes(data)
    monkeypatch.setattr(cached, "CHUNK_BYTES", 3000)  # three blocks held at a time
    cache = ab.DiskCache(tmp_path / "cache", block_size=1000)
    rng = np.random.default_rng(3)
    starts = rng.integers(0, len(data), 40).tolist()  # unsorted, overlapping, some empty
    ends = [
        min(len(data), s + int(n)) for s, n in zip(starts, rng.integers(0, 3000, 40), strict=True)
    ]
    starts.append(len(data) - 10)  # the short last block
    ends.append(len(data))

    async def main() -> list[bytes]:
        store = open_store(url, cache=cache)
        try:
            results = []
            for _ in range(2):  # misses, then hits
                buffers = [memoryview(bytearray(e - s)) for s, e in zip(starts, ends, strict=True)]
                await store.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
                results += [bytes(b) for b in buffers]
            return results
        finally:
            await store.close()

    expected = [data[s:e] for s, e in zip(starts, ends, strict=True)]
    assert asyncio.run(main()) == expected + expected
    assert cache.misses == len(entries(tmp_path / "cache")) and cache.hits >= cache.misses


def test_least_recently_used_blocks_are_evicted_first(tmp_path: Path) -> None:
    url = str(tmp_path / "object")
    Path(url).write_bytes(np.random.default_rng(1).bytes(10_000))
    cache = ab.DiskCache(tmp_path / "cache", max_bytes=5000, block_size=1000)
    read_blocks(cache, url, 0, 1, 2, 3, 4)
    files = entries(tmp_path / "cache")
    assert [int(f.name) for f in files] == [0, 1, 2, 3, 4]
    now = time.time()
    for file in files:  # distinct ages: block 0 the oldest
        os.utime(file, (now - 100 + int(file.name), now - 100 + int(file.name)))
    read_blocks(cache, url, 0)  # a hit: now the most recently used
    assert cache.hits == 1
    read_blocks(cache, url, 5)
    assert [int(f.name) for f in entries(tmp_path / "cache")] == [0, 2, 3, 4, 5]
    assert cache_info(tmp_path / "cache").bytes_used <= 5000


def test_eviction_keeps_max_bytes_when_files_vanish_under_it(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, folder, _ = http_dataset
    limit = 6 * BLOCK
    cache = ab.DiskCache(tmp_path / "cache", max_bytes=limit, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
        check_epoch(loader, tokens)
        assert 0 < cache_info(tmp_path / "cache").bytes_used <= limit
        for file in entries(tmp_path / "cache")[::2]:  # another process evicted these
            file.unlink()
        check_epoch(loader, tokens)
        assert 0 < cache_info(tmp_path / "cache").bytes_used <= limit
    assert check_entries(cache, url, folder) <= 6


# --- a cache that fails ----------------------------------------------------------------


def only_cache_warning(record: pytest.WarningsRecorder) -> str:
    warned = [w for w in record if issubclass(w.category, ab.CacheWarning)]
    assert len(warned) == 1, [str(w.message) for w in warned]
    return str(warned[0].message)


def test_an_unwritable_cache_warns_once_and_reads_go_on(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, _, server = http_dataset
    (tmp_path / "file").write_text("not a directory")  # fails for root too, unlike chmod
    path = tmp_path / "file" / "cache"
    with (
        pytest.warns(ab.CacheWarning) as record,
        ab.Loader(url, batch_size=4, seq_len=SEQ, cache=path) as loader,
    ):
        check_epoch(loader, tokens)
        before = server.requests
        check_epoch(loader, tokens)
        assert server.requests > before  # nothing cached: read from the server
    assert str(path) in only_cache_warning(record)


def remove_tree(path: Path) -> None:
    """rmtree, again while a writer adds files to a folder being removed."""
    for _ in range(50):
        try:
            shutil.rmtree(path)
            return
        except OSError:
            time.sleep(0.01)
    raise AssertionError(f"could not remove {path}")


def test_a_cache_deleted_while_running_warns_once_and_reads_go_on(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, _, _ = http_dataset
    path = tmp_path / "cache"
    cache = ab.DiskCache(path, block_size=BLOCK)
    with (
        pytest.warns(ab.CacheWarning) as record,
        ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache, prefetch=2) as loader,
    ):
        batches = iter(loader)
        first = next(batches)
        remove_tree(path)
        expected = expected_windows(tokens, first.global_indexes, SEQ)
        np.testing.assert_array_equal(first["tokens"].numpy(), expected)
        for batch in batches:
            expected = expected_windows(tokens, batch.global_indexes, SEQ)
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
        check_epoch(loader, tokens)
    assert "cannot be written" in only_cache_warning(record)
    assert not path.exists()  # not created again behind the user's back


def test_a_full_disk_warns_once_and_reads_go_on(
    http_dataset: tuple[str, Path, RangeHTTPServer], tmp_path: Path
) -> None:
    url, _, _ = http_dataset
    # Files may not grow past 2 KiB in the child: every 4 KiB block's write fails half-way.
    args = {"url": url, "cache": str(tmp_path / "cache"), "block_size": BLOCK, "limit": 2048}
    result = child_result(run_child("full", **args))
    assert result["sha256"] == uncached_digest(url)
    assert len(result["warnings"]) == 1 and "File too large" in result["warnings"][0]
    # Only what fits was cached (the small manifest); no failed write left a file.
    assert all(entry.stat().st_size <= 2048 for entry in entries(tmp_path / "cache"))
    assert not temporaries(tmp_path / "cache")


# --- integrity of entries --------------------------------------------------------------


@pytest.mark.parametrize("verify", ["block", "full"])
def test_a_corrupt_entry_is_never_delivered(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
    verify: str,
) -> None:
    url, _, server = http_dataset
    path = tmp_path / "cache"
    cache = ab.DiskCache(path, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache, verify=verify) as loader:
        check_epoch(loader, tokens)
    shard = f"{url}/{ab.open_dataset(url).manifest.shards[0].path}"
    entry = entry_dir(cache, shard) / "1"
    good = entry.read_bytes()
    with entry.open("r+b") as file:  # one flipped bit, same length
        file.seek(100)
        file.write(bytes([good[100] ^ 1]))
    before = server.requests
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache, verify=verify) as loader:
        check_epoch(loader, tokens)
    assert server.requests > before  # read again from the server
    assert entry.read_bytes() == good  # and cached again


def test_an_entry_of_the_wrong_length_is_a_miss(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    url, folder, _ = http_dataset
    path = tmp_path / "cache"
    cache = ab.DiskCache(path, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
        check_epoch(loader, tokens)
        for file in entries(path):
            with file.open("r+b") as handle:
                handle.truncate(file.stat().st_size - 1)
        misses = cache.misses
        check_epoch(loader, tokens)
        assert cache.misses > misses
    ab.open_dataset(url, cache=cache)  # the manifest's entry, read again
    assert check_entries(cache, url, folder) == len(entries(path))


# --- command line ----------------------------------------------------------------------


def test_cli_info_and_clear(
    tmp_path: Path, tokens: npt.NDArray[np.uint16], capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "ds")
    ab.write_tokens(url, tokens, shard_size=16_000)
    path = tmp_path / "cache"
    cache = ab.DiskCache(path, max_bytes=10**6, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
        check_epoch(loader, tokens)
    count = len(entries(path))
    assert cli.main(["cache", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"entries     {count}\n" in out and "objects     4\n" in out  # 3 shards, manifest
    assert f"bytes used  {sum(p.stat().st_size for p in entries(path))}\n" in out
    assert "max bytes   1000000 bytes" in out and f"block size  {BLOCK}" in out
    assert cli.main(["cache", "clear", str(path)]) == 0
    assert "bytes freed" in capsys.readouterr().out
    assert not entries(path)
    assert cli.main(["cache", "info", str(path)]) == 0
    assert "entries     0\n" in capsys.readouterr().out
    assert cli.main(["cache", "info", str(tmp_path / "nothing")]) == 1
    assert "no cache at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["cache", "--help"])
    assert "4194304 bytes" in capsys.readouterr().out


def test_an_object_changed_under_a_loader_is_refused_at_its_next_miss(
    http_dataset: tuple[str, Path, RangeHTTPServer],
    tokens: npt.NDArray[np.uint16],
    tmp_path: Path,
) -> None:
    """A loader reads one version of each object: the cache serves the version it first
    saw, and when a block must be fetched again (evicted here, the cache holding only two)
    from an object that changed meanwhile, the run fails with ShardChangedError instead of
    caching the new bytes under the old version."""
    url, folder, _ = http_dataset
    cache = ab.DiskCache(tmp_path / "cache", max_bytes=2 * BLOCK, block_size=BLOCK)
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=cache) as loader:
        check_epoch(loader, tokens)
        shard = folder / "shard-00000.bin"
        changed = np.fromfile(shard, dtype=np.uint8) ^ 0xFF
        changed.tofile(shard)
        os.utime(shard, ns=(1, 1))  # another ETag, as any rewrite gives
        with pytest.raises(ShardChangedError, match="shard-00000.bin"):
            check_epoch(loader, tokens)


@pytest.mark.parametrize("verify", ["size", "off"])
def test_fetched_blocks_are_checked_against_the_manifest_before_they_are_kept(
    http_dataset: tuple[str, Path, RangeHTTPServer], tmp_path: Path, verify: str
) -> None:
    """Bytes that disagree with the manifest's block checksums are never cached (nor
    delivered), at the default level too; verify="off" is the one way to skip the check."""
    url, folder, _ = http_dataset
    shard = folder / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    path = tmp_path / "cache"
    with ab.Loader(url, batch_size=4, seq_len=SEQ, cache=path, verify=verify) as loader:
        if verify == "off":
            assert sum(1 for _ in loader) == len(loader)
            return
        with pytest.raises(ab.ChecksumError, match=r"block 1 \(bytes \[4096, 8192\)\).*-00001"):
            for _ in loader:
                pass
    # Shards 0 and 2 hold 16,000 and 8,022 bytes: shard 1's 16,000 were never kept.
    assert cache_info(path).bytes_used <= 16_000 + 8_022
