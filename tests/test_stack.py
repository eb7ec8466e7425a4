"""The guards stacked over every transport (``stores/_stack.py``): exact lengths, ranges read
into buffers, retries (and no timeout on a local store's calls), what a store can do stated
through the layers."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import WriteDataset, expected_windows

import asyncbatch as ab
from asyncbatch._errors import (
    NotFoundError,
    RetriesExhaustedError,
    ShortReadError,
)
from asyncbatch._manifest import MANIFEST_NAME
from asyncbatch.stores import open_store, register_store
from asyncbatch.stores._local import LocalStore


def _truncate(
    store: str, url: str, nbytes: int, options: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Replace the object at ``url`` with its first ``nbytes`` bytes, behind the manifest's back."""
    if store == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        fs.pipe(url, fs.cat_file(url)[:nbytes])
        return
    if store == "http":
        root, server = request.getfixturevalue("http_root")
        path = root / url.removeprefix(server.url + "/")
    else:
        path = Path(url)
    path.write_bytes(path.read_bytes()[:nbytes])


class _FlakyLocalStore(LocalStore):
    """The local store with one transient ``EIO`` on its first shard read (as a parallel
    filesystem's hiccup surfaces), or every shard read ``delay`` seconds late."""

    def __init__(self, calls: list[str], delay: float = 0.0) -> None:
        super().__init__()
        self.calls = calls
        self.delay = delay

    async def _fault(self, urls: Sequence[str], which: npt.NDArray[np.int64]) -> None:
        url = urls[int(which[0])]
        if url.endswith(MANIFEST_NAME):
            return
        self.calls.append(url)
        if self.delay:
            await asyncio.sleep(self.delay)
        elif len(self.calls) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO), url)

    async def read_into(self, urls: Sequence[str], which: Any, *args: Any) -> None:
        await self._fault(urls, which)
        await super().read_into(urls, which, *args)

    async def read_windows(self, urls: Sequence[str], *args: Any) -> bool:
        await self._fault(urls, np.zeros(1, dtype=np.int64))
        return await super().read_windows(urls, *args)


@pytest.fixture
def flaky_file_store(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], list[str]]:
    """``flaky_file_store(delay)`` serves plain paths with :class:`_FlakyLocalStore` until
    the test ends, and returns the list of its shard reads."""
    from asyncbatch.stores import _registry as registry

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))

    def register(delay: float = 0.0) -> list[str]:
        calls: list[str] = []
        register_store(
            "file", lambda s, o, *, max_inflight: _FlakyLocalStore(calls, delay), clobber=True
        )
        return calls

    return register


def test_short_read_is_an_error(
    store: str,
    write_dataset: WriteDataset,
    tokens: npt.NDArray[np.uint16],
    request: pytest.FixtureRequest,
) -> None:
    url, options = write_dataset(tokens, shard_size=8000)
    dataset = ab.open_dataset(url, options)
    last = dataset.shard_urls[1]
    _truncate(store, last, 100, options, request)
    with (
        # verify="off": the store's own length check, not the size check, must catch it.
        ab.Loader(
            dataset, batch_size=4, seq_len=100, shuffle=False, prefetch=2, verify="off"
        ) as loader,
        pytest.raises(ShortReadError) as caught,
    ):
        for _ in loader:
            pass
    message = str(caught.value)
    assert last in message and "bytes [" in message
    assert caught.value.url == last


def test_read_ranges_into_buffers(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4)

    async def main() -> list[bytes]:
        store = open_store(str(path))
        buffers = [bytearray(3), bytearray(10), bytearray(0)]
        try:
            await store.read_ranges(
                str(path),
                starts=[0, 250, 1024],
                ends=[3, 260, 1024],
                buffers=[memoryview(b) for b in buffers],
            )
            with pytest.raises(ShortReadError, match=r"bytes \[1000, 1030\)"):
                await store.read_ranges(
                    str(path), starts=[1000], ends=[1030], buffers=[memoryview(bytearray(30))]
                )
        finally:
            await store.close()
        return [bytes(b) for b in buffers]

    assert asyncio.run(main()) == [bytes([0, 1, 2]), bytes(range(250, 256)) + bytes(range(4)), b""]


def test_the_stack_keeps_the_local_stores_capabilities(tmp_path: Path) -> None:
    """Stacked (and counted), the local store still reads groups into one buffer, converts
    as it copies, copies windows itself, reads tails and lists with sizes."""
    from asyncbatch.stores._base import ListsInfo, ReadsTail
    from asyncbatch.stores._counting import ReadCounts

    async def check() -> None:
        for counts in (None, ReadCounts()):
            store = open_store(str(tmp_path), counts=counts)
            try:
                capabilities = ("read_into", "convert", "windows")
                for capability in capabilities:
                    assert getattr(store, f"supports_{capability}"), capability
                for protocol in (ReadsTail, ListsInfo):
                    assert isinstance(store, protocol), protocol
                await store.write(str(tmp_path / "written"), b"x")  # it writes
            finally:
                await store.close()

    asyncio.run(check())


@pytest.mark.parametrize("dtype", [None, torch.int64])
def test_a_transient_local_io_error_is_retried(
    tmp_path: Path,
    tokens: npt.NDArray[np.uint16],
    flaky_file_store: Callable[[float], list[str]],
    dtype: torch.dtype | None,
) -> None:
    """A plain ``OSError`` (EIO) from a local read is retried by the stack, and the loader
    delivers exact bytes (int64: through the read that converts as it copies)."""
    dataset = ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000)
    calls = flaky_file_store(0.0)
    policy = ab.RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.001)
    extra: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    with ab.Loader(dataset, batch_size=4, seq_len=50, retry=policy, **extra) as loader:
        batches = list(loader)
    assert len(calls) > 1  # the failed read, then the reads that succeeded
    seen = np.concatenate([b.global_indexes for b in batches])
    assert sorted(seen.tolist()) == list(range(len(tokens) // 50))
    for batch in batches:
        expected = expected_windows(tokens, batch.global_indexes, 50)
        np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
        assert dtype is None or batch["tokens"].dtype == dtype


def test_a_missing_local_file_is_not_retried(tmp_path: Path) -> None:
    dataset = ab.write_tokens(str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16))
    os.remove(dataset.shard_urls[0])
    policy = ab.RetryPolicy(max_attempts=5, base_delay=1.0, max_delay=1.0)
    with (
        ab.Loader(dataset, batch_size=4, seq_len=16, retry=policy) as loader,
        pytest.raises(NotFoundError, match="shard-00000.bin") as caught,
    ):
        next(loader)
    assert not isinstance(caught.value, RetriesExhaustedError)


@pytest.mark.timeout(30)
def test_a_slow_local_read_is_not_cut_by_the_retry_timeouts(
    tmp_path: Path,
    tokens: npt.NDArray[np.uint16],
    flaky_file_store: Callable[[float], list[str]],
) -> None:
    """The local transport is unbounded: a group read slower than the whole-call bound of a
    remote request (here 0.3 s) completes, on its first attempt."""
    dataset = ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000)
    calls = flaky_file_store(0.5)
    policy = ab.RetryPolicy(
        max_attempts=1, connect_timeout=0.1, first_byte_timeout=0.1, idle_timeout=0.1
    )
    with ab.Loader(dataset, batch_size=4, seq_len=50, retry=policy, prefetch=1) as loader:
        batch = next(loader)
    np.testing.assert_array_equal(
        batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 50)
    )
    assert calls
