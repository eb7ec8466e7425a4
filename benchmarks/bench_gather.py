"""The local store's C copy alone: ``_preadv.gather`` per batch, as stored and widened.

Over ``bench_local.py``'s dataset (1 GiB of uint16 tokens, page cache warm) and its windows
(global shuffle, ``seq_len`` 2048, batch 16), one thread calls the C helper the way the
local store does, one group of 1024 windows (64 batches) per call into a fresh buffer,
without the loader around it: what the copy itself costs, the floor under the Loader's
per-batch time.

* ``uint16 fresh maps``: the files mapped just before (first-touch page faults, as a new
  Loader's first epoch pays them);
* ``uint16 warm maps``: the same mappings a second time (a loader's later epochs);
* ``int64 warm maps``: converting to int64 in the copy (``dtype=torch.int64``): each token
  written as 8 bytes, 256 KiB per batch.

Thread CPU time per batch, median over rounds.

Usage: ``.venv/bin/python benchmarks/bench_gather.py [--rounds 5] [--batches 8192]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import numpy.typing as npt
from bench_local import batch_ids, default_data_dir, ensure_dataset, warm_page_cache
from common import git_revision, positive

import asyncbatch as ab
from asyncbatch.stores import _local as local

GROUP_WINDOWS = 1024
WINDOWS_PER_BATCH = 16


class Mapped:
    """Every shard of ``dataset`` opened and mapped (closed by :meth:`close`)."""

    def __init__(self, dataset: ab.Dataset) -> None:
        assert local._preadv is not None, "the C helper was not built"
        self.helper = local._preadv
        self.fds = [os.open(url, os.O_RDONLY) for url in dataset.shard_urls]
        self.sizes = [os.fstat(fd).st_size for fd in self.fds]
        pairs = zip(self.fds, self.sizes, strict=True)
        bases = [self.helper.map_file(fd, size) for fd, size in pairs]
        self.bases = np.array(bases, dtype=np.int64)
        self.limits = np.array(self.sizes, dtype=np.int64)

    def close(self) -> None:
        for fd, size, base in zip(self.fds, self.sizes, self.bases.tolist(), strict=True):
            self.helper.unmap_file(base, size)
            os.close(fd)


def time_gather(
    mapped: Mapped, dataset: ab.Dataset, starts: npt.NDArray[np.int64], convert: str | None
) -> float:
    """Thread CPU microseconds per batch of gathering ``starts`` group by group."""
    layout = dataset.shard_map
    out_size = 8 if convert else 2
    extra = () if convert is None else (convert,)
    began = time.thread_time()
    for at in range(0, starts.size, GROUP_WINDOWS):
        group = starts[at : at + GROUP_WINDOWS]
        dest = np.empty(group.size * 2048 * out_size, dtype=np.uint8)
        done, *_ = mapped.helper.gather(
            mapped.bases, mapped.limits, layout.ends, layout.offsets, 2, group, 2048, dest, *extra
        )
        assert done == group.size
    return (time.thread_time() - began) * 1e6 / (starts.size / WINDOWS_PER_BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=positive, default=5, help="rounds (median)")
    parser.add_argument("--batches", type=positive, default=8192, help="batches per measurement")
    args = parser.parse_args()
    dataset = ensure_dataset(default_data_dir(1.0), 1.0)
    warm_page_cache(dataset)
    starts = np.ascontiguousarray(batch_ids(dataset, args.batches).reshape(-1) * 2048)
    lines: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        mapped = Mapped(dataset)
        try:
            lines.setdefault("uint16 fresh maps", []).append(
                time_gather(mapped, dataset, starts, None)
            )
            lines.setdefault("uint16 warm maps", []).append(
                time_gather(mapped, dataset, starts, None)
            )
            lines.setdefault("int64 warm maps", []).append(
                time_gather(mapped, dataset, starts, "u2>i8")
            )
        finally:
            mapped.close()
    print(f"# bench_gather, commit {git_revision()}, {args.batches} batches, {args.rounds} rounds")
    print(f"{'line':<20} {'us/batch':>9} {'min':>7} {'max':>7}")
    for name, values in lines.items():
        median = statistics.median(values)
        print(f"{name:<20} {median:9.1f} {min(values):7.1f} {max(values):7.1f}")


if __name__ == "__main__":
    main()
