"""The asyncio engine: sample ids → planned reads → one buffer per batch → the queue.

For each batch the engine reserves a queue slot (bounding memory), plans its reads with the
shard map, reads them concurrently straight into the batch buffer, decodes the fields and
delivers batches in order. Requests in flight are bounded by the store. Any error ends the
run with a :class:`~asyncbatch.handoff.Final` item carrying it, after the batches before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .batch import Batch
from .formats.tokens import TokenWindows
from .handoff import BatchQueue, Final
from .sampling.order import EpochOrder
from .stores import open_store
from .stores.base import Buffer, Store

#: Batches whose sample ids are computed in one vectorised call.
IDS_CHUNK = 64

ReadRequest = tuple[str, list[int], list[int], list[Buffer]]


class Engine:
    """Produces the batches of one epoch of one rank, from any position, into a queue."""

    def __init__(
        self,
        source: TokenWindows,
        order: EpochOrder,
        *,
        max_inflight: int,
        coalesce_gap: int | None = None,
    ) -> None:
        self.source = source
        self.order = order
        self.max_inflight = max_inflight
        self.coalesce_gap = coalesce_gap

    async def run(self, queue: BatchQueue, epoch: int, first_batch: int) -> None:
        """Deliver batches ``first_batch, ...`` of ``epoch`` then a :class:`Final`; never raises."""
        dataset = self.source.dataset
        tasks: set[asyncio.Task[bool]] = set()
        store: Store | None = None
        try:
            store = open_store(dataset.url, dataset.storage_options, max_inflight=self.max_inflight)
            gap = store.coalesce_gap if self.coalesce_gap is None else self.coalesce_gap
            previous: asyncio.Task[bool] | None = None
            batch_size = self.order.batch_size
            stop = self.order.batches_per_epoch
            for chunk in range(first_batch, stop, IDS_CHUNK):
                chunk_stop = min(stop, chunk + IDS_CHUNK)
                ids = self.order.sample_ids(epoch, chunk, chunk_stop)
                for index in range(chunk, chunk_stop):
                    await queue.reserve()
                    offset = (index - chunk) * batch_size
                    batch_ids = ids[offset : offset + batch_size]
                    previous = asyncio.create_task(
                        self._deliver(store, gap, epoch, index, batch_ids, previous, queue)
                    )
                    tasks.add(previous)
                    previous.add_done_callback(tasks.discard)
            if previous is None or await previous:
                queue.put(Final())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every error must reach the consumer
            queue.put(Final(exc))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if store is not None:
                await store.close()

    async def _deliver(
        self,
        store: Store,
        gap: int,
        epoch: int,
        index: int,
        ids: npt.NDArray[np.int64],
        previous: asyncio.Task[bool] | None,
        queue: BatchQueue,
    ) -> bool:
        """Read one batch, wait for the batch before it, then queue it; False once failed."""
        try:
            item: Batch | Final = await self._read_batch(store, gap, epoch, index, ids)
        except Exception as exc:
            item = Final(exc)
        if previous is not None and not await previous:
            return False
        queue.put(item)
        return isinstance(item, Batch)

    async def _read_batch(
        self, store: Store, gap: int, epoch: int, index: int, ids: npt.NDArray[np.int64]
    ) -> Batch:
        plan = self.source.plan(ids, gap)
        buffer = np.empty(plan.nbytes, dtype=np.uint8)
        view = memoryview(buffer)
        urls = self.source.dataset.shard_urls
        requests: dict[str, ReadRequest] = {}
        scratch: dict[int, bytearray] = {}
        destinations = plan.read_dest.tolist()
        for read, (shard, start, end, dest) in enumerate(
            zip(plan.read_shard.tolist(), plan.read_start.tolist(), plan.read_end.tolist(), destinations)
        ):
            url = urls[shard]
            request = requests.get(url)
            if request is None:
                request = requests[url] = (url, [], [], [])
            request[1].append(start)
            request[2].append(end)
            if dest >= 0:
                request[3].append(view[dest : dest + end - start])
            else:
                scratch[read] = bytearray(end - start)
                request[3].append(memoryview(scratch[read]))
        await _read_all(store, list(requests.values()))
        # Pieces of merged reads that could not land in place (overlapping windows, gaps).
        for read, src, dest, length in zip(
            plan.piece_read.tolist(),
            plan.piece_src.tolist(),
            plan.piece_dest.tolist(),
            plan.piece_length.tolist(),
        ):
            view[dest : dest + length] = memoryview(scratch[read])[src : src + length]
        fields = self.source.decode(buffer, int(ids.size))
        return Batch(ids, fields, self.source.schema, {"epoch": epoch, "batch": index})


async def _read_all(store: Store, requests: Sequence[ReadRequest]) -> None:
    """Issue the reads of one batch: in one call where the store batches across objects."""
    read_many: Any = getattr(store, "read_many", None)
    if read_many is not None:
        await read_many(requests)
        return
    await asyncio.gather(
        *(
            store.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            for url, starts, ends, buffers in requests
        )
    )

