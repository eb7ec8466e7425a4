"""The order of a mixture: several datasets blended by weight into one stream, O(1) per sample.

The stream is cut into chunks of ``C`` positions (at most 65536). In every chunk dataset
``d`` owns exactly ``n_d`` positions (``C`` split by the weights, largest remainder first),
scattered over the chunk by a Feistel permutation keyed by ``(seed, chunk)``. A table of one
chunk (which dataset each position serves, and how many of that dataset's positions come
before it) is computed when first needed and cached, so position ``t`` of the stream maps in
O(1) to the ``k``-th sample dataset ``d`` contributes, with ``k`` growing along the stream.
Dataset ``d``'s ``k``-th sample is position ``k mod N_d`` of its own epoch ``k // N_d``, in its
own shuffle: no sample comes twice before all of its dataset's others came once.

The policy when a dataset runs out: it starts its next epoch, with a new order, and goes on;
no dataset restarts in the middle of an epoch. The mixture's epoch ``e`` is positions
``[e·L, (e+1)·L)`` of the stream, so each dataset continues in epoch ``e + 1`` where it
stopped in epoch ``e``. By default ``L`` is the datasets' sizes summed and the weights are
proportional to the sizes: one mixture epoch is then one epoch of every dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._feistel import FeistelPermutation
from ._order import SampleOrder, derive_key
from ._schedule import SchedulePiece

Int64Array = npt.NDArray[np.int64]

#: The most positions per chunk: weights are exact over every chunk of this many samples.
MAX_CHUNK = 2**16


def split_by_weight(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``, largest remainders rounded up."""
    quotas = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * total
    counts = np.floor(quotas).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(quotas - counts), kind="stable")
        counts[order[:short]] += 1
    return [int(c) for c in counts]


class MixtureOrder:
    """Positions of the mixture's epochs → ids in the concatenation of its datasets' samples.

    ``inner[d]`` orders dataset ``d``'s ``sizes[d]`` samples; the id of its sample ``s`` is
    ``sum(sizes[:d]) + s``.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seed: int,
        samples_per_epoch: int,
        inner: Sequence[SampleOrder],
    ) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.num_samples = samples_per_epoch
        self.seed = seed
        self.inner = list(inner)
        self.chunk = max(1, min(samples_per_epoch, MAX_CHUNK))
        counts = split_by_weight(self.chunk, weights)
        for d, (count, weight) in enumerate(zip(counts, weights, strict=True)):
            if weight > 0 and count == 0:
                raise ConfigError(
                    f"weight {weight} of dataset {d} gives it no sample in {self.chunk};"
                    " raise it or the mixture's samples per epoch"
                )
        self.counts = np.asarray(counts, dtype=np.int64)
        self.slot_ends = np.cumsum(self.counts)
        self.slot_starts = self.slot_ends - self.counts
        self.id_base = np.cumsum(self.sizes) - self.sizes
        self._table = lru_cache(maxsize=4)(self._make_table)

    def _make_table(self, chunk: int) -> tuple[Int64Array, Int64Array]:
        """For each position of ``chunk``: its dataset, and its ``k`` in that dataset."""
        slots = FeistelPermutation(self.chunk, derive_key(self.seed, chunk))(
            np.arange(self.chunk, dtype=np.int64)
        )
        which = np.searchsorted(self.slot_ends, slots, side="right").astype(np.int64)
        by_dataset = np.argsort(which, kind="stable")  # positions of d, in stream order
        nth = np.empty(self.chunk, dtype=np.int64)
        nth[by_dataset] = np.arange(self.chunk) - self.slot_starts[which[by_dataset]]
        nth += chunk * self.counts[which]
        which.flags.writeable = nth.flags.writeable = False
        return which, nth

    def locate_stream(self, stream: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Dataset and ``k`` (its sample's rank in that dataset's stream) of stream positions."""
        chunks = stream // self.chunk
        inside = stream - chunks * self.chunk
        if chunks.size and chunks.min() == chunks.max():  # the usual case: one table
            table_which, table_nth = self._table(int(chunks[0]))
            return table_which[inside], table_nth[inside]
        which = np.empty(stream.shape, dtype=np.int64)
        nth = np.empty(stream.shape, dtype=np.int64)
        for chunk in np.unique(chunks).tolist():
            mask = chunks == chunk
            table_which, table_nth = self._table(chunk)
            which[mask] = table_which[inside[mask]]
            nth[mask] = table_nth[inside[mask]]
        return which, nth

    def taken_at(self, position: int) -> Int64Array:
        """Samples of each dataset in stream positions ``[0, position)``."""
        chunk, inside = divmod(position, self.chunk)
        which, _ = self._table(chunk)
        out: Int64Array = chunk * self.counts + np.bincount(
            which[:inside], minlength=self.counts.size
        )
        return out

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        if not positions.size:
            return np.empty(positions.shape, dtype=np.int64)
        which, nth = self.locate_stream(positions + epoch * self.num_samples)
        return ids_of(which, nth, self.sizes, self.id_base, self.inner)


