"""Cost per index of ``FeistelPermutation`` beside ``numpy.random.Generator.permutation``.

For each permutation size (``--sizes``) and count of positions per call (``--counts``; the
loader calls the permutation on blocks of ``ID_BLOCK`` = 16384 positions), one call permutes
an int64 array of ``count`` consecutive positions ``[size // 3, size // 3 + count)`` (taken
modulo ``size``), as ``EpochOrder`` does for a block of one epoch. Each measurement times as
many calls as fill about ``--ms`` milliseconds and reports nanoseconds per index.

Beside each case, in the same round, ``numpy.random.default_rng(0).permutation(count)`` is
timed the same way: it is not the same job (it shuffles ``count`` items and keeps nothing),
only a reference point that moves with the machine's load. The cases run in interleaved
rounds (the order rotated each round); the table gives medians over rounds, and the ratio
column is the median over rounds of the ratio of the two measurements taken side by side.

``2**20 + 1`` is the worst case of a power-of-two domain (a domain of 2**21 or 2**22 for
2**20 + 1 positions); ``domain / size`` is printed where the permutation exposes its domain.

Usage: ``.venv/bin/python benchmarks/bench_sampling.py [--rounds 15] [--ms 20]``
``[--sizes 1000000 1048577 1000000000 4611686018427387904] [--counts 16384 1048576]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from common import git_revision, positive

from asyncbatch.sampling import FeistelPermutation
from asyncbatch.sampling._order import ID_BLOCK

SEED = 0x5EED
DEFAULT_SIZES = [10**6, 2**20 + 1, 10**9, 2**62]
DEFAULT_COUNTS = [ID_BLOCK, 2**20]


def positions(size: int, count: int) -> npt.NDArray[np.int64]:
    """``count`` consecutive positions from ``size // 3``, modulo ``size``."""
    block = np.arange(count, dtype=np.int64)
    block += size // 3
    if size // 3 + count > size:
        block %= size
    return block


def calls_for(call: Callable[[], object], seconds: float) -> int:
    """How many calls of ``call`` take about ``seconds`` (after one warm-up call)."""
    call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, round(seconds / once))


def ns_per_index(call: Callable[[], object], calls: int, count: int) -> float:
    """Nanoseconds per index of ``calls`` calls of ``call`` on ``count`` indexes each."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / (calls * count)


def main() -> None:
    """Parse options, check each permutation once, run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive, default=15, help="interleaved rounds (median)")
    parser.add_argument("--ms", type=positive, default=20, help="milliseconds per measurement")
    parser.add_argument("--sizes", type=positive, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--counts", type=positive, nargs="+", default=DEFAULT_COUNTS)
    args = parser.parse_args()
    seconds = args.ms / 1e3

    print(f"asyncbatch bench_sampling  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  python {platform.python_version()}  numpy {np.__version__}")
    print(f"  cpus {os.cpu_count()}  {platform.machine()}  {platform.processor() or ''}".rstrip())
    print(
        f"  positions [size // 3, size // 3 + count) mod size, int64; {args.rounds} rounds,"
        f" about {args.ms} ms per measurement; baseline numpy Generator.permutation(count)"
    )

    cases: list[tuple[int, int]] = [(s, c) for c in args.counts for s in args.sizes]
    feistel: dict[tuple[int, int], tuple[Callable[[], object], int]] = {}
    baseline: dict[tuple[int, int], tuple[Callable[[], object], int]] = {}
    domains: dict[int, float | None] = {}
    for size, count in cases:
        perm = FeistelPermutation(size, SEED)
        x = positions(size, count)
        values = perm(x)  # a check, and the warm-up: in range, and undone by inverse
        if values.min() < 0 or values.max() >= size or not np.array_equal(perm.inverse(values), x):
            raise SystemExit(f"FeistelPermutation({size}) is wrong on {count} positions")
        domain = getattr(perm, "domain", None)
        domains[size] = domain / size if isinstance(domain, int) else None

        run_perm = functools.partial(perm, x)
        run_rng = functools.partial(np.random.default_rng(0).permutation, count)
        feistel[size, count] = (run_perm, calls_for(run_perm, seconds))
        baseline[size, count] = (run_rng, calls_for(run_rng, seconds))

    ours: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    theirs: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    for round_ in range(args.rounds):
        shift = round_ % len(cases)  # rotate the order so no case always runs first
        for case in cases[shift:] + cases[:shift]:
            pairs = [(feistel, ours), (baseline, theirs)]
            if round_ % 2:  # and alternate which of the pair goes first
                pairs.reverse()
            for table, results in pairs:
                call, calls = table[case]
                results[case].append(ns_per_index(call, calls, case[1]))
        print(
            f"  round {round_ + 1}: "
            + ", ".join(f"{s}/{c} {ours[s, c][-1]:.1f}" for s, c in cases)
            + " ns/idx",
            file=sys.stderr,
        )

    print()
    print(
        f"{'size':>20} {'count':>8} {'domain/size':>11} {'ns/idx':>7} {'min':>6} {'max':>6}"
        f" {'us/call':>9} {'rng ns/idx':>10} {'/ rng (paired)':>14}"
    )
    for size, count in cases:
        mine, rng = ours[size, count], theirs[size, count]
        median = statistics.median(mine)
        ratio = statistics.median(a / b for a, b in zip(mine, rng, strict=True))
        domain = domains[size]
        print(
            f"{size:>20} {count:>8} {'-' if domain is None else f'{domain:.4f}':>11}"
            f" {median:7.2f} {min(mine):6.2f} {max(mine):6.2f} {median * count / 1e3:9.1f}"
            f" {statistics.median(rng):10.2f} {ratio:14.2f}"
        )
    print(
        f"(ns/idx: median over {args.rounds} rounds, min and max beside it; rng: numpy"
        " Generator.permutation of the same count; / rng: median of the per-round ratios)"
    )


if __name__ == "__main__":
    main()
