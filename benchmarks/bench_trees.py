"""A/B of the ``Loader`` between two source trees (e.g. main and a branch), interleaved.

Each round runs one subprocess per tree (``PYTHONPATH=TREE``) that reads ``--batches``
batches of 16 × 2048 tokens from a local dataset (page cache warm) in three settings: plain
uint16, ``next_token=True`` (merged reads through scratch) and ``dtype=int64``. Prints each
round and, per setting, the medians and the median of the per-round ratios B / A.

    .venv/bin/python benchmarks/bench_trees.py /work/main . --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import paired_ratio, positive

SETTINGS = {"uint16": {}, "next_token": {"next_token": True}, "int64": {"dtype": "int64"}}

CHILD = """
import json, sys, time
import numpy as np
import asyncbatch as ab
dataset = ab.open_dataset(sys.argv[1])
batches, settings = int(sys.argv[2]), json.loads(sys.argv[3])
out = {"tree": ab.__file__}
for name, kwargs in settings.items():
    with ab.Loader(dataset, batch_size=16, seq_len=2048, seed=0, prefetch=32, **kwargs) as loader:
        start, tokens = time.perf_counter(), 0
        for step, batch in enumerate(loader):
            tokens += batch.batch_size * 2048
            if step + 1 == batches:
                break
        out[name] = tokens / (time.perf_counter() - start) / 1e6
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a", type=Path)
    parser.add_argument("tree_b", type=Path)
    parser.add_argument("--data", type=Path, default=Path("/tmp/asyncbatch-bench-trees"))
    parser.add_argument("--rounds", type=positive, default=8)
    parser.add_argument("--batches", type=positive, default=3000)
    args = parser.parse_args()
    if not (args.data / "manifest.json").exists():
        import numpy as np

        sys.path.insert(0, str(args.tree_a))
        import asyncbatch as ab

        tokens = np.random.default_rng(0).integers(0, 60_000, 2**27, dtype=np.uint16)
        ab.write_tokens(str(args.data), tokens, shard_size=64 * 2**20)
    for shard in args.data.glob("*.bin"):
        shard.read_bytes()  # warm the page cache
    results: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for round_ in range(args.rounds):
        for key, tree in (("a", args.tree_a), ("b", args.tree_b)):
            # The child runs in the tree: ``python -c`` puts its working directory first on
            # sys.path, ahead of PYTHONPATH, so from another checkout it would import that one.
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.data.resolve()), str(args.batches)]
                + [json.dumps(SETTINGS)],
                env=dict(os.environ, PYTHONPATH=str(tree.resolve())),
                cwd=tree.resolve(),
                capture_output=True,
                text=True,
                check=True,
            )
            out = json.loads(done.stdout)
            if not Path(out.pop("tree")).is_relative_to(tree.resolve()):
                raise SystemExit(f"the child imported asyncbatch from outside {tree}")
            results[key].append(out)
        line = ", ".join(
            f"{name} {results['a'][-1][name]:.0f} / {results['b'][-1][name]:.0f}"
            for name in SETTINGS
        )
        print(f"round {round_ + 1}: M tok/s A / B: {line}", flush=True)
    for name in SETTINGS:
        a = [r[name] for r in results["a"]]
        b = [r[name] for r in results["b"]]
        print(
            f"{name}: A {statistics.median(a):.0f}, B {statistics.median(b):.0f} M tok/s;"
            f" B / A {paired_ratio(b, a):.2f} (median of per-round ratios)"
        )


if __name__ == "__main__":
    main()
