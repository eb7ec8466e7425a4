"""Opening a dataset: read its manifest (or the headers and index of data in another
layout), and nothing else."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ConfigError, NotFoundError
from .integrity import digest, format_digest
from .layout import ShardMap
from .manifest import MANIFEST_NAME, Manifest
from .portal import run_sync
from .stores import open_store
from .stores.base import Store
from .stores.disk_cache import DiskCache
from .stores.retry import RetryPolicy


def join_url(root: str, path: str) -> str:
    return f"{root.rstrip('/')}/{path}"


@dataclass(frozen=True)
class Dataset:
    """A dataset root URL with its manifest; holds no live store, so it pickles freely."""

    url: str
    manifest: Manifest
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    #: Index arrays a format reads at open (document offsets, ...), kept in memory.
    arrays: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict, compare=False, repr=False)
    #: Without manifest checksums (data read in place, or a manifest without them): the
    #: versions (ETag, file identity) of the objects it was opened from, its content
    #: identity; None: a store that tells no version.
    versions: tuple[str | None, ...] = field(default=(), repr=False)

    @cached_property
    def shard_urls(self) -> list[str]:
        return [join_url(self.url, shard.path) for shard in self.manifest.shards]

    @cached_property
    def shard_map(self) -> ShardMap:
        counts = np.array([s.elements for s in self.manifest.shards], dtype=np.int64)
        offsets = np.array([s.offset for s in self.manifest.shards], dtype=np.int64)
        return ShardMap(counts, self.manifest.dtype.itemsize, offsets)

    def fingerprint(self) -> str:
        """Identifies the data for checking resume states: its shape and its bytes, by the
        manifest's shard checksums, else by the versions of the objects read in place."""
        m = self.manifest
        arrays = "".join(f":{name}={array.size}" for name, array in sorted(self.arrays.items()))
        # Data read in place may name its own (a digest of Parquet footers).
        own = f":{m.metadata['fingerprint']}" if "fingerprint" in m.metadata else ""
        return (
            f"{m.format}:{m.dtype.str}:{len(m.shards)}:{m.total_elements}{arrays}{own}"
            f"{self._content}"
        )

    @cached_property
    def _content(self) -> str:
        """``:<algorithm>=<digest of every shard's checksum>``, else ``:versions=<digest of
        the objects' versions>``, or "" with neither (computed once: ``state_dict()`` asks
        for the fingerprint every time)."""
        m = self.manifest
        if m.checksum is None:
            if not self.versions or None in self.versions:
                return ""
            return f":versions={format_digest(digest(repr(self.versions).encode()))}"
        checksums = np.array([shard.checksum or 0 for shard in m.shards], dtype="<u8")
        return f":{m.checksum}={format_digest(digest(checksums.tobytes()))}"

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
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    format: str | None = None,
    options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    cache: DiskCache | str | os.PathLike[str] | None = None,
) -> Dataset:
    """Open the dataset at ``url`` in the running loop; see :func:`open_dataset`."""
    from .formats import OPENERS  # formats import this module

    openers = {opener.name: opener for opener in OPENERS}
    if format is not None and format not in openers and format != "manifest":
        known = ", ".join(["manifest", *openers])
        raise ConfigError(f"format={format!r} is not one asyncbatch opens (known: {known})")
    extra = dict(options or {})
    store_options = dict(storage_options or {})
    if not isinstance(url, str):
        return await _open_list(list(url), store_options, format, extra, retry, cache)
    store = open_store(url, store_options, retry=retry, cache=DiskCache.of(cache))
    try:
        if format is not None and format != "manifest":
            return await openers[format].open(url, store, store_options, extra)
        if format is None:
            for opener in OPENERS:
                if opener.claims(url):
                    return await opener.open(url, store, store_options, extra)
        try:
            dataset = await _open_manifest(url, store, store_options)
        except NotFoundError as exc:
            if format is not None:
                raise
            missing = exc
        else:
            if extra:
                raise ConfigError(f"options={extra!r}: a dataset with a manifest takes none")
            return dataset
        for opener in OPENERS:
            if opener.probe is not None and await opener.probe(url, store):
                return await opener.open(url, store, store_options, extra)
        if not OPENERS:
            raise missing
        looked = [f"no manifest ({missing.url} not found)"]
        looked += [opener.probes_for for opener in OPENERS if opener.probe is not None]
        names = ", ".join(repr(opener.name) for opener in OPENERS)
        raise NotFoundError(
            f"no dataset at {url}: {', '.join(looked)}; for data in another layout, name"
            f" its format with format= (one of {names})",
            missing.url,
        ) from missing
    finally:
        await store.close()


