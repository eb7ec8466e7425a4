"""Token streams: shards of one numpy dtype, read as fixed windows of the concatenated stream.

Sample ``i`` of a loader with ``seq_len = L`` is the window of elements ``[i*L, i*L + L)``
(``+ 1`` element with ``next_token=True``, for next-token targets). A window may cross shard
ends. Only the global tail that does not fill a window is left out. Plain dtypes give one
field, ``tokens``; a structured dtype gives one field per dtype field.

Several datasets of one dtype (a mixture) read as one: their shards are numbered one after
another, and sample ids run through the first dataset's samples, then the second's, and so
on; a window never crosses from one dataset into the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._dataset import Dataset
from .._errors import ConfigError
from .._layout import ReadPlan, ShardMap, WindowPlan
from ._base import PlannedSource

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

TOKENS_FIELD = "tokens"


class TokenWindows(PlannedSource):
    """Fixed windows over a token dataset: maps sample ids to spans and decodes buffers."""

    def __init__(
        self,
        dataset: Dataset | Sequence[Dataset],
        seq_len: int | None,
        *,
        next_token: bool = False,
        dtype: npt.DTypeLike | torch.dtype | None = None,
    ) -> None:
        datasets = [dataset] if isinstance(dataset, Dataset) else list(dataset)
        if seq_len is None:
            raise ConfigError(f"{datasets[0].url} is a token stream: give seq_len= (window length)")
        self.datasets: Sequence[Dataset] = datasets
        self.dataset = datasets[0]
        self.seq_len = seq_len
        self.window = seq_len + int(next_token)
        totals = np.array([d.shard_map.total for d in datasets], dtype=np.int64)
        #: Samples of each dataset; ids of dataset d start at the sum of those before it.
        self.sizes = np.maximum(0, (totals - int(next_token)) // seq_len)
        self.num_samples = int(self.sizes.sum())
        self._id_ends = np.cumsum(self.sizes)
        self._element_base = np.cumsum(totals) - totals
        if len(datasets) == 1:
            self.shard_map = self.dataset.shard_map
            self.shard_urls: Sequence[str] = self.dataset.shard_urls
        else:
            counts = np.concatenate([d.shard_map.counts for d in datasets])
            offsets = np.concatenate([d.shard_map.offsets for d in datasets])
            self.shard_map = ShardMap(counts, datasets[0].manifest.dtype.itemsize, offsets)
            self.shard_urls = [url for d in datasets for url in d.shard_urls]
        #: The dataset (so the store) each shard belongs to.
        self.shard_dataset = np.repeat(
            np.arange(len(datasets)), [len(d.manifest.shards) for d in datasets]
        )
        stored = self.dataset.manifest.dtype
        for one in datasets[1:]:
            if one.manifest.dtype != stored:
                raise ConfigError(f"{one.url} holds {one.manifest.dtype}, not {stored} as the rest")
        self.stored_dtype = stored
        names = stored.names or (TOKENS_FIELD,)
        self.out_dtype = output_dtype(dtype, stored, self.dataset.url)
        if self.out_dtype is not None and stored.names:
            raise ConfigError(f"dtype={dtype!r} cannot convert the structured dtype {stored}")
        #: Whether decoding converts every value (worth a thread of its own).
        self.converts = self.out_dtype is not None and self.out_dtype != stored
        out_itemsize = self.out_dtype.itemsize if self.converts and self.out_dtype else 0
        self.sample_bytes = self.window * (stored.itemsize + out_itemsize)
        if (
            self.converts
            and self.out_dtype is not None
            and type(self).decode is TokenWindows.decode
        ):
            # A dtype conversion happens in the read's copy, and decoding touches no byte
            # (formats built on this one that decode more than the tokens convert in their
            # decode).
            self.convert = (stored, self.out_dtype)
            self.converts = False
        # The engine asks ``reads`` for the group's reads: the windows unplanned (a local
        # store copies them in one call), or the plan of a format that plans its own.
        own_plan = type(self).plan is not TokenWindows.plan
        self.reads = self.plan if own_plan else self.windows  # type: ignore[method-assign,assignment]
        self.schema = {
            name: FieldSchema(
                dtype=str(self.out_dtype or (stored[name] if stored.names else stored)),
                shape=(self.window,),
            )
            for name in names
        }

    def plan(self, sample_ids: npt.NDArray[np.int64], gap_bytes: int) -> ReadPlan:
        return self.windows(sample_ids, gap_bytes).plan()

    def windows(self, ids: npt.NDArray[np.int64], gap: int) -> WindowPlan:
        """The windows of ``ids``, unplanned (a local store copies them in one call)."""
        if len(self.datasets) == 1:
            starts = ids * self.seq_len
        else:
            which = np.searchsorted(self._id_ends, ids, side="right")
            local = ids - (self._id_ends - self.sizes)[which]
            starts = self._element_base[which] + local * self.seq_len
        return WindowPlan(self.shard_map, starts, self.window, gap)

    def decode(self, buffer: npt.NDArray[np.uint8], ids: npt.NDArray[np.int64]) -> dict[str, Any]:
        """Fields of windows ``ids`` from the raw batch buffer (views, no copy if possible)."""
        import torch

        if self.convert is not None:  # converted as they were read
            assert self.out_dtype is not None
            converted = buffer.view(self.out_dtype).reshape(ids.size, self.window)
            return {TOKENS_FIELD: torch.from_numpy(converted)}
        stored = self.stored_dtype
        array = buffer.view(stored).reshape(ids.size, self.window)
        if stored.names:
            return {
                name: torch.from_numpy(np.ascontiguousarray(array[name])) for name in stored.names
            }
        if self.out_dtype is not None and self.out_dtype != stored:
            array = array.astype(self.out_dtype)
        return {TOKENS_FIELD: torch.from_numpy(array)}


#: Output dtypes suggested when the one asked for would lose values.
_WIDE = tuple(np.dtype(name) for name in ("int32", "int64", "float32", "float64"))


def output_dtype(
    dtype: npt.DTypeLike | torch.dtype | None, stored: np.dtype[Any], url: str
) -> np.dtype[Any] | None:
    """``dtype`` as numpy's (None: keep ``stored``); a ConfigError when it cannot hold every
    value of ``stored``. A manifest records no value range, so nothing proves that a
    narrower dtype (int16 for uint16 ids, float16, ...) holds the data: it would wrap or
    round ids silently. Structured dtypes are the caller's to refuse."""
    if dtype is None:
        return None
    out = _numpy_dtype(dtype)
    if not stored.names and not np.can_cast(stored, out, "safe"):
        fits = ", ".join(str(d) for d in _WIDE if np.can_cast(stored, d, "safe"))
        raise ConfigError(
            f"dtype={dtype!r} cannot hold every {stored} value of {url}: the values would"
            f" wrap or round (the manifest records no value range); use one that does"
            f" ({fits or 'the stored dtype'}) or dtype=None"
        )
    return out


def _numpy_dtype(dtype: npt.DTypeLike | torch.dtype) -> np.dtype[Any]:
    import torch

    if isinstance(dtype, torch.dtype):
        try:
            return torch.empty((), dtype=dtype).numpy().dtype
        except TypeError as exc:  # bfloat16, float8: batches are decoded by numpy
            raise ConfigError(f"dtype={dtype!r} has no numpy equivalent") from exc
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"dtype={dtype!r} is not a numpy or torch dtype") from exc


def token_windows(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> TokenWindows:
    """Source factory of the ``tokens`` format (no format options)."""
    if options:
        raise ConfigError(f"token streams take no format_options, got {sorted(options)}")
    return TokenWindows(datasets, seq_len, next_token=next_token, dtype=dtype)
