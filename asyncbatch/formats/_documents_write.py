"""Writing documents: token documents into shards, their index files and a manifest (read by
:mod:`asyncbatch.formats._documents`).

The helpers another writer (``prepare``) needs for the per-shard layout live in
:mod:`asyncbatch.formats._documents_index`: :func:`~.documents_index.shard_index_bytes`,
:func:`~.documents_index.shard_index_info`, :func:`~.documents_index.per_shard_metadata` and
:func:`~.documents_index.index_path`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checksums import ALGORITHM, DEFAULT_CHECKSUM_BLOCK
from .._dataset import Dataset, join_url
from .._errors import ConfigError
from .._manifest import MANIFEST_NAME, Manifest
from .._portal import run_sync
from .._writer import DEFAULT_SHARD_SIZE, ShardWriter, check_write_args, checked_cast
from ..stores import open_store
from ..stores._base import Store
from ._documents import FORMAT, INDEX_DTYPE, INDEX_NAME, OFFSETS
from ._documents_index import (
    PAGE_DOCUMENTS,
    SHARD_DOCUMENTS,
    index_path,
    per_shard_metadata,
    shard_index_bytes,
    shard_index_info,
)

#: ``index=`` of the writers: one index per shard (documents never cross shard ends), or
#: one ``documents.idx`` for the whole dataset (the layout before per-shard indexes).
INDEX_LAYOUTS = ("per_shard", "single")


async def write_documents_async(
    url: str,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
    index: str = "per_shard",
    page_documents: int | None = PAGE_DOCUMENTS,
    slots: bool = True,
) -> Dataset:
    """Async form of :func:`write_documents`, in the running loop."""
    check_write_args(shard_size, max_concurrency, checksum_block)
    if index not in INDEX_LAYOUTS:
        raise ConfigError(f"index={index!r}: expected one of {INDEX_LAYOUTS}")
    if not isinstance(slots, bool):
        raise ConfigError(f"slots must be True or False, got {slots!r}")
    if page_documents is not None and (
        isinstance(page_documents, bool)
        or not isinstance(page_documents, int)
        or page_documents < 1
    ):
        raise ConfigError(
            f"page_documents must be a positive integer or None, got {page_documents!r}"
        )
    if isinstance(documents, np.ndarray) and documents.ndim < 2:
        raise ConfigError(
            f"documents must be an iterable of 1-D arrays, got one array of shape {documents.shape}"
        )
    root = url.rstrip("/")
    options = dict(storage_options or {})
    store = open_store(root, options, max_inflight=max_concurrency)
    try:
        async with ShardWriter(
            store,
            root,
            dtype=dtype,
            shard_size=shard_size,
            max_concurrency=max_concurrency,
            checksum_block=checksum_block,
        ) as shards:
            lengths: list[int] = []
            per_shard: tuple[list[int], list[dict[str, Any]]] = ([], [])
            if index == "single":
                lengths = await _write_stream(shards, documents)
            else:
                per_shard = await _write_per_shard(
                    store, root, shards, documents, page_documents, slots
                )
            written = await shards.finish()
        target = shards.dtype
        if target is None:
            raise ConfigError("no documents given and no dtype: pass dtype= for an empty dataset")
        arrays: dict[str, npt.NDArray[Any]]
        if index == "single":
            offsets = np.zeros(len(lengths) + 1, dtype=INDEX_DTYPE)
            np.cumsum(lengths, out=offsets[1:])
            await store.write(join_url(root, INDEX_NAME), offsets.tobytes())
            metadata: dict[str, Any] = {"document_index": INDEX_NAME, "documents": len(lengths)}
            arrays = {OFFSETS: offsets.astype(np.int64)}
        else:
            counts, infos = per_shard
            metadata = per_shard_metadata(counts, infos)
            arrays = {SHARD_DOCUMENTS: np.array(counts, dtype=np.int64)}
        manifest = Manifest(
            FORMAT,
            target,
            written,
            metadata,
            checksum=ALGORITHM,
            checksum_block=checksum_block,
        )
        await store.write(join_url(root, MANIFEST_NAME), manifest.to_json().encode())
    finally:
        await store.close()
    return Dataset(root, manifest, options, arrays)


def _document(number: int, document: npt.ArrayLike) -> npt.NDArray[Any]:
    array = np.asarray(document)
    if array.ndim != 1:
        raise ConfigError(f"document {number} has shape {array.shape}; documents are 1-D")
    return array


async def _write_stream(shards: ShardWriter, documents: Iterable[npt.ArrayLike]) -> list[int]:
    """The single-index layout: documents cut into shards anywhere; their lengths."""
    lengths: list[int] = []
    for number, document in enumerate(documents):
        array = _document(number, document)
        lengths.append(array.size)
        await shards.add(array)
    return lengths


async def _write_per_shard(
    store: Store,
    root: str,
    shards: ShardWriter,
    documents: Iterable[npt.ArrayLike],
    page_documents: int | None,
    slots: bool = True,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The per-shard layout: a shard closes after the document that fills it to
    ``shard_size`` bytes (empty documents after it join it; a document larger than a shard
    makes one larger shard); each shard's index (paged unless ``page_documents`` is None,
    with a slot table when ``slots``) is written beside it. Documents per shard and the
    index entries."""
    counts: list[int] = []
    infos: list[dict[str, Any]] = []
    writes: list[asyncio.Task[None]] = []
    pending: list[npt.NDArray[Any]] = []
    lengths: list[int] = []
    filled = 0  # bytes of the pending documents

    async def close() -> None:
        nonlocal filled
        dtype = shards.dtype
        assert dtype is not None
        data = np.concatenate(pending) if pending else np.zeros(0, dtype=dtype)
        shard = await shards.add_shard(data)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        raw = shard_index_bytes(offsets, page_documents=page_documents, slots=slots)
        path = index_path(shard.path)
        infos.append(shard_index_info(path, raw, checksum=True))
        counts.append(len(lengths))
        writes.append(asyncio.create_task(store.write(join_url(root, path), raw)))
        pending.clear()
        lengths.clear()
        filled = 0

    try:
        for number, document in enumerate(documents):
            array = _document(number, document)
            if shards.dtype is None:
                shards.dtype = array.dtype
            array = checked_cast(array, shards.dtype)
            if array.size and filled >= shards.shard_size:
                await close()
            pending.append(array)
            lengths.append(array.size)
            filled += array.nbytes
        if lengths:
            await close()
        await asyncio.gather(*writes)
    finally:
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
    return counts, infos


