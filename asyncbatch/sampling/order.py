"""The order of samples in an epoch, for one rank: pure functions of their arguments.

Two layers, both computed from scratch for any position, so nothing is stored per sample
and resuming anywhere costs nothing:

- A *sample order* maps the positions ``0 .. N-1`` of an epoch to sample ids:
  :class:`Sequential`, :class:`GlobalShuffle` (a Feistel permutation keyed by
  ``(seed, epoch)``) or :class:`BlockShuffle` (blocks of consecutive samples in a Feistel
  order, shuffled again inside windows of a few blocks).
- :class:`EpochOrder` cuts an epoch into ranks and batches. Global position ``q`` belongs to
  rank ``q % W`` (rank ``r`` takes ``r, r + W, r + 2W, …``), so global batch ``g`` — the
  positions ``[g·B·W, (g+1)·B·W)`` — holds the same samples whatever ``W`` is, as long as the
  global batch ``B·W`` is the same: a run can resume on another world size exactly.

The tail: every rank yields the same number of batches (an uneven count hangs DDP).
``tail="drop"`` leaves out the last positions that do not fill a global batch (with
``drop_last=False``: that do not give every rank one more sample, and the last batch is
short); ``tail="wrap"`` fills them with the first samples of the same epoch's order again.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from .feistel import FeistelPermutation, _splitmix64

Int64Array = npt.NDArray[np.int64]

SHUFFLES = ("none", "global", "block")
TAILS = ("drop", "wrap")

#: Positions whose sample ids are computed (and cached) together.
ID_BLOCK = 16384

_MASK64 = (1 << 64) - 1


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
    _, key = _splitmix64((seed * 0x9E3779B97F4A7C15 + epoch) & _MASK64)
    return key


def derive_key(key: int, tag: int) -> int:
    """An independent key for part ``tag`` of something keyed by ``key``."""
    _, out = _splitmix64((key ^ ((tag + 1) * 0xD1B54A32D192ED03)) & _MASK64)
    return out


class SampleOrder(Protocol):
    """Maps positions ``0 .. num_samples-1`` of an epoch to sample ids, a bijection per epoch."""

    num_samples: int

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array: ...


class Sequential:
    """Position ``q`` is sample ``q``, every epoch."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        return positions


