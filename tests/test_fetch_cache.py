"""FetchCache, the bounded cache of index pieces the paged formats share: batches that need
one piece share its fetch, the bytes kept stay within the budget (bar pieces held), and a
failed fetch is raised to every batch that waited for it and caches nothing."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

from asyncbatch.formats._base import Wait
from asyncbatch.formats._fetch_cache import FetchCache

Piece = np.ndarray[Any, np.dtype[np.uint8]]


class Fetches:
    """A fetch of pieces of ``size`` bytes (key k: bytes all k) in one step (a string, as
    a read would be), recording the keys each fetch asked for; fails with ``error`` if set."""

    def __init__(self, size: int = 10) -> None:
        self.size = size
        self.calls: list[list[int]] = []
        self.error: Exception | None = None

    def __call__(self, keys: list[int]) -> Generator[Any, Any, dict[int, Piece]]:
        self.calls.append(keys)
        yield f"read {keys}"
        if self.error is not None:
            raise self.error
        return {k: np.full(self.size, k, dtype=np.uint8) for k in keys}


def run(steps: Generator[Any, Any, Any]) -> Any:
    """Drive ``steps`` to its end, answering every step with None."""
    try:
        step = next(steps)
        while True:
            assert not isinstance(step, Wait), "nothing was being fetched"
            step = steps.send(None)
    except StopIteration as stop:
        return stop.value


def test_concurrent_batches_share_one_fetch() -> None:
    cache: FetchCache[int, Piece] = FetchCache(1000)
    fetch = Fetches()
    first = cache.obtain([1, 2], fetch)
    assert next(first) == "read [1, 2]"
    second = cache.obtain([2, 3], fetch)
    assert next(second) == "read [3]"  # 2 is being fetched: not asked for again
    wait = second.send(None)
    assert isinstance(wait, Wait) and not any(f.done() for f in wait.futures)
    with pytest.raises(StopIteration) as done:
        first.send(None)
    assert sorted(done.value.value) == [1, 2]
    assert all(f.done() for f in wait.futures)
    with pytest.raises(StopIteration) as done:
        second.send(None)
    got = done.value.value
    assert sorted(got) == [2, 3] and (got[2] == 2).all() and (got[3] == 3).all()
    assert fetch.calls == [[1, 2], [3]]
    assert sorted(run(cache.obtain([3, 1], fetch))) == [1, 3]  # cached: no fetch
    assert fetch.calls == [[1, 2], [3]] and cache.cached_bytes == 30


def test_bytes_stay_within_the_budget_least_recently_used_dropped_first() -> None:
    dropped: list[int] = []
    cache: FetchCache[int, Piece] = FetchCache(25, lambda key, _: dropped.append(key))
    fetch = Fetches()
    run(cache.obtain([1], fetch))
    run(cache.obtain([2], fetch))
    run(cache.obtain([1], fetch))  # 1 is now the most recently used
    run(cache.obtain([3], fetch))
    assert dropped == [2] and len(cache) == 2 and cache.cached_bytes == 20
    cache.touch([1])
    run(cache.obtain([4], fetch))
    assert dropped == [2, 3] and cache.cached_bytes == 20
    # Held pieces are kept over the budget until released, then dropped to it.
    held = cache.obtain([5, 6, 7], fetch, hold=True)
    run(held)
    assert cache.cached_bytes == 30 and dropped == [2, 3, 1, 4]
    run(cache.obtain([5], fetch))  # another batch's use does not release the hold
    assert cache.cached_bytes == 30
    cache.release([5, 6, 7])
    assert cache.cached_bytes == 20 and dropped == [2, 3, 1, 4, 6]
    assert [call for call in fetch.calls] == [[1], [2], [3], [4], [5, 6, 7]]


def test_a_failed_fetch_is_raised_to_every_waiter_and_not_cached() -> None:
    cache: FetchCache[int, Piece] = FetchCache(1000)
    fetch = Fetches()
    fetch.error = OSError("index unreadable")
    first = cache.obtain([1], fetch)
    next(first)
    second = cache.obtain([1], fetch)
    assert isinstance(next(second), Wait)
    with pytest.raises(OSError, match="index unreadable"):
        first.send(None)
    with pytest.raises(OSError, match="index unreadable"):
        second.send(None)
    assert len(cache) == 0 and cache.cached_bytes == 0
    fetch.error = None
    assert (run(cache.obtain([1], fetch))[1] == 1).all()  # fetched again
    assert fetch.calls == [[1], [1]]


def test_a_stopped_fetch_is_fetched_by_its_waiters() -> None:
    cache: FetchCache[int, Piece] = FetchCache(0)
    fetch = Fetches()
    first = cache.obtain([1], fetch, hold=True)
    next(first)
    second = cache.obtain([1], fetch)
    assert isinstance(next(second), Wait)
    first.close()  # its batch was cancelled
    assert second.send(None) == "read [1]"
    with pytest.raises(StopIteration):
        second.send(None)
    assert fetch.calls == [[1], [1]]
    assert cache.cached_bytes == 0  # nothing held any more: dropped to the budget
