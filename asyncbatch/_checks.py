"""Verification on the read path: the ``verify=`` levels, and what the manifests of a
loader's datasets record about each shard, in the terms the checking store layer
(:mod:`asyncbatch.stores._checked`) takes.

Verification levels (``verify=`` of the loaders, docs/reliability.md)::

    off     the stores' length checks only
    size    each shard's size is compared with the store's the first time it is touched
    block   size, then every read is widened to whole checksum blocks, each block checked
    full    size, then each shard is read and checked whole before its first use

A shard that passed stays passed for the loader's life (across epochs), so ``size`` costs
one ``size()`` call per shard and ``full`` one extra read of each shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

import numpy as np

from ._errors import ConfigError
from .stores._checked import SCAN_CHUNK as SCAN_CHUNK
from .stores._checked import Expected as Expected
from .stores._checked import ScanReport as ShardReport
from .stores._checked import scan as scan_shard
from .stores._checked import size_error as size_error

if TYPE_CHECKING:
    from ._dataset import Dataset

__all__ = [
    "DEFAULT_VERIFY",
    "SCAN_CHUNK",
    "VERIFY_LEVELS",
    "Expected",
    "ShardReport",
    "Verify",
    "check_level",
    "scan_shard",
    "shard_checks",
    "size_error",
]

Verify: TypeAlias = Literal["off", "size", "block", "full"]
VERIFY_LEVELS: tuple[Verify, ...] = get_args(Verify)
DEFAULT_VERIFY: Verify = "size"


def check_level(verify: Any) -> str:
    """``verify`` if it names a level, else a ConfigError naming the value."""
    if not isinstance(verify, str) or verify not in VERIFY_LEVELS:
        raise ConfigError(f"verify={verify!r}: expected one of {VERIFY_LEVELS}")
    return verify


def shard_checks(
    datasets: Sequence[Dataset],
    level: str,
    *,
    blocks: bool | None = None,
    urls: Sequence[str] | None = None,
    files: Mapping[str, tuple[int, int | None]] | None = None,
) -> Expected:
    """What the manifests of ``datasets`` record about each shard (numbered as the engine
    numbers them: dataset after dataset), to be checked at ``level``.

    ``urls``: every file the source's plans name, if more than the manifests' shards (a
    format's index or metadata files follow the shards); those extra files are checked only
    where ``files`` gives their size and checksum (``{url: (bytes, checksum or None)}``),
    and never by blocks. Refuses (ConfigError) a level that needs checksums a dataset does
    not record. Block digests are gathered only for ``block`` and ``full`` (or
    ``blocks=True``): a big manifest holds millions of them.
    """
    check_level(level)
    for dataset in datasets:
        manifest = dataset.manifest
        if level in ("block", "full") and manifest.checksum is None:
            raise ConfigError(
                f"verify={level!r} needs checksums, and {dataset.url} records none"
                " (written without them): use verify='size' or rewrite the dataset"
            )
        if level == "block" and manifest.checksum_block is None:
            raise ConfigError(
                f"verify='block' needs block checksums, and {dataset.url} records only"
                " whole-shard ones (written with checksum_block=None): use verify='full'"
            )
    shards = [(d, s) for d in datasets for s in d.manifest.shards]
    names: Sequence[str] = [url for d in datasets for url in d.shard_urls]
    #: Object sizes: a header before the elements (``offset``) is part of the object, and
    #: the checksums cover the whole object.
    sizes = np.array([s.object_size for _, s in shards], dtype=np.int64)
    checksums = [s.checksum for _, s in shards]
    block_size = np.array([d.manifest.checksum_block or 0 for d, _ in shards], np.int64)
    if blocks is None:
        blocks = level in ("block", "full")
    packed = [
        np.frombuffer((s.block_checksums if blocks else None) or b"", dtype="<u8")
        for _, s in shards
    ]
    digests = np.concatenate(packed).astype(np.uint64) if packed else np.zeros(0, np.uint64)
    counts = np.array([b.size for b in packed], dtype=np.int64)
    first_block = np.cumsum(counts) - counts
    extra = 0 if urls is None else len(urls) - len(shards)
    if extra > 0:  # files no manifest describes (not in ``files``): nothing to check
        assert urls is not None
        names = urls
        described = [(files or {}).get(url) for url in names[len(shards) :]]
        sizes = np.append(sizes, np.array([-1 if d is None else d[0] for d in described], np.int64))
        checksums += [None if d is None else d[1] for d in described]
        block_size = np.append(block_size, np.zeros(extra, dtype=np.int64))
        first_block = np.append(first_block, np.zeros(extra, dtype=np.int64))
    elif urls is not None:
        names = urls
    return Expected(
        names,
        sizes,
        level=level,
        checksums=checksums,
        block_size=block_size,
        digests=digests if blocks else None,
        first_block=first_block,
    )
