"""Token streams: shards of one numpy dtype, read as fixed windows of the concatenated stream.

Sample ``i`` of a loader with ``seq_len = L`` is the window of elements ``[i*L, i*L + L)``
(``+ 1`` element with ``next_token=True``, for next-token targets). A window may cross shard
ends. Only the global tail that does not fill a window is left out. Plain dtypes give one
field, ``tokens``; a structured dtype gives one field per dtype field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..batch import FieldSchema
from ..dataset import Dataset
from ..errors import ConfigError
from ..layout import ReadPlan

TOKENS_FIELD = "tokens"


class TokenWindows:
    """Fixed windows over a token dataset: maps sample ids to spans and decodes buffers."""

    def __init__(
        self,
        dataset: Dataset,
        seq_len: int,
        *,
        next_token: bool = False,
        dtype: npt.DTypeLike | torch.dtype | None = None,
    ) -> None:
        if dataset.manifest.format != "tokens":
            raise ConfigError(f"{dataset.url} holds {dataset.manifest.format!r} data, not tokens")
        self.dataset = dataset
        self.seq_len = seq_len
        self.window = seq_len + int(next_token)
        total = dataset.shard_map.total
        self.num_samples = max(0, (total - int(next_token)) // seq_len)
        stored = dataset.manifest.dtype
        self.stored_dtype = stored
        names = stored.names or (TOKENS_FIELD,)
        self.out_dtype = _numpy_dtype(dtype) if dtype is not None else None
        if self.out_dtype is not None and stored.names:
            raise ConfigError(f"dtype={dtype!r} cannot convert the structured dtype {stored}")
        #: Whether decoding converts every value (worth a thread of its own).
        self.converts = self.out_dtype is not None and self.out_dtype != stored
        self.schema = {
            name: FieldSchema(
                dtype=str(self.out_dtype or (stored[name] if stored.names else stored)),
                shape=(self.window,),
            )
            for name in names
        }

    def plan(self, sample_ids: npt.NDArray[np.int64], gap_bytes: int) -> ReadPlan:
        return self.dataset.shard_map.plan(sample_ids * self.seq_len, self.window, gap_bytes)

    def decode(self, buffer: npt.NDArray[np.uint8], count: int) -> dict[str, Any]:
        """Fields of ``count`` windows from the raw batch buffer (views, no copy if possible)."""
        stored = self.stored_dtype
        array = buffer.view(stored).reshape(count, self.window)
        if stored.names:
            return {
                name: torch.from_numpy(np.ascontiguousarray(array[name])) for name in stored.names
            }
        if self.out_dtype is not None and self.out_dtype != stored:
            array = array.astype(self.out_dtype)
        return {TOKENS_FIELD: torch.from_numpy(array)}


def _numpy_dtype(dtype: npt.DTypeLike | torch.dtype) -> np.dtype[Any]:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).numpy().dtype
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"dtype={dtype!r} is not a numpy or torch dtype") from exc
