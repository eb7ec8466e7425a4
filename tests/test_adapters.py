"""A small third-party adapter gets the whole stack, by every registration route."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import pytest
from conftest import expected_windows
from fsspec.implementations.memory import MemoryFileSystem
from plugin.abtest_adapter import DirTransport

import asyncbatch as ab
from asyncbatch._errors import (
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    RetriesExhaustedError,
    ShardChangedError,
    ShortReadError,
    StoreError,
)
from asyncbatch._manifest import MANIFEST_NAME
from asyncbatch.stores import ObjectInfo, Progress, open_store
from asyncbatch.stores._stack import stacked

FAST = ab.RetryPolicy(max_attempts=4, base_delay=0.0, max_delay=0.001)


class FaultyTransport(DirTransport):
    """The example adapter with one fault on shard reads (never on the manifest)."""

    def __init__(self, fault: str, calls: list[str]) -> None:
        super().__init__()
        self.fault = fault
        self.calls = calls

    async def get_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes]:
        if url.endswith(MANIFEST_NAME):
            return await super().get_ranges(url, starts=starts, ends=ends)
        self.calls.append(url)
        if self.fault == "short":
            return [c[:-1] for c in await super().get_ranges(url, starts=starts, ends=ends)]
        if self.fault == "missing":
            raise FileNotFoundError(2, "No such file", self.path(url))
        if self.fault == "denied":
            raise PermissionError(13, "Permission denied", self.path(url))
        if self.fault == "bug":
            raise ValueError("a bug in the adapter")
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "reset" and len(self.calls) <= 2:  # the first two calls only
            raise ConnectionResetError(104, "Connection reset by peer")
        return await super().get_ranges(url, starts=starts, ends=ends)


def _read_all(url: str) -> list[Any]:
    with ab.Loader(url, batch_size=4, seq_len=50, prefetch=1, retry=FAST) as loader:
        return list(loader)


@pytest.fixture
def dataset(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> Path:
    ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=5_000)
    return tmp_path / "ds"


def _register(fault: str) -> tuple[str, list[str]]:
    scheme = f"faulty-{fault}"
    calls: list[str] = []
    ab.register_store(
        scheme, lambda s, o, *, max_inflight: FaultyTransport(fault, calls), clobber=True
    )
    return scheme, calls


@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [
        ("short", ShortReadError, r"returned \d+ of \d+ bytes"),
        ("missing", NotFoundError, "not found"),
        ("denied", PermissionDeniedError, "permission denied"),
        ("bug", StoreError, "ValueError: a bug in the adapter"),
    ],
)
def test_an_adapters_faults_are_typed_errors(
    dataset: Path, fault: str, error: type[StoreError], match: str
) -> None:
    scheme, calls = _register(fault)
    with pytest.raises(error, match=match) as caught:
        _read_all(f"{scheme}://{dataset}")
    assert caught.value.url.startswith(f"{scheme}://{dataset}/")
    assert len(calls) == len(set(calls))  # no read retried: no attempt can fix these


def test_an_adapters_short_read_names_the_range(dataset: Path) -> None:
    scheme, _ = _register("short")
    with pytest.raises(ShortReadError) as caught:
        _read_all(f"{scheme}://{dataset}")
    error = caught.value
    assert error.start is not None and error.end is not None
    assert f"[{error.start}, {error.end})" in str(error)


def test_an_adapters_reset_connection_is_retried(
    dataset: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    scheme, calls = _register("reset")
    batches = _read_all(f"{scheme}://{dataset}")
    assert len(calls) > 2  # the two resets, then the reads that succeeded
    seen = np.concatenate([b.global_indexes for b in batches])
    assert sorted(seen.tolist()) == list(range(len(tokens) // 50))
    for batch in batches:
        np.testing.assert_array_equal(
            batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 50)
        )


@pytest.mark.timeout(30)
def test_an_adapter_that_hangs_times_out_and_is_retried(dataset: Path) -> None:
    scheme, calls = _register("hang")
    policy = ab.RetryPolicy(
        max_attempts=2,
        base_delay=0.0,
        max_delay=0.001,
        connect_timeout=0.1,
        first_byte_timeout=0.1,
        idle_timeout=0.1,
    )
    url = f"{scheme}://{dataset}"
    with (
        ab.Loader(url, batch_size=4, seq_len=50, prefetch=1, shuffle=False, retry=policy) as loader,
        pytest.raises(
            RetriesExhaustedError, match=r"after 2 attempts, each: no answer within 0.3 s"
        ),
    ):
        next(loader)
    assert len(calls) == 2


def test_a_transport_needs_ranges_and_stat() -> None:
    ab.register_store("notatransport", lambda s, o, *, max_inflight: object(), clobber=True)
    with pytest.raises(ConfigError, match="needs get_ranges"):
        open_store("notatransport://x")


def test_a_read_only_transport_refuses_writes(tmp_path: Path) -> None:
    ab.register_store("readonlydir", lambda s, o, *, max_inflight: DirTransport(), clobber=True)

    async def main() -> None:
        store = open_store(f"readonlydir://{tmp_path}")
        try:
            with pytest.raises(StoreError, match="cannot write"):
                await store.write(f"readonlydir://{tmp_path}/x", b"x")
        finally:
            await store.close()

    asyncio.run(main())


def test_a_missing_dataset_on_a_transport_that_cannot_list_is_not_found(tmp_path: Path) -> None:
    ab.register_store("twomethods", lambda s, o, *, max_inflight: DirTransport(), clobber=True)
    url = f"twomethods://{tmp_path}/no-such-dataset"
    with pytest.raises(NotFoundError, match="no dataset at twomethods://") as caught:
        ab.open_dataset(url)
    assert caught.value.url == f"{url}/manifest.json"
    assert "no manifest" in str(caught.value)


@pytest.mark.timeout(120)
def test_an_installed_entry_point_registers_its_scheme(
    tmp_path: Path, dataset: Path, tokens: npt.NDArray[np.uint16], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real install into a directory of its own: a dist-info with the entry point.
    source = shutil.copytree(Path(__file__).parent / "plugin", tmp_path / "src")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
        + ["--no-build-isolation", "--target", str(target), str(source)],
        check=True,
        timeout=100,
    )
    assert list(target.glob("abtest_adapter-*.dist-info/entry_points.txt"))
    monkeypatch.syspath_prepend(str(target))
    with ab.Loader(f"dirplug://{dataset}", batch_size=5, seq_len=40, shuffle=False) as loader:
        batch = next(loader)
    np.testing.assert_array_equal(
        batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 40)
    )
    assert ab.stores.registered_stores["dirplug"] == "abtest_adapter:dir_store"


class _RegisteredFS(MemoryFileSystem):
    """An fsspec filesystem known only through ``fsspec.register_implementation``."""

    protocol = ("abtestfs",)
    store: dict[str, Any] = {}  # its own objects, not the memory filesystem's
    pseudo_dirs = [""]


def test_a_filesystem_registered_with_fsspec_is_served(tokens: npt.NDArray[np.uint16]) -> None:
    fsspec.register_implementation("abtestfs", _RegisteredFS, clobber=True)
    assert "abtestfs" not in fsspec.available_protocols()  # the case this route covers
    ab.write_tokens("abtestfs://root/ds", tokens, shard_size=4_000)
    with ab.Loader("abtestfs://root/ds", batch_size=3, seq_len=60) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 60)
            )
    assert _RegisteredFS.store  # the objects went to the registered class
    with pytest.raises(ConfigError, match="needs two slashes"):
        open_store("abtestfs:/root/ds")


def test_the_adapter_page_shows_the_tested_adapter() -> None:
    root = Path(__file__).parent.parent
    page = (root / "docs" / "adapters.md").read_text()
    code = (root / "tests" / "plugin" / "abtest_adapter.py").read_text()
    assert f"```python\n{code}```" in page
    assert f"```toml\n{(root / 'tests' / 'plugin' / 'pyproject.toml').read_text()}```" in page


class VersionedTransport:
    """Objects in a dict, each with a version that every read tells (an ETag on each
    answer); it sends nothing as a precondition, so only the stack's comparison stands."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.sent: list[str | None] = []

    async def get_versioned_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], version: str | None
    ) -> tuple[list[bytes], str | None]:
        self.sent.append(version)
        data, current = self.objects[url]
        return [data[s:e] for s, e in zip(starts, ends, strict=True)], current

    async def stat(self, url: str) -> ObjectInfo:
        data, current = self.objects[url]
        return ObjectInfo(len(data), current)


