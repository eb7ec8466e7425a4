"""Mixtures: several datasets read as one weighted stream (see ``sampling/_mixture.py``),
with fixed weights or weights that follow a schedule (``sampling/_schedule.py``)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._dataset import Dataset
from ._errors import ConfigError
from ._open import open_dataset
from ._redact import redact
from .formats._registry import make_source, one_format
from .sampling._schedule import Schedule


@dataclass(frozen=True)
class Mixture:
    """Datasets, their weights, the seed of the blend and the samples per mixture epoch.

    Build it with :func:`mix`; any loader accepts it in place of a dataset. ``weights=None``
    means in proportion to the datasets' sizes; ``samples=None`` means their sizes summed.
    ``weights`` may be a :class:`~asyncbatch.Schedule` (weights over training steps).
    """

    datasets: tuple[Dataset, ...]
    weights: tuple[float, ...] | Schedule | None = None
    seed: int = 0
    samples: int | None = None
    #: The datasets' sizes by :meth:`locate`'s arguments (building a source reads footers).
    _sizes: dict[str, npt.NDArray[np.int64]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def schedule(self) -> Schedule | None:
        """The weights' schedule (None: fixed weights)."""
        return self.weights if isinstance(self.weights, Schedule) else None

    def fingerprint(self, weights: bool = True) -> str:
        """Identifies the blend (datasets, weights, seed, length), for checking resume states;
        ``weights=False``: all of it but the weights (a changed schedule may continue it)."""
        parts = [d.fingerprint() for d in self.datasets]
        if not weights:
            text = repr((parts, self.seed, self.samples))
            return f"blend:{len(parts)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        text = repr((parts, self.weights, self.seed, self.samples))
        return f"mixture:{len(parts)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def locate(
        self,
        indexes: npt.ArrayLike,
        seq_len: int,
        next_token: bool = False,
        format_options: Mapping[str, Any] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(dataset, sample)`` of each of a batch's ``global_indexes``; pass the loader's
        ``seq_len``, ``next_token`` and ``format_options``: the datasets' sizes are counted by
        the source the loader builds (a Parquet dataset's windows, from its token column)."""
        key = repr((seq_len, next_token, sorted((format_options or {}).items())))
        sizes = self._sizes.get(key)
        if sizes is None:
            source = make_source(
                self.datasets, seq_len=seq_len, next_token=next_token, options=format_options
            )
            sizes = self._sizes[key] = source.sizes
        ends = np.cumsum(sizes)
        ids = np.asarray(indexes, dtype=np.int64)
        which = np.searchsorted(ends, ids, side="right")
        return which.astype(np.int64), ids - (ends - sizes)[which]

    def __repr__(self) -> str:
        urls = ", ".join(redact(d.url) for d in self.datasets)
        return f"Mixture([{urls}], weights={self.weights}, seed={self.seed})"


def mix(
    datasets: Sequence[Dataset | str],
    weights: Sequence[float] | Sequence[tuple[int, Sequence[float]]] | Schedule | None = None,
    *,
    seed: int = 0,
    samples: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Mixture:
    """A weighted blend of ``datasets`` that :class:`~asyncbatch.Loader` reads as one stream.

    Each dataset keeps its own shuffle (the loader's, keyed per dataset); when one runs out it
    starts its next epoch and goes on. URLs are opened with ``storage_options``.

    ``weights`` is one weight per dataset, or a schedule over training steps (global
    batches): ``[(step, weights), ...]``, linear between breakpoints, constant before the
    first and after the last, two breakpoints at one step for a step change. With a schedule
    a mixture epoch is ``samples`` rounded down to whole global batches.
    """
    if not datasets:
        raise ConfigError("mix() needs at least one dataset")
    opened = tuple(
        d if isinstance(d, Dataset) else open_dataset(d, storage_options) for d in datasets
    )
    checked: tuple[float, ...] | Schedule | None = None
    if isinstance(weights, Schedule) or (
        isinstance(weights, Sequence) and len(weights) and isinstance(weights[0], Sequence)
    ):
        checked = Schedule.parse(weights, len(opened))
    elif weights is not None:
        try:
            checked = tuple(float(w) for w in weights)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"weights: expected numbers or a schedule, got {weights!r}") from exc
        if len(checked) != len(opened):
            raise ConfigError(f"{len(checked)} weights for {len(opened)} datasets")
        if any(not math.isfinite(w) or w < 0 for w in checked) or not sum(checked) > 0:
            raise ConfigError(f"weights must be finite, non-negative, not all 0: {checked}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    if samples is not None and (
        isinstance(samples, bool) or not isinstance(samples, int) or samples < 1
    ):
        raise ConfigError(f"samples must be a positive integer, got {samples!r}")
    one_format(opened)  # before the dtypes: a Parquet dataset's is no token dtype
    dtypes = {d.manifest.dtype for d in opened}
    if len(dtypes) > 1:
        raise ConfigError(f"mixed datasets must share one dtype, got {sorted(map(str, dtypes))}")
    return Mixture(opened, checked, seed, samples)
