"""Writing datasets: arrays or iterables of arrays → shards plus ``manifest.json``, last.

Shards are written concurrently (a bounded number at once) to any store URL. The manifest
is written after every shard succeeded, so a reader never sees a half-written dataset. It
records each shard's xxh3-64 checksum and, unless ``checksum_block=None``, one per block of
``checksum_block`` bytes (see :mod:`asyncbatch.integrity`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .dataset import Dataset, join_url
from .errors import ConfigError
from .integrity import ALGORITHM, DEFAULT_CHECKSUM_BLOCK, block_digests, digest
from .manifest import MANIFEST_NAME, Manifest, ShardInfo
from .portal import run_sync
from .progress import Progress
from .stores import open_store

DEFAULT_SHARD_SIZE = 256 * 2**20


def _checksums(data: memoryview, block: int | None) -> tuple[int, bytes | None]:
    """A shard's checksum and its blocks' (runs in a thread: xxhash releases the GIL)."""
    return digest(data), None if block is None else block_digests(data, block)


def _checked_cast(array: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``array`` as ``dtype``; integers that do not fit are an error, never wrapped."""
    if array.dtype == dtype:
        return array
    if dtype.names or array.dtype.names:
        raise ConfigError(f"cannot convert tokens of dtype {array.dtype} to {dtype}")
    if array.size and not np.can_cast(array.dtype, dtype, "safe") and dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ConfigError(
                f"tokens in [{low}, {high}] do not fit dtype {dtype} ([{info.min}, {info.max}])"
            )
    return array.astype(dtype)


async def write_tokens_async(
    url: str,
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    progress: Progress | None = None,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
) -> Dataset:
    """Async form of :func:`write_tokens`, in the running loop."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ConfigError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
    if max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be positive, got {max_concurrency!r}")
    if checksum_block is not None and (
        isinstance(checksum_block, bool)
        or not isinstance(checksum_block, int)
        or checksum_block < 1
    ):
        raise ConfigError(
            f"checksum_block must be a positive number of bytes or None, got {checksum_block!r}"
        )
    root = url.rstrip("/")
    options = dict(storage_options or {})
    chunks: Iterable[npt.ArrayLike] = (
        [tokens] if isinstance(tokens, np.ndarray) else tokens  # type: ignore[assignment]
    )
    target = np.dtype(dtype) if dtype is not None else None
    store = open_store(root, options, max_inflight=max_concurrency)
    shards: list[ShardInfo] = []
    checksums: dict[int, tuple[int, bytes | None]] = {}
    writes: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(max_concurrency)

    async def write_shard(index: int, name: str, data: npt.NDArray[Any]) -> None:
        try:
            raw = memoryview(data.view(np.uint8))  # type: ignore[arg-type]
            checksums[index] = await asyncio.to_thread(_checksums, raw, checksum_block)
            await store.write(join_url(root, name), raw)
            if progress is not None:
                progress.update(data.nbytes)
        finally:
            slots.release()

    async def flush(data: npt.NDArray[Any]) -> None:
        name = f"shard-{len(shards):05d}.bin"
        shards.append(ShardInfo(name, data.nbytes, int(data.size)))
        await slots.acquire()  # bounds the shard buffers held in memory
        task = asyncio.create_task(write_shard(len(shards) - 1, name, data))
        writes.add(task)

    try:
        buffer: npt.NDArray[Any] | None = None
        fill = 0
        for chunk in chunks:
            array = np.asarray(chunk)
            if target is None:
                target = array.dtype
            array = _checked_cast(array.reshape(-1), target)
            per_shard = max(1, shard_size // target.itemsize)
            while array.size:
                if buffer is None:
                    buffer, fill = np.empty(per_shard, dtype=target), 0
                take = min(per_shard - fill, array.size)
                buffer[fill : fill + take] = array[:take]
                fill += take
                array = array[take:]
                if fill == per_shard:
                    await flush(buffer)
                    buffer = None
            for done in [t for t in writes if t.done()]:
                writes.discard(done)
                done.result()
        if buffer is not None and fill:
            await flush(buffer[:fill])
        await asyncio.gather(*writes)
        if target is None:
            raise ConfigError("no tokens given and no dtype: pass dtype= to write an empty dataset")
        manifest = Manifest(
            "tokens",
            target,
            tuple(
                ShardInfo(
                    s.path,
                    s.nbytes,
                    s.elements,
                    checksum=checksums[i][0],
                    block_checksums=checksums[i][1],
                )
                for i, s in enumerate(shards)
            ),
            checksum=ALGORITHM,
            checksum_block=checksum_block,
        )
        await store.write(join_url(root, MANIFEST_NAME), manifest.to_json().encode())
    finally:
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        await store.close()
    return Dataset(root, manifest, options)


def write_tokens(
    url: str,
    tokens: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    progress: bool = False,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
) -> Dataset:
    """Write ``tokens`` (an array, or an iterable of arrays) as a token dataset at ``url``.

    Shards hold ``shard_size`` bytes (the last one less); ``dtype`` defaults to the first
    array's. Integers that do not fit ``dtype`` are an error, never silently wrapped. The
    manifest records each shard's checksum and its ``checksum_block``-byte blocks' (1 MiB by
    default; ``None``: whole shards only), which ``verify=`` and ``asyncbatch verify`` check.
    """
    bar = None
    if progress:
        total = float(np.asarray(tokens).nbytes) if isinstance(tokens, np.ndarray) else 0.0
        bar = Progress(total, f"writing {url}", "B")
    try:
        return run_sync(
            write_tokens_async(
                url,
                tokens,
                dtype=dtype,
                shard_size=shard_size,
                storage_options=storage_options,
                max_concurrency=max_concurrency,
                progress=bar,
                checksum_block=checksum_block,
            )
        )
    finally:
        if bar is not None:
            bar.close()
