"""Per-batch planning of WebDataset shards with sidecar indexes: the time from a group's
sample ids to its read plan (each sample's shard, its table row, its members' byte ranges),
with every sidecar table already fetched, under an exact shuffle over many shards.

``--shards`` local shards of ``--per-shard`` tiny samples (``bin``: 16 random bytes,
``cls``: a label) are written once to a cache folder by ``ab.write_webdataset`` (sidecars
beside them) and opened with ``ab.open_dataset``. Two sources of the same dataset: the
current code and the baseline's (``asyncbatch/formats/_webdataset.py`` and
``_webdataset_tables.py`` as they were at ``--baseline``, loaded from ``git show`` into
temporary modules beside the package's). Each reads every sidecar once (a warm-up epoch of
its index fetches, served from the local files), then, for each of ``--batches`` batches of
``--batch-size`` ids of a Feistel shuffle, both plan the batch in rotating order: the time
from ``source.fetch(ids, gap)`` to the read of the samples it yields. Their plans must be
equal. Prints per-batch medians and the paired ratio baseline / current.

Usage: ``.venv/bin/python benchmarks/bench_webdataset_lookup.py [--shards 1000]
[--per-shard 100] [--batch-size 256] [--batches 200] [--baseline 377edd3]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from common import REPO, git_revision, paired_ratio, positive, read_plan_files

import asyncbatch as ab
import asyncbatch.formats
from asyncbatch.formats._base import OffLoop, Read, Wait
from asyncbatch.formats._webdataset import WebDatasetSamples
from asyncbatch.sampling._order import GlobalShuffle

#: The commit before the planning was vectorised.
BASELINE = "377edd3"


def ensure_shards(shards: int, per_shard: int) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache) / "asyncbatch" / f"bench-webdataset-lookup-{shards}x{per_shard}"
    if (root / "done").exists():
        return root
    rng = np.random.default_rng(0)
    samples = (
        {"__key__": f"{i:09d}", "bin": rng.bytes(16), "cls": i % 1000}
        for i in range(shards * per_shard)
    )
    ab.write_webdataset(str(root), samples, max_count=per_shard)
    (root / "done").touch()
    return root


def baseline_module(revision: str) -> ModuleType:
    """``_webdataset.py`` as it was at ``revision``, importing that revision's tables."""
    package = asyncbatch.formats
    modules: dict[str, ModuleType] = {}
    for name in ("_webdataset_tables", "_webdataset"):
        source = subprocess.run(
            ["git", "show", f"{revision}:asyncbatch/formats/{name}.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        source = source.replace("from ._webdataset_tables import", "from ._baseline_tables import")
        full = f"{package.__name__}._baseline{'_tables' if name.endswith('tables') else ''}"
        spec = importlib.util.spec_from_loader(full, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__package__ = package.__name__
        sys.modules[full] = module
        exec(compile(source, f"<{revision}:{name}.py>", "exec"), module.__dict__)
        modules[name] = module
    return modules["_webdataset"]


def serve(read: Read, files: list[str]) -> np.ndarray:
    """The bytes ``read`` asks for, from the local files."""
    return read_plan_files(read.plan, files)  # type: ignore[no-any-return]


def plan_of(source: Any, ids: np.ndarray, files: list[str]) -> tuple[float, Any]:
    """Seconds from ``source.fetch(ids)`` to the read of its samples (index reads served
    before it, untimed), and that read's plan."""
    steps: Generator[Any, Any, Any] = source.fetch(ids, 0)
    served = 0.0
    start = time.perf_counter()
    step = next(steps)
    while True:
        if isinstance(step, Wait):
            step = steps.send(None)
        elif isinstance(step, OffLoop):
            step = steps.send(step.work())
        elif isinstance(step, Read) and step.plan.num_reads and step.plan.read_dest[0] >= 0:
            at = time.perf_counter()  # a sidecar's read: the engine's time, not planning's
            buffer = serve(step, files)
            served += time.perf_counter() - at
            step = steps.send(buffer)
        else:
            elapsed = time.perf_counter() - start - served
            steps.close()
            return elapsed, step.plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=positive, default=1000)
    parser.add_argument("--per-shard", type=positive, default=100)
    parser.add_argument("--batch-size", type=positive, default=256)
    parser.add_argument("--batches", type=positive, default=200)
    parser.add_argument("--baseline", default=BASELINE)
    args = parser.parse_args()
    root = ensure_shards(args.shards, args.per_shard)
    dataset = ab.open_dataset(str(root))
    assert dataset.manifest.metadata["sidecars"] == args.shards
    old = baseline_module(args.baseline)
    sources = {
        "baseline": old.WebDatasetSamples([dataset]),
        "current": WebDatasetSamples([dataset]),
    }
    files = [u.removeprefix("file://") for u in sources["current"].shard_urls]
    total = sources["current"].num_samples
    shuffle = GlobalShuffle(total, 0)
    ids_of = [
        shuffle(0, np.arange(b * args.batch_size, (b + 1) * args.batch_size, dtype=np.int64))
        for b in range(total // args.batch_size)
    ]
    for source in sources.values():  # fetch every sidecar once
        for ids in ids_of:
            plan_of(source, ids, files)
    times: dict[str, list[float]] = {name: [] for name in sources}
    names = list(sources)
    for b in range(args.batches):
        ids = ids_of[b % len(ids_of)]
        plans = {}
        for name in names[b % 2 :] + names[: b % 2]:
            times[name].append(plan_of(sources[name], ids, files)[0])
            plans[name] = plan_of(sources[name], ids, files)[1]
        for field in ("read_shard", "read_start", "read_end", "piece_src", "piece_dest"):
            assert np.array_equal(
                getattr(plans["baseline"], field), getattr(plans["current"], field)
            ), field
    touched = statistics.median(np.unique(sources["current"].shard_of(i)).size for i in ids_of)
    print(
        f"revision {git_revision()} against {args.baseline}; {args.shards} shards x"
        f" {args.per_shard} samples, sidecars; batches of {args.batch_size} ids of an exact"
        f" shuffle, {touched:.0f} shards each (median); {args.batches} batches"
    )
    print(f"{'source':<10}{'median ms':>11}{'p90 ms':>9}")
    for name in names:
        print(
            f"{name:<10}{statistics.median(times[name]) * 1e3:>11.3f}"
            f"{np.percentile(times[name], 90) * 1e3:>9.3f}"
        )
    ratio = paired_ratio(times["baseline"], times["current"])
    print(f"planning time per batch, baseline / current: {ratio:.1f}x (paired median)")


if __name__ == "__main__":
    main()
