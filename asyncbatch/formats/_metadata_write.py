"""Writing metadata streams: tokens with per-span metadata into token shards, metadata index
and data files, and a manifest (read by :mod:`asyncbatch.formats._metadata`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dataset import Dataset, join_url
from .._errors import ConfigError
from .._manifest import MANIFEST_NAME, Manifest, ShardInfo
from .._portal import run_sync
from .._writer import DEFAULT_SHARD_SIZE, check_write_args, checked_cast
from ..stores import open_store
from ._metadata import FORMAT, INDEX_DTYPE, Int64Array, MetaLayout, make_codec


class _Values:
    """Metadata values by global id while shards are written; forgets what no shard needs."""

    def __init__(self, values: Sequence[Any] | None = None) -> None:
        self.fixed = values
        self.window: list[Any] = []
        self.base = 0

    def add(self, value: Any) -> int:
        self.window.append(value)
        return self.base + len(self.window) - 1

    def get(self, gid: int) -> Any:
        return self.fixed[gid] if self.fixed is not None else self.window[gid - self.base]

    def forget_below(self, gid: int) -> None:
        if self.fixed is None and gid > self.base:
            del self.window[: gid - self.base]
            self.base = gid


def _token_chunks(
    spans: Iterable[tuple[npt.ArrayLike, Any]] | None,
    tokens: npt.ArrayLike | None,
    meta_ids: npt.ArrayLike | None,
    values: Sequence[Any] | None,
    memo: _Values,
) -> Iterator[tuple[npt.NDArray[Any], Int64Array]]:
    """(tokens, global metadata id or -1) chunks from either form of input."""
    if spans is not None:
        if tokens is not None or meta_ids is not None or values is not None:
            raise ConfigError("give spans, or tokens with meta_ids and values, not both")
        for chunk, value in spans:
            array = np.asarray(chunk).reshape(-1)
            gid = -1 if value is None else memo.add(value)
            yield array, np.full(array.size, gid, dtype=np.int64)
        return
    if tokens is None or meta_ids is None or values is None:
        raise ConfigError("give spans=, or tokens=, meta_ids= and values=")
    array = np.asarray(tokens).reshape(-1)
    ids = np.asarray(meta_ids).reshape(-1)
    if ids.size != array.size or ids.dtype.kind not in "iu":
        raise ConfigError(f"meta_ids must be {array.size} integers, got {ids.size} of {ids.dtype}")
    if ids.size and (ids.min() < -1 or ids.max() >= len(values)):
        raise ConfigError(
            f"meta_ids in [{ids.min()}, {ids.max()}]: each must index values (0..{len(values) - 1})"
            " or be -1 (no metadata)"
        )
    yield array, ids.astype(np.int64)


def _checked_tokens(array: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    if array.dtype.kind not in "iu":
        raise ConfigError(f"tokens must be integers, got {array.dtype}")
    return checked_cast(array, dtype)


async def write_metadata_stream_async(
    url: str,
    spans: Iterable[tuple[npt.ArrayLike, Any]] | None = None,
    *,
    tokens: npt.ArrayLike | None = None,
    meta_ids: npt.ArrayLike | None = None,
    values: Sequence[Any] | None = None,
    codec: str = "json",
    codec_options: Mapping[str, Any] | None = None,
    token_dtype: npt.DTypeLike = "<u4",
    meta_dtype: npt.DTypeLike = "<u4",
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
) -> Dataset:
    """Async form of :func:`write_metadata_stream`, in the running loop."""
    check_write_args(shard_size, max_concurrency, None)
    try:  # the manifest holds the options as JSON: store what a reader will get back
        options = json.loads(json.dumps(dict(codec_options or {})))
    except TypeError as exc:
        raise ConfigError(f"codec_options must be JSON values (dtype='<i8'): {exc}") from exc
    encoder = make_codec(codec, options)
    stream = np.dtype([("token", np.dtype(token_dtype)), ("meta", np.dtype(meta_dtype))])
    if stream["meta"].kind != "u" or stream["token"].kind not in "iu":
        raise ConfigError(f"token_dtype and meta_dtype must be integers (meta unsigned): {stream}")
    no_meta = int(np.iinfo(stream["meta"]).max)
    per_shard = max(1, shard_size // stream.itemsize)
    root = url.rstrip("/")
    store = open_store(root, dict(storage_options or {}), max_inflight=max_concurrency)
    memo = _Values(values)
    shards: list[ShardInfo] = []
    index_paths: list[str] = []
    data_paths: list[str] = []
    counts: list[int] = []
    sizes: list[int] = []
    writes: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(max_concurrency)

    async def write_all(objects: list[tuple[str, bytes | memoryview]]) -> None:
        try:
            for name, data in objects:
                await store.write(join_url(root, name), data)
        finally:
            slots.release()

    async def flush(chunk: npt.NDArray[Any], gids: Int64Array) -> None:
        k = len(shards)
        has = gids >= 0
        unique, local = np.unique(gids[has], return_inverse=True)
        if unique.size >= no_meta:
            raise ConfigError(
                f"shard {k} holds {unique.size} metadata values; {stream['meta']} ids hold"
                f" {no_meta}: use a smaller shard_size or meta_dtype='<u8'"
            )
        records = np.empty(chunk.size, dtype=stream)
        records["token"] = chunk
        records["meta"] = no_meta
        records["meta"][has] = local
        encoded = []
        for gid in unique.tolist():
            try:
                encoded.append(bytes(encoder.encode(memo.get(gid))))
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(f"codec {codec!r} cannot encode value {gid}: {exc!r}") from exc
        offsets = np.zeros(len(encoded) + 1, dtype=INDEX_DTYPE)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        name = f"shard-{k:05d}"
        shards.append(ShardInfo(f"{name}.bin", records.nbytes, int(records.size)))
        index_paths.append(f"{name}.meta.idx")
        data_paths.append(f"{name}.meta.bin")
        counts.append(len(encoded))
        sizes.append(int(offsets[-1]))
        objects: list[tuple[str, bytes | memoryview]] = [
            (f"{name}.bin", memoryview(records.view(np.uint8))),  # type: ignore[arg-type]
            (f"{name}.meta.idx", offsets.tobytes()),
            (f"{name}.meta.bin", b"".join(encoded)),
        ]
        await slots.acquire()  # bounds the shards held in memory
        writes.add(asyncio.create_task(write_all(objects)))

    try:
        token_buffer = np.empty(per_shard, dtype=stream["token"])
        gid_buffer = np.empty(per_shard, dtype=np.int64)
        fill = 0
        for chunk, gids in _token_chunks(spans, tokens, meta_ids, values, memo):
            chunk = _checked_tokens(chunk, stream["token"])
            while chunk.size:
                take = min(per_shard - fill, chunk.size)
                token_buffer[fill : fill + take] = chunk[:take]
                gid_buffer[fill : fill + take] = gids[:take]
                fill += take
                chunk, gids = chunk[take:], gids[take:]
                if fill == per_shard:
                    await flush(token_buffer.copy(), gid_buffer.copy())
                    memo.forget_below(int(gid_buffer.max()))
                    fill = 0
            for done in [t for t in writes if t.done()]:
                writes.discard(done)
                done.result()
        if fill or not shards:
            await flush(token_buffer[:fill].copy(), gid_buffer[:fill].copy())
        await asyncio.gather(*writes)
        layout = MetaLayout(
            "token",
            "meta",
            codec,
            options,
            tuple(index_paths),
            tuple(data_paths),
            np.array(counts, dtype=np.int64),
            np.array(sizes, dtype=np.int64),
        )
        manifest = Manifest(FORMAT, stream, tuple(shards), {FORMAT: layout.to_json()})
        await store.write(join_url(root, MANIFEST_NAME), manifest.to_json().encode())
    finally:
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        await store.close()
    dataset = Dataset(root, manifest, dict(storage_options or {}))
    return replace(dataset, arrays={"meta_counts": layout.counts, "meta_bytes": layout.data_bytes})


def write_metadata_stream(
    url: str,
    spans: Iterable[tuple[npt.ArrayLike, Any]] | None = None,
    *,
    tokens: npt.ArrayLike | None = None,
    meta_ids: npt.ArrayLike | None = None,
    values: Sequence[Any] | None = None,
    codec: str = "json",
    codec_options: Mapping[str, Any] | None = None,
    token_dtype: npt.DTypeLike = "<u4",
    meta_dtype: npt.DTypeLike = "<u4",
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
) -> Dataset:
    """Write a token stream with per-span metadata at ``url`` (any store); manifest last.

    Either ``spans``, an iterable of ``(tokens, value)``: the tokens of a span share one
    metadata value (``None``: no metadata); or ``tokens`` with one ``meta_ids`` entry per
    token indexing ``values`` (``-1``: no metadata). ``codec`` (a registered name, with
    ``codec_options``) encodes the values: ``"json"`` (default), ``"bytes"`` or ``"numpy"``
    (``dtype=``, ``shape=`` — ``None`` for 1-D values of any length).
    """
    return run_sync(
        write_metadata_stream_async(
            url,
            spans,
            tokens=tokens,
            meta_ids=meta_ids,
            values=values,
            codec=codec,
            codec_options=codec_options,
            token_dtype=token_dtype,
            meta_dtype=meta_dtype,
            shard_size=shard_size,
            storage_options=storage_options,
            max_concurrency=max_concurrency,
        )
    )
