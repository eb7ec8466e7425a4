"""Readers run in their own processes by tests/test_cache.py.

``python tests/cache_child.py MODE JSON`` reads one epoch of the dataset at ``url`` through
the cache at ``cache`` (blocks of ``block_size``) and prints one JSON line: the sha256 of
every batch's tokens in order, the CacheWarnings seen and the cache's counters. Modes:

    read    just that (several of these run at once against one cache)
    kill    block for good half-way through writing the first cache entry, after creating
            the file ``marker``: the test kills the process there with SIGKILL
    full    writes of more than ``limit`` bytes fail (RLIMIT_FSIZE, as on a full disk):
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

import asyncbatch as ab


class StallingCache(ab.DiskCache):
    """A cache whose first entry write stops half-way, for good."""

    marker = ""

    def _write(self, fd: int, data: Any) -> None:
        view = memoryview(data)
        if len(view) != self.block_size:  # cache.json, or an object's last block
            super()._write(fd, data)
            return
        os.write(fd, view[: len(view) // 2])
        Path(self.marker).touch()
        while True:
            time.sleep(1)


def read_epoch(url: str, cache: ab.DiskCache | None) -> np.ndarray[Any, Any]:
    """One epoch's tokens, batch after batch (the parent reads the same without a cache)."""
    with ab.Loader(url, batch_size=4, seq_len=16, shuffle=True, seed=3, cache=cache) as loader:
        return np.concatenate([batch["tokens"].numpy() for batch in loader])


def digest(tokens: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(tokens.tobytes()).hexdigest()


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    block_size = args["block_size"]
    if mode == "kill":
        cache: ab.DiskCache = StallingCache(args["cache"], block_size=block_size)
        StallingCache.marker = args["marker"]
        read_epoch(args["url"], cache)
        return
    cache = ab.DiskCache(args["cache"], block_size=block_size, max_bytes=args.get("max_bytes"))
    if mode == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (args["limit"], args["limit"]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tokens = read_epoch(args["url"], cache)
    cached = [str(w.message) for w in seen if issubclass(w.category, ab.CacheWarning)]
    print(json.dumps({"sha256": digest(tokens), "warnings": cached, **cache.statistics()}))


if __name__ == "__main__":
    main()
