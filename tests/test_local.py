"""The local store (``stores/_local.py``): the C copy helpers and their guard against bus
errors, windows gathered across shards, files kept and checked across runs, local I/O errors
retried or not, stats in one thread job."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import expected_windows

import asyncbatch as ab
from asyncbatch._errors import (
    ConfigError,
    NotFoundError,
    ShortReadError,
)
from asyncbatch.stores import _local as local_store
from asyncbatch.stores._local import LocalStore

# The C helper's mapped copies, each in a child process: if the SIGBUS guard failed, the child
# would die of the signal and the test fail, instead of the whole test run dying with it.
COPY_CHILD = """
import os, sys
import numpy as np
from asyncbatch.stores import _preadv
path = sys.argv[1]
with open(path, "wb") as file:
    file.write(bytes(range(256)) * 64)  # 16 KiB: four pages
fd = os.open(path, os.O_RDONLY)
base = _preadv.map_file(fd, 16384)
one = lambda *v: np.array(v, dtype=np.int64)
dest = np.zeros(8192, dtype=np.uint8)
copy = lambda limits, offsets, lengths, at: _preadv.copy_many(
    one(*[base] * len(limits)), one(*limits), one(*offsets), one(*lengths), dest, one(*at)
)
print(copy([16384, 16384], [0, 300], [100, 50], [0, 100]))
assert bytes(dest[:150]) == (bytes(range(256)) * 2)[:100] + (bytes(range(256)) * 2)[300:350]
print(copy([16000], [15990], [100], [0]))  # past the end of the map
os.truncate(path, 4096)  # the file shrinks under its mapping
print(copy([16384, 16384], [0, 8192], [10, 100], [0, 10]))
print(copy([16384], [100], [10], [0]))  # the guard is ready for the next copy
_preadv.unmap_file(base, 16384)
os.close(fd)
if sys.argv[2] == "outside":  # a bus error outside a copy still ends the process
    os.truncate(path, 16384)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=(16384,))
    os.truncate(path, 0)
    print(int(mapped[8192]))
"""


def _copy_child(tmp_path: Path, case: str) -> Any:
    import subprocess
    import sys

    from asyncbatch.stores import _local as local

    if local._preadv is None:
        pytest.skip("the C helper was not built")
    return subprocess.run(
        [sys.executable, "-c", COPY_CHILD, str(tmp_path / "blob"), case],
        capture_output=True,
        text=True,
        timeout=60,
    )


GATHER_CHILD = """
import os, sys
import numpy as np
from asyncbatch.stores import _preadv
one = lambda *v: np.array(v, dtype=np.int64)
tokens = np.arange(1000, 1100, dtype=np.uint16)
# Shards of 30, 0 (empty), 5, 65 tokens behind headers of 8, 0, 2 and 4096 bytes.
counts, headers = [30, 0, 5, 65], [8, 0, 2, 4096]
bases, limits, fds, at = [], [], [], 0
for k, (count, header) in enumerate(zip(counts, headers)):
    path = os.path.join(sys.argv[1], f"s{k}")
    with open(path, "wb") as file:
        file.write(b"h" * header + tokens[at : at + count].tobytes())
    at += count
    fds.append(os.open(path, os.O_RDONLY))
    size = os.fstat(fds[-1]).st_size
    bases.append(_preadv.map_file(fds[-1], size))
    limits.append(size)
ends = np.cumsum(counts)
def gather(starts, window, limit=None, convert=None, out=2):
    dest = np.zeros(len(starts) * window * out, dtype=np.uint8)
    extra = () if convert is None else (convert,)
    got = _preadv.gather(one(*bases), one(*(limit or limits)), ends, one(*headers), 2,
                         one(*starts), window, dest, *extra)
    return got, dest
