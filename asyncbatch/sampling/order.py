"""The order of samples in an epoch, for one rank: a pure function of its arguments.

Position ``p`` of rank ``r`` out of ``w`` is global position ``p * w + r``; with a shuffle,
global positions go through a Feistel permutation keyed by ``(seed, epoch)``. Nothing is
stored per sample, so the order of any batch is computed in O(batch) time from scratch,
and resuming at any position costs nothing.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from .feistel import FeistelPermutation, _splitmix64

SHUFFLES = ("none", "global")

#: Positions whose sample ids are computed (and cached) together.
ID_BLOCK = 16384


def normalize_shuffle(shuffle: bool | str) -> str:
    """``True`` → ``"global"``, ``False`` → ``"none"``; anything unknown is a ConfigError."""
    if shuffle is True:
        return "global"
    if shuffle is False:
        return "none"
    if shuffle not in SHUFFLES:
        raise ConfigError(f"shuffle={shuffle!r}: expected True, False or one of {SHUFFLES}")
    return shuffle


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of one epoch: a hash of (seed, epoch)."""
    _, key = _splitmix64((seed * 0x9E3779B97F4A7C15 + epoch) & ((1 << 64) - 1))
    return key


class EpochOrder:
    """Which global samples rank ``rank`` reads, batch by batch, in each epoch."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = normalize_shuffle(shuffle)
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        # Every rank gets the same count: the last num_samples % world_size positions go unread.
        self.samples_per_rank = num_samples // world_size
        full, rest = divmod(self.samples_per_rank, batch_size)
        self.batches_per_epoch = full + int(rest > 0 and not drop_last)
        self._permutation = lru_cache(maxsize=2)(self._make_permutation)
        self._block = lru_cache(maxsize=4)(self._make_block)

    def _make_permutation(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, epoch_key(self.seed, epoch))

    def _make_block(self, epoch: int, block: int) -> npt.NDArray[np.int64]:
        start = block * ID_BLOCK
        stop = min(start + ID_BLOCK, self.samples_per_rank)
        positions = np.arange(start, stop, dtype=np.int64)
        positions *= self.world_size
        positions += self.rank
        if self.shuffle == "global" and positions.size:
            positions = self._permutation(epoch)(positions)
        positions.flags.writeable = False
        return positions

    def sample_ids(self, epoch: int, first_batch: int, stop_batch: int) -> npt.NDArray[np.int64]:
        """Global sample ids of batches ``[first_batch, stop_batch)``, concatenated."""
        start = first_batch * self.batch_size
        stop = min(stop_batch * self.batch_size, self.samples_per_rank)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        # Ids are computed a block at a time: a vectorised call has a fixed cost (about 55
        # numpy passes, ~25 us, plus as much again when cycle walking needs a second pass)
        # that a few hundred ids would not amortise.
        first, last = start // ID_BLOCK, (stop - 1) // ID_BLOCK
        if first == last:
            offset = first * ID_BLOCK
            return self._block(epoch, first)[start - offset : stop - offset]
        parts = [self._block(epoch, b) for b in range(first, last + 1)]
        joined = np.concatenate(parts)
        return joined[start - first * ID_BLOCK : stop - first * ID_BLOCK]
