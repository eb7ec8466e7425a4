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
  global batch ``B·W`` is the same: a run can resume on another world size exactly. The
  block shuffle of one dataset instead gives each rank whole windows of blocks
  (:mod:`asyncbatch.sampling._windows`), so that a rank's reads cover only its own samples.

The tail: every rank yields the same number of batches (an uneven count hangs DDP).
``tail="drop"`` leaves out the last positions that do not fill a global batch (with
``drop_last=False``: that do not give every rank one more sample, and the last batch is
short); ``tail="wrap"`` fills them with the first samples of the same epoch's order again.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Protocol, TypeAlias, get_args

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._feistel import FeistelPermutation
from ._keys import derive_key as derive_key
from ._keys import epoch_key as epoch_key
from ._keys import mix64
from ._windows import History, RankWindows

Int64Array = npt.NDArray[np.int64]

#: The shuffles by name; ``shuffle=True`` means "global", ``False`` "none".
ShuffleName: TypeAlias = Literal["none", "global", "block", "batch"]
Shuffle: TypeAlias = bool | ShuffleName
#: What a rank does with the samples left after its last whole batch.
Tail: TypeAlias = Literal["drop", "wrap"]
SHUFFLES: tuple[ShuffleName, ...] = get_args(ShuffleName)
TAILS: tuple[Tail, ...] = get_args(Tail)

#: Positions whose sample ids are computed (and cached) together.
ID_BLOCK = 16384
#: So few ids are computed alone, not sliced from their block (a run's first, small groups
#: wait for their own ids, not for a block's ~0.5 ms; larger groups share cached blocks).
FEW_IDS = 256


def normalize_shuffle(shuffle: bool | str) -> str:
    """``True`` → ``"global"``, ``False`` → ``"none"``; anything unknown is a ConfigError."""
    if shuffle is True:
        return "global"
    if shuffle is False:
        return "none"
    if shuffle not in SHUFFLES:
        raise ConfigError(f"shuffle={shuffle!r}: expected True, False or one of {SHUFFLES}")
    return shuffle


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

    def __init__(
        self, num_samples: int, seed: int, block_size: int, window: int, aligned: bool = False
    ) -> None:
        self.num_samples = num_samples
        #: Blocks start at sample 0 every epoch: a format whose blocks are its read units
        #: (Parquet row groups) keeps their edges where the units' are.
        self.aligned = aligned
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
        offset = 0 if self.aligned else derive_key(key, 0) % self.num_samples
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
            rotation = mix64(windows[picked].astype(np.uint64) ^ rotation_key)
            rotation %= np.uint64(self.window_samples)
            shifted = inside[picked] + rotation.astype(np.int64)
            shifted %= self.window_samples
            inside[picked] = full(shifted)
        if last is not None:
            picked = np.flatnonzero(~in_full)
            if picked.size:
                inside[picked] = last(inside[picked])
        return self.layout(epoch, windows * self.window_samples + inside)

    def layout(self, epoch: int, positions: Int64Array) -> Int64Array:
        """The blocks in their epoch's order, unshuffled inside windows: position ``p`` is
        sample ``p - block_size·b`` of the ``b``-th block. Positions from ``N`` on wrap
        around (``tail="wrap"``)."""
        positions = positions % self.num_samples
        block_of = positions // self.block_size
        within = positions - block_of * self.block_size
        permutation, offset = self._blocks(epoch)
        if permutation is not None:
            full_block = block_of < self.full_blocks
            block_of[full_block] = permutation(block_of[full_block])
        samples: Int64Array = block_of * self.block_size + within + offset
        samples %= self.num_samples
        return samples


def make_sample_order(
    num_samples: int,
    shuffle: str,
    seed: int,
    block_size: int = 1,
    window: int = 1,
    aligned_blocks: bool = False,
) -> SampleOrder:
    """The sample order named by ``shuffle`` (already normalised); ``"batch"`` orders whole
    batches, not samples (:class:`~asyncbatch.sampling._batches.BatchOrder`)."""
    if shuffle == "batch":
        raise ConfigError("shuffle='batch' orders a file's batches, not samples: use BatchOrder")
    if shuffle == "global":
        return GlobalShuffle(num_samples, seed)
    if shuffle == "block":
        return BlockShuffle(num_samples, seed, block_size, window, aligned_blocks)
    return Sequential(num_samples)


