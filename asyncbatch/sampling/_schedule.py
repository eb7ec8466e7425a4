"""Mixture weights that follow a schedule over training steps, allocated exactly.

A :class:`Schedule` is data: breakpoints ``(step, weights)``, linear between them, constant
before the first and after the last; two breakpoints at one step make a step change. A step
is one global batch (``batch_size × world_size`` positions of the stream), so the schedule
reads the same at every world size with that global batch.

Allocation, exact at every step: with ``f_d(s)`` the schedule's integral for dataset ``d``
up to step ``s`` (its target count, in samples), the counts after step ``s`` are ``f(s)``
rounded by largest remainder: each within ±1 of its target, summing to the positions so
far. Where that would take a sample back (a dataset whose target grew by less than one in a
step lost its rounding up), the step carries instead: that dataset keeps its count (ahead
by less than one) and the others share the step by largest remainder of what they lack.
Both are vectorised over a block of steps; only carried steps run one at a time, and the
counts at each block's start are kept, so a far position costs one pass over the blocks
before it once. Inside a step, :func:`rank_loads` shares each dataset's samples between
the ranks (position ``q`` is rank ``q mod W``'s) so that each rank's count stays near its
``1/W`` share, and each rank's batch interleaves its datasets evenly.

A :class:`SchedulePiece` is a schedule applied from stream position ``start`` on, with the
counts each dataset had there (``taken``): a run resumed with a changed schedule appends a
piece, and each dataset goes on with its ``taken[d]``-th sample of its own order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError

Int64Array = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: Positions per table of a piece (a table costs a few sorts of this many positions).
PIECE_CHUNK = 2**16


@dataclass(frozen=True)
class Schedule:
    """Mixture weights over training steps: ``((step, (w_0, ..., w_n-1)), ...)``, steps
    non-decreasing; each breakpoint's weights are relative (normalised where used)."""

    breakpoints: tuple[tuple[int, tuple[float, ...]], ...]

    @classmethod
    def parse(cls, value: Any, datasets: int) -> Schedule:
        """``value`` (a Schedule, or pairs ``(step, weights)``) checked for ``datasets``."""
        if isinstance(value, Schedule):
            value = value.breakpoints
        if not isinstance(value, Sequence) or isinstance(value, str) or not value:
            raise ConfigError(f"a weight schedule needs (step, weights) pairs, got {value!r}")
        points: list[tuple[int, tuple[float, ...]]] = []
        for item in value:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise ConfigError(f"schedule breakpoint {item!r}: expected (step, weights)")
            step, weights = item
            if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
                raise ConfigError(f"schedule step {step!r}: expected a non-negative integer")
            if points and step < points[-1][0]:
                raise ConfigError(f"schedule steps must not decrease: {step} after {points[-1][0]}")
            try:
                floats = tuple(float(w) for w in weights)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"schedule weights at step {step}: {weights!r}") from exc
            if len(floats) != datasets:
                raise ConfigError(
                    f"{len(floats)} weights for {datasets} datasets at schedule step {step}"
                )
            total = sum(floats)
            if any(not math.isfinite(w) or w < 0 for w in floats) or not total > 0:
                raise ConfigError(
                    f"weights at schedule step {step} must be finite, non-negative, not all 0:"
                    f" {floats}"
                )
            points.append((int(step), floats))
        if any(
            a[0] == b[0] == c[0] for a, b, c in zip(points, points[1:], points[2:], strict=False)
        ):
            raise ConfigError("a schedule step has more than two breakpoints (one step change)")
        return cls(tuple(points))

    def to_data(self) -> list[list[Any]]:
        """Plain lists, for a state."""
        return [[step, list(weights)] for step, weights in self.breakpoints]

    def digest(self) -> str:
        return hashlib.sha256(repr(self.breakpoints).encode()).hexdigest()[:16]

    def weights_at(self, step: float) -> FloatArray:
        """The weights at ``step`` (after a step change there)."""
        points = [(s, _normalised(w)) for s, w in self.breakpoints]
        return _rate(points, float(step), after=True)

    def __repr__(self) -> str:
        return f"Schedule({list(self.breakpoints)})"


