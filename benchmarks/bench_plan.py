"""``plan()`` at corpus scale: a synthetic manifest of 10^12 uint16 tokens in 4,000 shards
(metadata only, no data) planned for world size 1024 (batch 8, seq_len 2048, global shuffle).

Each round, in rotating order, two lines run in fresh child processes (so that each
process's peak resident memory is its own):

* ``plan``: ``ab.plan(dataset, world_size=1024, ...)``: the manifest built in memory, 8
  ranks costed from 48 sampled groups of each size, extrapolated (the bound it prints);
* ``one rank``: the baseline: rank 0's epoch costed group by group in full, every one of its
  ~10^3 groups (what costing all 1024 ranks exactly would pay 1024 times).

Each prints wall seconds, peak RSS of its process (``ru_maxrss``; the interpreter, numpy and
torch included) and the Python allocations' peak (``tracemalloc``, in a second untimed call).
The script prints medians, the ratio of ``plan`` to ``one rank``, the time enumerating every
rank would take (``one rank`` x 1024), and how far the plan's estimate of rank 0 lies from
rank 0 costed in full, beside the bound the plan states.

With ``--documents 1e9``, the manifest is a documents dataset of that many documents with
paged per-shard indexes (512 a page), and the index bytes of rank 0 (estimated from the
sampled groups) are compared with those of the walk over every one of its groups.

Usage: ``.venv/bin/python benchmarks/bench_plan.py [--tokens 1e12] [--shards 4000]
[--world 1024] [--rounds 3] [--documents 1e9]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from common import REPO, git_revision

OPTIONS: dict[str, Any] = {"batch_size": 8, "seq_len": 2048, "shuffle": True}


def synthetic(tokens: int, shards: int, documents: int = 0) -> Any:
    """A manifest of ``tokens`` uint16 tokens in ``shards`` shards, no data behind it; with
    ``documents``, a documents dataset of that many with paged per-shard indexes (512 a page,
    as ``write_documents`` writes them)."""
    import numpy as np

    from asyncbatch._checksums import format_digest
    from asyncbatch._dataset import Dataset
    from asyncbatch._manifest import Manifest, ShardInfo
    from asyncbatch.formats._documents_index import PAGE_DOCUMENTS, index_file_bytes

    per = tokens // shards
    infos = tuple(
        ShardInfo(path=f"s{i:05d}.bin", nbytes=2 * per, elements=per) for i in range(shards)
    )
    if not documents:
        return Dataset(
            "s3://bucket/corpus", Manifest(format="tokens", dtype=np.dtype("<u2"), shards=infos)
        )
    each = documents // shards
    size = index_file_bytes(each, PAGE_DOCUMENTS)
    metadata = {
        "document_index": "per_shard",
        "documents": each * shards,
        "shard_documents": [each] * shards,
        "shard_indexes": [
            {
                "path": f"s{i:05d}.idx",
                "bytes": size,
                "page_documents": PAGE_DOCUMENTS,
                "top_checksum": format_digest(0),
            }
            for i in range(shards)
        ],
    }
    manifest = Manifest("documents", np.dtype("<u2"), infos, metadata)
    return Dataset("s3://bucket/documents", manifest)


def child(line: str, tokens: int, shards: int, world: int, documents: int) -> dict[str, Any]:
    """One line's run in this process: its figures as a dict."""
    import asyncbatch as ab
    from asyncbatch._options import LoaderConfig
    from asyncbatch._plan import _cost_rank, _Ranked, _store_traits
    from asyncbatch._portal import run_sync

    def run() -> dict[str, Any]:
        dataset = synthetic(tokens, shards, documents)
        if line == "plan":
            got = ab.plan(dataset, world_size=world, **OPTIONS)
            rank0 = got.ranks[0]
            return {
                "rank0_requests": rank0.requests,
                "rank0_bytes": rank0.bytes_fetched,
                "bound": got.relative_error,
                "total_requests": got.requests,
                "total_bytes": got.bytes_fetched,
                "rank0_index": rank0.index_bytes,
            }
        config = LoaderConfig(rank=0, world_size=world, verify="off", **OPTIONS)
        ranked = _Ranked(dataset, config)
        gap, windows = run_sync(_store_traits(ranked.engine.source, config))
        cost = _cost_rank(ranked.engine, 0, gap, windows, 0, 0)
        return {
            "rank0_requests": cost.requests,
            "rank0_bytes": cost.bytes_fetched,
            "rank0_index": cost.index_bytes,
        }

    started = time.perf_counter()
    figures = run()
    figures["seconds"] = time.perf_counter() - started
    figures["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tracemalloc.start()
    run()
    figures["traced_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=float, default=1e12)
    parser.add_argument("--shards", type=int, default=4000)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--documents",
        type=float,
        default=0,
        help="a documents dataset of this many documents (paged per-shard indexes)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens, documents = int(args.tokens), int(args.documents)
    if args.child:
        print(json.dumps(child(args.child, tokens, args.shards, args.world, documents)))
        return
    print(
        f"bench_plan {git_revision()}: {tokens:.3g} tokens, {args.shards} shards, world"
        f" {args.world}, {OPTIONS}, {documents:.3g} documents, {os.cpu_count()} CPUs"
    )
    lines = ["plan", "one rank"]
    results: dict[str, list[dict[str, Any]]] = {line: [] for line in lines}
    for r in range(args.rounds):
        for line in lines[r % 2 :] + lines[: r % 2]:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    line,
                    "--tokens",
                    str(tokens),
                    "--shards",
                    str(args.shards),
                    "--world",
                    str(args.world),
                    "--documents",
                    str(documents),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            )
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            results[line].append(figures)
            print(
                f"  round {r + 1} {line:>8}: {figures['seconds']:.2f} s, peak RSS"
                f" {figures['rss_mib']:.0f} MiB, Python peak {figures['traced_mib']:.0f} MiB",
                flush=True,
            )
    med = {line: statistics.median(f["seconds"] for f in results[line]) for line in lines}
    rss = {line: max(f["rss_mib"] for f in results[line]) for line in lines}
    plan, one = results["plan"][0], results["one rank"][0]
    print(f"plan:     median {med['plan']:.2f} s, peak RSS {rss['plan']:.0f} MiB")
    print(f"one rank: median {med['one rank']:.2f} s, peak RSS {rss['one rank']:.0f} MiB")
    print(
        f"plan / one rank in full: {med['plan'] / med['one rank']:.2f}x;"
        f" every rank in full would take ~{med['one rank'] * args.world:,.0f} s"
    )
    for name in ("requests", "bytes"):
        est, exact = plan[f"rank0_{name}"], one[f"rank0_{name}"]
        print(
            f"rank 0 {name}: plan {est:,.0f}, in full {exact:,.0f}, off by"
            f" {abs(est - exact) / exact:.3%} (stated bound {plan['bound']:.3%})"
        )
    print(f"total: {plan['total_requests']:,.0f} requests, {plan['total_bytes']:,.0f} bytes")
    if documents:
        est, walked = plan["rank0_index"], one["rank0_index"]
        print(
            f"rank 0 index bytes: plan (sampled) {est:,.0f}, walked over every group"
            f" {walked:,.0f}, off by {abs(est - walked) / max(1, walked):.2%}"
        )


if __name__ == "__main__":
    main()
