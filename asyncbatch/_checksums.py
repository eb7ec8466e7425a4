"""Checksum primitives: the digests the writer records in a manifest and readers compare.

The algorithm is xxh3-64 (the ``xxhash`` package: BSD licence, wheels everywhere, ~20 GB/s
on one core, hashes any buffer without a copy and releases the GIL). The manifest records one
digest per shard and, optionally, one per *checksum block* of ``checksum_block`` bytes (the
last block of a shard may be shorter); see docs/format.md. How loaders check them:
:mod:`asyncbatch._checks`; ``asyncbatch verify``: :mod:`asyncbatch._verify`.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import numpy as np
import xxhash

#: The one checksum algorithm, as the manifest names it.
ALGORITHM = "xxh3_64"
#: Bytes per checksum block written by default: one block shuffle block (loader.BLOCK_BYTES),
#: ~11 manifest bytes per MiB of data.
DEFAULT_CHECKSUM_BLOCK = 2**20

_HEX16 = re.compile("[0-9a-f]{16}")


def digest(data: Any) -> int:
    """xxh3-64 of a bytes-like object, as an integer."""
    return xxhash.xxh3_64_intdigest(data)


def format_digest(value: int) -> str:
    """A digest as the manifest writes it: 16 lowercase hex digits."""
    return f"{value:016x}"


def parse_digest(text: Any) -> int:
    """The digest written as ``text``; ValueError unless it is 16 hex digits."""
    if not isinstance(text, str) or _HEX16.fullmatch(text) is None:
        raise ValueError(f"expected 16 lowercase hex digits, got {text!r}")
    return int(text, 16)


def num_blocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def block_digests(data: Any, block: int) -> bytes:
    """Digests of each ``block`` bytes of ``data``, packed as little-endian uint64."""
    view = memoryview(data).cast("B")
    out = np.empty(num_blocks(len(view), block), dtype="<u8")
    for index in range(out.size):
        out[index] = xxhash.xxh3_64_intdigest(view[index * block : (index + 1) * block])
    return out.tobytes()


def encode_blocks(packed: bytes) -> str:
    """Packed block digests as the manifest writes them (base64)."""
    return base64.b64encode(packed).decode("ascii")


def decode_blocks(text: Any, count: int) -> bytes:
    """Packed block digests from the manifest's text; ValueError unless ``count`` of them."""
    if not isinstance(text, str):
        raise ValueError(f"expected a base64 string, got {type(text).__name__}")
    try:
        packed = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from exc
    if len(packed) != 8 * count:
        raise ValueError(f"expected {count} block digests, got {len(packed) / 8:g}")
    return packed
