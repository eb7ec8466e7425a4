"""``manifest.json``: the one file read when a dataset is opened.

It names the format, the element dtype and every shard with its byte size and element
count, so opening a dataset never touches (or lists) the data. See docs/format.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ManifestError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard: its path relative to the dataset root, the bytes of its elements, their
    count, and the byte offset where they start in the object (0 but for headers)."""

    path: str
    nbytes: int
    elements: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Manifest:
    format: str
    dtype: np.dtype[Any]
    shards: tuple[ShardInfo, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_elements(self) -> int:
        return sum(shard.elements for shard in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def to_json(self) -> str:
        return json.dumps(
            {
                "asyncbatch_manifest": MANIFEST_VERSION,
                "format": self.format,
                "dtype": np.lib.format.dtype_to_descr(self.dtype),
                "shards": [_shard_json(s) for s in self.shards],
                "metadata": self.metadata,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: bytes | str, url: str) -> Manifest:
        """Parse and validate; any problem is a :class:`ManifestError` naming ``url``."""
        try:
            raw = json.loads(text)
            version = raw["asyncbatch_manifest"]
            if version != MANIFEST_VERSION:
                raise ManifestError(f"{url}: unsupported manifest version {version!r}")
            dtype = np.lib.format.descr_to_dtype(_tuples(raw["dtype"]))
            shards = tuple(
                ShardInfo(
                    str(s["path"]), int(s["bytes"]), int(s["elements"]), int(s.get("offset", 0))
                )
                for s in raw["shards"]
            )
            manifest = cls(str(raw["format"]), dtype, shards, dict(raw.get("metadata", {})))
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
    entry: dict[str, Any] = {"path": shard.path, "bytes": shard.nbytes, "elements": shard.elements}
    if shard.offset:
        entry["offset"] = shard.offset
    return entry


def _tuples(descr: Any) -> Any:
    """JSON turns the tuples of a structured dtype's descr into lists; turn them back."""
    if isinstance(descr, list):
        return [
            tuple(_tuples(part) for part in item) if isinstance(item, list) else item
            for item in descr
        ]
    return descr