class GlobalShuffle:
    """Every epoch a uniformly mixed permutation of all samples (Feistel, O(1) memory)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self._permutation = lru_cache(maxsize=2)(self._make)

    def _make(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, epoch_key(self.seed, epoch))

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        if not positions.size:
            return positions
        return self._permutation(epoch)(positions)


class BlockShuffle:
    """Blocks of ``block_size`` consecutive samples in a random order, mixed per window.

    Each epoch starts the blocks at a random offset (so block edges move between epochs)
    and orders the ``N // block_size`` whole blocks by a Feistel permutation; the last,
    partial block comes last. Consecutive runs of ``window`` blocks form a window whose
    ``window * block_size`` positions are shuffled among themselves: by one Feistel
    permutation of the epoch after a rotation keyed by the window (so all windows cost one
    vectorised call), and by a permutation of its own for the last, shorter window. A reader
    that takes a window at a time needs one request per block rather than one per sample;
    the price is that samples meet only others of their window in a batch (see
    docs/sampling.md for the measured quality).
    """

    def __init__(self, num_samples: int, seed: int, block_size: int, window: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.block_size = block_size
        self.window = window
        self.window_samples = block_size * window
        self.full_blocks = num_samples // block_size
        self.full_windows = num_samples // self.window_samples
        self._blocks = lru_cache(maxsize=2)(self._make_blocks)
        self._in_window = lru_cache(maxsize=2)(self._make_in_window)

    def _make_blocks(self, epoch: int) -> tuple[FeistelPermutation | None, int]:
        key = epoch_key(self.seed, epoch)
        offset = derive_key(key, 0) % self.num_samples
        if not self.full_blocks:
            return None, offset
        return FeistelPermutation(self.full_blocks, derive_key(key, 1)), offset

    def _make_in_window(
        self, epoch: int
    ) -> tuple[FeistelPermutation | None, FeistelPermutation | None, np.uint64]:
        """The shuffle of full windows, that of the last short one, and the rotation key."""
        key = epoch_key(self.seed, epoch)
        full = last = None
        if self.full_windows:
            full = FeistelPermutation(self.window_samples, derive_key(key, 2))
        rest = self.num_samples - self.full_windows * self.window_samples
        if rest:
            last = FeistelPermutation(rest, derive_key(key, 3))
        return full, last, np.uint64(derive_key(key, 4))

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        if not positions.size:
            return positions
        windows = positions // self.window_samples
        inside = positions - windows * self.window_samples
        full, last, rotation_key = self._in_window(epoch)
        in_full = windows < self.full_windows
        if full is not None:
            picked = np.flatnonzero(in_full)
            rotation = _mix64(windows[picked].astype(np.uint64) ^ rotation_key)
            rotation %= np.uint64(self.window_samples)
            shifted = inside[picked] + rotation.astype(np.int64)
            shifted %= self.window_samples
            inside[picked] = full(shifted)
        if last is not None:
            picked = np.flatnonzero(~in_full)
            if picked.size:
                inside[picked] = last(inside[picked])
        block_of = windows * self.window + inside // self.block_size
        within = inside % self.block_size
        permutation, offset = self._blocks(epoch)
        if permutation is not None:
            full_block = block_of < self.full_blocks
            block_of[full_block] = permutation(block_of[full_block])
        samples: Int64Array = block_of * self.block_size + within + offset
        samples %= self.num_samples
        return samples


def _mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser on an array (multiplication wraps modulo 2**64 by design)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def make_sample_order(
    num_samples: int, shuffle: str, seed: int, block_size: int = 1, window: int = 1
) -> SampleOrder:
    """The sample order named by ``shuffle`` (already normalised)."""
    if shuffle == "global":
        return GlobalShuffle(num_samples, seed)
    if shuffle == "block":
        return BlockShuffle(num_samples, seed, block_size, window)
    return Sequential(num_samples)


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
        tail: str = "drop",
        block_size: int = 1,
        window: int = 1,
        samples: SampleOrder | None = None,
    ) -> None:
        if tail not in TAILS:
            raise ConfigError(f"tail={tail!r}: expected one of {TAILS}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = normalize_shuffle(shuffle)
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.tail = tail
        self.samples = samples or make_sample_order(
            num_samples, self.shuffle, seed, block_size, window
        )
        unit = batch_size * world_size if drop_last else world_size
        if tail == "drop":
            positions = num_samples // unit * unit
        else:
            positions = -(-num_samples // unit) * unit if num_samples else 0
        #: Global positions per epoch: num_samples minus the dropped or plus the wrapped tail.
        self.positions_per_epoch = positions
        self.samples_per_rank = positions // world_size
        self.batches_per_epoch = -(-self.samples_per_rank // batch_size)
        self._block = lru_cache(maxsize=4)(self._make_block)

    def _make_block(self, epoch: int, block: int) -> Int64Array:
        start = block * ID_BLOCK
        stop = min(start + ID_BLOCK, self.samples_per_rank)
        positions = np.arange(start, stop, dtype=np.int64)
        positions *= self.world_size
        positions += self.rank
        if self.tail == "wrap":
            np.remainder(positions, self.num_samples, out=positions)
        ids = self.samples(epoch, positions)
        ids.flags.writeable = False
        return ids

    def batch_length(self, batch: int) -> int:
        """Samples in batch ``batch`` (only the last one of an epoch may be short)."""
        return min(self.batch_size, self.samples_per_rank - batch * self.batch_size)

    def sample_ids(self, epoch: int, first_batch: int, stop_batch: int) -> Int64Array:
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
