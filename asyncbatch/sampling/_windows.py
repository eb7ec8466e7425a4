"""The block shuffle cut by rank windows: each rank reads whole runs of blocks of its own.

The epoch's *layout* (:meth:`BlockShuffle.layout`) orders blocks of ``block_size``
consecutive samples. A *rank window* is ``c = window * block_size`` consecutive layout
positions: ``window`` whole blocks. Of ``M`` layout positions and ``W`` ranks, the first
``n = M // (W·c)`` rounds of ``W`` rank windows are dealt out whole (window ``u`` to rank
``u mod W``), and the rest, ``R = M - n·W·c`` positions, in ``W`` contiguous slices of
``R / W``. Inside its window (or slice) a rank's positions are shuffled by one Feistel
permutation of the epoch after a rotation keyed by the window, so all windows cost one
vectorised call. A rank's requests therefore cover only its own samples, at any ``W``, and
its batches mix ``window`` blocks whatever ``W`` is.

The cost: which samples a global batch holds depends on ``W``. A run resumed on another
world size (same global batch ``B·W``) replays the epoch's *history*, a list of
``(world_size, first global batch)`` segments: at each change the samples not yet delivered
are the unread rest of the rounds the ranks were in (at most ``W·c`` ids, kept explicitly,
in layout order) followed by the untouched layout, and this *virtual layout* is dealt out
again to the new ranks the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ._feistel import FeistelPermutation
from ._keys import derive_key, epoch_key, mix64

Int64Array = npt.NDArray[np.int64]

#: ``(world_size, first global batch)`` of each stretch of an epoch run on one world size.
Segment = tuple[int, int]
History = tuple[Segment, ...]


class BlockLayout(Protocol):
    """The epoch's blocks in order (:class:`~asyncbatch.sampling._order.BlockShuffle`)."""

    seed: int
    window_samples: int

    def layout(self, epoch: int, positions: Int64Array) -> Int64Array: ...


def extend_history(segments: Sequence[Segment], world_size: int, done: int) -> History:
    """The history after resuming ``segments`` on ``world_size`` at global batch ``done``.

    The same world size adds nothing; a segment that delivered no batch is dropped. A
    history of one segment (nothing changed in the epoch) is ``()``.
    """
    history = [(int(w), int(g)) for w, g in segments] or [(world_size, 0)]
    while history and history[-1][0] != world_size and history[-1][1] >= done:
        history.pop()
    if not history or history[-1][0] != world_size:
        history.append((world_size, done if history else 0))
    return tuple(history) if len(history) > 1 else ()


@dataclass(frozen=True)
class VirtualLayout:
    """Explicit sample ids, then layout positions ``start, start + 1, …`` of the epoch."""

    explicit: Int64Array
    start: int

    def ids(self, index: Int64Array, layout: Callable[[Int64Array], Int64Array]) -> Int64Array:
        """The sample ids at ``index`` (virtual positions)."""
        count = self.explicit.size
        if not count:
            return layout(index + self.start)
        out = np.empty(index.size, dtype=np.int64)
        inside = index < count
        out[inside] = self.explicit[index[inside]]
        out[~inside] = layout(index[~inside] - count + self.start)
        return out

    def after(self, index: int) -> VirtualLayout:
        """The virtual layout from position ``index`` on."""
        count = self.explicit.size
        if index <= count:
            return VirtualLayout(self.explicit[index:], self.start)
        return VirtualLayout(self.explicit[:0], self.start + index - count)


