"""Writing LLMBATCH ``.batch`` files (read by :mod:`asyncbatch.formats._llmbatch`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dataset import Dataset
from .._errors import ConfigError
from .._portal import run_sync
from .._writer import checked_cast
from ..stores import open_store
from ._llmbatch import DTYPES, HEADER_SIZE, LLMBatchHeader, llmbatch_dataset

_U32 = 2**32 - 1


def _u32(name: str, value: Any, low: int = 0) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or not low <= value <= _U32
    ):
        raise ConfigError(f"{name} must be an integer in [{low}, {_U32}], got {value!r}")
    return int(value)


def _records(
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike], seq_len: int | None, dtype: np.dtype[Any]
) -> tuple[npt.NDArray[Any], int]:
    """All records as one ``[N, seq_len]`` array of ``dtype``, and ``seq_len``."""
    chunks: Iterable[npt.ArrayLike] = (
        [tokens] if isinstance(tokens, np.ndarray) else tokens  # type: ignore[assignment]
    )
    parts: list[npt.NDArray[Any]] = []
    for chunk in chunks:
        array = np.asarray(chunk)
        if array.ndim == 1:  # one record
            array = array[None, :]
        if array.ndim != 2:
            raise ConfigError(
                f"tokens must be [records, seq_len] arrays (or single records), got shape"
                f" {array.shape}"
            )
        if seq_len is None:
            seq_len = _u32("seq_len", int(array.shape[1]), 1)
        if array.shape[1] != seq_len:
            raise ConfigError(f"a record of {array.shape[1]} tokens, but seq_len={seq_len}")
        parts.append(checked_cast(array, dtype))
    if seq_len is None:
        raise ConfigError("no records given and no seq_len: pass seq_len= to write an empty file")
    if not parts:
        return np.empty((0, seq_len), dtype=dtype), seq_len
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), seq_len


def llmbatch_bytes(
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    batch_size: int,
    seq_len: int | None = None,
    dtype: npt.DTypeLike = np.uint32,
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[npt.NDArray[np.uint8], LLMBatchHeader]:
    """The bytes of an LLMBATCH file of ``tokens``; see :func:`write_llmbatch`."""
    batch_size = _u32("batch_size", batch_size, 1)
    if seq_len is not None:
        seq_len = _u32("seq_len", seq_len, 1)
    seed = _u32("seed", seed)
    try:
        wanted = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"dtype={dtype!r} is not a numpy dtype") from exc
    codes = [code for code, stored in DTYPES.items() if stored == wanted.newbyteorder("<")]
    if not codes:
        known = ", ".join(f"{d}" for d in DTYPES.values())
        raise ConfigError(f"dtype={dtype!r}: LLMBATCH stores tokens as {known}")
    stored = DTYPES[codes[0]]
    records, seq_len = _records(tokens, seq_len, stored)
    total = _u32("the number of records (header field total_records)", int(records.shape[0]))
    if shuffle:
        records = records[np.random.default_rng(seed).permutation(total)]
    header = LLMBatchHeader(batch_size, seq_len, total // batch_size, codes[0], seed, total)
    out = np.zeros(header.file_size, dtype=np.uint8)
    out[:HEADER_SIZE] = np.frombuffer(header.pack(), dtype=np.uint8)
    slots = out[HEADER_SIZE:].reshape(header.num_batches, header.slot_bytes)
    rows = slots[:, : header.raw_batch_bytes].view(stored)
    rows[...] = records[: header.num_batches * batch_size].reshape(header.num_batches, -1)
    return out, header


async def write_llmbatch_async(
    url: str,
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    batch_size: int,
    seq_len: int | None = None,
    dtype: npt.DTypeLike = np.uint32,
    seed: int = 0,
    shuffle: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Dataset:
    """Async form of :func:`write_llmbatch`, in the running loop."""
    data, header = llmbatch_bytes(
        tokens, batch_size=batch_size, seq_len=seq_len, dtype=dtype, seed=seed, shuffle=shuffle
    )
    options = dict(storage_options or {})
    store = open_store(url, options)
    try:
        await store.write(url, memoryview(data))  # type: ignore[arg-type]
    finally:
        await store.close()
    return llmbatch_dataset(url, header, header.file_size, options)


def write_llmbatch(
    url: str,
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    batch_size: int,
    seq_len: int | None = None,
    dtype: npt.DTypeLike = np.uint32,
    seed: int = 0,
    shuffle: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Dataset:
    """Write ``tokens`` (a ``[N, seq_len]`` array, or an iterable of such arrays or of
    single records) as one LLMBATCH file at ``url`` (any store).

    As the layout's own writer does: with ``shuffle`` the records are first put in the
    order ``np.random.default_rng(seed).permutation(N)``; they are then cut into batches of
    ``batch_size`` and the ``N % batch_size`` left over are dropped (``total_records`` in the
    header still counts them). ``seed`` is recorded in the header either way. Tokens are
    stored as uint32 (the only dtype the layout defines); values that do not fit are an
    error. The whole file is built in memory, then written as one object.
    """
    return run_sync(
        write_llmbatch_async(
            url,
            tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            dtype=dtype,
            seed=seed,
            shuffle=shuffle,
            storage_options=storage_options,
        )
    )
