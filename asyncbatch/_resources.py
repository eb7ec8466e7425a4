"""What an engine's runs read through, opened once per event loop and kept across runs.

The first run of an engine in a loop opens one store per scheme and options of its datasets
(a mixture may read several) and the threads that decode and transform (and, with
``decode=``, the pool that decodes samples: :mod:`asyncbatch._decode`); the next runs in that
loop (epochs, ``for`` loops, resumes) read through the same ones, so a new epoch opens no
store and starts no thread. The stores are bound to the loop (a client session is): a task
of that loop holds them, and closes them (and the threads) when it is cancelled, by the
engine's ``aclose()`` or by the loop's own end (``asyncio.run`` cancels every task left), so
they are closed in their own loop whoever stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._dataset import Dataset
from ._decode import OrderedPool
from .stores import open_store
from .stores._base import ObjectInfo, Store
from .stores._checked import Expected
from .stores._counting import ReadCounts
from .stores._disk_cache import DiskCache
from .stores._registry import scheme_of
from .stores._retry import RetryPolicy


@dataclass(eq=False)
class StoreStack:
    """The layers every store of an engine's runs is built with, as the loader assembled
    them: requests in flight, retries, read counts, the node-local cache, and what the
    checks layer verifies of each shard (None: nothing). The engine opens its stores through
    :meth:`open` and knows none of these layers itself."""

    max_inflight: int
    retry: RetryPolicy | None = None
    counts: ReadCounts | None = None
    cache: DiskCache | None = None
    expected: Expected | None = None
    #: What the cache has stat'ed, kept across runs: later epochs read hits without a HEAD.
    seen: dict[str, ObjectInfo] = field(default_factory=dict)

    def open(
        self, url: str, storage_options: Mapping[str, Any], pins: Mapping[str, str] | None
    ) -> Store:
        """A store of this stack for ``url``'s scheme, in the running loop."""
        return open_store(
            url,
            storage_options,
            max_inflight=self.max_inflight,
            retry=self.retry,
            counts=self.counts,
            cache=self.cache,
            seen=self.seen,
            expected=self.expected,
            pins=pins,
        )


class Resources:
    """The stores and threads of one engine in one loop; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        datasets: Sequence[Dataset],
        shard_dataset: npt.NDArray[np.int64],
        *,
        stack: StoreStack,
        decodes: bool,
        transforms: bool,
        sample_threads: int = 0,
    ) -> None:
        self.loop = loop
        #: One store per scheme and options (a mixture may read several).
        self.stores: list[Store] = []
        index: dict[tuple[str, str], int] = {}
        of_dataset = []
        # Remote data read in place is read at the versions (ETags) its headers were read
        # from: an object replaced since the dataset was opened is a ShardChangedError. (A
        # local file's version at open is a digest of its bytes, not what its store pins.)
        pins: dict[tuple[str, str], dict[str, str]] = {}
        for dataset in datasets:
            key = (scheme_of(dataset.url), repr(sorted(dataset.storage_options.items())))
            versions = dataset.versions
            if key[0] != "file" and len(versions) == len(dataset.manifest.shards):
                found = zip(dataset.shard_urls, versions, strict=True)
                pins.setdefault(key, {}).update((u, v) for u, v in found if v is not None)
        try:
            for dataset in datasets:
                key = (scheme_of(dataset.url), repr(sorted(dataset.storage_options.items())))
                if key not in index:
                    index[key] = len(self.stores)
                    self.stores.append(
                        stack.open(dataset.url, dataset.storage_options, pins.get(key))
                    )
                of_dataset.append(index[key])
        except BaseException:
            # Nothing read through them yet: closed here, in the loop that opened them.
            for store in self.stores:
                loop.create_task(store.close())
            raise
        #: The store of each shard (an index into ``stores``).
        self.shard_store = np.asarray(of_dataset, dtype=np.int64)[shard_dataset]
        self.gap = min(store.coalesce_gap for store in self.stores)
        # A dtype conversion touches every byte: it runs off the loop (numpy drops the GIL).
        self.decoder = (
            ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-decode") if decodes else None
        )
        # One thread, so transforms run one at a time, in batch order, as the user wrote them.
        self.transformer = (
            ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-transform") if transforms else None
        )
        #: ``decode=``: the pool that decodes, transforms and collates samples (None without).
        self.samples = OrderedPool(sample_threads) if sample_threads else None
        #: The runs reading through these (each removed as it ends).
        self.runs: set[asyncio.Task[Any]] = set()
        #: The first error a store's close raised, for :meth:`aclose` to raise.
        self.error: Exception | None = None
        self._holder = loop.create_task(self._hold(), name="asyncbatch-stores")

    async def _hold(self) -> None:
        """Wait until cancelled, then close everything to the end (a second cancellation,
        the loop's end say, waits for the close all the same)."""
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await to_the_end(self._close())

    async def stop_runs(self) -> None:
        """Cancel the runs reading through these and wait until they have ended."""
        runs = list(self.runs)
        for run in runs:
            run.cancel()
        if runs:
            await to_the_end(_wait_all(runs))

    async def _close(self) -> None:
        """Stop the runs, close the stores, then the threads: each step to the end, and
        every step taken however often this task is cancelled meanwhile (by the loop's end,
        which cancels every task left, this one too)."""
        await _despite_cancellation(self.stop_runs())
        for store in self.stores:
            try:
                await _despite_cancellation(store.close())
            except Exception as exc:  # the others are closed all the same
                self.error = self.error or exc
        # Both wait for a call under way (a transform cannot be interrupted): no thread is
        # left running once the stores are closed.
        for pool in (self.decoder, self.samples, self.transformer):
            if pool is not None:
                pool.shutdown(wait=True)

    async def aclose(self) -> None:
        """Close, in this loop: stop the runs, then close the stores and the threads; raises
        the first error a store's close raised."""
        self._holder.cancel()
        await to_the_end(_wait_all([self._holder]))
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        """From any thread: have this loop close them, without waiting (nothing when the
        loop is closed: its end cancelled the holder, which closed them)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._holder.cancel)


async def _wait_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every one of ``tasks`` is done (whatever its outcome)."""
    await asyncio.wait(tasks)


async def _despite_cancellation(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` in a task of its own until it is done; a cancellation of the caller
    meanwhile is ignored (the caller closes things and must go on), one of ``work`` ends it."""
    task = asyncio.get_running_loop().create_task(work)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    if not task.cancelled():
        task.result()


async def to_the_end(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` in a task of its own and wait for it to finish, even when the caller is
    cancelled meanwhile (then raise that cancellation once it has)."""
    try:
        task = asyncio.get_running_loop().create_task(work)
    except RuntimeError:  # no loop runs it (a coroutine closed after its loop)
        work.close()
        raise
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise cancelled
    task.result()
