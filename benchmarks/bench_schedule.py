"""Planning a batch of a mixture from a weight schedule beside fixed weights, paired.

Both orders blend the same three datasets (10**6, 3·10**5 and 10**5 samples, each in its
own exact shuffle) for rank 0 of ``--world`` ranks with ``--batch`` samples per rank: the
fixed one with weights 0.7 / 0.2 / 0.1, the scheduled one with the docs' schedule (a linear
stretch, a second one, a step change) over ``--batches`` steps. One measurement plans
``--batches`` consecutive batches from a fresh order (``EpochOrder.sample_ids`` for one
batch at a time, as the engine asks: the sample ids of the batch), so the tables each order
builds (65536 positions at a time) are in the per-batch cost. Rounds alternate which order
goes first; the table gives medians over rounds, and the difference column is the median
over rounds of the difference of the two measurements taken side by side.

Then, once each: the first batch at step 10**6 (a resume far into the run, cold caches).

Then how evenly ranks share each dataset: the largest ``|rank's count − integral / W|`` over
ranks, datasets and 2000 steps of the docs' schedule (three datasets) and of a five-dataset
one, for a few world sizes and batches (counts, not timings).

``--plot PNG`` also draws one schedule's realised mix against its target (docs/sampling.md).

Usage: ``.venv/bin/python benchmarks/bench_schedule.py [--rounds 11] [--batches 4000]``
``[--plot docs/img/schedule_mix.png]``
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
from typing import Any

import numpy as np
from common import git_revision, positive

from asyncbatch.sampling._mixture import MixtureOrder, ScheduledMixtureOrder
from asyncbatch.sampling._order import EpochOrder, GlobalShuffle, derive_key
from asyncbatch.sampling._schedule import Schedule, SchedulePiece

SIZES = [10**6, 3 * 10**5, 10**5]
FIXED = [0.7, 0.2, 0.1]


def schedule_for(steps: int) -> Schedule:
    """The docs' schedule, its breakpoints at 1/2, 3/5 and 4/5 of ``steps``."""
    half, three, four = steps // 2, steps * 3 // 5, steps * 4 // 5
    return Schedule.parse(
        [
            (0, [0.7, 0.2, 0.1]),
            (half, [0.5, 0.3, 0.2]),
            (three, [0.2, 0.2, 0.6]),
            (four, [0.2, 0.2, 0.6]),
            (four, [0.0, 0.0, 1.0]),
        ],
        len(SIZES),
    )


def order(kind: str, batch: int, world: int, steps: int) -> EpochOrder:
    inner = [GlobalShuffle(n, derive_key(7, d)) for d, n in enumerate(SIZES)]
    step = batch * world
    length = sum(SIZES) // step * step
    samples: MixtureOrder | ScheduledMixtureOrder
    if kind == "fixed":
        samples = MixtureOrder(SIZES, FIXED, 3, length, inner)
    else:
        piece = SchedulePiece(schedule_for(steps), 0, [0] * len(SIZES), step, world)
        samples = ScheduledMixtureOrder(SIZES, length, inner, None, [piece])
    return EpochOrder(length, batch, seed=3, rank=0, world_size=world, samples=samples)


def plan(kind: str, batch: int, world: int, batches: int, first: int = 0) -> float:
    """Seconds per batch to plan ``batches`` batches from batch ``first``, fresh order."""
    epoch_order = order(kind, batch, world, batches)
    epoch, start = divmod(first, epoch_order.batches_per_epoch)
    begin = time.perf_counter()
    for b in range(start, start + batches):
        epoch_order.sample_ids(epoch, b, b + 1)
    return (time.perf_counter() - begin) / batches


def locate(kind: str, batch: int, world: int, batches: int) -> float:
    """Seconds per batch to map one batch's stream positions to (dataset, k): the part of
    planning that differs between the two orders, fresh order (tables built on the way)."""
    samples = order(kind, batch, world, batches).samples
    assert isinstance(samples, MixtureOrder | ScheduledMixtureOrder)
    rank = np.arange(batch, dtype=np.int64) * world
    begin = time.perf_counter()
    for b in range(batches):
        samples.locate_stream(rank + b * batch * world)
    return (time.perf_counter() - begin) / batches


def far(kind: str, batch: int, world: int, steps: int) -> float:
    """Seconds for the first batch at step ``steps`` (cold)."""
    epoch_order = order(kind, batch, world, steps)
    epoch, b = divmod(steps, epoch_order.batches_per_epoch)
    begin = time.perf_counter()
    epoch_order.sample_ids(epoch, b, b + 1)
    return time.perf_counter() - begin


FIVE = [(0, [5, 1, 1, 1, 0.01]), (1000, [0.01, 1, 1, 1, 5])]