class SchedulePiece:
    """``schedule`` from stream position ``start`` (a whole step) on, dataset ``d`` having
    had ``taken[d]`` samples there; ``step`` positions per schedule step (the global batch),
    shared by ``ranks`` ranks (balanced between them, see :func:`rank_loads`)."""

    def __init__(
        self, schedule: Schedule, start: int, taken: Sequence[int], step: int, ranks: int = 1
    ) -> None:
        if start % step or step % ranks:
            raise ValueError(f"a schedule piece starts at a whole step, not position {start}")
        self.schedule = schedule
        self.start = int(start)
        self.taken = np.asarray(taken, dtype=np.int64)
        self.step = step
        #: Ranks sharing each step (position ``q`` of a step is rank ``q mod ranks``'s).
        self.ranks = ranks
        self.first_step = self.start // step
        #: Steps per block: the unit of vectorised allocation and of the tables.
        self.block = max(1, PIECE_CHUNK // step)
        points = [(s * step, _normalised(w)) for s, w in schedule.breakpoints]
        # Segments [knots[i], knots[i+1]) from start on, with the rates at their two ends.
        knots = [float(start)] + sorted({float(x) for x, _ in points if x > start})
        self.knots = np.asarray(knots, dtype=np.float64)
        left = np.stack([_rate(points, x, after=True) for x in knots])
        right = np.stack([_rate(points, x, after=False) for x in knots[1:]] + [left[-1]])
        lengths = np.append(np.diff(self.knots), 1.0)
        self.rate = left
        self.slope = (right - left) / lengths[:, None]
        values = np.zeros((len(knots), self.taken.size), dtype=np.float64)
        values[0] = self.taken
        for i in range(len(knots) - 1):
            values[i + 1] = values[i] + (left[i] + right[i]) / 2 * lengths[i]
        #: The target count of each dataset at each knot.
        self.values = values
        #: Counts at the start of blocks 0, 1, ... (grown in order, kept).
        self._block_starts: list[Int64Array] = [self.taken.copy()]
        self._counts = lru_cache(maxsize=4)(self._make_counts)
        self._table = lru_cache(maxsize=4)(self._make_table)

    def integral(self, x: FloatArray) -> FloatArray:
        """Target counts ``f_d(x)`` at stream positions ``x``, shape ``(len(x), n)``."""
        seg = (np.searchsorted(self.knots, x, side="right") - 1).clip(0)
        u = (x - self.knots[seg])[:, None]
        out: FloatArray = self.values[seg] + self.rate[seg] * u + self.slope[seg] * u * u / 2
        return out

    def _make_counts(self, block: int) -> Int64Array:
        """Counts after each step of ``block``: shape ``(block + 1, n)``, row 0 its start."""
        while len(self._block_starts) <= block:
            last = len(self._block_starts) - 1
            self._block_starts.append(self._allocate(last)[-1])
        return self._allocate(block)

    def _allocate(self, block: int) -> Int64Array:
        begin = self.start + block * self.block * self.step
        ends = begin + self.step * np.arange(1, self.block + 1, dtype=np.float64)
        targets = self.integral(ends)
        rounded = largest_remainder(targets, ends - self.start + self.taken.sum())
        out = np.empty((self.block + 1, self.taken.size), dtype=np.int64)
        out[0] = self._block_starts[block]
        # Rows where the rounded counts fall below the row before: the fast path ends there.
        drops = np.flatnonzero((rounded[1:] < rounded[:-1]).any(axis=1)) + 1
        i = 0
        while i < self.block:
            if (rounded[i] >= out[i]).all():
                k = int(np.searchsorted(drops, i, side="right"))
                stop = int(drops[k]) if k < drops.size else self.block
                out[i + 1 : stop + 1] = rounded[i:stop]
                i = stop
                continue
            out[i + 1] = carry(out[i], targets[i], self.step)
            i += 1
        return out

    def _make_table(self, block: int) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Positions of ``block``: dataset and ``k`` of each; counts after each step."""
        counts = self._counts(block)
        m = np.diff(counts, axis=0)  # (steps, n) samples of each dataset per step
        steps, n = m.shape
        world, per_rank = self.ranks, self.step // self.ranks
        loads = rank_loads(counts[:-1], m, world, per_rank)  # (steps, W, n)
        # Each rank's share of a step spread evenly over its batch (one pattern per distinct
        # share: there are few).
        rows = loads.reshape(-1, n)
        if (per_rank + 1) ** n < 2**62:  # one integer per row: a fast unique
            code = rows @ (per_rank + 1) ** np.arange(n, dtype=np.int64)
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            shares = rows[first]
        else:
            shares, inverse = np.unique(rows, axis=0, return_inverse=True)
            inverse = inverse.ravel()
        spread = spread_evenly(shares, per_rank)[inverse].ravel()
        # Item j of rank r in step s is position s·G + j·W + r of the stream.
        which = spread.reshape(steps, world, per_rank).transpose(0, 2, 1).ravel()
        # k in stream order within each step: dataset d's count before the step, plus its
        # positions so far in the step (each dataset's samples come in its own order).
        seen = (which.reshape(steps, self.step, 1) == np.arange(n)).cumsum(axis=1)
        step_of = np.repeat(np.arange(steps, dtype=np.int64), self.step)
        flat_seen = seen.reshape(-1, n)[np.arange(which.size), which]
        nth = counts[:-1][step_of, which] + flat_seen - 1
        which.flags.writeable = nth.flags.writeable = False
        return which, nth, counts

    def locate_stream(self, stream: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Dataset and ``k`` of stream positions (all at or after ``start``)."""
        which = np.empty(stream.shape, dtype=np.int64)
        nth = np.empty(stream.shape, dtype=np.int64)
        size = self.block * self.step
        offset = stream - self.start
        blocks = offset // size
        if blocks.size and blocks.min() == blocks.max():  # the usual case: one table
            block = int(blocks[0])
            table_which, table_nth, _ = self._table(block)
            inside = offset - block * size
            return table_which[inside], table_nth[inside]
        for block in np.unique(blocks).tolist():
            mask = blocks == block
            table_which, table_nth, _ = self._table(block)
            inside = offset[mask] - block * size
            which[mask] = table_which[inside]
            nth[mask] = table_nth[inside]
        return which, nth

    def taken_at(self, position: int) -> Int64Array:
        """Samples of each dataset in stream positions ``[0, position)``."""
        block, inside = divmod(position - self.start, self.block * self.step)
        which, _, counts = self._table(block)
        step, within = divmod(inside, self.step)
        first = step * self.step
        out: Int64Array = counts[step] + np.bincount(
            which[first : first + within], minlength=self.taken.size
        )
        return out


def spread_evenly(shares: Int64Array, size: int) -> Int64Array:
    """For each row of ``shares`` (samples of each dataset, summing to ``size``), the
    datasets of ``size`` slots: item ``i`` of dataset ``d`` goes where ``(i + 1/2) / L_d``
    falls among all the row's items' (ties: the lower dataset first), placed in integers."""
    rows, n = shares.shape
    sizes = shares.ravel()
    owner = np.repeat(np.tile(np.arange(n, dtype=np.int64), rows), sizes)
    row = np.repeat(np.arange(rows, dtype=np.int64), size)
    i = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    own = shares[row, owner]
    place = i.copy()
    for other in range(n):
        theirs = shares[row, other]
        scaled = (2 * i + 1) * theirs  # items i' of ``other`` with (2i' + 1)·L < (2i + 1)·L'
        before = np.where(other < owner, (scaled // own + 1) // 2, (-(-scaled // own)) // 2)
        place += np.where(other == owner, 0, np.minimum(before, theirs))
    out = np.empty((rows, size), dtype=np.int64)
    out.ravel()[row * size + place] = owner
    return out


def rank_loads(before: Int64Array, m: Int64Array, world: int, per_rank: int) -> Int64Array:
    """How many samples of each dataset each rank takes in each step, shape (steps, W, n).

    Dataset ``d``'s ``k``-th sample counts for rank ``(k + c_d) mod W`` (``c_d`` spreads the
    datasets' starts), so each rank's count of ``d`` stays within 1 of its ``1/W`` share; the
    dataset with the most samples in the step fills what the others leave of each rank's
    batch (so its count per rank is off by at most the others' deviations). A step where
    that would not fit (batches of fewer samples than about n² for n datasets) deals its
    samples out in dataset order, round robin, and balances ranks less well.
    """
    steps, n = m.shape
    ranks = np.arange(world, dtype=np.int64)[None, :, None]
    offsets = (np.arange(n, dtype=np.int64) * world) // n

    def residue(first: Int64Array, size: Int64Array) -> Int64Array:
        """Of ``k`` in ``[first, first + size)``, how many fall to each rank."""
        lead = (ranks - first[:, None, :]) % world
        extra = (lead < (size % world)[:, None, :]).astype(np.int64)
        out: Int64Array = size[:, None, :] // world + extra
        return out

    loads = residue(before + offsets, m)
    filler = np.argmax(m, axis=1)
    is_filler = np.arange(n)[None, :] == filler[:, None]
    loads[np.broadcast_to(is_filler[:, None, :], loads.shape)] = 0
    rest = per_rank - loads.sum(axis=2)  # (steps, W): what the filler takes
    loads[np.arange(steps)[:, None], np.arange(world)[None, :], filler[:, None]] = rest
    bad = (rest < 0).any(axis=1)
    if bad.any():
        # Round robin in dataset order from where the first dataset's last one went: item z
        # of the step is rank (C_0 + z) mod W's.
        start = np.cumsum(m[bad], axis=1) - m[bad] + before[bad][:, :1]
        loads[bad] = residue(start, m[bad])
    return loads


def _normalised(weights: Sequence[float]) -> FloatArray:
    out: FloatArray = np.asarray(weights, dtype=np.float64)
    out /= out.sum()
    return out


def _rate(points: list[tuple[int, FloatArray]], x: float, *, after: bool) -> FloatArray:
    """The weights at position ``x``: after a step change there, or before it."""
    xs = [p for p, _ in points]
    i = int(np.searchsorted(xs, x, side="right" if after else "left")) - 1
    if i < 0:
        return points[0][1]
    if i == len(points) - 1:
        return points[i][1]
    (x0, w0), (x1, w1) = points[i], points[i + 1]
    if x1 == x0:
        return w1
    out: FloatArray = w0 + (x - x0) / (x1 - x0) * (w1 - w0)
    return out


def largest_remainder(targets: FloatArray, totals: FloatArray) -> Int64Array:
    """Each row of ``targets`` rounded to integers summing to its ``totals`` (rounded):
    floors, then one more for the largest fractions (ties: the lower dataset)."""
    floors = np.floor(targets)
    short = np.rint(totals).astype(np.int64) - floors.sum(axis=1).astype(np.int64)
    rank = np.argsort(np.argsort(floors - targets, axis=1, kind="stable"), axis=1)
    out: Int64Array = floors.astype(np.int64) + (rank < short[:, None])
    return out


def carry(counts: Int64Array, targets: FloatArray, step: int) -> Int64Array:
    """Counts after a step from ``counts``, towards ``targets``, never taking one back."""
    lack = targets - counts
    add = np.floor(lack).clip(0).astype(np.int64)
    short = step - int(add.sum())
    fraction = np.where(lack > 0, lack - add, -np.inf)
    if short > 0:
        add[np.argsort(-fraction, kind="stable")[:short]] += 1
    elif short < 0:  # more floors than positions: the smallest fractions give one back
        fraction = np.where(add > 0, lack - add, np.inf)
        add[np.argsort(fraction, kind="stable")[:-short]] -= 1
    out: Int64Array = counts + add
    return out