got, dest = gather([0, 25, 28, 95, 40], 5)  # 25, 28: across the empty shard; 28: three shards
assert got[0] == 5, got
want = np.concatenate([tokens[s : s + 5] for s in (0, 25, 28, 95, 40)])
assert (dest.view(np.uint16) == want).all()
got, dest = gather([3, 27, 90], 10, convert="u2>i8", out=8)
assert got[0] == 3, got
want = np.concatenate([tokens[s : s + 10] for s in (3, 27, 90)]).astype(np.int64)
assert (dest.view(np.int64) == want).all()
print(gather([0, 50], 5, limit=[68, 0, 12, 4130])[0])  # shard 3 holds 17 of its 65 tokens
print(gather([0, 50], 5, limit=[68, 0, 12, -1])[0])  # shard 3 not mapped
os.truncate(os.path.join(sys.argv[1], "s3"), 10)  # shrinks under its mapping: bus errors
print(gather([0, 60], 5)[0])
for bad in ([96], [-1]):
    try:
        gather(bad, 5)
    except ValueError as exc:
        print(exc)
"""


def _mapped(path: Path) -> int:
    """How many mappings of ``path`` this process holds."""
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip().endswith(str(path)) for line in maps)


def _open_paths() -> set[str]:
    """What this process's descriptors point at."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.float32])
@pytest.mark.parametrize("mode", ["mmap", "pread", "python"])
def test_local_reads_with_and_without_the_c_helper(
    mode: str,
    dtype: torch.dtype | None,
    tmp_path: Path,
    tokens: npt.NDArray[np.uint16],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncbatch import _engine as engine
    from asyncbatch.stores import _local as local

    if mode == "python":
        monkeypatch.setattr(local, "_preadv", None)
    else:
        assert local._preadv is not None, "the C helper was not built"
        # With the helper, a dtype is converted in the store's copy, never cast afterwards.
        cast_after = engine._cast_off_loop

        async def no_cast_after(buffer: npt.NDArray[np.uint8], convert: Any) -> Any:
            assert convert is None, "cast after the read"
            return await cast_after(buffer, convert)

        monkeypatch.setattr(engine, "_cast_off_loop", no_cast_after)
    ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000)
    dataset = ab.open_dataset(str(tmp_path / "ds"), storage_options={"mmap": mode == "mmap"})
    # Mapped, each group's windows are copied in one call of the C helper (read_windows).
    # With pread, in order, next-token windows overlap: every read is merged and copied out
    # in pieces (converted as they are copied with a dtype); shuffled, most land in place.
    for shuffle in (True, False):
        with ab.Loader(
            dataset,
            batch_size=5,
            seq_len=33,
            next_token=True,
            prefetch=8,
            shuffle=shuffle,
            dtype=dtype,
        ) as loader:
            for batch in loader:
                got = batch["tokens"]
                assert got.dtype == (dtype or torch.uint16)
                expected = expected_windows(tokens, batch.global_indexes, 33, True)
                np.testing.assert_array_equal(got.numpy(), expected)
    if dtype is not None:
        return
    Path(dataset.shard_urls[2]).write_bytes(b"\0" * 10)
    with (
        # verify="off": the read loop's own length check must catch it.
        ab.Loader(dataset, batch_size=5, seq_len=33, shuffle=False, verify="off") as loader,
        pytest.raises(ShortReadError, match=r"shard-00002.bin bytes \[\d+, \d+\) returned"),
    ):
        for _ in loader:
            pass


