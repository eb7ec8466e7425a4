"""The batch-level shuffle: a file's pre-built batches kept whole, their order shuffled.

For data stored as batches (LLMBATCH: ``rows`` records to a slot), the unit of order is the
slot. :class:`BatchOrder` runs an :class:`~asyncbatch.sampling._order.EpochOrder` over the
slots — a Feistel permutation keyed by ``(seed, epoch)``, slot position ``q`` to rank
``q % W`` — and turns each slot into its ``rows`` record ids, in file order. A loader batch is
``batch_size / rows`` whole slots, so global batch ``g`` holds the same slots at every world
size with the same global batch (exact elastic resume, as the position split), and a rank's
reads are whole slots of its own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._order import EpochOrder
from ._windows import History

Int64Array = npt.NDArray[np.int64]


class BatchOrder:
    """Which records rank ``rank`` reads, batch by batch: ``batch_size // rows`` whole slots
    of ``rows`` records each, the ``num_slots`` slots shuffled per epoch (``shuffle="batch"``).

    ``drop_last`` and ``tail`` apply to slots as they apply to samples elsewhere. The methods
    the engine calls are those of :class:`EpochOrder`, in records.
    """

    def __init__(
        self,
        num_slots: int,
        rows: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        tail: str = "drop",
    ) -> None:
        if batch_size % rows:
            raise ConfigError(
                f"shuffle='batch' keeps the file's batches of {rows} records whole:"
                f" batch_size={batch_size} must be a multiple of {rows}"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.slots = EpochOrder(
            num_slots,
            batch_size // rows,
            shuffle="global",
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            tail=tail,
        )
        self.batches_per_epoch = self.slots.batches_per_epoch
        self.samples_per_rank = self.slots.samples_per_rank * rows
        self._row = np.arange(rows, dtype=np.int64)

    def first_batch(self, history: History) -> int:
        """0: the slots of a global batch never depend on the world size."""
        return 0

    def batch_length(self, batch: int) -> int:
        """Records in batch ``batch`` (only the last one of an epoch may be short)."""
        return self.slots.batch_length(batch) * self.rows

    def slot_ids(self, epoch: int, first_batch: int, stop_batch: int) -> Int64Array:
        """The slots of batches ``[first_batch, stop_batch)``, in order."""
        return self.slots.sample_ids(epoch, first_batch, stop_batch)

    def sample_ids(
        self, epoch: int, first_batch: int, stop_batch: int, history: History = ()
    ) -> Int64Array:
        """Record ids of batches ``[first_batch, stop_batch)``: each slot's rows in order."""
        slots = self.slot_ids(epoch, first_batch, stop_batch)
        ids: Int64Array = (slots[:, None] * self.rows + self._row).reshape(-1)
        return ids