def test_reads_that_tell_a_version_are_compared_with_the_pin() -> None:
    transport = VersionedTransport()
    transport.objects["v://a"] = (b"0123456789", "v1")

    async def main() -> None:
        store = stacked(transport, FAST)
        buffer = memoryview(bytearray(4))
        await store.read_ranges("v://a", starts=[2], ends=[6], buffers=[buffer])  # pins v1
        assert bytes(buffer) == b"2345"
        transport.objects["v://a"] = (b"abcdefghij", "v2")
        with pytest.raises(ShardChangedError, match="version v1 when first seen, v2 now") as caught:
            await store.read_ranges("v://a", starts=[0], ends=[4], buffers=[buffer])
        assert caught.value.url == "v://a"
        await store.close()

    asyncio.run(main())
    assert transport.sent == [None, "v1"]  # the pin goes back in as the precondition


class ResumingTransport:
    """A resumable transport whose first attempt at each range breaks off halfway with a
    reset connection, as a broken HTTP body does."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[tuple[int, int]] = []

    async def read_range(
        self,
        url: str,
        *,
        start: int,
        end: int,
        buffer: memoryview,
        progress: Progress,
        version: str | None,
    ) -> None:
        first = start + progress.got
        self.asked.append((first, end))
        progress.version = "v1"
        stop = end if progress.got else first + (end - first) // 2
        buffer[progress.got : stop - start] = self.data[first:stop]
        progress.got = stop - start
        if stop < end:
            raise ConnectionResetError("reset by peer")

    async def stat(self, url: str) -> ObjectInfo:
        return ObjectInfo(len(self.data), "v1")


def test_a_resumable_transport_is_asked_only_for_the_missing_tail() -> None:
    data = bytes(range(200))
    transport = ResumingTransport(data)

    async def main() -> list[bytes]:
        store = stacked(transport, FAST)
        buffers = [bytearray(100), bytearray(50)]
        await store.read_ranges(
            "r://a", starts=[0, 120], ends=[100, 170], buffers=[memoryview(b) for b in buffers]
        )
        await store.close()
        return [bytes(b) for b in buffers]

    assert asyncio.run(main()) == [data[:100], data[120:170]]
    assert sorted(transport.asked) == [(0, 100), (50, 100), (120, 170), (145, 170)]


class SlotTransport(ResumingTransport):
    """:class:`ResumingTransport` over several objects (``o://<n>``, the same bytes), that
    counts the reads in flight and the tasks alive during them; ``missing`` answers
    ``FileNotFoundError`` (not retried)."""

    max_inflight = 3

    def __init__(self, data: bytes, missing: str = "") -> None:
        super().__init__(data)
        self.missing = missing
        self.inflight = self.most = self.most_tasks = 0
        #: Reads asked for after ``missing`` failed (the other slots' last steps).
        self.after_error: list[str] = []
        self.failed = False

    async def read_range(self, url: str, **kwargs: Any) -> None:
        if self.failed:
            self.after_error.append(url)
        if url == self.missing:
            self.failed = True
            raise FileNotFoundError(url)
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        self.most_tasks = max(self.most_tasks, len(asyncio.all_tasks()))
        try:
            await asyncio.sleep(0)
            await super().read_range(url, **kwargs)
        finally:
            self.inflight -= 1


def test_a_group_over_a_resumable_transport_reads_in_its_max_inflight_slots() -> None:
    """Every range of a 60-range group over 5 objects arrives whole (each resumed on its
    own), with never more than the transport's ``max_inflight`` reads, nor tasks for
    more, alive at once; a range that fails for good stops the group."""
    from asyncbatch.stores._ranged import read_by_ranges

    data = bytes(range(256)) * 4
    rng = np.random.default_rng(0)
    which = rng.integers(0, 5, 60).astype(np.int64)
    starts = rng.integers(0, 900, 60).astype(np.int64)
    ends = starts + rng.integers(2, 100, 60)  # ResumingTransport halves each: 2 bytes at least
    ends[::10] = starts[::10]  # and some empty ones, asked for nothing
    at = np.cumsum(ends - starts) - (ends - starts)
    urls = [f"o://{n}" for n in range(5)]

    async def read(transport: SlotTransport) -> npt.NDArray[np.uint8]:
        store = stacked(transport, FAST)
        dest = np.zeros(int((ends - starts).sum()), dtype=np.uint8)
        try:
            await read_by_ranges(store, urls, which, starts, ends, dest, at)
        finally:
            await store.close()
        return dest

    transport = SlotTransport(data)
    dest = asyncio.run(read(transport))
    for start, end, where in zip(starts.tolist(), ends.tolist(), at.tolist(), strict=True):
        assert dest[where : where + end - start].tobytes() == data[start:end]
    assert transport.most == SlotTransport.max_inflight
    assert transport.most_tasks <= SlotTransport.max_inflight + 1  # the slots and main()
    assert len(transport.asked) == 2 * int((ends > starts).sum())  # a break, then the tail

    failing = SlotTransport(data, missing="o://2")
    with pytest.raises(NotFoundError):
        asyncio.run(read(failing))
    assert failing.inflight == 0  # the others cancelled and awaited
    assert len(failing.after_error) < SlotTransport.max_inflight  # their last steps only
    assert len(failing.asked) < len(transport.asked) // 2  # the group stopped there
