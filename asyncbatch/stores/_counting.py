"""What a loader's reads count: requests and bytes, and the node-local cache's blocks.

The stack's lowest guard (:class:`~asyncbatch.stores._stack.RetryingStore`, right above the
transport and below a cache, when there is one) counts ``requests`` and ``bytes_fetched``,
so they are what the object store or filesystem was asked for, whatever the layers above
serve from elsewhere. A request is one byte range; a store's retries are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReadCounts:
    """Cumulative counts of one loader's reads; each field is written by one thread only."""

    requests: int = 0
    bytes_fetched: int = 0
    #: Blocks the node-local cache served, and blocks it had to fetch.
    cache_hits: int = 0
    cache_misses: int = 0
