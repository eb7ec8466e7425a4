"""Loader defaults the command line shows without importing the loader (and so torch)."""

from __future__ import annotations

#: Byte-range requests in flight per loader.
MAX_INFLIGHT = 64
#: With ``prefetch=None``: read ahead as many batches as fit in this many bytes (2 to 128,
#: 1024 for local files, or two shuffle windows' worth with ``shuffle="block"``, four locally).
PREFETCH_BYTES = 64 * 2**20
#: Bytes per entry of a node-local cache (``DiskCache(block_size=)``).
CACHE_BLOCK_SIZE = 4 * 2**20
