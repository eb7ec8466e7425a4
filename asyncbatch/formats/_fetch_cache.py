"""Index pieces fetched through the engine by key, shared and kept within a byte budget.

A format that reads its index piece by piece as batches need it (documents' index pages,
Megatron ``.idx`` pages, WebDataset sidecar tables) asks a :class:`FetchCache` for the
pieces of a batch. Pieces cached are returned at once (and become the most recently used);
a piece another batch is fetching is waited for, not fetched twice; the rest are fetched
together by the format's own ``fetch`` generator, in this batch's steps. Pieces a batch
asks for are *held* while it obtains them (with ``hold=True`` until it releases them):
eviction drops the least recently used pieces not held until the cache is within its
budget, so the bound is exceeded only by the pieces batches are using.

A failed fetch caches nothing: its error is raised in the batch that fetched and in every
batch waiting for it. A fetch that was stopped (its batch cancelled) cancels its futures,
and the batches waiting for it fetch the pieces themselves.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from ._base import Step, Wait


class Sized(Protocol):
    """A piece: what it costs the budget."""

    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Sized)
#: Fetches pieces by key (all of them, or raises), in a batch's steps.
Fetcher = Callable[[list[K]], Generator[Step, Any, dict[K, V]]]


class FetchCache(Generic[K, V]):
    """Pieces by key, at most ``budget`` bytes of them kept (bar those held by batches);
    ``evicted(key, piece)`` is called for each piece dropped."""

    def __init__(self, budget: int, evicted: Callable[[K, V], None] | None = None) -> None:
        self.budget = budget
        self._evicted = evicted
        self._cache: OrderedDict[K, V] = OrderedDict()
        self._cached_bytes = 0
        #: Fetches under way, settled by the batch that fetches them.
        self._loading: dict[K, Future[V]] = {}
        #: How many batches hold each piece (cached or not yet).
        self._held: dict[K, int] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into a worker process: pieces and fetches under way stay behind.
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cached_bytes=0, _loading={}, _held={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pid=os.getpid())

    @property
    def cached_bytes(self) -> int:
        """Bytes of the pieces kept now."""
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def touch(self, keys: Iterable[K]) -> None:
        """Mark the cached pieces ``keys`` the most recently used, fetching nothing."""
        move = self._cache.move_to_end
        for key in keys:
            move(key)

    def obtain(
        self, keys: Sequence[K], fetch: Fetcher[K, V], *, hold: bool = False
    ) -> Generator[Step, Any, dict[K, V]]:
        """The pieces ``keys`` (unique), fetching with ``fetch`` those neither cached nor
        being fetched. With ``hold``, they stay cached until :meth:`release` (call it
        however the batch ends); else they are released on return."""
        if self._pid != os.getpid():  # a forked child: no one here settles the parent's
            self._loading, self._held, self._pid = {}, {}, os.getpid()
        held = self._held
        for key in keys:
            held[key] = held.get(key, 0) + 1
        obtained = False
        try:
            got = yield from self._obtain(keys, fetch)
            obtained = True
        finally:
            if not (obtained and hold):
                self.release(keys)
        return got

    def _obtain(self, keys: Sequence[K], fetch: Fetcher[K, V]) -> Generator[Step, Any, dict[K, V]]:
        cache, loading = self._cache, self._loading
        table: dict[K, V] = {}
        todo: Iterable[K] = keys
        while todo:
            missing: list[K] = []
            waiting: dict[K, Future[V]] = {}
            for key in todo:
                value = cache.get(key)
                if value is not None:
                    cache.move_to_end(key)
                    table[key] = value
                elif key in loading:
                    waiting[key] = loading[key]
                else:
                    missing.append(key)
            if missing:
                table.update((yield from self._fetch(missing, fetch)))
            if waiting:
                yield Wait(tuple(waiting.values()))
            todo = []
            for key, future in waiting.items():
                if future.cancelled():  # the batch fetching it was stopped: fetch it here
                    todo.append(key)
                    continue
                error = future.exception()
                if error is not None:
                    raise error
                table[key] = future.result()
        return table

    def _fetch(self, keys: list[K], fetch: Fetcher[K, V]) -> Generator[Step, Any, dict[K, V]]:
        futures: dict[K, Future[V]] = {key: Future() for key in keys}
        self._loading.update(futures)
        try:
            got = yield from fetch(keys)
            values = [got[key] for key in keys]  # a piece not fetched fails every waiter
        except BaseException as exc:
            # Stopped (cancelled, or the generator closed): the waiters fetch it themselves.
            for key, future in futures.items():
                del self._loading[key]
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            raise
        for key, value in zip(keys, values, strict=True):
            del self._loading[key]
            futures[key].set_result(value)
            if key not in self._cache:
                self._cache[key] = value
                self._cached_bytes += value.nbytes
        self._evict()
        return got

    def release(self, keys: Iterable[K]) -> None:
        """Let go of ``keys`` (held by :meth:`obtain`), then evict down to the budget."""
        held = self._held
        for key in keys:
            count = held.get(key, 0) - 1
            if count > 0:
                held[key] = count
            else:
                held.pop(key, None)
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used pieces not held until within the budget."""
        excess = self._cached_bytes - self.budget
        if excess <= 0:
            return
        dropped: list[K] = []
        for key, value in self._cache.items():
            if key not in self._held:
                dropped.append(key)
                excess -= value.nbytes
                if excess <= 0:
                    break
        for key in dropped:
            value = self._cache.pop(key)
            self._cached_bytes -= value.nbytes
            if self._evicted is not None:
                self._evicted(key, value)