def test_c_helper_converts_while_it_copies() -> None:
    from asyncbatch.stores import _copying as copying
    from asyncbatch.stores import _local as local

    if local._preadv is None:
        pytest.skip("the C helper was not built")
    source = np.arange(-300, 300, dtype=np.int16)
    raw = np.concatenate([np.zeros(1, np.uint8), source.view(np.uint8)])  # values unaligned
    for target in (np.int32, np.int64, np.float32, np.float64):
        dest = np.zeros(20, dtype=target)
        name = copying.c_conversion(np.dtype(np.int16), np.dtype(target))
        assert name is not None
        offsets = np.array([1 + 2 * 5, 1 + 2 * 590], dtype=np.int64)
        at = np.array([0, 10 * dest.itemsize], dtype=np.int64)
        lengths = np.array([20, 20], dtype=np.int64)
        copying.copy_pieces(raw, offsets, lengths, dest.view(np.uint8), at, name)
        np.testing.assert_array_equal(dest, np.r_[source[5:15], source[590:600]])
    # uint16 to int32 / int64 runs vector loops (one per instruction set, each version this
    # CPU runs checked): outputs that start off their alignment and lengths that are not a
    # multiple of their width take the scalar head and tail.
    tokens = np.arange(60_000, 60_000 + 64, dtype=np.uint16)
    versions = local._preadv.conversion_versions()
    assert {"u2>i4:c", "u2>i8:c"} <= set(versions)
    for target in (np.int32, np.int64):
        name = copying.c_conversion(np.dtype(np.uint16), np.dtype(target))
        assert name is not None
        cases = [(0, 64, 0), (3, 29, 1), (1, 17, 3), (2, 61, 5)]
        mine = [v for v in versions if v.startswith(f"{name}:")]
        for version, (first, count, at) in [(v, case) for v in mine for case in cases]:
            dest = np.zeros(70, dtype=target)
            copying.copy_pieces(
                tokens.view(np.uint8),
                np.array([2 * first], dtype=np.int64),
                np.array([2 * count], dtype=np.int64),
                dest.view(np.uint8),
                np.array([at * dest.itemsize], dtype=np.int64),
                version,
            )
            expected = np.zeros(70, dtype=target)
            expected[at : at + count] = tokens[first : first + count]
            np.testing.assert_array_equal(dest, expected)
    # Only casts that keep every value: none narrows, none drops a sign.
    assert copying.c_conversion(np.dtype(np.uint16), np.dtype(np.int16)) is None
    assert copying.c_conversion(np.dtype(np.int16), np.dtype(np.uint64)) is None
    assert copying.c_conversion(np.dtype(">u2"), np.dtype(np.int64)) is None
    dest8 = np.zeros(4, dtype=np.int64).view(np.uint8)
    one = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="no conversion u2>i2"):
        local._preadv.copy_many(one, one + 8, one, one + 2, dest8, one, "u2>i2")
    with pytest.raises(ValueError, match="outside"):  # 5 values of 8 bytes do not fit in 32
        local._preadv.copy_many(one + raw.ctypes.data, one + 20, one, one + 10, dest8, one, "u2>i8")


def test_c_helper_refuses_ranges_outside_the_buffer(tmp_path: Path) -> None:
    from asyncbatch.stores import _local as local

    if local._preadv is None:
        pytest.skip("the C helper was not built")
    path = tmp_path / "blob"
    path.write_bytes(bytes(100))
    fd = os.open(path, os.O_RDONLY)
    try:
        fds = np.array([fd], dtype=np.int32)
        dest = np.zeros(10, dtype=np.uint8)
        one = np.array([0], dtype=np.int64)
        with pytest.raises(ValueError, match="outside"):
            local._preadv.read_many(fds, one, np.array([11], dtype=np.int64), dest, one)
        with pytest.raises(ValueError, match="outside"):
            local._preadv.read_many(fds, one, np.array([5], dtype=np.int64), dest, one + 6)
        done, got, error = local._preadv.read_many(
            fds, np.array([95], dtype=np.int64), np.array([10], dtype=np.int64), dest, one
        )
        assert (done, got, error) == (0, 5, 0)  # a short read at the end of the file
    finally:
        os.close(fd)


def test_mmap_option_is_checked(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> None:
    ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000)
    with pytest.raises(ConfigError, match="mmap must be True or False, got 'no'"):
        ab.open_dataset(str(tmp_path / "ds"), storage_options={"mmap": "no"})


def test_mapped_copies_stop_at_the_map_end_and_survive_truncation(tmp_path: Path) -> None:
    child = _copy_child(tmp_path, "inside")
    assert child.returncode == 0, child.stderr
    assert child.stdout.split("\n")[:4] == [
        "(2, 0, 0)",  # both copies done
        "(0, 10, 0)",  # 10 bytes of 100 left in the map: read 0 stops short after 10
        "(1, 0, -1)",  # read 1 lies past the new end of the file: a bus error, caught
        "(1, 0, 0)",  # and the guard is ready for the next copy
    ]


def test_bus_errors_outside_a_copy_still_end_the_process(tmp_path: Path) -> None:
    import signal

    child = _copy_child(tmp_path, "outside")
    assert child.returncode == -signal.SIGBUS, (child.returncode, child.stderr)


