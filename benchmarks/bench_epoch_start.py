"""A/B of a new epoch's start between two source trees: the time to epoch 2's first batch.

Each round runs one subprocess per tree (``PYTHONPATH=TREE``, interleaved). The child opens
a ``Loader`` (batch 16 × 2048 uint16 tokens, global shuffle) over a small dataset, reads
``--epochs`` whole epochs, and times, for every epoch after the first, its first ``next()``
(the ``for`` loop's start) to the batch: what a new epoch costs to start. It also counts the
threads started during those epochs. Two stores: local files (page cache warm) and HTTP
(tests/servers.py's Range server, in a process of its own, over 127.0.0.1). Prints each
round, then per store the medians and the median of the per-round ratios B / A.

    .venv/bin/python benchmarks/bench_epoch_start.py /work/main . --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import paired_ratio, positive, stop_process

CHILD = """
import json, statistics, sys, threading, time
import asyncbatch as ab
url, epochs = sys.argv[1], int(sys.argv[2])
started = [0]
start_thread = threading.Thread.start
def counted(self):
    started[0] += 1
    start_thread(self)
with ab.Loader(url, batch_size=16, seq_len=2048, seed=0) as loader:
    for batch in loader:  # the first epoch: opens the stores (and, today, starts the loop)
        pass
    threading.Thread.start = counted
    firsts = []
    for _ in range(epochs - 1):
        begin = time.perf_counter()
        for step, batch in enumerate(loader):
            if step == 0:
                firsts.append(time.perf_counter() - begin)
    threading.Thread.start = start_thread
print(json.dumps({"tree": ab.__file__, "first_ms": 1e3 * statistics.median(firsts),
                  "threads_per_epoch": started[0] / (epochs - 1)}))
"""

SERVER = """
import sys, pathlib
sys.path.insert(0, sys.argv[2])
from servers import RangeHTTPServer
server = RangeHTTPServer(pathlib.Path(sys.argv[1]))
print(server.url, flush=True)
server.serve_forever()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a", type=Path)
    parser.add_argument("tree_b", type=Path)
    parser.add_argument("--data", type=Path, default=Path("/tmp/asyncbatch-bench-epoch-start"))
    parser.add_argument("--rounds", type=positive, default=7)
    parser.add_argument("--epochs", type=positive, default=8)
    args = parser.parse_args()
    data = args.data.resolve()
    if not (data / "ds" / "manifest.json").exists():
        import numpy as np

        sys.path.insert(0, str(args.tree_a))
        import asyncbatch as ab

        tokens = np.random.default_rng(0).integers(0, 60_000, 2**21, dtype=np.uint16)
        ab.write_tokens(str(data / "ds"), tokens, shard_size=2**20)  # 4 shards, 64 batches
    for shard in (data / "ds").glob("*.bin"):
        shard.read_bytes()  # warm the page cache
    tests = Path(__file__).resolve().parent.parent / "tests"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(data), str(tests)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        stores = {"local": str(data / "ds"), "http": server.stdout.readline().strip() + "/ds"}
        results: dict[str, dict[str, list[dict[str, float]]]] = {
            store: {"a": [], "b": []} for store in stores
        }
        for round_ in range(args.rounds):
            line = []
            for store, url in stores.items():
                for key, tree in (("a", args.tree_a), ("b", args.tree_b)):
                    # From the tree's folder: ``python -c`` puts it first on sys.path.
                    done = subprocess.run(
                        [sys.executable, "-c", CHILD, url, str(args.epochs)],
                        env=dict(os.environ, PYTHONPATH=str(tree.resolve())),
                        cwd=tree.resolve(),
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    out = json.loads(done.stdout)
                    if not Path(out.pop("tree")).is_relative_to(tree.resolve()):
                        raise SystemExit(f"the child imported asyncbatch from outside {tree}")
                    results[store][key].append(out)
                a, b = results[store]["a"][-1], results[store]["b"][-1]
                line.append(f"{store} {a['first_ms']:.2f} / {b['first_ms']:.2f}")
            print(f"round {round_ + 1}: ms to epoch 2+'s first batch, A / B: {', '.join(line)}")
        for store in stores:
            a = [r["first_ms"] for r in results[store]["a"]]
            b = [r["first_ms"] for r in results[store]["b"]]
            threads_a = statistics.median(r["threads_per_epoch"] for r in results[store]["a"])
            threads_b = statistics.median(r["threads_per_epoch"] for r in results[store]["b"])
            print(
                f"{store}: first batch of a new epoch A {statistics.median(a):.2f} ms,"
                f" B {statistics.median(b):.2f} ms; B / A {paired_ratio(b, a):.2f}"
                f" (median of per-round ratios); threads started per epoch A {threads_a:g},"
                f" B {threads_b:g}"
            )
    finally:
        stop_process(server)


if __name__ == "__main__":
    main()
