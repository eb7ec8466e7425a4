"""``manifest.json``: the one file read when a dataset is opened.

It names the format, the element dtype and every shard with its byte size and element
count, so opening a dataset never touches (or lists) the data. Checksums (whole shards and,
optionally, blocks of them) are optional fields: a manifest without them still opens, and
readers that predate them ignore them. See docs/format.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._checksums import (
    ALGORITHM,
    decode_blocks,
    encode_blocks,
    format_digest,
    num_blocks,
    parse_digest,
)
from ._errors import ManifestError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard: its path relative to the dataset root, the bytes of its elements, their
    count, the byte offset where they start in the object (0 but for headers), and optionally
    the object's checksum and its blocks' (packed little-endian uint64 digests)."""

    path: str
    nbytes: int
    elements: int
    offset: int = 0
    checksum: int | None = None
    block_checksums: bytes | None = None
    #: Bytes after the elements that belong to no sample. Only data read in place has them
    #: (a Megatron ``.bin`` longer than its index says, which Megatron reads too); a manifest
    #: never records them.
    trailing: int = 0

    @property
    def object_size(self) -> int:
        """The size of the whole object: header, elements and trailing bytes."""
        return self.offset + self.nbytes + self.trailing


@dataclass(frozen=True, slots=True)
class Manifest:
    format: str
    dtype: np.dtype[Any]
    shards: tuple[ShardInfo, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The checksum algorithm of the shards' ``checksum`` fields (None: no checksums).
    checksum: str | None = None
    #: Bytes per checksum block (None: no block checksums).
    checksum_block: int | None = None

    @property
    def total_elements(self) -> int:
        return sum(shard.elements for shard in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def to_json(self) -> str:
        raw: dict[str, Any] = {
            "asyncbatch_manifest": MANIFEST_VERSION,
            "format": self.format,
            "dtype": np.lib.format.dtype_to_descr(self.dtype),
        }
        if self.checksum is not None:
            raw["checksum"] = self.checksum
        if self.checksum_block is not None:
            raw["checksum_block"] = self.checksum_block
        raw["shards"] = [_shard_json(s) for s in self.shards]
        raw["metadata"] = self.metadata
        return json.dumps(raw, indent=1)

    @classmethod
    def from_json(cls, text: bytes | str, url: str) -> Manifest:
        """Parse and validate; any problem is a :class:`ManifestError` naming ``url``."""
        try:
            raw = json.loads(text)
            version = raw["asyncbatch_manifest"]
            if version != MANIFEST_VERSION:
                raise ManifestError(f"{url}: unsupported manifest version {version!r}")
            dtype = np.lib.format.descr_to_dtype(_tuples(raw["dtype"]))
            algorithm, block = _checksum_fields(raw, url)
            shards = tuple(_shard(s, url, algorithm, block) for s in raw["shards"])
            manifest = cls(
                str(raw["format"]),
                dtype,
                shards,
                dict(raw.get("metadata", {})),
                checksum=algorithm,
                checksum_block=block,
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"{url}: not a valid asyncbatch manifest: {exc!r}") from exc
        for shard in shards:
            if (
                shard.nbytes != shard.elements * dtype.itemsize
                or shard.elements < 0
                or shard.offset < 0
            ):
                raise ManifestError(
                    f"{url}: shard {shard.path!r} has {shard.nbytes} bytes, which is not"
                    f" {shard.elements} elements of {dtype} ({dtype.itemsize} bytes each)"
                )
        return manifest


def _shard_json(shard: ShardInfo) -> dict[str, Any]:
    out: dict[str, Any] = {"path": shard.path, "bytes": shard.nbytes, "elements": shard.elements}
    if shard.offset:
        out["offset"] = shard.offset
    if shard.checksum is not None:
        out["checksum"] = format_digest(shard.checksum)
    if shard.block_checksums is not None:
        out["block_checksums"] = encode_blocks(shard.block_checksums)
    return out


def _checksum_fields(raw: dict[str, Any], url: str) -> tuple[str | None, int | None]:
    """The manifest's checksum algorithm and block size, validated (None when absent)."""
    algorithm = raw.get("checksum")
    block = raw.get("checksum_block")
    if algorithm is not None and algorithm != ALGORITHM:
        raise ManifestError(
            f"{url}: field 'checksum' is {algorithm!r}; this asyncbatch knows {ALGORITHM!r}"
        )
    if block is not None:
        if algorithm is None:
            raise ManifestError(f"{url}: field 'checksum_block' is set without 'checksum'")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ManifestError(
                f"{url}: field 'checksum_block' must be a positive integer, got {block!r}"
            )
    return algorithm, block


def _shard(raw: dict[str, Any], url: str, algorithm: str | None, block: int | None) -> ShardInfo:
    """One shard entry; its checksum fields must be there exactly when the manifest's are."""
    path, nbytes, offset = str(raw["path"]), int(raw["bytes"]), int(raw.get("offset", 0))
    checksum: int | None = None
    block_checksums: bytes | None = None
    for name, top, wanted in (
        ("checksum", "checksum", algorithm),
        ("block_checksums", "checksum_block", block),
    ):
        if name in raw and wanted is None:
            raise ManifestError(
                f"{url}: shard {path!r} has field {name!r} but the manifest no {top!r}"
            )
        if name not in raw and wanted is not None:
            raise ManifestError(
                f"{url}: shard {path!r} lacks field {name!r} (the manifest sets {top!r})"
            )
    if algorithm is not None:
        try:
            checksum = parse_digest(raw["checksum"])
        except ValueError as exc:
            raise ManifestError(f"{url}: shard {path!r} field 'checksum': {exc}") from exc
    if block is not None:
        try:
            count = num_blocks(offset + nbytes, block)  # blocks cover the whole object
            block_checksums = decode_blocks(raw["block_checksums"], count)
        except ValueError as exc:
            raise ManifestError(f"{url}: shard {path!r} field 'block_checksums': {exc}") from exc
    return ShardInfo(path, nbytes, int(raw["elements"]), offset, checksum, block_checksums)


def _tuples(descr: Any) -> Any:
    """JSON turns the tuples of a structured dtype's descr into lists; turn them back."""
    if isinstance(descr, list):
        return [
            tuple(_tuples(part) for part in item) if isinstance(item, list) else item
            for item in descr
        ]
    return descr
