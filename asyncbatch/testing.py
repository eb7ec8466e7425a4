"""A conformance suite for store transports, to run in an adapter's own pytest.

Subclass :class:`StoreConformance` and give it a ``store_kit`` fixture returning a
:class:`StoreKit`: how to open the store and how to put objects where it reads them::

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store_kit(self, tmp_path):
            return StoreKit(open=MyTransport, url=..., put=...)

Every test runs the transport under the registry's guards
(:func:`~asyncbatch.stores._stack.stacked`), as a :class:`~asyncbatch.Loader` would, in a
fresh event loop with a time limit of its own, so a hang fails instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pytest

from ._errors import NotFoundError, PermissionDeniedError, ShardChangedError, ShortReadError
from .stores._base import ObjectInfo, ReadsTail, Store, Versioned
from .stores._stack import stacked

__all__ = ["StoreConformance", "StoreKit"]

T = TypeVar("T")

#: Seconds any one test may run (a hung read fails the test).
TIME_LIMIT = 60.0
#: Seconds threads started during a test get to end after the store closed.
SETTLE = 10.0


@dataclass
class StoreKit:
    """What the suite needs from the store under test.

    ``open()`` returns the transport (or ``asyncbatch.stores.open_store(url)``); it is
    called inside the test's event loop. ``url(name)`` is the URL of object ``name``;
    ``put(name, data)`` creates or replaces it out of band (as another writer would).
    ``deny(name)``, if given, makes the store refuse object ``name`` (it exists); without
    it the denied-object test is skipped.
    """

    open: Callable[[], object]
    url: Callable[[str], str]
    put: Callable[[str, bytes], None]
    deny: Callable[[str], None] | None = None


def _data(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(size)


async def _read(store: Store, url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    buffers = [memoryview(bytearray(end - start)) for start, end in ranges]
    await store.read_ranges(
        url, starts=[s for s, _ in ranges], ends=[e for _, e in ranges], buffers=buffers
    )
    return [bytes(b) for b in buffers]


async def _stat(store: Store, url: str) -> ObjectInfo:
    if isinstance(store, Versioned):
        return await store.stat(url)
    return ObjectInfo(await store.size(url), None)


def _run(kit: StoreKit, body: Callable[[Store], Awaitable[T]]) -> T:
    """``body(store)`` in a new event loop; the store is closed after, whatever happens."""

    async def main() -> T:
        store = stacked(kit.open())
        try:
            return await asyncio.wait_for(body(store), TIME_LIMIT)
        finally:
            await store.close()

    return asyncio.run(main())


class StoreConformance:
    """The tests every store transport passes; subclass it with a ``store_kit`` fixture."""

    def test_stat_tells_the_size(self, store_kit: StoreKit) -> None:
        store_kit.put("stat", _data(1000))
        info = _run(store_kit, lambda s: _stat(s, store_kit.url("stat")))
        assert info.size == 1000
        assert info.version is None or isinstance(info.version, str)

    def test_ranges_are_end_exclusive(self, store_kit: StoreKit) -> None:
        data = _data(10_000, 1)
        store_kit.put("ranges", data)
        ranges = [(0, 1), (1, 2), (9_999, 10_000), (123, 4_567), (0, 10_000), (5_000, 5_001)]
        got = _run(store_kit, lambda s: _read(s, store_kit.url("ranges"), ranges))
        assert got == [data[start:end] for start, end in ranges]

    def test_empty_ranges_read_nothing(self, store_kit: StoreKit) -> None:
        data = _data(1000, 2)
        store_kit.put("empty", data)
        ranges = [(0, 0), (500, 500), (1000, 1000), (10, 20)]
        got = _run(store_kit, lambda s: _read(s, store_kit.url("empty"), ranges))
        assert got == [b"", b"", b"", data[10:20]]

    @pytest.mark.parametrize(("start", "end"), [(990, 1010), (1000, 1001), (2000, 3000)])
    def test_a_range_past_the_end_is_a_short_read(
        self, store_kit: StoreKit, start: int, end: int
    ) -> None:
        store_kit.put("short", _data(1000, 3))
        url = store_kit.url("short")
        with pytest.raises(ShortReadError) as caught:
            _run(store_kit, lambda s: _read(s, url, [(0, 10), (start, end)]))
        assert caught.value.url == url

    def test_a_missing_object_is_not_found(self, store_kit: StoreKit) -> None:
        url = store_kit.url("never-written")
        with pytest.raises(NotFoundError, match="never-written"):
            _run(store_kit, lambda s: s.size(url))
        with pytest.raises(NotFoundError, match="never-written"):
            _run(store_kit, lambda s: _read(s, url, [(0, 1)]))

    def test_a_denied_object_is_permission_denied(self, store_kit: StoreKit) -> None:
        if store_kit.deny is None:
            pytest.skip("this store kit cannot deny an object")
        store_kit.put("denied", _data(100, 4))
        store_kit.deny("denied")
        url = store_kit.url("denied")
        with pytest.raises(PermissionDeniedError, match="denied"):
            _run(store_kit, lambda s: _read(s, url, [(0, 10)]))

    def test_many_concurrent_reads(self, store_kit: StoreKit) -> None:
        data = _data(1 << 20, 5)
        store_kit.put("concurrent", data)
        url = store_kit.url("concurrent")
        rng = np.random.default_rng(6)
        starts = rng.integers(0, len(data) - 4096, 64).tolist()
        ranges = [(start, start + 1 + start % 4096) for start in starts]

        async def body(store: Store) -> list[list[bytes]]:
            return await asyncio.gather(*(_read(store, url, [r]) for r in ranges))

        got = _run(store_kit, body)
        assert [chunks[0] for chunks in got] == [data[s:e] for s, e in ranges]

    def test_cancelling_a_read_leaks_nothing(self, store_kit: StoreKit) -> None:
        data = _data(16 << 20, 7)
        store_kit.put("cancel", data)
        url = store_kit.url("cancel")
        # Garbage of earlier tests (their closed sockets) is collected before the check,
        # which then warns only of what this read leaves behind.
        gc.collect()
        threads = set(threading.enumerate())

        async def body(store: Store) -> bytes:
            read = asyncio.ensure_future(_read(store, url, [(0, len(data))]))
            # One turn of the loop: the read has started and waits on its I/O. (A longer
            # sleep let a loaded machine finish the read first: nothing left to cancel.)
            await asyncio.sleep(0)
            assert not read.done(), "a 16 MiB read finished at once: nothing to cancel"
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            # The store still works after a cancelled read.
            return (await _read(store, url, [(1, 100)]))[0]

        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            assert _run(store_kit, body) == data[1:100]
            gc.collect()
        # A server in this process (a test's HTTP server) may still be finishing the
        # cancelled response on a thread of its own: give new threads a moment to end. A
        # thread the store left behind (a pool, a loop) stays alive and fails the check.
        deadline = time.monotonic() + SETTLE
        for thread in set(threading.enumerate()) - threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t for t in set(threading.enumerate()) - threads if t.is_alive()]
        assert not left, f"threads left running after close: {left}"

    def test_a_changed_object_is_never_mixed(self, store_kit: StoreKit) -> None:
        old, new = _data(4000, 8), _data(4000, 9)
        store_kit.put("changed", old)
        url = store_kit.url("changed")

        async def body(store: Store) -> None:
            info = await _stat(store, url)
            assert (await _read(store, url, [(0, 4000)]))[0] == old
            store_kit.put("changed", new + b"!")
            if info.version is not None:  # a store that tells versions pins the first
                with pytest.raises(ShardChangedError, match="changed"):
                    await _stat(store, url)
            try:
                again = (await _read(store, url, [(0, 4000)]))[0]
            except ShardChangedError:
                return
            assert again in (old, new), "a read mixed two versions of the object"

        _run(store_kit, body)

    def test_large_reads(self, store_kit: StoreKit) -> None:
        data = _data(10 << 20, 10)
        store_kit.put("large", data)
        ranges = [(0, 8 << 20), (1, (8 << 20) + 1), (2 << 20, 10 << 20)]
        got = _run(store_kit, lambda s: _read(s, store_kit.url("large"), ranges))
        assert got == [data[s:e] for s, e in ranges]

    def test_reads_into_one_buffer(self, store_kit: StoreKit) -> None:
        first, second = _data(5000, 11), _data(3000, 12)
        store_kit.put("into-a", first)
        store_kit.put("into-b", second)
        urls = [store_kit.url("into-a"), store_kit.url("into-b")]
        which = np.array([0, 0, 1, 1], dtype=np.int64)
        starts = np.array([0, 4000, 10, 2999], dtype=np.int64)
        ends = np.array([10, 5000, 20, 3000], dtype=np.int64)
        offsets = np.array([0, 10, 1010, 1020], dtype=np.int64)

        async def body(store: Store) -> bytes | None:
            if not store.supports_read_into:
                return None
            dest = np.zeros(1021, dtype=np.uint8)
            await store.read_into(urls, which, starts, ends, dest, offsets)
            past = np.array([4990], dtype=np.int64), np.array([5010], dtype=np.int64)
            with pytest.raises(ShortReadError):
                await store.read_into(urls, which[:1], *past, np.zeros(20, np.uint8), offsets[:1])
            return dest.tobytes()

        got = _run(store_kit, body)
        if got is None:
            pytest.skip("this store does not read into one buffer")
        assert got == first[:10] + first[4000:] + second[10:20] + second[2999:]

    def test_reads_a_tail_with_its_size_and_version(self, store_kit: StoreKit) -> None:
        data, changed = _data(5000, 13), _data(5001, 14)
        store_kit.put("tail", data)
        store_kit.put("tail-empty", b"")
        url, empty = store_kit.url("tail"), store_kit.url("tail-empty")

        async def body(store: Store) -> list[tuple[bytes, ObjectInfo]] | None:
            if not isinstance(store, ReadsTail):
                return None
            got = [await store.read_tail(url, n) for n in (100, 5000, 10_000)]
            got.append(await store.read_tail(empty, 100))
            got.append((b"", await _stat(store, url)))  # the version stat pinned
            info = got[0][1]
            store_kit.put("tail", changed)
            if info.version is not None:  # pinned by the tail read, as by stat
                with pytest.raises(ShardChangedError, match="changed"):
                    await store.read_tail(url, 100)
            return [(bytes(tail), info) for tail, info in got]

        got = _run(store_kit, body)
        if got is None:
            pytest.skip("this store does not read tails")
        stat = got.pop()[1]
        assert got == [
            (data[-100:], stat),  # shorter than the object
            (data, stat),  # exactly its length
            (data, stat),  # longer: the whole object
            (b"", ObjectInfo(0, got[3][1].version)),
        ]