def test_gather_plans_and_copies_windows_across_shards(tmp_path: Path) -> None:
    """The C helper's one-call windows: found by binary search, across shard ends (an empty
    shard and three shards included), converted in the copy; a short or shrunk file, or a
    shard not mapped, stops with where; a window outside the elements is a ValueError."""
    import subprocess
    import sys

    from asyncbatch.stores import _local as local

    if local._preadv is None:
        pytest.skip("the C helper was not built")
    child = subprocess.run(
        [sys.executable, "-c", GATHER_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split("\n")[:5] == [
        "(1, 3, 4126, 4136, 0)",  # window 1: bytes [4126, 4136) of shard 3, past its 4130
        "(1, 3, 4126, 4136, -2)",  # shard 3 not mapped
        "(1, 3, 4146, 4156, -1)",  # a bus error in shard 3: it shrank under its mapping
        "gather: window 0 (elements 96 + 5) outside the 100 elements",
        "gather: window 0 (elements -1 + 5) outside the 100 elements",
    ]


@pytest.mark.parametrize("dtype", [None, torch.int64])
def test_windows_longer_than_shards(
    tmp_path: Path, tokens: npt.NDArray[np.uint16], dtype: torch.dtype | None
) -> None:
    """Windows that span three or more shards read exactly through the mapped path, in
    order and shuffled, and the loader counts one read per window."""
    dataset = ab.write_tokens(str(tmp_path / "ds"), tokens[:600], shard_size=7)  # 86 shards
    for shuffle in (False, True):
        with ab.Loader(dataset, batch_size=5, seq_len=20, shuffle=shuffle, dtype=dtype) as loader:
            batches = list(loader)
            stats = loader.statistics()
        seen = np.concatenate([b.global_indexes for b in batches])
        assert sorted(seen.tolist()) == list(range(600 // 20))
        for batch in batches:
            expected = expected_windows(tokens, batch.global_indexes, 20)
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
        assert stats.requests == 600 // 20
        assert stats.bytes_fetched == stats.bytes_delivered == 600 * 2


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "pread"])
def test_file_truncated_under_its_mapping_is_shard_changed(tmp_path: Path, mapped: bool) -> None:
    """A file truncated in place between two reads: copied from its mapping (a bus error
    caught in the copy) or, read a few ranges at a time and never mapped, with ``pread``
    (a short read): either way a ShardChangedError naming both sizes."""
    from asyncbatch._errors import ShardChangedError
    from asyncbatch.stores._local import LocalStore

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 256)

    async def main() -> None:
        store = LocalStore(mmap=True)
        try:
            buffer = bytearray(100)
            view = [memoryview(buffer)]
            # Many ranges at once: the file is mapped for them (a few reads use pread).
            count = 32 if mapped else 4
            many = [memoryview(bytearray(10)) for _ in range(count)]
            starts = list(range(0, count * 1000, 1000))
            ends = [s + 10 for s in starts]
            await store.read_ranges(str(path), starts=starts, ends=ends, buffers=many)
            assert (store._files._fds[str(path)][3] == 65536) == mapped
            await store.read_ranges(str(path), starts=[20000], ends=[20100], buffers=view)
            assert bytes(buffer) == (bytes(range(256)) * 256)[20000:20100]
            os.truncate(path, 4096)  # in place: same inode, the mapping stays
            with pytest.raises(ShardChangedError, match=r"blob was inode \d+, 65536 bytes"):
                await store.read_ranges(str(path), starts=[20000], ends=[20100], buffers=view)
        finally:
            await store.close()

    asyncio.run(main())


def test_a_loader_keeps_its_mapped_files_across_runs(tmp_path: Path) -> None:
    """Consecutive ``for`` loops over one Loader read through the same descriptors and
    mappings (no new mmap, no new first-touch faults); close() releases them."""
    tokens = np.arange(6000, dtype=np.uint16)
    dataset = ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000)
    shard = Path(dataset.shard_urls[0])
    base = _mapped(shard)
    with ab.Loader(dataset, batch_size=4, seq_len=16, seed=3) as loader:
        epochs = []
        for _ in range(3):
            epochs.append([b["tokens"].numpy().copy() for b in loader])
            # The run ended (its thread and pool are gone); the file stays open and mapped.
            assert loader.statistics() is not None
            assert _mapped(shard) == base + 1
        assert str(shard) in _open_paths()
    assert _mapped(shard) == base
    for batches in epochs:
        ids = np.concatenate([b[:, 0] for b in batches]) // 16
        expected = tokens[ids[:, None] * 16 + np.arange(16)]
        np.testing.assert_array_equal(np.concatenate(batches), expected)
    assert not np.array_equal(np.concatenate(epochs[0]), np.concatenate(epochs[1]))

    async def two_loops() -> None:
        async with ab.AsyncLoader(dataset, batch_size=4, seq_len=16) as async_loader:
            for _ in range(2):
                async for _batch in async_loader:
                    pass
                assert _mapped(shard) == base + 1

    asyncio.run(two_loops())
    assert _mapped(shard) == base


