"""``index_webdataset``: the sidecar index of every WebDataset tar shard, written beside it
(``000000.tar`` → ``000000.tar.abidx``; the layout: :mod:`._webdataset_index`).

Every shard is scanned (its headers, in large sequential ranges) and its sidecar written,
:data:`~._webdataset_shards.CONCURRENT_SHARDS` shards at once, on the store's own event loop: the
work is reading, and parsing the headers is small beside it. A sidecar already there is
written again, from the shard as it is now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._portal import run_sync
from ..stores import open_store
from ..stores._base import ObjectInfo, Store
from ._webdataset_index import scan_shard, sidecar_url
from ._webdataset_shards import find_shards, limited


@dataclass(frozen=True, slots=True)
class IndexReport:
    """What :func:`index_webdataset` wrote: one sidecar per shard."""

    shards: int
    samples: int
    #: Bytes of the shards scanned and of the sidecars written.
    shard_bytes: int
    index_bytes: int
    sidecars: tuple[str, ...]


async def index_webdataset_async(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> IndexReport:
    """:func:`index_webdataset` in the running event loop."""
    options = dict(storage_options or {})
    first = url if isinstance(url, str) else (list(url) or [""])[0]
    store = open_store(first, options)
    try:
        _, shards, known, _ = await find_shards(url, store)
        count = [0]

        def one_done() -> None:
            count[0] += 1
            if progress is not None:
                progress(count[0], len(shards))

        if progress is not None:
            progress(0, len(shards))
        done = await limited([_index_one(store, u, known.get(u), one_done) for u in shards])
    finally:
        await store.close()
    return IndexReport(
        shards=len(shards),
        samples=sum(samples for samples, _, _ in done),
        shard_bytes=sum(size for _, size, _ in done),
        index_bytes=sum(nbytes for _, _, nbytes in done),
        sidecars=tuple(sidecar_url(u) for u in shards),
    )


async def _index_one(
    store: Store,
    url: str,
    info: ObjectInfo | None,
    done: Callable[[], None],
) -> tuple[int, int, int]:
    size = info.size if info is not None else await store.size(url)
    index = await scan_shard(store, url, size)
    data = index.pack()
    await store.write(sidecar_url(url), data)
    done()
    return index.num_samples, size, len(data)


def index_webdataset(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> IndexReport:
    """Write the sidecar index of every WebDataset tar shard at ``url`` beside it.

    ``url`` is what :func:`~asyncbatch.open_dataset` takes for shards: a ``.tar``, a folder
    or prefix, a glob, a brace pattern (``s3://b/laion/{000000..000123}.tar``) or a list.
    Each shard is scanned once with large sequential reads, all shards at once (up to 16),
    and ``<shard>.abidx`` written beside it; ``progress(done, shards)`` is called once the
    shards are found (``done`` 0) and as each one is written. Opening the shards then reads
    the sidecars only.
    """
    return run_sync(index_webdataset_async(url, storage_options, progress=progress))
