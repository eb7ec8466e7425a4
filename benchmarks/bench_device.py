"""``Loader(device="cuda")`` beside the copy written in the training loop.

A local token dataset (random uint16, 64 Mi tokens by default, written to a temporary folder
and read with the page cache warm), ``--batch-size`` × ``--seq-len`` windows (16 × 2049 by
default), global shuffle, ``infinite=True``. Per dtype (uint16 as stored, and
``dtype=torch.int64``), in interleaved rounds (the order rotates; the median is reported):

* ``no copy``: ``Loader()``, batches left on the CPU (the reference: the loader alone);
* ``device``: ``Loader(device="cuda")``;
* ``to in loop``: ``Loader()`` and ``t.to("cuda", non_blocking=True)`` in the loop;
* ``pin + to in loop``: ``Loader()`` and ``t.pin_memory().to("cuda", non_blocking=True)``.

Each line is timed from the second batch to the last after a ``torch.cuda.synchronize()``,
twice: with a consumer that only takes each batch (``pipeline``), and with a simulated
training step per batch (``--step-us`` of ``torch.cuda._sleep`` on the current stream, a read
of the batch there, and a stream sync, as ``loss.item()`` does). CPU seconds per GB: the
process's CPU time (all threads) over the bytes delivered.

Before the rounds, ``device`` batches are checked byte for byte against the plain Loader's
(same seed, in lockstep, the consumer's stream lagging about 50 µs per batch).

Without CUDA the script says so and exits with status 0.

Usage: ``.venv/bin/python benchmarks/bench_device.py [--rounds 3] [--batches 5000]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import git_revision, paired_ratio, positive, write_rates

import asyncbatch as ab

DTYPES = {"uint16": None, "int64": torch.int64}
VOCAB = 50_257
SEED = 7


def loader(
    dataset: ab.Dataset, args: argparse.Namespace, dtype: str, **kwargs: object
) -> ab.Loader:
    """The Loader every line reads through (the script's sizes, global shuffle, infinite)."""
    return ab.Loader(
        dataset,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        shuffle=True,
        seed=SEED,
        infinite=True,
        dtype=DTYPES[dtype],
        **kwargs,  # type: ignore[arg-type]
    )


def batch_bytes(args: argparse.Namespace, dtype: str) -> int:
    return int(args.batch_size * args.seq_len * (2 if dtype == "uint16" else 8))


def sleep_cycles_per_us() -> float:
    """``torch.cuda._sleep`` cycles per microsecond on this GPU."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1000)


#: What the loop does to each batch's tokens before the step (None: nothing).
Move = Callable[[torch.Tensor], torch.Tensor] | None


def in_loop(pin: bool) -> Move:
    cuda = torch.device("cuda")
    if pin:
        return lambda t: t.pin_memory().to(cuda, non_blocking=True)
    return lambda t: t.to(cuda, non_blocking=True)


def time_line(
    make: Callable[[], ab.Loader], move: Move, batches: int, step_cycles: int
) -> tuple[float, float]:
    """(wall, process CPU) seconds for ``batches`` batches after the first."""
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    with make() as source:
        iterator = iter(source)
        next(iterator)
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            tokens = next(iterator)["tokens"]
            if move is not None:
                tokens = move(tokens)
            if step_cycles:
                if tokens.is_cuda:
                    acc += tokens[:, 0].sum()  # the step reads the batch on its stream
                torch.cuda._sleep(step_cycles)
                torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu


def check_equal(dataset: ab.Dataset, args: argparse.Namespace, dtype: str, lag: int) -> str:
    """``device`` batches against the plain Loader's, in lockstep, bytes compared on the GPU."""
    bad = bad_indexes = 0
    with loader(dataset, args, dtype) as plain, loader(dataset, args, dtype, device="cuda") as gpu:
        for _, want, got in zip(range(args.check_batches), plain, gpu, strict=False):
            torch.cuda._sleep(lag)  # the consumer's stream runs behind the copies
            tokens = got["tokens"].clone()
            bad_indexes += not np.array_equal(want.global_indexes, got.global_indexes)
            bad += not torch.equal(
                tokens.view(torch.uint8), want["tokens"].view(torch.uint8).cuda()
            )
    verdict = "equal" if bad == bad_indexes == 0 else "DIFFERENT"
    return (
        f"{dtype}: {args.check_batches} batches {verdict} ({bad} with other bytes,"
        f" {bad_indexes} with other global_indexes)"
    )


def main() -> None:
    """Parse options, write the dataset, check, run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive, default=64 * 2**20, help="dataset tokens")
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--seq-len", type=positive, default=2049)
    parser.add_argument("--dtypes", default="uint16,int64", help="comma-separated")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (median)")
    parser.add_argument("--batches", type=positive, default=5000, help="pipeline batches")
    parser.add_argument("--step-batches", type=positive, default=1500, help="with a step")
    parser.add_argument("--step-us", type=float, default=250.0, help="simulated step, µs")
    parser.add_argument("--check-batches", type=positive, default=500, help="byte check")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")

    print(f"asyncbatch bench_device  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  asyncbatch from {Path(ab.__file__).parent}")
    print(
        f"  python {platform.python_version()}  torch {torch.__version__}  numpy {np.__version__}"
    )
    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): nothing measured")
        return
    props = torch.cuda.get_device_properties(0)
    print(
        f"  CUDA {torch.version.cuda}  {props.name} ({props.total_memory / 2**30:.0f} GiB)"
        f"  cpus {os.cpu_count()}  torch threads {torch.get_num_threads()}"
    )
    print(
        f"  {args.batch_size} x {args.seq_len} windows, {args.tokens} tokens;"
        f" {args.batches} batches per pipeline line, {args.step_batches} with a step of"
        f" {args.step_us:g} µs; {args.rounds} rounds"
    )

    with tempfile.TemporaryDirectory(prefix="bench-device-") as folder:
        tokens = np.random.default_rng(0).integers(0, VOCAB, args.tokens, dtype=np.uint16)
        dataset = ab.write_tokens(str(Path(folder) / "tokens"), tokens, shard_size=64 * 2**20)
        del tokens
        per_us = sleep_cycles_per_us()
        step_cycles = int(args.step_us * per_us)
        for dtype in dtypes:
            print("  byte check, " + check_equal(dataset, args, dtype, int(50 * per_us)))

        lines: dict[str, tuple[Callable[[], ab.Loader], Move]] = {}
        for dtype in dtypes:
            plain = functools.partial(loader, dataset, args, dtype)
            lines[f"{dtype} no copy"] = (plain, None)
            lines[f"{dtype} device"] = (functools.partial(plain, device="cuda"), None)
            lines[f"{dtype} to in loop"] = (plain, in_loop(pin=False))
            lines[f"{dtype} pin + to in loop"] = (plain, in_loop(pin=True))
        variants = {"pipeline": (args.batches, 0), "with step": (args.step_batches, step_cycles)}
        names = list(lines)
        for make, move in lines.values():  # warm-up: CUDA context, allocators, page cache
            time_line(make, move, 50, 0)
        rates: dict[str, list[float]] = {}
        cpu_per_gb: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for variant, (count, cycles) in variants.items():
                for name in names[shift:] + names[:shift]:
                    make, move = lines[name]
                    wall, cpu = time_line(make, move, count, cycles)
                    nbytes = count * batch_bytes(args, name.split()[0])
                    rates.setdefault(f"{variant}: {name}", []).append(count / wall)
                    cpu_per_gb.setdefault(f"{variant}: {name}", []).append(cpu / (nbytes / 1e9))
            print(f"  round {round_ + 1}/{args.rounds} done", file=sys.stderr)

    for variant in variants:
        print()
        print(f"{variant} ({variants[variant][0]} batches per line)")
        print(f"{'line':24} {'batches/s':>10} {'min':>8} {'max':>8} {'GB/s':>6} {'CPU s/GB':>9}")
        for name in names:
            key = f"{variant}: {name}"
            median = statistics.median(rates[key])
            width = batch_bytes(args, name.split()[0])
            print(
                f"{name:24} {median:10.0f} {min(rates[key]):8.0f} {max(rates[key]):8.0f}"
                f" {median * width / 1e9:6.2f} {statistics.median(cpu_per_gb[key]):9.2f}"
            )
    print()
    print("paired ratios (median over rounds of the ratio within each round):")
    for variant in variants:
        for dtype in dtypes:
            device = rates[f"{variant}: {dtype} device"]
            for other in ("to in loop", "no copy"):
                ratio = paired_ratio(device, rates[f"{variant}: {dtype} {other}"])
                print(f"  {variant}, {dtype}: device / {other} {ratio:.2f}")
    if args.json is not None:
        title = f"device= on {props.name}: {args.batch_size} x {args.seq_len}"
        baselines = {k: k.replace("device", "to in loop") for k in rates if k.endswith("device")}
        write_rates(
            args.json,
            "bench_device",
            rates,
            unit="batches/s",
            baseline=f"pipeline: {dtypes[0]} no copy",
            title=title,
            baselines=baselines,
        )


if __name__ == "__main__":
    main()