def rank_balance(points: Any, world: int, batch: int, steps: int = 2000) -> float:
    """Largest ``|rank's count − integral / W|`` after any step, any rank and dataset."""
    schedule = points if isinstance(points, Schedule) else Schedule.parse(points, len(points[0][1]))
    n = len(schedule.breakpoints[0][1])
    step = world * batch
    piece = SchedulePiece(schedule, 0, [0] * n, step, world)
    which, _ = piece.locate_stream(np.arange(steps * step, dtype=np.int64))
    targets = piece.integral(np.arange(steps + 1, dtype=np.float64) * step) / world
    per_step = which.reshape(steps, batch, world)
    worst = 0.0
    for d in range(n):
        counts = (per_step == d).sum(axis=1).cumsum(axis=0)  # (steps, world)
        worst = max(worst, float(np.abs(counts - targets[1:, d : d + 1]).max()))
    return worst


def draw(path: Path) -> None:
    """The docs' schedule over 2000 steps of 64 samples: realised share per 20 steps beside
    the target, and each dataset's count minus the schedule's integral at every step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, step = 2000, 64
    schedule = schedule_for(steps)
    piece = SchedulePiece(schedule, 0, [0] * len(SIZES), step)
    which, _ = piece.locate_stream(np.arange(steps * step, dtype=np.int64))
    per_step = np.stack(
        [np.bincount(which[s * step : (s + 1) * step], minlength=3) for s in range(steps)]
    )
    counts = np.vstack([np.zeros(3, dtype=np.int64), per_step.cumsum(axis=0)])
    targets = piece.integral(np.arange(steps + 1, dtype=np.float64) * step)
    window = 20
    realised = per_step.reshape(-1, window, 3).sum(axis=1) / (window * step)
    mids = np.arange(steps // window) * window + window / 2
    target = np.stack([schedule.weights_at(s) for s in np.arange(steps)])
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    names = ["web", "code", "books"]
    for d in range(3):
        (line,) = top.plot(np.arange(steps), target[:, d], "--", label=f"{names[d]} target")
        top.plot(mids, realised[:, d], "o", ms=3, color=line.get_color(), label=f"{names[d]}")
        bottom.plot(np.arange(steps + 1), counts[:, d] - targets[:, d], lw=0.6)
    top.set_ylabel(f"share of the samples\n(realised: per {window} steps)")
    top.legend(ncol=3, fontsize=8)
    bottom.axhline(1, color="grey", lw=0.5)
    bottom.axhline(-1, color="grey", lw=0.5)
    bottom.set_ylim(-1.2, 1.2)
    bottom.set_ylabel("samples taken − integral\n(every step)")
    bottom.set_xlabel(f"step (global batch of {step})")
    figure.suptitle("ab.mix(..., weights=schedule): realised mix against the schedule")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}: max |count - integral| = {np.abs(counts - targets).max():.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=positive, default=11)
    parser.add_argument("--batches", type=positive, default=4000)
    parser.add_argument("--batch", type=positive, default=16)
    parser.add_argument("--world", type=positive, default=8)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    print(
        f"# {datetime.date.today()} {platform.node()} {os.cpu_count()} CPUs"
        f" python {sys.version.split()[0]} asyncbatch {git_revision()}"
    )
    print(f"# {' '.join(sys.argv)}")
    plan("fixed", args.batch, args.world, 200)  # warm up numpy and the imports
    print(
        f"\none batch of {args.batch} (rank 0 of {args.world}), {args.batches} batches per"
        f" measurement, {args.rounds} rounds; µs per batch"
    )
    print("| what | fixed (median) | schedule (median) | schedule − fixed, paired (median) |")
    print("|---|---:|---:|---:|")
    for name, measure in (("sample ids (EpochOrder.sample_ids)", plan), ("locate", locate)):
        times: dict[str, list[float]] = {"fixed": [], "schedule": []}
        differences: list[float] = []
        for r in range(args.rounds):
            kinds = ["fixed", "schedule"] if r % 2 == 0 else ["schedule", "fixed"]
            got: dict[str, Any] = {
                k: measure(k, args.batch, args.world, args.batches) for k in kinds
            }
            for kind, seconds in got.items():
                times[kind].append(seconds)
            differences.append(got["schedule"] - got["fixed"])
        print(
            f"| {name} | {statistics.median(times['fixed']) * 1e6:.2f}"
            f" | {statistics.median(times['schedule']) * 1e6:.2f}"
            f" | {statistics.median(differences) * 1e6:+.2f}"
            f" (range {min(differences) * 1e6:+.2f} .. {max(differences) * 1e6:+.2f}) |"
        )
    print("\nfirst batch at step 10**6, cold (a resume far into the run):")
    for kind in ("fixed", "schedule"):
        print(f"  {kind}: {far(kind, args.batch, args.world, 10**6) * 1e3:.1f} ms")
    print("\nranks: largest |rank's count - integral / W| over 2000 steps")
    print("| W × batch | docs' schedule (3 datasets) | five datasets |")
    print("|---|---:|---:|")
    for world, batch in ((4, 16), (8, 16), (64, 4), (6, 10), (16, 1)):
        print(
            f"| {world} × {batch} | {rank_balance(schedule_for(2000), world, batch):.2f}"
            f" | {rank_balance(FIVE, world, batch):.2f} |"
        )
    if args.plot is not None:
        draw(args.plot)


if __name__ == "__main__":
    main()