def positions_per_epoch(
    num_samples: int, batch_size: int, world_size: int, drop_last: bool, tail: str
) -> int:
    """Global positions of an epoch: ``num_samples`` less the dropped or plus the wrapped tail."""
    unit = batch_size * world_size if drop_last else world_size
    if tail == "drop":
        return num_samples // unit * unit
    return -(-num_samples // unit) * unit if num_samples else 0


class EpochOrder:
    """Which global samples rank ``rank`` reads, batch by batch, in each epoch.

    A block shuffle of one dataset (``samples`` not given) deals whole rank windows out
    (:mod:`asyncbatch.sampling._windows`); every other order splits positions ``q % W``.
    """

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
        aligned_blocks: bool = False,
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
            num_samples, self.shuffle, seed, block_size, window, aligned_blocks
        )
        #: Global positions per epoch: num_samples minus the dropped or plus the wrapped tail.
        self.positions_per_epoch = positions_per_epoch(
            num_samples, batch_size, world_size, drop_last, tail
        )
        self.samples_per_rank = self.positions_per_epoch // world_size
        self.batches_per_epoch = -(-self.samples_per_rank // batch_size)
        global_batch = batch_size * world_size
        #: The rank-window split of a block shuffle; None for the position split.
        self.windows: RankWindows | None = None
        if samples is None and isinstance(self.samples, BlockShuffle) and num_samples:
            self.windows = RankWindows(
                self.samples,
                rank=rank,
                world_size=world_size,
                global_batch=global_batch,
                positions_for=lambda world: positions_per_epoch(
                    num_samples, global_batch // world, world, drop_last, tail
                ),
            )
        self._block = lru_cache(maxsize=4)(self._make_block)

    def first_batch(self, history: History) -> int:
        """The batch where the current stretch of ``history`` starts: the rank windows
        start there (0 for the position split, whose batches never depend on ``W``)."""
        return history[-1][1] if history and self.windows is not None else 0

    def _make_block(self, epoch: int, history: History, block: int) -> Int64Array:
        """Ids of ``ID_BLOCK`` stream indexes, counted from :meth:`first_batch`."""
        origin = self.first_batch(history) * self.batch_size
        start = block * ID_BLOCK
        return self._ids(
            epoch, history, start, min(start + ID_BLOCK, self.samples_per_rank - origin)
        )

    def _ids(self, epoch: int, history: History, start: int, stop: int) -> Int64Array:
        """Ids of stream indexes ``[start, stop)``, counted from :meth:`first_batch`."""
        positions = np.arange(start, stop, dtype=np.int64)
        if self.windows is not None:
            ids = self.windows(epoch, history, positions)
        else:
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

    def sample_ids(
        self, epoch: int, first_batch: int, stop_batch: int, history: History = ()
    ) -> Int64Array:
        """Global sample ids of batches ``[first_batch, stop_batch)``, concatenated.

        ``history`` is the epoch's world sizes so far (:func:`~asyncbatch.sampling._windows.
        extend_history`); the batches asked for must lie in its last stretch.
        """
        origin = self.first_batch(history) * self.batch_size
        if first_batch * self.batch_size < origin:
            raise ValueError(f"batch {first_batch} precedes the history's last stretch")
        history = history if self.windows is not None else ()
        start = first_batch * self.batch_size - origin
        stop = min(stop_batch * self.batch_size, self.samples_per_rank) - origin
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        # Ids are computed a block at a time: a vectorised call has a fixed cost (about 55
        # numpy passes, ~25 us, plus as much again when cycle walking needs a second pass)
        # that a few hundred ids would not amortise.
        first, last = start // ID_BLOCK, (stop - 1) // ID_BLOCK
        if first == last:
            if stop - start <= FEW_IDS:
                return self._ids(epoch, history, start, stop)
            offset = first * ID_BLOCK
            return self._block(epoch, history, first)[start - offset : stop - offset]
        parts = [self._block(epoch, history, b) for b in range(first, last + 1)]
        joined = np.concatenate(parts)
        return joined[start - first * ID_BLOCK : stop - first * ID_BLOCK]
