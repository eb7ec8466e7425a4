"""Writing datasets: arrays or iterables of arrays → shards plus ``manifest.json``, last.

Shards are written concurrently (a bounded number at once) to any store URL. The manifest
is written after every shard succeeded, so a reader never sees a half-written dataset. It
records each shard's xxh3-64 checksum and, unless ``checksum_block=None``, one per block of
``checksum_block`` bytes (see :mod:`asyncbatch._checksums`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ._checksums import ALGORITHM, DEFAULT_CHECKSUM_BLOCK, block_digests, digest
from ._dataset import Dataset, join_url
from ._errors import ConfigError
from ._manifest import MANIFEST_NAME, Manifest, ShardInfo
from ._portal import run_sync
from ._progress import Progress
from .stores import open_store
from .stores._base import Store

DEFAULT_SHARD_SIZE = 256 * 2**20


def _checksums(data: memoryview, block: int | None) -> tuple[int, bytes | None]:
    """A shard's checksum and its blocks' (runs in a thread: xxhash releases the GIL)."""
    return digest(data), None if block is None else block_digests(data, block)


def checked_cast(array: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
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


def check_write_args(shard_size: Any, max_concurrency: Any, checksum_block: Any) -> None:
    """ConfigError naming the first bad writer argument."""
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


class ShardWriter:
    """Cuts a stream of 1-D arrays into shards of ``shard_size`` bytes and writes them, a
    bounded number at once, each with its checksums; used as ``async with``.

    After an error, shards in flight finish rather than being cancelled midway; cancelling
    the writer cancels them.
    """

    def __init__(
        self,
        store: Store,
        root: str,
        *,
        dtype: npt.DTypeLike | None,
        shard_size: int,
        max_concurrency: int,
        checksum_block: int | None,
        progress: Progress | None = None,
    ) -> None:
        self.store, self.root = store, root
        self.dtype: np.dtype[Any] | None = np.dtype(dtype) if dtype is not None else None
        self.shard_size = shard_size
        self.checksum_block = checksum_block
        self.progress = progress
        self.shards: list[ShardInfo] = []
        self._writes: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._buffer: npt.NDArray[Any] | None = None
        self._fill = 0

    async def add(self, array: npt.NDArray[Any]) -> None:
        """Append the elements of ``array`` (cast to the dataset's dtype, checked)."""
        if self.dtype is None:
            self.dtype = array.dtype
        array = checked_cast(array.reshape(-1), self.dtype)
        per_shard = max(1, self.shard_size // self.dtype.itemsize)
        while array.size:
            if self._buffer is None:
                self._buffer, self._fill = np.empty(per_shard, dtype=self.dtype), 0
            take = min(per_shard - self._fill, array.size)
            self._buffer[self._fill : self._fill + take] = array[:take]
            self._fill += take
            array = array[take:]
            if self._fill == per_shard:
                await self._flush(self._buffer)
                self._buffer = None
        self._reap()

    async def add_shard(self, array: npt.NDArray[Any]) -> ShardInfo:
        """Write ``array`` (cast and checked as :meth:`add` does) as one shard of its own,
        whatever its size, after the elements added before it (written as a shard first);
        the new shard's entry (its checksums are filled in once it is written)."""
        if self.dtype is None:
            self.dtype = array.dtype
        array = checked_cast(array.reshape(-1), self.dtype)
        if self._buffer is not None and self._fill:
            await self._flush(self._buffer[: self._fill])
        self._buffer = None
        await self._flush(np.ascontiguousarray(array))
        self._reap()
        return self.shards[-1]

    def _reap(self) -> None:
        """Raise the error of a finished shard write, if one failed."""
        for done in [t for t in self._writes if t.done()]:
            self._writes.discard(done)
            done.result()

    async def finish(self) -> tuple[ShardInfo, ...]:
        """Write the last partial shard, wait for every shard; the shards written."""
        if self._buffer is not None and self._fill:
            await self._flush(self._buffer[: self._fill])
        self._buffer = None
        await asyncio.gather(*self._writes)
        return tuple(self.shards)

    async def _flush(self, data: npt.NDArray[Any]) -> None:
        self.shards.append(ShardInfo(f"shard-{len(self.shards):05d}.bin", data.nbytes, data.size))
        await self._slots.acquire()  # bounds the shard buffers held in memory
        self._writes.add(asyncio.create_task(self._write(len(self.shards) - 1, data)))

    async def _write(self, index: int, data: npt.NDArray[Any]) -> None:
        try:
            raw = memoryview(data.view(np.uint8))  # type: ignore[arg-type]
            checksum, blocks = await asyncio.to_thread(_checksums, raw, self.checksum_block)
            shard = self.shards[index]
            await self.store.write(join_url(self.root, shard.path), raw)
            self.shards[index] = dataclasses.replace(
                shard, checksum=checksum, block_checksums=blocks
            )
            if self.progress is not None:
                self.progress.update(data.nbytes)
        finally:
            self._slots.release()

    async def __aenter__(self) -> ShardWriter:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            for task in self._writes:
                task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)


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
    check_write_args(shard_size, max_concurrency, checksum_block)
    root = url.rstrip("/")
    options = dict(storage_options or {})
    chunks: Iterable[npt.ArrayLike] = (
        [tokens] if isinstance(tokens, np.ndarray) else tokens  # type: ignore[assignment]
    )
    store = open_store(root, options, max_inflight=max_concurrency)
    try:
        async with ShardWriter(
            store,
            root,
            dtype=dtype,
            shard_size=shard_size,
            max_concurrency=max_concurrency,
            checksum_block=checksum_block,
            progress=progress,
        ) as shards:
            for chunk in chunks:
                await shards.add(np.asarray(chunk))
            written = await shards.finish()
        if shards.dtype is None:
            raise ConfigError("no tokens given and no dtype: pass dtype= to write an empty dataset")
        manifest = Manifest(
            "tokens", shards.dtype, written, checksum=ALGORITHM, checksum_block=checksum_block
        )
        await store.write(join_url(root, MANIFEST_NAME), manifest.to_json().encode())
    finally:
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
