"""Metadata streams: tokens/s against the tokens format, and read requests per window.

Writes the same random tokens twice into a temporary folder: as a ``tokens`` dataset (uint32)
and as a ``metadata_stream`` (uint32 token + uint32 id) whose spans have random lengths
around ``--span`` tokens, once with the ``numpy`` codec (an int64 per span) and once with
``json`` (a small object per span). Then:

- *tokens/s*: ``Loader(batch_size, seq_len, shuffle=True)`` over ``--batches`` batches
  after the first, local files, warm page cache; every round times each dataset once, and
  the figure is the median over rounds of the ratio to the tokens format in the same round.
- *requests / window*: GET requests the HTTP Range server of tests/servers.py served per
  window over one shuffled epoch of a smaller copy (``--http-tokens``), with the metadata
  reads combined (the default: one index and one data read per metadata file per group)
  and not (``format_options={"combine": False}``: per span), beside the tokens format.

Usage: ``.venv/bin/python benchmarks/bench_metadata.py [--tokens 8388608] [--span 64]``
``[--seq-len 2048] [--batch-size 16] [--batches 200] [--rounds 5] [--http-tokens 524288]``
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO, git_revision, paired_ratio, positive

import asyncbatch as ab

sys.path.insert(0, str(REPO / "tests"))
from servers import http_server  # noqa: E402


def write(root: Path, total: int, span: int) -> dict[str, str]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**17, total, dtype=np.uint32)
    lengths = rng.integers(1, 2 * span, total // span + 2)
    cuts = np.cumsum(lengths)
    cuts = cuts[cuts < total]
    starts = np.concatenate([[0], cuts])
    chunks = np.split(tokens, cuts)
    paths = {"tokens": str(root / "tokens")}
    ab.write_tokens(paths["tokens"], tokens, shard_size=64 * 2**20)
    for codec, options, value in (
        ("numpy", {"dtype": "<i8"}, lambda k, s: int(s)),
        ("json", {}, lambda k, s: {"doc": k // 10, "span": k, "concepts": [k % 97, k % 89]}),
    ):
        paths[codec] = str(root / f"meta-{codec}")
        spans = (
            (chunk, value(k, s))
            for k, (chunk, s) in enumerate(zip(chunks, starts.tolist(), strict=True))
        )
        ab.write_metadata_stream(
            paths[codec], spans, codec=codec, codec_options=options, shard_size=128 * 2**20
        )
    return paths


def rate(url: str, args: argparse.Namespace, seed: int, **options: Any) -> float:
    """Tokens per second over ``args.batches`` shuffled batches after the first (start-up,
    the first group's latency, is not counted)."""
    with ab.Loader(
        url, batch_size=args.batch_size, seq_len=args.seq_len, shuffle=True, seed=seed, **options
    ) as loader:
        batches = iter(loader)
        next(batches)
        start = time.perf_counter()
        for count, _ in enumerate(batches, 1):
            if count == args.batches:
                break
        elapsed = time.perf_counter() - start
    return args.batches * args.batch_size * args.seq_len / elapsed


def requests_per_window(url: str, server: Any, args: argparse.Namespace, **options: Any) -> float:
    """GET requests per window over one whole epoch (nothing prefetched and thrown away)."""
    before = server.requests
    with ab.Loader(
        url, batch_size=args.batch_size, seq_len=args.seq_len, shuffle=True, **options
    ) as loader:
        windows = sum(batch.batch_size for batch in loader)
    return (server.requests - before) / windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive, default=2**23)
    parser.add_argument("--span", type=positive, default=64)
    parser.add_argument("--seq-len", type=positive, default=2048)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--batches", type=positive, default=200)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--http-tokens", type=positive, default=2**19)
    args = parser.parse_args()
    print(f"asyncbatch {git_revision()}, {platform.python_version()}, {platform.machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write(root / "local", args.tokens, args.span)
        write(root / "http", args.http_tokens, args.span)
        names = ["tokens", "numpy", "json"]
        rates: dict[str, list[float]] = {name: [] for name in names}
        for seed in range(args.rounds):
            for name in names:
                rates[name].append(rate(paths[name], args, seed))
        print(
            f"\nlocal, {args.tokens} tokens, spans ~{args.span} tokens, windows of {args.seq_len},"
            f" batch {args.batch_size}, {args.batches} batches x {args.rounds} rounds"
        )
        print(f"{'dataset':<24}{'M tokens/s (median)':>22}{'vs tokens format':>18}")
        for name in names:
            median = float(np.median(rates[name])) / 1e6
            ratio = paired_ratio(rates[name], rates["tokens"])
            print(f"{name:<24}{median:>22.1f}{ratio:>17.2f}x")
        print(f"\nHTTP Range server on 127.0.0.1, one shuffled epoch of {args.http_tokens} tokens")
        print(f"{'dataset':<24}{'requests / window':>20}")
        with http_server(root / "http") as server:
            base = server.url
            rows = [
                ("tokens", "tokens", {}),
                ("numpy, combined", "meta-numpy", {}),
                ("numpy, per span", "meta-numpy", {"format_options": {"combine": False}}),
                ("json, combined", "meta-json", {}),
                ("json, per span", "meta-json", {"format_options": {"combine": False}}),
            ]
            for label, folder, options in rows:
                value = requests_per_window(f"{base}/{folder}", server, args, **options)
                print(f"{label:<24}{value:>20.2f}")


if __name__ == "__main__":
    main()
