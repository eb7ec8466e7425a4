"""Opening a dataset: read its manifest (or the headers and index of data in another
layout, by the openers of the registered formats), and nothing else."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ._dataset import Dataset, join_url, read_object
from ._errors import BucketNotFoundError, ConfigError, NotFoundError
from ._manifest import MANIFEST_NAME, Manifest
from ._portal import run_sync
from .formats._base import Opener
from .formats._npy import object_infos
from .formats._registry import INDEX_LOADERS, openers
from .stores import open_store
from .stores._base import Store
from .stores._disk_cache import DiskCache
from .stores._retry import RetryPolicy
from .stores._stack import Unsupported


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
    known_openers = openers()
    by_name = {opener.name: opener for opener in known_openers}
    if format is not None and format not in by_name and format != "manifest":
        known = ", ".join(["manifest", *by_name])
        raise ConfigError(f"format={format!r} is not one asyncbatch opens (known: {known})")
    extra = dict(options or {})
    store_options = dict(storage_options or {})
    if not isinstance(url, str):
        return await _open_list(list(url), store_options, format, extra, retry, cache)
    store = open_store(url, store_options, retry=retry, cache=DiskCache.of(cache))
    try:
        if format is not None and format != "manifest":
            return await by_name[format].open(url, store, store_options, extra)
        if format is None:
            for opener in known_openers:
                if opener.claims(url):
                    return await opener.open(url, store, store_options, extra)
        try:
            dataset = await _open_manifest(url, store, store_options)
        except NotFoundError as exc:
            if format is not None or isinstance(exc, BucketNotFoundError):
                raise  # no other layout can be there either
            missing = exc
        else:
            if extra:
                raise ConfigError(f"options={extra!r}: a dataset with a manifest takes none")
            return dataset
        # Every layout looked for at once (a remote probe is a round trip); the first found,
        # in the openers' order, opens it, as if they had been tried one after another.
        probing = [opener for opener in known_openers if opener.probe is not None]
        found = await asyncio.gather(
            *(_probe(opener, url, store) for opener in probing), return_exceptions=True
        )
        for opener, result in zip(probing, found, strict=True):
            if isinstance(result, BaseException):
                raise result
            if result:
                return await opener.open(url, store, store_options, extra)
        if not known_openers:
            raise missing
        looked = [f"no manifest ({missing.url} not found{_reason(missing.__cause__)})"]
        looked += [opener.probes_for for opener in known_openers if opener.probe is not None]
        names = ", ".join(repr(opener.name) for opener in known_openers)
        raise NotFoundError(
            f"no dataset at {url}: {', '.join(looked)}; for data in another layout, name"
            f" its format with format= (one of {names})",
            missing.url,
        ) from missing
    finally:
        await store.close()


async def _probe(opener: Opener, url: str, store: Store) -> bool:
    """Whether ``opener`` finds its layout at ``url``; a store that cannot list holds none
    that needs a listing to be found."""
    assert opener.probe is not None
    try:
        return await opener.probe(url, store)
    except Unsupported:
        return False


async def _open_list(
    urls: list[str],
    store_options: dict[str, Any],
    format: str | None,
    options: dict[str, Any],
    retry: RetryPolicy | None,
    cache: DiskCache | str | os.PathLike[str] | None,
) -> Dataset:
    """``open_dataset([url, ...])``: the files of a list, by an opener that takes one."""
    if not urls or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"a list of URLs must hold at least one URL string, got {urls!r}")
    known_openers = openers()
    takers = [
        o
        for o in known_openers
        if o.open_many is not None
        and (o.name == format or (format is None and all(o.claims(u) for u in urls)))
    ]
    if not takers:
        takes = ", ".join(repr(o.name) for o in known_openers if o.open_many is not None)
        raise ConfigError(
            f"format={format!r} does not open a list of URLs (formats that do: {takes})"
        )
    open_many = takers[0].open_many
    assert open_many is not None
    store = open_store(urls[0], store_options, retry=retry, cache=DiskCache.of(cache))
    try:
        return await open_many(urls, store, store_options, options)
    finally:
        await store.close()


def _reason(error: BaseException | None) -> str:
    """``: why``, when a store said more than "not found" (a missing bucket or container)."""
    detail = str(getattr(error, "detail", "") or "")
    return "" if not detail or detail.startswith("not found") else f": {detail}"


async def _open_manifest(url: str, store: Store, options: dict[str, Any]) -> Dataset:
    root = (
        url[: -len(MANIFEST_NAME)].rstrip("/") if url.endswith(MANIFEST_NAME) else url.rstrip("/")
    )
    manifest_url = join_url(root, MANIFEST_NAME)
    try:
        text = await read_object(store, manifest_url)
    except BucketNotFoundError:
        raise
    except NotFoundError as exc:
        msg = f"no dataset at {url}: {manifest_url} not found{_reason(exc)}"
        raise NotFoundError(msg, manifest_url) from exc
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
    or data in another layout that an opener registered with
    :func:`~asyncbatch.register_format` recognises;
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
