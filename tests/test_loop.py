"""One event loop per loader: the URL opened on it, every run a task on it, the stores and
threads of the first run kept for the next; an AsyncLoader's stores bound to their loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import asyncbatch_threads, expected_windows

import asyncbatch as ab
from asyncbatch._errors import StoreError
from asyncbatch.stores._local import LocalStore

ARGS: dict[str, Any] = dict(batch_size=4, seq_len=50, shuffle=True, seed=2, prefetch=4)


@pytest.fixture
def url(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> str:
    return ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000).url


class Counted(LocalStore):
    """Local files under ``counted://`` URLs; counts the stores made and closed, and fails
    the data reads while ``Counted.failing`` is set."""

    made = 0
    closed = 0
    failing = False

    def __init__(self) -> None:
        super().__init__()
        Counted.made += 1

    async def size(self, url: str) -> int:
        return await super().size(url.removeprefix("counted://"))

    async def stat(self, url: str) -> ab.stores.ObjectInfo:
        return await super().stat(url.removeprefix("counted://"))

    async def read_into(self, urls: list[str], *args: Any) -> None:
        if Counted.failing:
            raise StoreError("injected store failure", urls[0])
        await super().read_into([url.removeprefix("counted://") for url in urls], *args)

    async def read_windows(self, urls: list[str], *args: Any) -> bool:
        if Counted.failing:
            raise StoreError("injected store failure", urls[0])
        return await super().read_windows([url.removeprefix("counted://") for url in urls], *args)

    async def close(self) -> None:
        await super().close()
        Counted.closed += 1


@pytest.fixture
def counted(url: str) -> ab.Dataset:
    Counted.made = Counted.closed = 0
    Counted.failing = False
    ab.register_store("counted", lambda scheme, options, *, max_inflight: Counted(), clobber=True)
    local = ab.open_dataset(url)
    return ab.Dataset("counted://" + local.url, local.manifest)


def test_epochs_share_one_loop_its_thread_and_the_stores(
    url: str, counted: ab.Dataset, tokens: npt.NDArray[np.uint16]
) -> None:
    """Opened from a URL on its own thread, the loader reads every epoch (and a resume) on
    that thread, through the stores of its first run: a new epoch starts no loop thread and
    opens no store; close() closes them and stops the thread."""
    with ab.Loader(url, **ARGS) as loader:
        opened_on = [t.ident for t in asyncbatch_threads() if t.name == "asyncbatch-loader"]
        assert len(opened_on) == 1  # the URL was opened on the loader's loop
        for _ in range(3):
            for batch in loader:
                want = expected_windows(tokens, batch.global_indexes, 50)
                np.testing.assert_array_equal(batch["tokens"].numpy(), want)
            loops = [t.ident for t in asyncbatch_threads() if t.name == "asyncbatch-loader"]
            assert loops == opened_on
    assert asyncbatch_threads() == []
    with ab.Loader(counted, **ARGS) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        next(loader)
        loader.load_state_dict(loader.state_dict())  # a resume: the run under way stops
        next(loader)
        assert (Counted.made, Counted.closed) == (1, 0)
    assert (Counted.made, Counted.closed) == (1, 1)


def test_a_failed_run_leaves_the_stores_usable(counted: ab.Dataset) -> None:
    """A store error ends the run; the next for loop reads through the same stores."""
    with ab.Loader(counted, **ARGS) as loader:
        Counted.failing = True
        with pytest.raises(StoreError, match="injected"):
            next(loader)
        Counted.failing = False
        assert sum(1 for _ in loader) == len(loader)
        assert (Counted.made, Counted.closed) == (1, 0)


def test_an_async_loader_keeps_its_stores_in_its_loop_and_reopens_in_another(
    counted: ab.Dataset,
) -> None:
    """Runs in one loop share its stores; a run in a second asyncio.run opens its own, and
    the first loop's closed as that loop ended; nothing is left once aclose() returns."""
    loader = ab.AsyncLoader(counted, **ARGS)

    async def epoch() -> int:
        return sum([1 async for _ in loader])

    async def two_epochs() -> int:
        return await epoch() + await epoch()

    assert asyncio.run(two_epochs()) == 2 * len(loader)
    assert (Counted.made, Counted.closed) == (1, 1)  # closed as asyncio.run ended
    assert asyncio.run(epoch()) == len(loader)
    assert Counted.made == 2
    asyncio.run(loader.aclose())
    assert (Counted.made, Counted.closed) == (2, 2)
    assert asyncbatch_threads() == []


def test_the_thread_of_a_loader_collected_after_its_epoch_stops(url: str) -> None:
    """Dropped between runs (no run reading ahead): no warning, and its thread stops."""
    loader = ab.Loader(url, **ARGS)
    for _ in loader:
        pass
    thread = next(t for t in asyncbatch_threads() if t.name == "asyncbatch-loader")
    del loader
    thread.join(10)
    assert not thread.is_alive()
