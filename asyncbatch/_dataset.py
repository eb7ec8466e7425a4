"""A dataset: its root URL and manifest, as a data class (opened by
:mod:`asyncbatch._open`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from ._checksums import digest, format_digest
from ._layout import ShardMap
from ._manifest import Manifest
from ._redact import redact
from .stores._base import Store

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[list[str | int], str]:
    """Sort key of natural order, the order of the files of a folder read in place: runs of
    digits compare as numbers, so ``p-2`` comes before ``p-10`` (ties: plain order)."""
    # re.split with a group alternates text and digits, so equal positions hold equal types.
    parts: list[str | int] = [
        int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(name))
    ]
    return parts, name


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
            f"Dataset({redact(self.url)!r}, format={m.format!r}, dtype={m.dtype},"
            f" shards={len(m.shards)}, elements={m.total_elements})"
        )


async def read_object(store: Store, url: str) -> bytes:
    """The whole object at ``url``, length-checked."""
    size = await store.size(url)
    buffer = bytearray(size)
    await store.read_ranges(url, starts=[0], ends=[size], buffers=[memoryview(buffer)])
    return bytes(buffer)