@pytest.mark.parametrize("change", ["replace", "truncate", "delete"])
def test_a_file_changed_between_runs_is_refused(tmp_path: Path, change: str) -> None:
    """A file kept open and mapped from an earlier run is checked against its path again:
    replaced (a new inode, the same size), truncated or deleted between two ``for`` loops,
    the next loop fails with ShardChangedError (or NotFoundError), never old bytes."""
    from asyncbatch._errors import NotFoundError, ShardChangedError

    dataset = ab.write_tokens(str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16))
    shard = dataset.shard_urls[0]
    with ab.Loader(dataset, batch_size=4, seq_len=16, shuffle=False) as loader:
        for _ in loader:
            pass
        if change == "replace":
            Path(f"{shard}.new").write_bytes(Path(shard).read_bytes()[::-1])
            os.replace(f"{shard}.new", shard)
        elif change == "truncate":
            os.truncate(shard, 4096)
        else:
            os.remove(shard)
        error = NotFoundError if change == "delete" else ShardChangedError
        with pytest.raises(error, match="shard-00000.bin"):
            next(loader)


def test_an_unclosed_loader_releases_its_kept_files_when_collected(tmp_path: Path) -> None:
    """A loader whose run ended but was never closed warns of nothing; collected, it
    closes the files and mappings it kept for its next run (and stops its thread)."""
    import gc

    dataset = ab.write_tokens(str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16))
    shard = Path(dataset.shard_urls[0])
    base = _mapped(shard)
    loader = ab.Loader(dataset, batch_size=4, seq_len=16)
    for _ in loader:
        pass
    assert _mapped(shard) == base + 1
    del loader
    gc.collect()
    assert _mapped(shard) == base
    assert str(shard) not in _open_paths()


