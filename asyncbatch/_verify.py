"""``verify_dataset``: every shard of a dataset checked against its manifest, offline
(``asyncbatch verify``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._checks import ShardReport, scan_shard, shard_checks, size_error
from ._dataset import Dataset
from ._errors import ConfigError, StoreError
from ._open import open_dataset_async
from ._portal import run_sync
from .formats._documents_index import index_files
from .formats._documents_metadata import metadata_files
from .stores import open_store


@dataclass
class VerifyReport:
    """What :func:`verify_dataset` found: the level it could check at, and the bad shards."""

    url: str
    level: str  # "block", "full", or "size" when the manifest records no checksums
    shards: int  # every file checked: data shards, and index and metadata files
    nbytes: int  # of every file checked
    bad: list[ShardReport]
    notes: list[str] = field(default_factory=list)
    #: The files checked, by kind: a documents dataset's per-shard index files and document
    #: metadata files are checked as its shards are.
    data_shards: int = 0
    index_files: int = 0
    metadata_files: int = 0

    @property
    def clean(self) -> bool:
        return not self.bad


async def verify_dataset_async(
    dataset: Dataset | str,
    *,
    level: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every shard of ``dataset`` (or of the one at that URL) against its manifest,
    ``concurrency`` shards at once; reports every problem (it does not stop at the first).
    The per-shard index files of a documents dataset, and its document metadata files, count
    as shards (checked whole).

    ``level``: ``"block"`` (every block's checksum and the whole shard's; the default when
    blocks are recorded) or ``"full"`` (whole shards only). Sizes are always checked; a
    manifest without checksums can only be checked for sizes (``report.level == "size"``).
    ``progress`` is called with the bytes (or, at ``size``, shard bytes) done.
    """
    if level not in (None, "block", "full"):
        raise ConfigError(f"level={level!r}: expected 'block' or 'full'")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}")
    if isinstance(dataset, str):
        dataset = await open_dataset_async(dataset, storage_options)
    manifest = dataset.manifest
    notes = []
    if manifest.checksum is None:
        used = "size"
        notes.append("the manifest records no checksums (written without them): sizes only")
    elif level == "full" or manifest.checksum_block is None:
        used = "full"
        if level == "block":
            notes.append("the manifest records no block checksums: whole shards only")
    else:
        used = "block"
    # A documents dataset's per-shard index files, and its document metadata files, are
    # checked as shards are (size and whole checksum, no blocks) and counted with them.
    indexes = index_files(dataset)
    metas = metadata_files(dataset)
    files = {url: (size, checksum) for url, size, checksum in [*indexes, *metas]}
    checks = shard_checks(
        [dataset], "size", blocks=True, urls=[*dataset.shard_urls, *files], files=files
    )
    store = open_store(dataset.url, dataset.storage_options, max_inflight=concurrency)
    slots = asyncio.Semaphore(concurrency)
    data_shards = len(manifest.shards)

    async def check(shard: int) -> ShardReport:
        # ``progress`` counts the shards' bytes (the index files' are not in its total).
        told = progress if shard < data_shards else None
        async with slots:
            if used != "size":
                return await scan_shard(store, checks, shard, blocks=used == "block", progress=told)
            report = ShardReport(checks.urls[shard])
            expected = int(checks.sizes[shard])
            try:
                size = await store.size(report.url)
            except StoreError as exc:
                report.problems.append(exc)
                return report
            if size != expected:
                report.problems.append(size_error(report.url, expected, size))
            if told is not None:
                told(expected)
            return report

    try:
        reports = await asyncio.gather(*(check(k) for k in range(len(checks.urls))))
    finally:
        await store.close()
    bad = [report for report in reports if report.problems]
    nbytes = manifest.total_bytes + sum(size for size, _ in files.values())
    return VerifyReport(
        dataset.url,
        used,
        len(reports),
        nbytes,
        bad,
        notes,
        data_shards=data_shards,
        index_files=len(indexes),
        metadata_files=len(metas),
    )


def verify_dataset(
    dataset: Dataset | str,
    *,
    level: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """:func:`verify_dataset_async`, from synchronous code."""
    return run_sync(
        verify_dataset_async(
            dataset,
            level=level,
            storage_options=storage_options,
            concurrency=concurrency,
            progress=progress,
        )
    )
