"""The asyncio engine: sample ids → planned reads → batch buffers → the queue.

The engine works on *groups* of consecutive batches so that its fixed costs (planning,
hops to the I/O threads, task switches) are paid once per group rather than once per batch:
for each group it reserves queue slots (bounding memory), computes the sample ids and the
reads in one vectorised call, reads everything concurrently straight into one buffer,
decodes the fields once, and delivers the group's batches (views of that buffer) in order.
The first groups are small, so the first batch waits only for its own reads.
Requests in flight are bounded by the store. Any error ends the run with a
:class:`~asyncbatch.handoff.Final` item carrying it, after the batches before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from .batch import Batch
from .formats.tokens import TokenWindows
from .handoff import BatchQueue, Final, fields_bytes
from .layout import ReadPlan
from .sampling.order import EpochOrder
from .stores import open_store
from .stores.base import Buffer, Store
from .stores.registry import scheme_of

#: The most batches planned and read as one group, and the most bytes one group may hold.
MAX_GROUP = 64
MAX_GROUP_BYTES = 16 * 2**20


def group_size(prefetch: int, batch_bytes: int, want: int = 0) -> int:
    """Batches per group: two groups fit in the prefetch queue, and one stays under 16 MiB
    unless ``want`` (a block shuffle's window) asks for more and the queue has room."""
    base = min(MAX_GROUP, prefetch // 2, MAX_GROUP_BYTES // max(1, batch_bytes))
    return max(1, base, min(want, prefetch // 2))


class Engine:
    """Produces the batches of one rank (or one worker of it), from any position, into a queue."""

    def __init__(
        self,
        source: TokenWindows,
        order: EpochOrder,
        *,
        max_inflight: int,
        group: int = 1,
        coalesce_gap: int | None = None,
        worker: int = 0,
        stride: int = 1,
        unit: int = 1,
    ) -> None:
        self.source = source
        self.order = order
        self.max_inflight = max_inflight
        #: Groups are whole multiples of ``unit`` batches (a block shuffle's window) and
        #: start on them, when a group can hold one.
        self.unit = unit if group >= unit else 1
        self.group = group // self.unit * self.unit
        self.coalesce_gap = coalesce_gap
        #: A DataLoader worker's share: the run's batches number worker, worker + stride, ...
        #: (counted from where the run starts), as the DataLoader takes them in turn.
        self.worker = worker
        self.stride = stride

    async def run(
        self, queue: BatchQueue, epoch: int, first_batch: int, *, infinite: bool = False
    ) -> None:
        """Deliver this engine's batches from ``first_batch`` of ``epoch`` on, then a
        :class:`Final` (``infinite``: go on through the next epochs instead); never raises."""
        tasks: set[asyncio.Task[bool]] = set()
        stores: list[Store] = []
        final: Final | None = None
        # A dtype conversion touches every byte: it runs off the loop (numpy drops the GIL).
        decoder = (
            ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-decode")
            if self.source.converts
            else None
        )
        try:
            # One store per scheme and options (a mixture may read several).
            index: dict[tuple[str, str], int] = {}
            of_dataset = []
            for dataset in self.source.datasets:
                key = (scheme_of(dataset.url), repr(sorted(dataset.storage_options.items())))
                if key not in index:
                    index[key] = len(stores)
                    stores.append(
                        open_store(
                            dataset.url, dataset.storage_options, max_inflight=self.max_inflight
                        )
                    )
                of_dataset.append(index[key])
            shard_store = np.asarray(of_dataset, dtype=np.int64)[self.source.shard_dataset]
            reader = Reader(stores, self.source.shard_urls, shard_store)
            gap = min(s.coalesce_gap for s in stores)
            gap = gap if self.coalesce_gap is None else self.coalesce_gap
            previous: asyncio.Task[bool] | None = None
            size = self.unit
            per_epoch = self.order.batches_per_epoch
            done = 0  # batches of the run (all workers) in the epochs before this one
            while True:
                # Slot i is batch start + i * stride of the epoch.
                start = first_batch + (self.worker - done) % self.stride
                stop = max(0, -(-(per_epoch - start) // self.stride))
                slot = 0
                while slot < stop:
                    # Groups grow 1, 2, 4, ... units up to the full size (the first batch only
                    # waits for the reads of its unit), and end on multiples of the group size
                    # counted from the epoch's start, so that each covers whole shuffle windows.
                    at = start // self.stride + slot
                    count = min(size, stop - slot, self.group - at % self.group)
                    size = min(self.group, size * 2)
                    await queue.reserve(count)
                    batches = range(
                        start + slot * self.stride,
                        start + (slot + count) * self.stride,
                        self.stride,
                    )
                    previous = asyncio.create_task(
                        self._deliver(reader, decoder, gap, epoch, batches, previous, queue)
                    )
                    tasks.add(previous)
                    previous.add_done_callback(tasks.discard)
                    slot += count
                if not infinite or per_epoch == 0:
                    break
                done += max(0, per_epoch - first_batch)
                epoch, first_batch = epoch + 1, 0
            if previous is None or await previous:
                final = Final()
        except (asyncio.CancelledError, GeneratorExit):  # stopped, not failed
            raise
        except BaseException as exc:  # noqa: BLE001 - every error must reach the consumer
            final = Final(exc)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for store in stores:
                try:
                    await store.close()
                except Exception as exc:  # a failed close still ends the run, with its error
                    if final is not None and final.error is None:
                        final = Final(exc)
            if decoder is not None:
                decoder.shutdown(wait=True)
            # The terminal item goes last, so a consumer that sees it finds everything closed.
            if final is not None:
                queue.put(final)

    async def _deliver(
        self,
        reader: Reader,
        decoder: ThreadPoolExecutor | None,
        gap: int,
        epoch: int,
        batches: range,
        previous: asyncio.Task[bool] | None,
        queue: BatchQueue,
    ) -> bool:
        """Read a group, wait for the group before it, then queue it; False once failed."""
        held = [0]  # bytes counted in the queue for this group until its batches are put
        try:
            try:
                items: list[Batch | Final] = list(
                    await self._read_group(reader, decoder, gap, epoch, batches, queue, held)
                )
            except (asyncio.CancelledError, GeneratorExit):  # stopped, not failed
                raise
            except BaseException as exc:  # noqa: BLE001 - every error must reach the consumer
                queue.add_bytes(-held[0])
                held[0] = 0
                items = [Final(exc)]
            if previous is not None and not await previous:
                return False
            queue.put_many(items)  # the bytes held now belong to the queued batches
            held[0] = 0
            return not isinstance(items[-1], Final)
        finally:
            if held[0]:
                queue.add_bytes(-held[0])

    async def _read_group(
        self,
        reader: Reader,
        decoder: ThreadPoolExecutor | None,
        gap: int,
        epoch: int,
        batches: range,
        queue: BatchQueue,
        held: list[int],
    ) -> list[Batch]:
        """The group's batches; counts the bytes it holds in ``queue`` and ``held[0]``."""
        order = self.order
        ids = order.sample_ids(epoch, batches.start, batches[-1] + 1)
        lengths = [order.batch_length(b) for b in batches]
        if batches.step > 1:  # a DataLoader worker's share: every stride-th batch
            size = order.batch_size
            starts = [(b - batches.start) * size for b in batches]
            ids = np.concatenate([ids[s : s + n] for s, n in zip(starts, lengths, strict=True)])
        plan = self.source.plan(ids, gap)
        scratch = scratch_bytes(plan)
        _hold(queue, held, plan.nbytes + scratch)
        buffer = await reader.read_plan(plan)
        _hold(queue, held, -scratch)
        if decoder is not None:
            loop = asyncio.get_running_loop()
            fields = await loop.run_in_executor(decoder, self.source.decode, buffer, int(ids.size))
        else:
            fields = self.source.decode(buffer, int(ids.size))
        # From here the group holds its decoded fields (the raw buffer, if they are new arrays,
        # is freed with this frame).
        _hold(queue, held, fields_bytes(fields) - plan.nbytes)
        schema = self.source.schema
        out = []
        start = 0
        for batch, length in zip(batches, lengths, strict=True):
            stop = start + length
            out.append(
                Batch(
                    ids[start:stop],
                    {name: value[start:stop] for name, value in fields.items()},
                    schema,
                    {"epoch": epoch, "batch": batch},
                )
            )
            start = stop
        return out


def _hold(queue: BatchQueue, held: list[int], nbytes: int) -> None:
    queue.add_bytes(nbytes)
    held[0] += nbytes


def scratch_bytes(plan: ReadPlan) -> int:
    """Bytes of the scratch area for ``plan``'s merged reads that cannot land in place."""
    indirect = plan.read_dest < 0
    return int((plan.read_end - plan.read_start)[indirect].sum())


class Reader:
    """Carries out read plans over shards that may live in several stores."""

    def __init__(
        self, stores: Sequence[Store], shard_urls: Sequence[str], shard_store: npt.NDArray[np.int64]
    ) -> None:
        self.stores = stores
        self.shard_urls = shard_urls
        self.shard_store = shard_store

    async def read_plan(self, plan: ReadPlan) -> npt.NDArray[np.uint8]:
        """Carry out ``plan``; returns the ``plan.nbytes`` bytes it describes.

        Reads that land in place go straight to their offset in the buffer; merged reads whose
        pieces cannot (overlapping windows, gaps) land in a separate scratch buffer, freed on
        return, and their pieces are copied into place. So the batches of a group keep only
        their own bytes alive, never the scratch.
        """
        buffer = np.empty(plan.nbytes, dtype=np.uint8)
        indirect = plan.read_dest < 0
        if not indirect.any():
            await self._read_all(plan, None, buffer, plan.read_dest)
            return buffer
        sizes = np.where(indirect, plan.read_end - plan.read_start, 0)
        scratch_at = np.cumsum(sizes) - sizes
        scratch = np.empty(int(sizes.sum()), dtype=np.uint8)
        direct = np.flatnonzero(~indirect)
        to_scratch = self._read_all(plan, np.flatnonzero(indirect), scratch, scratch_at)
        if direct.size:
            await asyncio.gather(self._read_all(plan, direct, buffer, plan.read_dest), to_scratch)
        else:
            await to_scratch
        if plan.piece_read.size:
            into = memoryview(buffer)  # type: ignore[arg-type]
            source = memoryview(scratch)  # type: ignore[arg-type]
            sources = scratch_at[plan.piece_read] + plan.piece_src
            for src, dest, length in zip(
                sources.tolist(), plan.piece_dest.tolist(), plan.piece_length.tolist(), strict=True
            ):
                into[dest : dest + length] = source[src : src + length]
        return buffer

    async def _read_all(
        self,
        plan: ReadPlan,
        picked: npt.NDArray[np.intp] | None,
        buffer: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> None:
        """The plan's reads (those ``picked``, if given) into ``buffer``, from every store."""
        if len(self.stores) == 1:
            await self._read(self.stores[0], plan, picked, buffer, dest_offsets)
            return
        store_of_read = self.shard_store[plan.read_shard]
        everything = np.arange(plan.num_reads) if picked is None else picked
        await asyncio.gather(
            *(
                self._read(
                    store,
                    plan,
                    everything[store_of_read[everything] == i],
                    buffer,
                    dest_offsets,
                )
                for i, store in enumerate(self.stores)
            )
        )

    async def _read(
        self,
        store: Store,
        plan: ReadPlan,
        picked: npt.NDArray[np.intp] | None,
        buffer: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> None:
        """The plan's reads (those ``picked``, if given) from one store."""
        shards, starts, ends = plan.read_shard, plan.read_start, plan.read_end
        if picked is not None:
            if not picked.size:
                return
            shards, starts, ends = shards[picked], starts[picked], ends[picked]
            dest_offsets = dest_offsets[picked]
        read_into: Any = getattr(store, "read_into", None)
        if read_into is not None:
            await read_into(self.shard_urls, shards, starts, ends, buffer, dest_offsets)
        else:
            await _read_ranges(store, self.shard_urls, shards, starts, ends, buffer, dest_offsets)


async def _read_ranges(
    store: Store,
    shard_urls: Sequence[str],
    shards: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    buffer: npt.NDArray[np.uint8],
    dest_offsets: npt.NDArray[np.int64],
) -> None:
    """Reads through the plain protocol: one ``read_ranges`` call per object."""
    view = memoryview(buffer)  # type: ignore[arg-type]
    by_shard: dict[int, tuple[list[int], list[int], list[Buffer]]] = {}
    for shard, start, end, at in zip(
        shards.tolist(), starts.tolist(), ends.tolist(), dest_offsets.tolist(), strict=True
    ):
        entry = by_shard.setdefault(shard, ([], [], []))
        entry[0].append(start)
        entry[1].append(end)
        entry[2].append(view[at : at + end - start])
    await asyncio.gather(
        *(
            store.read_ranges(shard_urls[shard], starts=s, ends=e, buffers=b)
            for shard, (s, e, b) in by_shard.items()
        )
    )
