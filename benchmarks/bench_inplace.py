"""Data read in place (``.npy`` files, raw token files) beside the same tokens in the
``tokens`` format, local files, in one process.

Writes the same uint16 tokens three ways in a temporary folder (``ab.write_tokens``; ``.npy``
files of the same sizes; raw files of the same sizes), then, in interleaved rounds, times
``ab.Loader`` (global shuffle, seq_len 2048, batch 16) from construction to its last batch
over each, and prints tokens/s and the ratio to the tokens format (median of per-round
ratios). Read requests per batch are counted over a separate whole epoch (a partial one
stops at a prefetch group boundary that depends on timing) through a store wrapper
(``benchcount://``, the local store) that counts the ranges it is asked for after
coalescing; the timed runs use the plain local store.

Usage: ``.venv/bin/python benchmarks/bench_inplace.py [--size-mb 256] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import git_revision, paired_ratio, positive

import asyncbatch as ab
from asyncbatch.stores import ObjectInfo
from asyncbatch.stores._local import LocalStore

SEQ_LEN = 2048
BATCH_SIZE = 16
SHARDS = 8
RANGES = [0]


class CountingStore(LocalStore):
    """``benchcount://PATH``: the local store, counting the byte ranges it reads."""

    async def size(self, url: str) -> int:
        return await super().size(url.removeprefix("benchcount://"))

    async def stat(self, url: str) -> ObjectInfo:
        return await super().stat(url.removeprefix("benchcount://"))

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        RANGES[0] += 1
        return await super().read_tail(url.removeprefix("benchcount://"), length)

    async def list(self, url: str) -> list[str]:
        return [f"benchcount://{u}" for u in await super().list(url.removeprefix("benchcount://"))]

    async def read_into(
        self,
        urls: Sequence[str],
        which: Any,
        starts: Any,
        ends: Any,
        dest: Any,
        offsets: Any,
        convert: Any = None,
    ) -> None:
        RANGES[0] += len(starts)
        paths = [url.removeprefix("benchcount://") for url in urls]
        await super().read_into(paths, which, starts, ends, dest, offsets, convert)

    async def read_windows(
        self, urls: Sequence[str], ends: Any, offsets: Any, itemsize: int, starts: Any, *args: Any
    ) -> bool:
        RANGES[0] += len(starts)
        paths = [url.removeprefix("benchcount://") for url in urls]
        return await super().read_windows(paths, ends, offsets, itemsize, starts, *args)


def write_all(root: Path, size_mb: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same tokens as a tokens dataset, ``.npy`` files and raw files: name -> (url, open
    keyword arguments)."""
    tokens = size_mb * 2**20 // 2
    parts = np.array_split(
        np.random.default_rng(0).integers(0, 50_257, tokens, dtype=np.uint16), SHARDS
    )
    ab.write_tokens(str(root / "tokens"), np.concatenate(parts), shard_size=len(parts[0]) * 2)
    for kind in ("npy", "raw"):
        (root / kind).mkdir()
    for i, part in enumerate(parts):
        np.save(root / "npy" / f"part-{i}.npy", part)
        part.tofile(root / "raw" / f"part-{i}.npy")
    return {
        "tokens": (str(root / "tokens"), {}),
        ".npy": (str(root / "npy"), {}),
        "raw": (str(root / "raw"), {"format": "raw", "options": {"dtype": "uint16"}}),
    }


def time_loader(dataset: ab.Dataset, batches: int) -> float:
    """Tokens per second from constructing the loader to its last batch."""
    start = time.perf_counter()
    with ab.Loader(dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=1) as loader:
        shapes = [batch["tokens"].shape for batch, _ in zip(loader, range(batches), strict=False)]
    seconds = time.perf_counter() - start
    assert shapes == [(BATCH_SIZE, SEQ_LEN)] * batches
    return batches * BATCH_SIZE * SEQ_LEN / seconds


def requests_per_batch(url: str, kwargs: dict[str, Any], batches: int) -> float:
    dataset = ab.open_dataset(f"benchcount://{url}", **kwargs)
    RANGES[0] = 0
    with ab.Loader(dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=1) as loader:
        for n, _ in enumerate(loader, 1):
            if n == batches:
                break
    return RANGES[0] / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=positive, default=256)
    parser.add_argument("--rounds", type=positive, default=5)
    args = parser.parse_args()
    ab.register_store("benchcount", lambda scheme, options, max_inflight: CountingStore())
    print(f"asyncbatch bench_inplace  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  python {platform.python_version()}  torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench-inplace-") as folder:
        layouts = write_all(Path(folder), args.size_mb)
        datasets = {name: ab.open_dataset(url, **kw) for name, (url, kw) in layouts.items()}
        batches = datasets["tokens"].manifest.total_elements // (SEQ_LEN * BATCH_SIZE)
        print(
            f"  {args.size_mb} MiB of uint16 tokens in {SHARDS} files each way, page cache"
            f" warm; seq_len {SEQ_LEN}, batch {BATCH_SIZE}, global shuffle, {batches} batches"
        )
        for dataset in datasets.values():
            time_loader(dataset, batches)  # warm the page cache and the imports
        rates: dict[str, list[float]] = {name: [] for name in datasets}
        for round_ in range(args.rounds):
            for name, dataset in datasets.items():
                rates[name].append(time_loader(dataset, batches))
            shown = ", ".join(f"{n} {r[-1] / 1e6:.1f}" for n, r in rates.items())
            print(f"  round {round_ + 1}: {shown} M tok/s")
        print(
            f"\n{'layout':8} {'M tok/s':>8} {'min-max':>12} {'requests/batch':>15} {'/ tokens':>9}"
        )
        for name, (url, kw) in layouts.items():
            rate = rates[name]
            requests = requests_per_batch(url, kw, batches)
            print(
                f"{name:8} {statistics.median(rate) / 1e6:8.1f}"
                f" {min(rate) / 1e6:5.1f}-{max(rate) / 1e6:<6.1f}"
                f" {requests:15.2f} {paired_ratio(rate, rates['tokens']):9.2f}"
            )
    print("(/ tokens: median over rounds of the per-round ratio to the tokens format)")


if __name__ == "__main__":
    main()
