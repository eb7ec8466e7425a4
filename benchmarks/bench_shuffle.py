"""Shuffle quality and read requests per sample: exact (global) shuffle vs block shuffle.

For one epoch of ``--samples`` samples in batches of ``--batch-size`` on one rank, each
shuffle kind's order comes from ``asyncbatch.sampling._order.EpochOrder`` (the loader's own
order). The figures are counts, not timings (except the last column), so they do not move
with the machine's load:

- *requests / sample*: the engine reads a group of batches at once and merges samples that
  are neighbours in storage into one request (``coalesce_gap=0``). Groups are as the loader
  makes them: a window's worth of batches for the block shuffle, 64 batches otherwise.
- *neighbours together*: of the pairs of samples next to each other in storage, the share
  that land in the same batch, divided by what an ideal uniform shuffle gives, (B−1)/(N−1).
  1 is ideal; the block shuffle's is about N / (block_size · window).
- *mean |shift| / N*: mean distance between a sample's position in the epoch and its place
  in storage, over N (a uniform shuffle gives 1/3; no shuffle gives 0).
- *regions per batch*: distinct storage regions of ``--region`` samples a batch touches,
  over the batch size (1 = every sample of a batch from a different region).
- *ns / id*: cost of computing the epoch's ids (median of ``--rounds``).

Usage: ``.venv/bin/python benchmarks/bench_shuffle.py [--samples 1048576] [--batch-size 16]``
``[--block-size 256] [--windows 1 8 64] [--region 256] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from common import git_revision, positive

from asyncbatch._engine import MAX_GROUP
from asyncbatch.sampling._order import EpochOrder

SEED = 7


def epoch_ids(order: EpochOrder) -> npt.NDArray[np.int64]:
    return order.sample_ids(0, 0, order.batches_per_epoch)


def requests_per_sample(ids: npt.NDArray[np.int64], group_samples: int) -> float:
    """Requests for ``ids`` read ``group_samples`` at a time, neighbours merged."""
    requests = 0
    for start in range(0, ids.size, group_samples):
        part = np.sort(ids[start : start + group_samples])
        requests += int(np.count_nonzero(np.diff(part) != 1)) + 1
    return requests / ids.size


def quality(ids: npt.NDArray[np.int64], samples: int, batch: int, region: int) -> dict[str, float]:
    batch_of = np.empty(samples, dtype=np.int64)
    batch_of.fill(-1)
    batch_of[ids] = np.arange(ids.size) // batch
    pairs = (batch_of[:-1] >= 0) & (batch_of[:-1] == batch_of[1:])
    ideal = (batch - 1) / (samples - 1)
    shift = np.abs(np.arange(ids.size) - ids).mean() / samples
    regions = ids.reshape(-1, batch) // region
    distinct = np.mean([np.unique(row).size for row in regions[:4096]]) / batch
    return {
        "neighbours": float(pairs.mean() / ideal),
        "shift": float(shift),
        "regions": float(distinct),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=positive, default=2**20)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--block-size", type=positive, default=256)
    parser.add_argument("--windows", type=positive, nargs="+", default=[1, 8, 64])
    parser.add_argument("--region", type=positive, default=256)
    parser.add_argument("--rounds", type=positive, default=5)
    args = parser.parse_args()
    samples, batch = args.samples, args.batch_size
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("none", {"shuffle": "none"}, MAX_GROUP * batch),
        ("global (exact)", {"shuffle": "global"}, MAX_GROUP * batch),
    ]
    for window in args.windows:
        span = args.block_size * window
        group = -(-span // batch) * batch  # the loader's group: one window's worth of batches
        cases.append(
            (
                f"block {args.block_size} x window {window}",
                {"shuffle": "block", "block_size": args.block_size, "window": window},
                max(group, batch),
            )
        )
    print(
        f"asyncbatch {git_revision()}, {platform.python_implementation()}"
        f" {platform.python_version()}, numpy {np.__version__}"
    )
    print(
        f"{samples} samples, batch {batch}, one rank; requests counted with coalesce_gap=0;"
        f" regions of {args.region} samples\n"
    )
    header = (
        f"{'order':>26} {'requests/sample':>16} {'neighbours together':>20}"
        f" {'mean |shift|/N':>15} {'regions/batch':>14} {'ns/id':>7}"
    )
    print(header)
    for name, kwargs, group in cases:
        order = EpochOrder(samples, batch, seed=SEED, **kwargs)
        ids = epoch_ids(order)
        timings = []
        for _ in range(args.rounds):
            fresh = EpochOrder(samples, batch, seed=SEED, **kwargs)
            start = time.perf_counter()
            epoch_ids(fresh)
            timings.append((time.perf_counter() - start) / ids.size * 1e9)
        q = quality(ids, samples, batch, args.region)
        print(
            f"{name:>26} {requests_per_sample(ids, group):>16.4f} {q['neighbours']:>20.1f}"
            f" {q['shift']:>15.3f} {q['regions']:>14.3f} {statistics.median(timings):>7.1f}"
        )


if __name__ == "__main__":
    main()
