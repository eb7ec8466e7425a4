"""Time to the first batch over many local shards, with ``verify="size"`` beside ``"off"``.

A local token dataset of ``--shards`` shards of ``--shard-kb`` KiB each (uint16, written once
to a cache folder outside the repository), page cache warm. Each round times, in rotating
order, ``ab.Loader(ds, batch_size=16, seq_len=512, shuffle=True, verify=V)`` from
construction to its first batch, for ``V`` = ``"size"`` (the default: every shard a group
touches is stat'ed once per run) and ``"off"`` (no check: the baseline). A global shuffle's
first groups touch every shard, so the checks of thousands of shards run before the first
batch. Prints medians, the paired ratio of ``size`` to ``off`` and what the checks add per
shard.

Usage: ``.venv/bin/python benchmarks/bench_startup.py [--shards 2000] [--shard-kb 16]
[--rounds 7]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from common import git_revision, paired_ratio, positive

import asyncbatch as ab

SEQ_LEN = 512
BATCH_SIZE = 16
LEVELS = ("size", "off")


def ensure_dataset(shards: int, shard_kb: int) -> ab.Dataset:
    """The cached dataset of ``shards`` shards of ``shard_kb`` KiB."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache) / "asyncbatch" / f"bench-startup-{shards}x{shard_kb}k"
    if not (root / "manifest.json").exists():
        print(f"creating {shards} shards of {shard_kb} KiB in {root}", file=sys.stderr)
        count = shards * shard_kb * 512  # uint16 tokens
        tokens = np.random.default_rng(0).integers(0, 50_257, count, dtype=np.uint16)
        ab.write_tokens(str(root), tokens, shard_size=shard_kb * 1024)
    dataset = ab.open_dataset(str(root))
    for url in dataset.shard_urls:  # the page cache warm
        Path(url).read_bytes()
    return dataset


def first_batch(dataset: ab.Dataset, verify: str) -> float:
    """Seconds from constructing a Loader to holding its first batch."""
    start = time.perf_counter()
    with ab.Loader(
        dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, shuffle=True, seed=0, verify=verify
    ) as loader:
        next(iter(loader))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=positive, default=2000)
    parser.add_argument("--shard-kb", type=positive, default=16)
    parser.add_argument("--rounds", type=positive, default=7)
    args = parser.parse_args()
    dataset = ensure_dataset(args.shards, args.shard_kb)
    first_batch(dataset, "size")  # imports and thread pools warm, untimed
    times: dict[str, list[float]] = {level: [] for level in LEVELS}
    for round_ in range(args.rounds):
        for level in LEVELS[round_ % 2 :] + LEVELS[: round_ % 2]:
            times[level].append(first_batch(dataset, level))
    print(f"# bench_startup {datetime.date.today()} commit {git_revision()}")
    print(f"# {platform.machine()} Python {platform.python_version()}, {os.cpu_count()} cpus")
    print(
        f"# {args.shards} shards of {args.shard_kb} KiB, seq_len {SEQ_LEN}, batch {BATCH_SIZE},"
        f" global shuffle, {args.rounds} rounds, medians"
    )
    print(f"{'verify':<8}{'first batch ms':>16}{'min':>9}{'max':>9}")
    for level, values in times.items():
        print(
            f"{level:<8}{statistics.median(values) * 1e3:>16.1f}"
            f"{min(values) * 1e3:>9.1f}{max(values) * 1e3:>9.1f}"
        )
    ratio = paired_ratio(times["size"], times["off"])
    added = statistics.median(
        (size - off) / args.shards for size, off in zip(times["size"], times["off"], strict=True)
    )
    print(f"size / off: {ratio:.2f} (paired); the checks add {added * 1e6:.0f} us per shard")


if __name__ == "__main__":
    main()
