"""Opening a dataset: read its manifest, and nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .errors import NotFoundError
from .layout import ShardMap
from .manifest import MANIFEST_NAME, Manifest
from .portal import run_sync
from .stores import open_store
from .stores.base import Store
from .stores.retry import RetryPolicy


def join_url(root: str, path: str) -> str:
    return f"{root.rstrip('/')}/{path}"


@dataclass(frozen=True)
class Dataset:
    """A dataset root URL with its manifest; holds no live store, so it pickles freely."""

    url: str
    manifest: Manifest
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def shard_urls(self) -> list[str]:
        return [join_url(self.url, shard.path) for shard in self.manifest.shards]

    @cached_property
    def shard_map(self) -> ShardMap:
        counts = np.array([s.elements for s in self.manifest.shards], dtype=np.int64)
        return ShardMap(counts, self.manifest.dtype.itemsize)

    def fingerprint(self) -> str:
        """Identifies the data (not where it lives), for checking resume states."""
        m = self.manifest
        return f"{m.format}:{m.dtype.str}:{len(m.shards)}:{m.total_elements}"

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"Dataset({self.url!r}, format={m.format!r}, dtype={m.dtype}, shards={len(m.shards)},"
            f" elements={m.total_elements})"
        )


async def read_object(store: Store, url: str) -> bytes:
    """The whole object at ``url``, length-checked."""
    size = await store.size(url)
    buffer = bytearray(size)
    await store.read_ranges(url, starts=[0], ends=[size], buffers=[memoryview(buffer)])
    return bytes(buffer)


async def open_dataset_async(
    url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryPolicy | None = None
) -> Dataset:
    """Open the dataset at ``url`` (its root, or its ``manifest.json``) in the running loop;
    ``retry``: how the manifest read is retried (default: :class:`RetryPolicy()`)."""
    root = (
        url[: -len(MANIFEST_NAME)].rstrip("/") if url.endswith(MANIFEST_NAME) else url.rstrip("/")
    )
    manifest_url = join_url(root, MANIFEST_NAME)
    options = dict(storage_options or {})
    store = open_store(manifest_url, options, retry=retry)
    try:
        text = await read_object(store, manifest_url)
    except NotFoundError as exc:
        msg = f"no dataset at {url}: {manifest_url} not found"
        raise NotFoundError(msg, manifest_url) from exc
    finally:
        await store.close()
    return Dataset(root, Manifest.from_json(text, manifest_url), options)


def open_dataset(
    url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryPolicy | None = None
) -> Dataset:
    """Open the dataset at ``url``; reads only its manifest, whatever the dataset's size."""
    return run_sync(open_dataset_async(url, storage_options, retry=retry))
