"""The asyncio engine: sample ids → planned reads → batch buffers → the queue.

The engine works on *groups* of consecutive batches so that its fixed costs (planning,
hops to the I/O threads, task switches) are paid once per group rather than once per batch:
for each group it reserves queue slots (bounding memory), computes the sample ids and the
reads in one vectorised call, reads everything concurrently straight into one buffer,
decodes the fields once, and delivers the group's batches (views of that buffer) in order.
The first groups are small, so the first batch waits only for its own reads.
With ``decode=``, each group's samples are decoded, transformed and collated into its
batches on the decode pool (see :mod:`asyncbatch._decode`) before that.
A ``transform`` runs on a thread of its own, group after group in batch order, between a
group's reads and its delivery (see :mod:`asyncbatch._transform`).
Requests in flight are bounded by the store. Any error ends the run with a
:class:`~asyncbatch._handoff.Final` item carrying it, after the batches before it.

What a run reads through, its stores and the threads that decode and transform, is opened
by the first run in a loop and kept for the next runs in that loop (epochs, ``for`` loops,
resumes: a new epoch opens nothing and starts no thread), until :meth:`Engine.aclose`.
A task of that loop holds them (see :mod:`asyncbatch._resources`), so they are closed in
their own loop also when the loop ends under them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from ._batch import Batch, Jagged
from ._buffers import BufferPool
from ._decode import Decoding, decode_group
from ._handoff import BatchQueue, Final
from ._layout import ReadPlan, WindowPlan
from ._resources import Resources, StoreStack, to_the_end
from ._transform import Transform, apply_transform
from .formats._base import (
    Converts,
    OffLoop,
    PlannedSource,
    Read,
    ReadsRowsAlone,
    Source,
    Step,
    Wait,
)
from .sampling._batches import BatchOrder
from .sampling._order import EpochOrder
from .sampling._windows import History
from .stores._base import Conversion, Store
from .stores._copying import c_conversion, copy_pieces
from .stores._ranged import read_by_ranges, run_all
from .stores._runs import begin_run

if TYPE_CHECKING:
    pass

#: The most batches planned and read as one group, and the most bytes one group may hold.
MAX_GROUP = 64
MAX_GROUP_BYTES = 16 * 2**20
#: Groups the prefetch queue holds at once. Local files: four groups of up to 256 batches,
#: so that while the consumer takes one, one group's copies (without the GIL) run beside
#: the planning of the next. Remote stores: two, each group's requests overlapping anyway.
GROUPS_IN_QUEUE = 2
MAX_LOCAL_GROUP = 256
LOCAL_GROUPS_IN_QUEUE = 4
#: Seconds a run waits, once its first group is queued, for the consumer to take it before
#: it plans more: a consumer already waiting takes it in a fraction of a millisecond, where
#: beside the engine's work it may wait for a core or the GIL for milliseconds.
FIRST_TAKEN_WAIT = 0.005


async def _handed_over(group: asyncio.Task[bool], queue: BatchQueue) -> None:
    """Wait until ``group`` is queued, then (a little while) until the consumer takes it."""
    await asyncio.wait({group})
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FIRST_TAKEN_WAIT):
            await queue.taken()


def group_size(prefetch: int, batch_bytes: int, want: int = 0, local: bool = False) -> int:
    """Batches per group: two groups fit in the prefetch queue (four, of up to 256 batches,
    for ``local`` files), and one stays under 16 MiB unless ``want`` (a block shuffle's
    window) asks for more and the queue holds two."""
    most, depth = (
        (MAX_LOCAL_GROUP, LOCAL_GROUPS_IN_QUEUE) if local else (MAX_GROUP, GROUPS_IN_QUEUE)
    )
    base = min(most, prefetch // depth, MAX_GROUP_BYTES // max(1, batch_bytes))
    return max(1, base, min(want, prefetch // 2))


class Engine:
    """Produces the batches of one rank (or one worker of it), from any position, into a queue."""

    def __init__(
        self,
        source: Source,
        order: EpochOrder | BatchOrder,
        *,
        stack: StoreStack,
        group: int = 1,
        coalesce_gap: int | None = None,
        worker: int = 0,
        stride: int = 1,
        unit: int = 1,
        transform: Transform | None = None,
        keep_bytes: int = 0,
        decoding: Decoding | None = None,
    ) -> None:
        self.source = source
        #: The source, when it is a :class:`PlannedSource` with its own ``fetch`` (one read,
        #: one decode), which the engine then carries out without a generator.
        kind: type[Any] = type(source)
        self._planned = (
            source
            if isinstance(source, PlannedSource) and kind.fetch is PlannedSource.fetch
            else None
        )
        #: Applied to every batch before it is queued (None: delivered as decoded).
        self.transform = transform
        #: ``decode=``: the samples' fields decoded on the decode pool (None: as read).
        self.decoding = decoding
        #: The layers of the stores its runs read through (retries, read counts, the cache,
        #: the checks of each shard), assembled by the loader; kept across runs.
        self.stack = stack
        self.order = order
        #: Groups are whole multiples of ``unit`` batches (a block shuffle's window) and
        #: start on them, when a group can hold one.
        self.unit = unit if group >= unit else 1
        self.group = group // self.unit * self.unit
        self.coalesce_gap = coalesce_gap
        #: A DataLoader worker's share: the run's batches number worker, worker + stride, ...
        #: (counted from where the run starts), as the DataLoader takes them in turn.
        self.worker = worker
        self.stride = stride
        #: Memory of the batches the consumer is done with, filled again by later groups
        #: and runs (see :mod:`asyncbatch._buffers`): at most ``keep_bytes`` of it kept free.
        self.buffers = BufferPool(keep_bytes)
        #: The stores and threads runs read through, by the loop they were opened in (one,
        #: but for an AsyncLoader whose runs moved to another loop); see :meth:`aclose`.
        self._resources: dict[asyncio.AbstractEventLoop, Resources] = {}

    async def run(
        self,
        queue: BatchQueue,
        epoch: int,
        first_batch: int,
        *,
        infinite: bool = False,
        history: History = (),
    ) -> None:
        """Deliver this engine's batches from ``first_batch`` of ``epoch`` on, then a
        :class:`Final` (``infinite``: go on through the next epochs instead); never raises.

        ``history``: the world sizes ``epoch`` ran on before (the next epochs start afresh).
        """
        begin_run()  # a store keeping state across runs checks it again (stores.runs)
        tasks: set[asyncio.Task[bool]] = set()
        final: Final | None = None
        try:
            opened = self._open(asyncio.get_running_loop())
            run = asyncio.current_task()
            if run is not None:
                opened.runs.add(run)
                run.add_done_callback(opened.runs.discard)
            urls = self.source.shard_urls
            reader = Reader(opened.stores, urls, opened.shard_store, self.buffers)
            gap = opened.gap if self.coalesce_gap is None else self.coalesce_gap
            decoder, transformer, samples = opened.decoder, opened.transformer, opened.samples
            previous: asyncio.Task[bool] | None = None
            per_epoch = self.order.batches_per_epoch
            done = 0  # batches of the run (all workers) in the epochs before this one
            # A block shuffle's first batch waits only for its own rows where the source
            # reads them without their blocks; the rest of its window is the next group.
            alone = self.source.reads_rows_alone if isinstance(self.source, ReadsRowsAlone) else 0
            first_size = 1 if 0 < alone < self.unit else self.unit
            first = True
            decoding: asyncio.Task[bool] | None = None
            while True:
                for batches in self.groups(first_batch, done, history, first_size):
                    await queue.reserve(len(batches))
                    fetched = asyncio.get_running_loop().create_future() if first else None
                    previous = asyncio.create_task(
                        self._deliver(
                            reader,
                            decoder,
                            transformer,
                            samples,
                            gap,
                            epoch,
                            history,
                            batches,
                            previous,
                            queue,
                            fetched,
                        )
                    )
                    tasks.add(previous)
                    previous.add_done_callback(tasks.discard)
                    if decoding is not None:  # the second group: the third waits for the first
                        await _handed_over(decoding, queue)
                        decoding = None
                    if fetched is not None:
                        # The first group alone, then the rest: planned and read beside
                        # the prefetch's later groups, it would wait on their work; and its
                        # batch handed over before that work begins, for the same reason.
                        # With decode=, the second group is read while the first one's
                        # samples decode (else the pool idles for its reads), and the third
                        # waits: the first decoded batch tells how many the queue holds.
                        first = False
                        await asyncio.wait({previous, fetched}, return_when="FIRST_COMPLETED")
                        if fetched.done() and self.decoding is not None:
                            decoding = previous
                        else:
                            await _handed_over(previous, queue)
                if not infinite or per_epoch == 0:
                    break
                done += max(0, per_epoch - first_batch)
                epoch, first_batch, history, first_size = epoch + 1, 0, (), self.group
            if previous is None or await previous:
                final = Final()
        except (asyncio.CancelledError, GeneratorExit):  # stopped, not failed
            raise
        except BaseException as exc:  # noqa: BLE001 - every error must reach the consumer
            final = Final(exc)
        finally:
            # The loader stops a run by cancelling it, also while the run ends on its own:
            # the end runs to completion all the same, so no group is left reading.
            await to_the_end(self._end_run(queue, final, tasks))

    @staticmethod
    async def _end_run(
        queue: BatchQueue, final: Final | None, tasks: set[asyncio.Task[bool]]
    ) -> None:
        """Stop the run's groups (and wait for their reads), then queue ``final``."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The terminal item goes last, so a consumer that sees it finds no read under way.
        if final is not None:
            queue.put(final)

    def _open(self, loop: asyncio.AbstractEventLoop) -> Resources:
        """What this loop's runs read through, opened by the first of them."""
        opened = self._resources.get(loop)
        if opened is None:
            # An AsyncLoader's runs moved to another loop (a second asyncio.run): what the
            # first loop opened is bound to it, and closes there (or closed as it ended).
            for other in list(self._resources):
                self._resources.pop(other).release()
            opened = self._resources[loop] = Resources(
                loop,
                self.source.datasets,
                self.source.shard_dataset,
                stack=self.stack,
                # A dtype conversion touches every byte: it runs off the loop.
                decodes=not isinstance(self.source, Converts) or self.source.converts,
                transforms=self.transform is not None,
                sample_threads=0 if self.decoding is None else self.decoding.threads,
            )
        return opened

    async def stop_runs(self) -> None:
        """Cancel the runs of the running loop and wait until they have ended."""
        opened = self._resources.get(asyncio.get_running_loop())
        if opened is not None:
            await opened.stop_runs()

    async def aclose(self) -> None:
        """Stop the runs of the running loop, then close what they read through (its
        stores, to the end; the decode and transform threads); a later run opens them
        again. Raises the first error a store's close raised."""
        opened = self._resources.pop(asyncio.get_running_loop(), None)
        if opened is not None:
            await opened.aclose()

    def release(self) -> None:
        """From any thread: have each loop close what its runs opened (their runs
        cancelled first), without waiting (an AsyncLoader dropped unclosed)."""
        opened, self._resources = self._resources, {}
        for each in opened.values():
            each.release()

    def forget(self) -> list[object]:
        """In a child made by ``fork()``: drop what the parent's runs opened, untouched (its
        threads are not in this process, and its locks may be held); returns it, for the
        caller to keep referenced, unused, so that none of it is finalized here."""
        opened, self._resources = self._resources, {}
        return list(opened.values())

    def close(self) -> None:
        """Drop the free batch memory (and the memory of batches as they are dropped); once
        the runs are over and :meth:`aclose` closed the stores."""
        self.buffers.close()

    def groups(
        self, first_batch: int, done: int = 0, history: History = (), first_size: int = 0
    ) -> Iterator[range]:
        """The batches of an epoch this engine reads together, group by group, from
        ``first_batch`` on, when the run delivered ``done`` batches before this epoch.

        Groups grow ``first_size`` (default: one unit), 2x, 4x, ... up to the full size (the
        first batch only waits for the reads of its unit), never less than a unit after the
        first, and end on multiples of the group size counted from where the rank's windows
        start, so that each covers whole shuffle windows (a first group of one batch: the
        rest of its window next). A worker's group holds every ``stride``-th batch.
        """
        stride = self.stride
        # Slot i is batch start + i * stride of the epoch.
        start = first_batch + (self.worker - done) % stride
        stop = max(0, -(-(self.order.batches_per_epoch - start) // stride))
        origin = self.order.first_batch(history)
        size = first_size or self.unit
        slot = 0
        while slot < stop:
            at = (start - origin) // stride + slot
            count = min(size, stop - slot, self.group - at % self.group)
            size = min(self.group, max(size * 2, self.unit))
            yield range(start + slot * stride, start + (slot + count) * stride, stride)
            slot += count

    async def _deliver(
        self,
        reader: Reader,
        decoder: ThreadPoolExecutor | None,
        transformer: ThreadPoolExecutor | None,
        samples: Executor | None,
        gap: int,
        epoch: int,
        history: History,
        batches: range,
        previous: asyncio.Task[bool] | None,
        queue: BatchQueue,
        fetched: asyncio.Future[None] | None = None,
    ) -> bool:
        """Read a group, wait for the group before it, transform it (``transformer``: the
        thread of ``self.transform``), then queue it; False once failed. ``fetched`` is set
        once the group's bytes are read (before they decode)."""
        held = GroupBytes(queue)  # counted in the queue until the group's batches are put
        stored: list[int] = []
        sizes: list[int] | None = None
        try:
            try:
                group, stored, sizes = await self._read_group(
                    reader, decoder, gap, epoch, history, batches, held, samples, fetched
                )
                items: list[Batch | Final] = list(group)
            except (asyncio.CancelledError, GeneratorExit):  # stopped, not failed
                raise
            except CutShort as cut:  # a sample failed: the batches before its own, then it
                group, stored, sizes = cut.group, [*cut.stored, 0], [*cut.sizes, 0]
                items = [*group, Final(cut.error)]
            except BaseException as exc:  # noqa: BLE001 - every error must reach the consumer
                held.release()
                group, items, stored, sizes = [], [Final(exc)], [0], None
            if previous is not None and not await previous:
                return False
            # After the group before it, so transforms run in batch order; later groups are
            # read meanwhile. A failure keeps the batches before it and ends with its Final.
            if transformer is not None and group:
                assert self.transform is not None
                failed = items[len(group) :]  # a sample's error after the batches before it
                items = await asyncio.get_running_loop().run_in_executor(
                    transformer, apply_transform, self.transform, group
                )
                if not isinstance(items[-1], Final):
                    items.extend(failed)
                stored, sizes = stored[: len(items)], None  # transformed: counted anew
                if isinstance(items[-1], Final):
                    stored[-1] = 0
            # The queue counts the batches' own bytes from here, in place of what was held.
            queue.put_many(items, release=held.held, stored=stored, sizes=sizes)
            held.held = 0
            if queue.capacity < GROUPS_IN_QUEUE * self.group and self.group > self.unit:
                # The queue shrank to what its decoded batches' bytes allow: groups follow.
                fits = queue.capacity // GROUPS_IN_QUEUE // self.unit * self.unit
                self.group = max(self.unit, fits)
            return not isinstance(items[-1], Final)
        finally:
            held.release()

    async def _read_group(
        self,
        reader: Reader,
        decoder: ThreadPoolExecutor | None,
        gap: int,
        epoch: int,
        history: History,
        batches: range,
        held: GroupBytes,
        samples: Executor | None = None,
        fetched: asyncio.Future[None] | None = None,
    ) -> tuple[list[Batch], list[int], list[int] | None]:
        """The group's batches, the bytes each holds in the store (its share of the group's
        planned bytes) and, where known, its own bytes; counts the bytes it holds in
        ``held``. With ``decode=``, its samples decoded on ``samples`` (the decode pool),
        once ``fetched`` is set."""
        order = self.order
        ids = order.sample_ids(epoch, batches.start, batches[-1] + 1, history)
        if order.batch_length(batches[-1]) == order.batch_size:  # only the last may be short
            lengths = [order.batch_size] * len(batches)
        else:
            lengths = [order.batch_length(b) for b in batches]
        if batches.step > 1:  # a DataLoader worker's share: every stride-th batch
            size = order.batch_size
            starts = [(b - batches.start) * size for b in batches]
            ids = np.concatenate([ids[s : s + n] for s, n in zip(starts, lengths, strict=True)])

        async def offload(work: Callable[[], Any]) -> Any:
            if decoder is None:
                return work()
            return await asyncio.get_running_loop().run_in_executor(decoder, work)

        read = functools.partial(reader.read, held=held)

        source = self.source
        simple = self._planned
        if simple is not None:  # its two steps, carried out here: no generator in between
            buffer = await reader.read(simple.reads(ids, gap), simple.convert, held)
            if simple.converts:
                fields = await offload(functools.partial(simple.decode, buffer, ids))
            else:
                fields = simple.decode(buffer, ids)
        else:
            fields = await run_fetch(source.fetch(ids, gap), read, offload)
        cuts = list(itertools.accumulate(lengths, initial=0))
        # Each batch's share of the stored bytes, by its samples (exact for equal samples).
        shares = [held.planned * cut // max(1, cuts[-1]) for cut in cuts]
        stored = [b - a for a, b in itertools.pairwise(shares)]
        if self.decoding is not None:
            assert samples is not None
            if fetched is not None and not fetched.done():
                fetched.set_result(None)
            group, decoded, error = await decode_group(
                self.decoding, samples, fields, ids, lengths, batches, epoch
            )
            if error is not None:
                raise CutShort(group, stored[: len(group)], decoded, error)
            return group, stored, decoded
        schema = source.schema
        names = list(fields)
        columns: list[Sequence[Any]] = []
        sizes: list[int] | None = [0] * len(lengths)
        for name in names:
            parts, nbytes = split_sized(fields[name], lengths)
            columns.append(parts)
            if sizes is not None and nbytes is not None:
                sizes = [a + b for a, b in zip(sizes, nbytes, strict=True)]
            else:
                sizes = None
        if len(names) == 1:  # the common case: no zip per batch
            fields_of = [{names[0]: part} for part in columns[0]]
        else:
            fields_of = [
                dict(zip(names, parts, strict=True)) for parts in zip(*columns, strict=True)
            ]
        group = [
            Batch(ids[a:b], fields, schema, {"epoch": epoch, "batch": n})
            for n, a, b, fields in zip(batches, cuts[:-1], cuts[1:], fields_of, strict=True)
        ]
        return group, stored, sizes


class CutShort(Exception):
    """A group whose sample failed to decode: the batches before the failed one's, what
    each holds and weighs, and the error."""

    def __init__(
        self, group: list[Batch], stored: list[int], sizes: list[int], error: Exception
    ) -> None:
        super().__init__(error)
        self.group, self.stored, self.sizes, self.error = group, stored, sizes, error


def split_sized(value: Any, lengths: Sequence[int]) -> tuple[Sequence[Any], list[int] | None]:
    """:func:`split_rows`, and each part's bytes as the queue counts them
    (:func:`~asyncbatch._handoff.fields_bytes`) where they are known without looking at
    every part: an array or tensor cut by rows, a jagged column of numbers."""
    parts = split_rows(value, lengths)
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim and value.shape[0]:
        per_row = int(value.nbytes) // int(value.shape[0])
        return parts, [n * per_row for n in lengths]
    if isinstance(value, Jagged) and isinstance(value.values, torch.Tensor) and len(lengths):
        offsets = value.offsets.numpy()
        ends = np.cumsum([0, *lengths])
        values = value.values
        per_value = values.element_size() * math.prod(values.shape[1:])
        nbytes = np.diff(offsets[ends]) * per_value + (np.asarray(lengths) + 1) * 8
        return parts, nbytes.tolist()
    return parts, None


def split_rows(value: Any, lengths: Sequence[int]) -> Sequence[Any]:
    """``value`` cut along its first axis into consecutive parts of ``lengths`` rows (views);
    a tensor is cut in one call, a jagged column of numbers in a few, the rest by slicing."""
    if isinstance(value, torch.Tensor):
        return torch.split_with_sizes(value, list(lengths))
    if (  # one batch (a run's first, say): the column itself, where slicing would rebuild it
        isinstance(value, Jagged)
        and len(lengths) == 1
        and int(value.offsets[0]) == 0
        and int(value.offsets[-1]) == len(value.values)
    ):
        return [value]
    if isinstance(value, Jagged) and isinstance(value.values, torch.Tensor) and len(lengths) > 1:
        # Slicing a Jagged costs ~35 us of torch calls; here every part's values come from one
        # split, and the offsets of the parts of the first length from one numpy gather.
        offsets = value.offsets.numpy()
        ends = np.cumsum([0, *lengths])
        bounds = offsets[ends]
        values = value.values[int(bounds[0]) : int(bounds[-1])]
        parts = torch.split_with_sizes(values, np.diff(bounds).tolist())
        same = next((k for k, n in enumerate(lengths) if n != lengths[0]), len(lengths))
        rebased = offsets[ends[:same, None] + np.arange(lengths[0] + 1)] - bounds[:same, None]
        rows: list[torch.Tensor] = list(torch.from_numpy(rebased).unbind(0))
        for a, b in itertools.pairwise(ends[same:].tolist()):
            rows.append(torch.from_numpy(offsets[a : b + 1] - offsets[a]))
        return [Jagged(part, row) for part, row in zip(parts, rows, strict=True)]
    cuts = list(itertools.accumulate(lengths, initial=0))
    return [value[a:b] for a, b in itertools.pairwise(cuts)]


class GroupBytes:
    """What one group's reads count: the bytes it holds in the queue (its buffers, and their
    scratch while they are read) until its batches are put, and the bytes it asked of the
    stores."""

    __slots__ = ("held", "planned", "queue")

    def __init__(self, queue: BatchQueue) -> None:
        self.queue = queue
        self.held = 0
        self.planned = 0

    def hold(self, nbytes: int) -> None:
        self.queue.add_bytes(nbytes)
        self.held += nbytes

    def release(self) -> None:
        """Stop counting what the group holds (its batches will not be put)."""
        if self.held:
            self.queue.add_bytes(-self.held)
            self.held = 0


def scratch_bytes(plan: ReadPlan) -> int:
    """Bytes of the scratch area for ``plan``'s merged reads that cannot land in place."""
    indirect = plan.read_dest < 0
    return int((plan.read_end - plan.read_start)[indirect].sum())


class Reader:
    """Carries out read plans over shards that may live in several stores (one per scheme
    and options), straight into the engine's buffers."""

    def __init__(
        self,
        stores: Sequence[Store],
        shard_urls: Sequence[str],
        shard_store: npt.NDArray[np.int64],
        buffers: BufferPool | None = None,
    ) -> None:
        self.stores = stores
        self.shard_urls = shard_urls
        #: Where batch buffers and scratch come from (kept across runs by the engine).
        self.buffers = buffers if buffers is not None else BufferPool()
        self.shard_store = shard_store
        one = stores[0] if len(stores) == 1 else None
        #: Whether reads can convert as they copy: one store, which does.
        self._converting = one is not None and one.supports_convert
        #: The one store, when it copies windows itself.
        self._windows = one if one is not None and one.supports_windows else None

    async def read(
        self,
        plan: ReadPlan | WindowPlan,
        convert: Conversion | None,
        held: GroupBytes,
    ) -> npt.NDArray[np.uint8]:
        """Carry out one read of a group: ``plan``'s bytes (``convert``: its elements as
        ``convert[1]``). Windows are copied by the one store in one call where it can (see
        :meth:`~asyncbatch.stores._base.Store.read_windows`), else planned as byte ranges.
        ``held`` counts what the group holds and asked for."""
        scale = 1 if convert is None else convert[1].itemsize // convert[0].itemsize
        if isinstance(plan, WindowPlan):
            store = self._windows
            if store is not None:
                nbytes = plan.nbytes
                held.hold(nbytes * scale)
                buffer = self.buffers.empty(nbytes * scale)
                layout = plan.layout
                if await store.read_windows(
                    self.shard_urls,
                    layout.ends,
                    layout.offsets,
                    layout.itemsize,
                    plan.starts,
                    plan.length,
                    buffer,
                    convert,
                ):
                    held.planned += nbytes
                    return buffer
                held.hold(-nbytes * scale)
            plan = plan.plan()
        held.planned += plan.nbytes
        scratch = scratch_bytes(plan)
        held.hold(plan.nbytes * scale + scratch)
        buffer = await self.read_plan(plan, convert)
        held.hold(-scratch)
        return buffer

    async def read_plan(
        self, plan: ReadPlan, convert: Conversion | None = None
    ) -> npt.NDArray[np.uint8]:
        """Carry out ``plan``; returns the ``plan.nbytes`` bytes it describes (``convert``:
        its elements as ``convert[1]``, so that many more bytes).

        Reads that land in place go straight to their offset in the buffer; merged reads whose
        pieces cannot (overlapping windows, gaps) land in a separate scratch buffer, freed on
        return, and their pieces are copied into place in one call, so the batches of a group
        keep only their own bytes alive, never the scratch. A store that converts as it
        copies (``supports_convert``) writes each value once; otherwise the bytes read are
        cast afterwards, off the loop.
        """
        name = None if convert is None else c_conversion(*convert)
        if convert is not None and not (
            self._converting and (name is not None or not plan.piece_read.size)
        ):
            return await _cast_off_loop(await self.read_plan(plan), convert)
        scale = 1 if convert is None else convert[1].itemsize // convert[0].itemsize
        shards, starts, ends = plan.read_shard, plan.read_start, plan.read_end
        buffer = self.buffers.empty(plan.nbytes * scale)
        indirect = plan.read_dest < 0
        if not indirect.any():
            await self._read_all(shards, starts, ends, buffer, plan.read_dest * scale, convert)
            return buffer
        sizes = np.where(indirect, ends - starts, 0)
        scratch_at = np.cumsum(sizes) - sizes
        scratch = self.buffers.empty(int(sizes.sum()), scratch=True)
        i, d = np.flatnonzero(indirect), np.flatnonzero(~indirect)
        to_scratch = self._read_all(shards[i], starts[i], ends[i], scratch, scratch_at[i])
        if d.size:
            to_buffer = self._read_all(
                shards[d], starts[d], ends[d], buffer, plan.read_dest[d] * scale, convert
            )
            await run_all((to_buffer, to_scratch))
        else:
            await to_scratch
        if plan.piece_read.size:
            sources = scratch_at[plan.piece_read] + plan.piece_src
            copy_pieces(scratch, sources, plan.piece_length, buffer, plan.piece_dest * scale, name)
        return buffer

    async def _read_all(
        self,
        shards: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        buffer: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
        convert: Conversion | None = None,
    ) -> None:
        """Read ``[starts[i], ends[i])`` of shard ``shards[i]`` to ``dest_offsets[i]``
        (``convert``: converting, through the one store, which converts): one group read
        per store (one ``read_ranges`` per object where a store has no ``read_into``)."""
        urls = self.shard_urls
        if len(self.stores) == 1:
            store = self.stores[0]
            if store.supports_read_into:
                await store.read_into(urls, shards, starts, ends, buffer, dest_offsets, convert)
            else:
                await read_by_ranges(store, urls, shards, starts, ends, buffer, dest_offsets)
            return
        store_of_read = self.shard_store[shards]
        picks = [np.flatnonzero(store_of_read == i) for i in range(len(self.stores))]
        await run_all(
            (
                store.read_into(urls, shards[p], starts[p], ends[p], buffer, dest_offsets[p])
                if store.supports_read_into
                else read_by_ranges(
                    store, urls, shards[p], starts[p], ends[p], buffer, dest_offsets[p]
                )
            )
            for store, p in zip(self.stores, picks, strict=True)
            if p.size
        )


async def _cast_off_loop(
    buffer: npt.NDArray[np.uint8], convert: Conversion | None
) -> npt.NDArray[np.uint8]:
    """``buffer``'s elements cast as ``convert`` says, in a thread (numpy drops the GIL)."""
    if convert is None:
        return buffer
    source, target = convert
    loop = asyncio.get_running_loop()
    cast = await loop.run_in_executor(None, buffer.view(source).astype, target)
    return cast.view(np.uint8)


_Read = Callable[[ReadPlan | WindowPlan, Conversion | None], Awaitable[npt.NDArray[np.uint8]]]
_Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


async def run_fetch(fetch: Generator[Step, Any, Any], read: _Read, offload: _Offload) -> Any:
    """Carry out the steps a source's ``fetch`` yields (see :mod:`asyncbatch.formats._base`),
    sending each one's result back and throwing its error in; returns what ``fetch`` returns.
    The generator is closed however this ends."""
    result: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = fetch.send(result) if error is None else fetch.throw(error)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                result = await _run_step(step, read, offload)
            except GeneratorExit:  # this coroutine closed: ``close`` below ends the fetch too
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown into the fetch, which decides
                error, result = exc, None
    finally:
        fetch.close()


async def _run_step(step: Step, read: _Read, offload: _Offload) -> Any:
    if isinstance(step, Read):
        return await read(step.plan, step.convert)
    if isinstance(step, OffLoop):
        return await offload(step.work)
    if isinstance(step, tuple):  # concurrently; on the first failure the others are cancelled
        tasks = [asyncio.ensure_future(_run_step(s, read, offload)) for s in step]
        await run_all(tasks)
        return [task.result() for task in tasks]
    if isinstance(step, Generator):
        return await run_fetch(step, read, offload)
    if isinstance(step, Wait):
        await _settled(step.futures)
        return None
    raise TypeError(f"a source's fetch yielded {step!r}, not a step (asyncbatch.formats._base)")


async def _settled(futures: Sequence[Future[Any]]) -> None:
    """Wait until ``futures`` are done, never cancelling them (others wait for them too)."""
    loop = asyncio.get_running_loop()
    for future in futures:
        if not future.done():
            waiter = loop.create_future()
            future.add_done_callback(functools.partial(_wake, loop, waiter))
            await waiter


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None], _: Future[Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
        loop.call_soon_threadsafe(_set_done, waiter)


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