def ids_of(
    which: Int64Array,
    nth: Int64Array,
    sizes: Int64Array,
    id_base: Int64Array,
    inner: Sequence[SampleOrder],
) -> Int64Array:
    """Ids of the ``nth[i]``-th samples of datasets ``which[i]``: pass ``k // size`` of the
    dataset, position ``k mod size`` of its own order (a new one each pass)."""
    out = np.empty(which.shape, dtype=np.int64)
    for d in np.unique(which).tolist():
        mask = which == d
        size = int(sizes[d])
        epochs = nth[mask] // size
        local = nth[mask] - epochs * size
        ids = np.empty(local.shape, dtype=np.int64)
        for inner_epoch in np.unique(epochs).tolist():
            part = epochs == inner_epoch
            ids[part] = inner[d](inner_epoch, local[part])
        out[mask] = ids + id_base[d]
    return out


class ScheduledMixtureOrder:
    """A mixture's order in parts along the stream: a first part (a fixed-weight
    :class:`MixtureOrder`, or a schedule piece from position 0), then a schedule piece from
    each position where a resumed run changed the schedule (:mod:`._schedule`)."""

    def __init__(
        self,
        sizes: Sequence[int],
        samples_per_epoch: int,
        inner: Sequence[SampleOrder],
        first: MixtureOrder | None,
        pieces: Sequence[SchedulePiece],
    ) -> None:
        if first is None and (not pieces or pieces[0].start != 0):
            raise ValueError("a scheduled mixture's first part starts at position 0")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.id_base = np.cumsum(self.sizes) - self.sizes
        self.num_samples = samples_per_epoch
        self.inner = list(inner)
        self.first = first
        self.pieces = list(pieces)
        self.starts = np.asarray([p.start for p in self.pieces], dtype=np.int64)

    def locate_stream(self, stream: Int64Array) -> tuple[Int64Array, Int64Array]:
        if self.first is None and len(self.pieces) == 1:
            return self.pieces[0].locate_stream(stream)
        part = np.searchsorted(self.starts, stream, side="right") - 1
        if part.size and part.min() == part.max():  # the usual case: one part
            return self._part(int(part[0])).locate_stream(stream)
        which = np.empty(stream.shape, dtype=np.int64)
        nth = np.empty(stream.shape, dtype=np.int64)
        for p in np.unique(part).tolist():
            mask = part == p
            which[mask], nth[mask] = self._part(p).locate_stream(stream[mask])
        return which, nth

    def _part(self, index: int) -> MixtureOrder | SchedulePiece:
        if index < 0:
            assert self.first is not None
            return self.first
        return self.pieces[index]

    def taken_at(self, position: int) -> Int64Array:
        """Samples of each dataset in stream positions ``[0, position)``."""
        index = int(np.searchsorted(self.starts, position, side="right")) - 1
        return self._part(index).taken_at(position)

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        if not positions.size:
            return np.empty(positions.shape, dtype=np.int64)
        which, nth = self.locate_stream(positions + epoch * self.num_samples)
        return ids_of(which, nth, self.sizes, self.id_base, self.inner)