def write_documents(
    url: str,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
    index: str = "per_shard",
    page_documents: int | None = PAGE_DOCUMENTS,
    slots: bool = True,
) -> Dataset:
    """Write ``documents`` (an iterable of 1-D arrays or lists of tokens) as a documents
    dataset at ``url``: shards of the concatenated tokens, the index, the manifest last.

    ``index="per_shard"`` (the default): documents never cross shard ends (a shard closes
    after the document that fills it to ``shard_size`` bytes; one larger document makes one
    larger shard) and each shard ``shard-K.bin`` has its index ``shard-K.idx``, so opening
    reads the manifest alone. The index is paged (``page_documents`` offsets a page, 512 by
    default): a loader fetches a shard's small top level, then only the pages its batches
    need; ``page_documents=None`` writes whole indexes (the earlier per-shard layout). A
    paged index ends with a slot table (``slots``, unless False or the table would not be
    smaller than the offsets): where documents start in each block of a shard's tokens, so
    that packed windows (``seq_len=``) read a few dozen bytes of index each instead of pages.
    ``index="single"``: one ``documents.idx`` for every document,
    read whole at open, documents cut at shard ends (the earlier layout).

    ``dtype`` defaults to the first document's; tokens that do not fit it are an error. As
    with ``write_tokens``, the manifest records each shard's xxh3-64 checksum and its
    ``checksum_block``-byte blocks' (``None``: whole shards only), for ``verify=``, and each
    per-shard index file's checksum.
    """
    return run_sync(
        write_documents_async(
            url,
            documents,
            dtype=dtype,
            shard_size=shard_size,
            storage_options=storage_options,
            max_concurrency=max_concurrency,
            checksum_block=checksum_block,
            index=index,
            page_documents=page_documents,
            slots=slots,
        )
    )