def test_local_stats_of_one_turn_share_one_thread_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's first groups check every shard they touch at once: the local store stats them
    all in one job, and each caller still gets its own answer (a missing file: its error)."""
    urls = []
    for i in range(300):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * i)
        urls.append(str(path))
    jobs = []
    stat_paths = local_store._stat_paths

    def counted(urls: Sequence[str]) -> list[Any]:
        jobs.append(len(urls))
        return stat_paths(urls)

    monkeypatch.setattr(local_store, "_stat_paths", counted)

    async def main() -> list[Any]:
        store = LocalStore()
        try:
            missing = str(tmp_path / "missing")
            calls = [store.size(url) for url in [*urls, missing]] + [store.stat(urls[7])]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await store.close()

    *sizes, missing, info = asyncio.run(main())
    assert sizes == list(range(300))
    assert isinstance(missing, NotFoundError) and "missing" in str(missing)
    assert info.size == 7
    assert jobs == [302]


def test_resident_tells_pages_in_memory_from_those_not() -> None:
    """``_preadv.resident``: an anonymous mapping's untouched pages are not in memory, its
    written ones are."""
    import ctypes
    import mmap

    from asyncbatch.stores import _preadv

    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 8 * page)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))

        def resident(start: int, length: int) -> bool:
            one = np.array([base], dtype=np.int64)
            return _preadv.resident(one, np.array([start]), np.array([length]))

        area[0] = 1
        area[3 * page + 5] = 1
        assert resident(0, page) and resident(3 * page, page)
        assert resident(3 * page + 7, 10) and resident(0, 0)
        assert not resident(0, 2 * page) and not resident(5 * page, 1)
        area[page] = 1
        assert resident(0, 2 * page)
    finally:
        with contextlib.suppress(BufferError):  # the ctypes view may still hold it
            area.close()


def _counting_jobs(store: LocalStore, jobs: list[int]) -> None:
    """Record the ranges of each read job the store hands its threads."""
    submit = store._pool.submit

    def counted(fn: Any, *args: Any) -> Any:
        if fn == store._read_job:
            jobs.append(len(args[2]))
        return submit(fn, *args)

    store._pool.submit = counted  # type: ignore[method-assign]


async def _read_checked(
    store: LocalStore, urls: list[str], data: npt.NDArray[np.uint8], count: int, size: int
) -> None:
    """``count`` reads of ``size`` bytes spread over ``urls``, checked against ``data``."""
    which = np.arange(count, dtype=np.int64) * len(urls) // count  # each file's together
    starts = np.arange(count, dtype=np.int64) * 7919 % (data.size - size)
    dest = np.zeros(count * size, dtype=np.uint8)
    at = np.arange(count, dtype=np.int64) * size
    await store.read_into(urls, which, starts, starts + size, dest, at)
    for k in range(count):
        np.testing.assert_array_equal(
            dest[at[k] : at[k] + size], data[starts[k] : starts[k] + size]
        )


def _files(tmp_path: Path, count: int) -> tuple[list[str], npt.NDArray[np.uint8]]:
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    urls = []
    for i in range(count):
        (tmp_path / f"f{i}").write_bytes(data.tobytes())
        urls.append(str(tmp_path / f"f{i}"))
    return urls, data


def test_small_reads_of_pages_in_memory_are_made_without_a_thread(tmp_path: Path) -> None:
    """A few ranges of files open in this run whose bytes are in memory are read on the
    loop (``pread`` with ``RWF_NOWAIT``, the files not mapped); the first read of a file
    (which opens it) and larger reads go to a thread."""
    urls, data = _files(tmp_path, 2)
    jobs: list[int] = []

    async def main() -> None:
        store = LocalStore()
        _counting_jobs(store, jobs)
        try:
            for count, size in [(4, 100), (4, 100), (16, 4096), (17, 100), (2, 600_000)]:
                await _read_checked(store, urls, data, count, size)
        finally:
            await store.close()

    asyncio.run(main())
    # The first read opens the files on a thread; the next two are small; 17 ranges are
    # too many; 1.2 MB too much.
    assert jobs == [4, 17, 2]


def test_files_are_mapped_for_many_ranges_then_copied_from_on_the_loop(tmp_path: Path) -> None:
    """A few reads leave a file unmapped (``pread`` costs less than a mapping, its faults
    and its unmapping); a read of many ranges maps it, and later small reads of its pages
    in memory copy from that mapping on the loop."""
    urls, data = _files(tmp_path, 2)
    jobs: list[int] = []

    async def main() -> None:
        store = LocalStore()
        _counting_jobs(store, jobs)

        def mapped() -> list[bool]:
            return [store._files._fds[url][3] >= 0 for url in urls]

        try:
            await _read_checked(store, urls, data, 4, 100)
            assert mapped() == [False, False]
            await _read_checked(store, urls, data, 64, 100)
            assert mapped() == [True, True]
            await _read_checked(store, urls, data, 8, 4096)
        finally:
            await store.close()

    asyncio.run(main())
    assert jobs == [4, 64]


def test_a_small_read_of_bytes_not_in_memory_waits_on_a_thread(tmp_path: Path) -> None:
    """Bytes the page cache does not hold (dropped with ``POSIX_FADV_DONTNEED``) are never
    waited for on the loop: the ``RWF_NOWAIT`` read fails and a thread reads them."""
    import mmap

    from asyncbatch.stores import _preadv

    urls, data = _files(tmp_path, 1)
    jobs: list[int] = []
    starts = np.arange(4, dtype=np.int64) * 7919  # _read_checked's 4 reads of 100 bytes

    def drop_pages() -> bool:
        """Drop the file's pages from the page cache; whether those of the reads went."""
        fd = os.open(urls[0], os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            area = mmap.mmap(fd, data.size, prot=mmap.PROT_READ)
            try:
                view = np.frombuffer(area, dtype=np.uint8)
                base = np.full(4, view.__array_interface__["data"][0], dtype=np.int64)
                held = _preadv.resident(base, starts, np.full(4, 100, dtype=np.int64))
                del view
            finally:
                with contextlib.suppress(BufferError):
                    area.close()
        finally:
            os.close(fd)
        return not held

    async def main() -> None:
        store = LocalStore()
        _counting_jobs(store, jobs)
        try:
            await _read_checked(store, urls, data, 4, 100)  # opens the file
            if not drop_pages():
                pytest.skip("this filesystem keeps a file's pages in memory (tmpfs)")
            await _read_checked(store, urls, data, 4, 100)
            await _read_checked(store, urls, data, 4, 100)
        finally:
            await store.close()

    asyncio.run(main())
    # The second read met pages not in memory: a thread read them (and brought them back).
    assert jobs == [4, 4]


def test_a_file_stated_is_opened_so_its_first_small_read_needs_no_thread(tmp_path: Path) -> None:
    """A few files' ``stat`` (a loader's size check before its first read of each) opens
    them in the same job, so their first small reads of bytes in memory are made on the
    loop; many at once are only stated (opening thousands would churn the open files)."""
    urls, data = _files(tmp_path, 2)
    many = [str(tmp_path / f"g{i}") for i in range(2)]
    for url in many:
        Path(url).write_bytes(b"x")
    jobs: list[int] = []

    async def main() -> None:
        store = LocalStore(max_open_files=8)  # a job opens up to 8 // 4 files
        _counting_jobs(store, jobs)
        try:
            await asyncio.gather(*(store.stat(url) for url in urls))
            assert sorted(store._files._fds) == sorted(urls)
            await _read_checked(store, urls, data, 4, 100)
            assert jobs == []
            await asyncio.gather(*(store.stat(url) for url in [*many, *urls]))
            assert sorted(store._files._fds) == sorted(urls)
        finally:
            await store.close()

    asyncio.run(main())


# Every shape of one local read: one range, fewer ranges than threads or jobs, ranges larger
# than a job, many ranges (mapped), through the C helper (mapped or not) and pure Python.
READ_SHAPES = {
    "one small range": [(1, 0, 100)],
    "one range larger than a job": [(0, 10, 9000)],
    "fewer ranges than threads": [(0, 0, 3000), (1, 5, 7000), (2, 100, 2000)],
    "ranges larger than a job": [(0, 0, 6000), (0, 7000, 9000), (1, 1, 5000), (2, 0, 9500)],
    "one large range then small ones": [
        (0, 0, 9000),
        *[(1, i * 50, i * 50 + 10) for i in range(40)],
    ],
    "many small ranges": [(i % 3, i * 37, i * 37 + 29) for i in range(200)],
}


@pytest.mark.parametrize("shape", list(READ_SHAPES))
@pytest.mark.parametrize("mode", ["mmap", "pread", "python"])
def test_every_read_shape_reads_its_bytes(
    shape: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Jobs of 1 KiB so a few KiB of ranges split into more jobs than the ranges (8 MiB each by
    # default: the same shapes at real sizes).
    monkeypatch.setattr(local_store, "GATHER_JOB_BYTES", 1024)
    monkeypatch.setattr(local_store, "RANGES_PER_JOB", 4)
    if mode == "python":
        monkeypatch.setattr(local_store, "_preadv", None)
    rng = np.random.default_rng(0)
    files = [rng.integers(0, 256, 10_000, dtype=np.uint8) for _ in range(3)]
    urls = []
    for i, data in enumerate(files):
        (tmp_path / f"f{i}").write_bytes(data.tobytes())
        urls.append(str(tmp_path / f"f{i}"))
    ranges = np.array(READ_SHAPES[shape], dtype=np.int64).reshape(-1, 3)
    which, starts, ends = ranges.T.copy()
    lengths = ends - starts
    offsets = np.cumsum(lengths) - lengths
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)

    async def read() -> None:
        store = LocalStore(max_threads=4, mmap=mode == "mmap")
        try:
            await store.read_into(urls, which, starts, ends, dest, offsets)
        finally:
            await store.close()

    asyncio.run(read())
    expected = np.concatenate([files[w][s:e] for w, s, e in ranges.tolist()])
    np.testing.assert_array_equal(dest, expected)