async def _open_list(
    urls: list[str],
    store_options: dict[str, Any],
    format: str | None,
    options: dict[str, Any],
    retry: RetryPolicy | None,
    cache: DiskCache | str | os.PathLike[str] | None,
) -> Dataset:
    """``open_dataset([url, ...])``: the files of a list, by an opener that takes one."""
    from .formats import OPENERS

    if not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"a list of URLs must hold at least one URL string, got {urls!r}")
    openers = [
        o
        for o in OPENERS
        if o.open_many is not None
        and (o.name == format or (format is None and all(o.claims(u) for u in urls)))
    ]
    if not openers:
        takes = ", ".join(repr(o.name) for o in OPENERS if o.open_many is not None)
        raise ConfigError(
            f"format={format!r} does not open a list of URLs (formats that do: {takes})"
        )
    open_many = openers[0].open_many
    assert open_many is not None
    store = open_store(urls[0], store_options, retry=retry, cache=DiskCache.of(cache))
    try:
        return await open_many(urls, store, store_options, options)
    finally:
        await store.close()


async def _open_manifest(url: str, store: Store, options: dict[str, Any]) -> Dataset:
    root = (
        url[: -len(MANIFEST_NAME)].rstrip("/") if url.endswith(MANIFEST_NAME) else url.rstrip("/")
    )
    manifest_url = join_url(root, MANIFEST_NAME)
    try:
        text = await read_object(store, manifest_url)
    except NotFoundError as exc:
        msg = f"no dataset at {url}: {manifest_url} not found"
        raise NotFoundError(msg, manifest_url) from exc
    from .formats import INDEX_LOADERS
    from .formats.npy import object_infos

    dataset = Dataset(root, Manifest.from_json(text, manifest_url), options)
    if dataset.manifest.checksum is None:
        # No checksums to tell these bytes from others of the same shape: their versions
        # (one stat per shard) do, for resume states.
        infos = await object_infos(store, dataset.shard_urls)
        dataset = replace(dataset, versions=tuple(info.version for info in infos))
    load = INDEX_LOADERS.get(dataset.manifest.format)
    return dataset if load is None else await load(dataset, store)


def open_dataset(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    format: str | None = None,
    options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    cache: DiskCache | str | os.PathLike[str] | None = None,
) -> Dataset:
    """Open the dataset at ``url``; reads only its manifest (or headers and index arrays),
    whatever the dataset's size (a manifest without checksums: also one stat per shard,
    whose versions identify its bytes).

    The layout is recognised by itself: an asyncbatch manifest at ``url`` or in the folder,
    or data in another layout an opener of :mod:`asyncbatch.formats` recognises;
    ``format=`` names it instead (``"manifest"`` or an opener's name); ``options=`` go to
    the opener (e.g. the dtype of raw token files); ``retry`` is how the store retries its
    reads (default: ``RetryPolicy()``); ``cache`` a node-local cache to read through (a
    path or a :class:`~asyncbatch.DiskCache`).
    """
    return run_sync(
        open_dataset_async(
            url, storage_options, format=format, options=options, retry=retry, cache=cache
        )
    )
