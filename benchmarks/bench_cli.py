"""A/B of the ``asyncbatch`` command's start between two source trees: the wall time of
``python -m asyncbatch inspect URL`` (and ``index``), a process each.

A small local documents dataset and a folder of WebDataset shards are written once to a
temporary folder. Each round runs, for each command, one process per tree
(``PYTHONPATH=TREE``, from a folder outside both, the trees' order rotated every round), and
times it from start to exit: what a user waits for at a prompt. One more process per tree
and command runs the command's ``main`` in-process and says which heavy modules (torch,
pyarrow) it loaded. Prints the medians and the median of the per-round ratios B / A.

    .venv/bin/python benchmarks/bench_cli.py /work/wt-base . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import git_revision, machine, paired_ratio, positive, rotated

import asyncbatch as ab

#: Runs ``main(argv)`` of the command in this process, then prints the heavy modules loaded.
PROBE = """
import contextlib, io, json, sys
from asyncbatch._cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(json.loads(sys.argv[1]))
print(json.dumps([name for name in ("torch", "pyarrow") if name in sys.modules]))
"""


def write_datasets(folder: Path) -> dict[str, list[str]]:
    """The commands timed, over datasets written in ``folder``."""
    rng = np.random.default_rng(0)
    documents = str(folder / "documents")
    ab.write_documents(documents, [rng.integers(0, 50_000, n, dtype=np.uint16) for n in (9, 99)])
    shards = str(folder / "shards")
    ab.write_webdataset(shards, [{"__key__": f"k{i}", "txt": b"x" * i} for i in range(64)])
    return {
        "inspect documents": ["inspect", documents],
        "inspect shards": ["inspect", shards],
        "index shards": ["index", shards, "--no-progress"],
    }


def run(tree: str, argv: list[str], cwd: str) -> float:
    """Seconds ``python -m asyncbatch ARGV`` takes with ``tree`` first on the path."""
    env = dict(os.environ, PYTHONPATH=tree)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "asyncbatch", *argv],
        env=env,
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def loaded(tree: str, argv: list[str], cwd: str) -> list[str]:
    """The heavy modules the command loads with ``tree`` first on the path."""
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        env=env,
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="tree A (the baseline): a folder holding asyncbatch/")
    parser.add_argument("b", help="tree B")
    parser.add_argument("--rounds", type=positive, default=5)
    args = parser.parse_args()
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as scratch:
        commands = write_datasets(Path(scratch))
        heavy = {
            (name, tree): loaded(path, argv, scratch)
            for name, argv in commands.items()
            for tree, path in trees.items()
        }
        times: dict[tuple[str, str], list[float]] = {key: [] for key in heavy}
        for round_ in range(args.rounds):
            for name, argv in commands.items():
                for number in rotated(len(trees), round_):
                    tree = list(trees)[number]
                    times[name, tree].append(run(trees[tree], argv, scratch))
    print(f"# bench_cli commit {git_revision()}, {machine()}, {args.rounds} rounds, medians")
    print(f"# A = {trees['A']}\n# B = {trees['B']}")
    print(f"{'command':<20}{'A s':>7}{'B s':>7}{'B / A':>7}  loads (A; B)")
    for name in commands:
        a, b = times[name, "A"], times[name, "B"]
        loads = "; ".join(", ".join(heavy[name, tree]) or "-" for tree in trees)
        print(
            f"{name:<20}{statistics.median(a):>7.2f}{statistics.median(b):>7.2f}"
            f"{paired_ratio(b, a):>7.2f}  {loads}"
        )


if __name__ == "__main__":
    main()
