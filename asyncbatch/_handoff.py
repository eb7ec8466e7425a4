"""The bounded queue between the engine (an event loop) and the consumer.

Capacity counts batches from the moment the engine starts reading them until the consumer
takes them, so memory stays bounded by ``prefetch`` batches whatever the consumer's speed.
The queue also counts bytes: the buffers of groups being read (with their scratch) and of
batches ready, so the bound can be checked in bytes as well (``peak_bytes``).
The engine side is async and never blocks its loop; the consumer side is either a plain
thread (:meth:`get`, waiting in short slices so Ctrl-C gets through) or a coroutine in the
engine's own loop (:meth:`aget`). Threads are only woken when the other side is waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: How long a waiting consumer sleeps before it checks for signals (Ctrl-C) again.
WAIT_SLICE = 0.1


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    capacity: int
    #: Batches reserved now: being read, or ready and not yet taken.
    reserved: int
    ready: int
    #: The most batches ever reserved at once; never more than ``capacity``.
    peak_reserved: int
    #: Bytes held now: buffers being read or decoded (with their scratch), and batches ready.
    bytes: int = 0
    #: The most bytes ever held at once.
    peak_bytes: int = 0


@dataclass(frozen=True, slots=True)
class LoaderStatistics(QueueStatistics):
    """The prefetch queue of the current (or last) run, and counts over the loader's life.

    ``requests`` and ``bytes_fetched`` are the byte ranges the storage itself was asked for
    (below any cache); ``bytes_delivered`` is what the batches taken hold as stored (before a
    ``dtype`` conversion), so ``bytes_fetched / bytes_delivered`` is the read amplification.
    """

    batches: int = 0
    requests: int = 0
    bytes_fetched: int = 0
    bytes_delivered: int = 0
    #: Blocks served by, or fetched into, the node-local cache (0 without ``cache=``).
    cache_hits: int = 0
    cache_misses: int = 0
    #: Samples ``decode=`` left out of their batches (``on_error="skip"``), read ahead too.
    skipped_samples: int = 0


@dataclass(slots=True)
class DeliveryCounts:
    """Batches taken by the consumer, and their bytes as stored; written by the consumer."""

    batches: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Final:
    """The last item of a run: the end of the epoch, or the error that stopped it."""

    error: BaseException | None = None


class BatchQueue:
    """Bounded hand-off of batches from one event loop to one consumer."""

    def __init__(
        self,
        capacity: int,
        loop: asyncio.AbstractEventLoop,
        delivered: DeliveryCounts | None = None,
        byte_bound: int | None = None,
    ) -> None:
        self.capacity = capacity
        #: With it, the capacity drops (never below 2) to as many batches as fit in it, by
        #: the largest batch put so far: decoded batches, whose size no plan knows ahead.
        self.byte_bound = byte_bound
        self._loop = loop
        #: Counts of the batches taken, kept by the caller across runs.
        self.delivered = delivered if delivered is not None else DeliveryCounts()
        self._items: deque[tuple[Any, int, int]] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._reserved = 0
        self._peak = 0
        self._bytes = 0
        self._peak_bytes = 0
        self._space_waiter: asyncio.Future[None] | None = None
        self._space_wanted = 0  # slots the waiting producer needs
        self._item_waiter: asyncio.Future[None] | None = None
        self._taken_waiter: asyncio.Future[None] | None = None  # see taken()

    async def reserve(self, count: int = 1) -> None:
        """Wait for ``count`` free slots (at most ``capacity``) and take them (engine side)."""
        count = min(count, self.capacity)
        while True:
            with self._lock:
                if self._reserved + count <= self.capacity:
                    self._reserved += count
                    self._peak = max(self._peak, self._reserved)
                    return
                waiter = self._space_waiter = self._loop.create_future()
                self._space_wanted = count
            await waiter

    async def taken(self) -> None:
        """Wait until the consumer has taken every batch queued (engine side)."""
        with self._lock:
            if not self._items:
                return
            waiter = self._taken_waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            with self._lock:
                if self._taken_waiter is waiter:
                    self._taken_waiter = None

    def add_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, if negative) bytes held by the engine (engine side).

        Bytes of a group being read are counted here; once the group's batches are put, the
        same bytes belong to them and leave the count as the consumer takes each one.
        """
        with self._lock:
            self._bytes += nbytes
            self._peak_bytes = max(self._peak_bytes, self._bytes)

    def put(self, item: Any) -> None:
        """Append a batch (holding a reserved slot) or a :class:`Final` (engine side)."""
        self.put_many((item,))

    def put_many(
        self,
        items: Iterable[Any],
        release: int = 0,
        stored: Iterable[int] | None = None,
        sizes: Iterable[int] | None = None,
    ) -> None:
        """Append several items at once, waking the consumer once (engine side).

        The batches' bytes are counted from now on, and ``release`` bytes the engine counted
        while reading them (:meth:`add_bytes`) no longer are. ``stored[i]`` is what item
        ``i`` held in the store, counted as delivered when it is taken; ``sizes[i]``, if
        given, its bytes as :func:`item_bytes` counts them (known to the engine per group).
        """
        items = list(items)
        stored = [0] * len(items) if stored is None else list(stored)
        # Each item is queued with its bytes, counted once here rather than again when taken.
        counted = [item_bytes(item) for item in items] if sizes is None else list(sizes)
        sized = list(zip(items, counted, stored, strict=True))
        nbytes = sum(counted) - release
        with self._lock:
            if self.byte_bound is not None and counted:
                fits = self.byte_bound // max(1, max(counted))
                self.capacity = max(2, min(self.capacity, fits))
            self._items.extend(sized)
            self._bytes += nbytes
            self._peak_bytes = max(self._peak_bytes, self._bytes)
            self._not_empty.notify()
            waiter, self._item_waiter = self._item_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pop(self) -> tuple[Any, list[asyncio.Future[None]]]:
        """Pop the head (lock held) and free its slot; the producer's waiters to wake."""
        item, nbytes, stored = self._items.popleft()
        if not isinstance(item, Final):
            self._reserved -= 1
            self._bytes -= nbytes
            self.delivered.batches += 1
            self.delivered.bytes += stored
        wake = []
        # Wake the producer only once it can take the whole group it waits for.
        waiter = self._space_waiter
        if waiter is not None and self._reserved + self._space_wanted <= self.capacity:
            self._space_waiter = None
            wake.append(waiter)
        if self._taken_waiter is not None and not self._items:
            wake.append(self._taken_waiter)
            self._taken_waiter = None
        return item, wake

    def get(self, alive: Callable[[], bool] = lambda: True) -> Any:
        """Next item, for a consumer in another thread; ``alive()`` false means none will come."""
        with self._lock:
            while not self._items:
                if not alive():
                    raise RuntimeError("the asyncbatch engine thread stopped without a result")
                self._not_empty.wait(WAIT_SLICE)
            item, wake = self._pop()
        for waiter in wake:
            self._loop.call_soon_threadsafe(_wake, waiter)
        return item

    async def aget(self) -> Any:
        """Next item, for a consumer running in the engine's loop."""
        while True:
            with self._lock:
                if self._items:
                    item, wake = self._pop()
                    break
                item_waiter = self._item_waiter = self._loop.create_future()
            await item_waiter
        for waiter in wake:
            _wake(waiter)
        return item

    def statistics(self) -> QueueStatistics:
        with self._lock:
            ready = sum(1 for item, _, _ in self._items if not isinstance(item, Final))
            return QueueStatistics(
                self.capacity, self._reserved, ready, self._peak, self._bytes, self._peak_bytes
            )


def item_bytes(item: Any) -> int:
    """Bytes of a batch's fields; 0 for anything that is not a batch."""
    fields = getattr(item, "fields", None)
    return fields_bytes(fields) if isinstance(fields, Mapping) else 0


def fields_bytes(fields: Mapping[str, Any]) -> int:
    """Bytes of decoded fields: arrays and tensors count their ``nbytes``, a jagged column
    its values and offsets, anything else nothing."""
    return sum(_value_bytes(value) for value in fields.values())


def _value_bytes(value: Any) -> int:
    if value is None:
        return 0
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return sum(_value_bytes(getattr(value, part, None)) for part in ("values", "offsets"))


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
