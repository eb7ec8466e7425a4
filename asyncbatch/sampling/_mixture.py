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

    def __call__(self, epoch: int, positions: Int64Array) -> Int64Array:
        out = np.empty(positions.shape, dtype=np.int64)
        if not positions.size:
            return out
        stream = positions + epoch * self.num_samples
        chunks = stream // self.chunk
        inside = stream - chunks * self.chunk
        which = np.empty(positions.shape, dtype=np.int64)
        nth = np.empty(positions.shape, dtype=np.int64)
        for chunk in np.unique(chunks).tolist():
            mask = chunks == chunk
            table_which, table_nth = self._table(chunk)
            which[mask] = table_which[inside[mask]]
            nth[mask] = table_nth[inside[mask]]
        for d in np.unique(which).tolist():
            mask = which == d
            size = int(self.sizes[d])
            epochs = nth[mask] // size
            local = nth[mask] - epochs * size
            ids = np.empty(local.shape, dtype=np.int64)
            for inner_epoch in np.unique(epochs).tolist():
                part = epochs == inner_epoch
                ids[part] = self.inner[d](inner_epoch, local[part])
            out[mask] = ids + self.id_base[d]
        return out
