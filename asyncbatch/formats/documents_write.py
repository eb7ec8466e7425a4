"""Writing documents: token documents into shards, their index file and a manifest (read by
:mod:`asyncbatch.formats.documents`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..checksums import ALGORITHM, DEFAULT_CHECKSUM_BLOCK
from ..dataset import Dataset, join_url
from ..errors import ConfigError
from ..manifest import MANIFEST_NAME, Manifest
from ..portal import run_sync
from ..stores import open_store
from ..writer import DEFAULT_SHARD_SIZE, ShardWriter, check_write_args
from .documents import FORMAT, INDEX_DTYPE, INDEX_NAME, OFFSETS


async def write_documents_async(
    url: str,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
) -> Dataset:
    """Async form of :func:`write_documents`, in the running loop."""
    check_write_args(shard_size, max_concurrency, checksum_block)
    if isinstance(documents, np.ndarray) and documents.ndim < 2:
        raise ConfigError(
            f"documents must be an iterable of 1-D arrays, got one array of shape {documents.shape}"
        )
    root = url.rstrip("/")
    options = dict(storage_options or {})
    store = open_store(root, options, max_inflight=max_concurrency)
    lengths: list[int] = []
    try:
        async with ShardWriter(
            store,
            root,
            dtype=dtype,
            shard_size=shard_size,
            max_concurrency=max_concurrency,
            checksum_block=checksum_block,
        ) as shards:
            for number, document in enumerate(documents):
                array = np.asarray(document)
                if array.ndim != 1:
                    raise ConfigError(
                        f"document {number} has shape {array.shape}; documents are 1-D"
                    )
                lengths.append(array.size)
                await shards.add(array)
            written = await shards.finish()
        target = shards.dtype
        if target is None:
            raise ConfigError("no documents given and no dtype: pass dtype= for an empty dataset")
        offsets = np.zeros(len(lengths) + 1, dtype=INDEX_DTYPE)
        np.cumsum(lengths, out=offsets[1:])
        await store.write(join_url(root, INDEX_NAME), offsets.tobytes())
        metadata = {"document_index": INDEX_NAME, "documents": len(lengths)}
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
    return Dataset(root, manifest, options, {OFFSETS: offsets.astype(np.int64)})


def write_documents(
    url: str,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 4,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
) -> Dataset:
    """Write ``documents`` (an iterable of 1-D arrays or lists of tokens) as a documents
    dataset at ``url``: shards of the concatenated tokens, the index, the manifest last.

    ``dtype`` defaults to the first document's; tokens that do not fit it are an error. As
    with ``write_tokens``, the manifest records each shard's xxh3-64 checksum and its
    ``checksum_block``-byte blocks' (``None``: whole shards only), for ``verify=``.
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
        )
    )
