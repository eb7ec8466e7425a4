"""What ``verify=`` costs: ``ab.Loader`` on local files with each verification level.

One local token dataset (uint16, 256 MiB by default, checksum blocks of ``--block`` bytes,
written once to a cache folder outside the repository), ``seq_len`` 2048, batch 16, page
cache warm. For the global shuffle and the block shuffle (1 MiB blocks, window 8), each round
times ``--batches`` batches from constructing a Loader with ``verify="off"``, ``"size"``,
``"block"`` and ``"full"`` (``full`` includes reading every shard once before first use),
in rotating order. Prints medians and the paired ratio of each level to ``off`` (the median
over rounds of the ratio within one round), and xxh3-64's speed on one core.

Usage: ``.venv/bin/python benchmarks/bench_verify.py [--size-mb 256] [--block 1048576]
[--batches 2048] [--rounds 3]``
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
import xxhash
from common import git_revision, paired_ratio, positive, write_rates

import asyncbatch as ab

SEQ_LEN = 2048
BATCH_SIZE = 16
LEVELS = ("off", "size", "block", "full")
SHUFFLES: tuple[bool | str, ...] = (True, "block")
SHARD_SIZE = 64 * 2**20


def ensure_dataset(size_mb: int, block: int) -> ab.Dataset:
    """The cached dataset of ``size_mb`` MiB with ``block``-byte checksum blocks."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache) / "asyncbatch" / f"bench-verify-{size_mb}m-{block}"
    if not (root / "manifest.json").exists():
        print(f"creating {size_mb} MiB of uint16 tokens in {root}", file=sys.stderr)
        tokens = np.random.default_rng(0).integers(0, 50_257, size_mb * 2**19, dtype=np.uint16)
        ab.write_tokens(str(root), tokens, shard_size=SHARD_SIZE, checksum_block=block)
    return ab.open_dataset(str(root))


def warm(dataset: ab.Dataset) -> None:
    for url in dataset.shard_urls:
        Path(url).read_bytes()


def time_loader(dataset: ab.Dataset, shuffle: bool | str, verify: str, batches: int) -> float:
    """Seconds from constructing a Loader to holding its ``batches``-th batch."""
    start = time.perf_counter()
    with ab.Loader(
        dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, shuffle=shuffle, seed=0, verify=verify
    ) as loader:
        for done, _batch in enumerate(loader, 1):
            if done == batches:
                return time.perf_counter() - start
    raise RuntimeError(f"the loader ended after fewer than {batches} batches")


def hash_speed() -> float:
    """xxh3-64 over a 64 MiB buffer, bytes per second (best of 5)."""
    data = np.random.default_rng(1).integers(0, 255, 64 * 2**20, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        xxhash.xxh3_64_intdigest(memoryview(data))
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=256, help="dataset size in MiB")
    parser.add_argument("--block", type=positive, default=2**20, help="checksum block bytes")
    parser.add_argument("--batches", type=positive, default=2048, help="batches per measurement")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (median)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    dataset = ensure_dataset(args.size_mb, args.block)
    per_epoch = dataset.manifest.total_elements // SEQ_LEN // BATCH_SIZE
    batches = min(args.batches, per_epoch)
    warm(dataset)
    print(f"asyncbatch bench_verify  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  python {platform.python_version()}  cpus {os.cpu_count()}")
    print(
        f"  dataset {dataset.url}: {dataset.manifest.total_bytes / 2**20:.0f} MiB,"
        f" {len(dataset.shard_urls)} shards, checksum blocks of {args.block} bytes;"
        f" {batches} batches of {BATCH_SIZE} x {SEQ_LEN} per measurement, {args.rounds} rounds"
    )
    print(f"  xxh3_64 on one core: {hash_speed() / 1e9:.1f} GB/s")
    tokens = batches * BATCH_SIZE * SEQ_LEN
    cases = [(shuffle, level) for shuffle in SHUFFLES for level in LEVELS]
    rates: dict[tuple[bool | str, str], list[float]] = {case: [] for case in cases}
    for round_ in range(args.rounds):
        shift = round_ % len(cases)
        for shuffle, level in cases[shift:] + cases[:shift]:
            rates[shuffle, level].append(tokens / time_loader(dataset, shuffle, level, batches))
        print(f"  round {round_ + 1} done", file=sys.stderr)
    print()
    print(
        f"{'shuffle':8} {'verify':6} {'M tok/s':>10} {'min':>8} {'max':>8} {'/ off (paired)':>15}"
    )
    for shuffle, level in cases:
        values = rates[shuffle, level]
        ratio = paired_ratio(values, rates[shuffle, "off"])
        name = "global" if shuffle is True else str(shuffle)
        print(
            f"{name:8} {level:6} {statistics.median(values) / 1e6:10.1f}"
            f" {min(values) / 1e6:8.1f} {max(values) / 1e6:8.1f} {ratio:15.3f}"
        )
    if args.json is not None:
        # Each level against verify="off" under the same shuffle, as the table reads.
        label = {True: "global", "block": "block"}
        named = {
            f"{label[shuffle]} shuffle, verify={level}": values
            for (shuffle, level), values in rates.items()
        }
        title = f"verify= levels, local files: {args.size_mb} MiB, checksum blocks {args.block} B"
        write_rates(
            args.json,
            "bench_verify",
            named,
            unit="tokens/s",
            baseline="global shuffle, verify=off",
            baselines={
                f"block shuffle, verify={level}": "block shuffle, verify=off" for level in LEVELS
            },
            title=title,
        )


if __name__ == "__main__":
    main()
