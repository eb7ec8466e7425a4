"""Python calls of asyncbatch functions per batch on the local fast path, for a tree.

Reads ``--batches`` batches of 16 x 2048 uint16 tokens (global shuffle) from a local
dataset with every thread profiled, and prints the calls into asyncbatch's own functions
per batch and the distinct functions met on the way (the path's hops). Compare two trees:

    PYTHONPATH=/path/to/tree .venv/bin/python benchmarks/bench_calls.py /tmp/data
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

import asyncbatch as ab

PACKAGE = str(Path(ab.__file__).resolve().parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="a folder for the dataset (made if missing)")
    parser.add_argument("--batches", type=int, default=256)
    parser.add_argument("--list", action="store_true", help="print every function met")
    args = parser.parse_args()
    root = Path(args.root)
    if not (root / "manifest.json").exists():
        tokens = np.random.default_rng(0).integers(0, 50000, 2**24, dtype=np.uint16)
        ab.write_tokens(str(root), tokens, shard_size=2**21)
    dataset = ab.open_dataset(str(root))
    counts: collections.Counter[str] = collections.Counter()
    on = [False]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if on[0] and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            counts[f"{Path(code.co_filename).stem}.{code.co_qualname}"] += 1

    # Threads the loader starts later are profiled too (one run: the epoch is long enough).
    threading.setprofile(profile)
    sys.setprofile(profile)
    with ab.Loader(dataset, batch_size=16, seq_len=2048, seed=0, prefetch=32) as loader:
        measured = 0
        for step, _ in enumerate(loader):  # warm: the first groups are small
            measured += on[0]
            if step == 63:
                on[0] = True
            if measured == args.batches:
                break
        on[0] = False
    if measured < args.batches:
        raise SystemExit(f"the epoch ended after {measured} measured batches")
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    total = sum(counts.values())
    out = {"tree": PACKAGE, "calls_per_batch": round(total / measured, 1)}
    out["functions"] = len(counts)
    print(json.dumps(out))
    if args.list:
        for name, n in counts.most_common():
            print(f"{n / measured:8.2f}  {name}")


if __name__ == "__main__":
    main()