class WindowSplit:
    """Rank ``r``'s ``k``-th position of ``size`` virtual positions dealt to ``world_size``
    ranks in rank windows of ``window_samples`` (see the module docstring)."""

    def __init__(self, size: int, world_size: int, window_samples: int, key: int) -> None:
        c = window_samples
        self.size, self.world_size, self.window_samples = size, world_size, c
        self.rounds = size // (world_size * c)
        self.tail_start = self.rounds * world_size * c
        #: Each rank's slice of the positions left after the full rounds.
        self.slice = (size - self.tail_start) // world_size
        self._full = FeistelPermutation(c, derive_key(key, 2)) if self.rounds else None
        self._last = FeistelPermutation(self.slice, derive_key(key, 3)) if self.slice else None
        self._rotation_key = np.uint64(derive_key(key, 4))

    def _rotated(
        self, permutation: FeistelPermutation, inside: Int64Array, windows: Int64Array, span: int
    ) -> Int64Array:
        rotation = mix64(windows.astype(np.uint64) ^ self._rotation_key) % np.uint64(span)
        shifted = inside + rotation.astype(np.int64)
        shifted %= span
        return permutation(shifted)

    def positions(self, rank: Int64Array | int, k: Int64Array) -> Int64Array:
        """Virtual positions of stream indexes ``k`` of ``rank`` (an array the size of ``k``
        or one rank)."""
        c, world = self.window_samples, self.world_size
        ranks = np.broadcast_to(np.asarray(rank, dtype=np.int64), k.shape)
        out = np.empty(k.size, dtype=np.int64)
        in_full = k < self.rounds * c
        if self._full is not None:
            picked = np.flatnonzero(in_full)
            windows = k[picked] // c * world + ranks[picked]
            inside = k[picked] % c
            out[picked] = windows * c + self._rotated(self._full, inside, windows, c)
        if self._last is not None:
            picked = np.flatnonzero(~in_full)
            if picked.size:
                mine = ranks[picked]
                inside = k[picked] - self.rounds * c
                placed = self._rotated(self._last, inside, mine, self.slice)
                out[picked] = self.tail_start + mine * self.slice + placed
        return out

    def unread(self, taken: int) -> tuple[Int64Array, int]:
        """After every rank took its first ``taken`` positions: the positions of the rounds
        they were in that nobody took (sorted), and where the untouched rest starts."""
        c, world = self.window_samples, self.world_size
        if taken <= self.rounds * c:
            done, part = divmod(taken, c)
            if not part:
                return np.empty(0, dtype=np.int64), done * world * c
            ks = np.arange(done * c + part, (done + 1) * c, dtype=np.int64)
            rest = (done + 1) * world * c
        else:
            ks = np.arange(taken, self.rounds * c + self.slice, dtype=np.int64)
            rest = self.size
        ranks = np.repeat(np.arange(world, dtype=np.int64), ks.size)
        left = self.positions(ranks, np.tile(ks, world))
        left.sort()
        return left, rest


class RankWindows:
    """The sample ids rank ``rank`` reads, by stream index, under any history of the epoch.

    ``positions_for(world_size)`` gives the epoch's positions at that world size (the same
    global batch); ``global_batch`` is ``batch_size * world_size``.
    """

    def __init__(
        self,
        order: BlockLayout,
        *,
        rank: int,
        world_size: int,
        global_batch: int,
        positions_for: Callable[[int], int],
    ) -> None:
        self.order = order
        self.rank = rank
        self.world_size = world_size
        self.global_batch = global_batch
        self.positions_for = positions_for
        self._plan = lru_cache(maxsize=4)(self._make_plan)

    def _make_plan(self, epoch: int, history: History) -> tuple[VirtualLayout, WindowSplit]:
        """The virtual layout and split of the last segment of ``history`` in ``epoch``."""
        key = epoch_key(self.order.seed, epoch)
        segments = history or ((self.world_size, 0),)

        def split_of(index: int, world: int, first: int) -> WindowSplit:
            # (Only drop_last=False with tail="drop" makes the epoch's length depend on W.)
            size = max(0, self.positions_for(world) - first * self.global_batch)
            # The first segment keeps the epoch's own keys; each later one gets its own.
            segment_key = key if not index else derive_key(key, 16 + index)
            return WindowSplit(size, world, self.order.window_samples, segment_key)

        virtual = VirtualLayout(np.empty(0, dtype=np.int64), 0)
        for index, ((world, first), (_, stop)) in enumerate(pairwise(segments)):
            split = split_of(index, world, first)
            taken = min((stop - first) * (self.global_batch // world), split.size // world)
            left, rest = split.unread(taken)
            after = virtual.after(rest)
            explicit = np.concatenate([virtual.ids(left, self._layout(epoch)), after.explicit])
            virtual = VirtualLayout(explicit, after.start)
        world, first = segments[-1]
        return virtual, split_of(len(segments) - 1, world, first)

    def _layout(self, epoch: int) -> Callable[[Int64Array], Int64Array]:
        return lambda positions: self.order.layout(epoch, positions)

    def __call__(self, epoch: int, history: History, k: Int64Array) -> Int64Array:
        """Sample ids of this rank's stream indexes ``k``, counted from the start of the
        last segment of ``history`` (of the epoch without one)."""
        virtual, split = self._plan(epoch, history)
        return virtual.ids(split.positions(self.rank, k), self._layout(epoch))
