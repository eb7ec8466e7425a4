"""Parquet under an exact shuffle: what a batch costs with and without an offset index.

Writes a pre-tokenised corpus twice with pyarrow to local files, once with
``write_page_index=True``: ``--files`` files of ``--row-groups`` row groups of ``--rows``
rows, an ``input_ids`` list<int32> column (documents of geometric length, mean
``--mean-tokens``, written without a dictionary), an ``id`` int64 and a ``source`` string
column (a dictionary of 8 values); pages of ``--page-kib`` KiB. Then reads ``--batches``
batches of ``--batch-size`` rows with ``shuffle=True`` from each, at ``prefetch=2`` (one batch
per read, so a batch's cost is its own) and at the default prefetch (groups of batches, so a
chunk fetched whole serves every row of the group in it), and prints per batch: bytes fetched,
requests (``statistics()``), fetched / delivered (delivered: the bytes of the batches'
values, decoded: tokens, ids and the strings' bytes), and batches/s. Local files: the bytes
and requests are what an object store would be asked for; the rates include no round trips.

Usage: ``.venv/bin/python benchmarks/bench_parquet_pages.py [--files 8] [--row-groups 2]
[--rows 8192] [--mean-tokens 128] [--page-kib 64] [--batch-size 32] [--batches 64]``
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import git_revision, positive

import asyncbatch as ab
from asyncbatch._batch import Jagged, Strings


def write_corpus(folder: Path, args: argparse.Namespace, indexed: bool) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    rows = args.rows * args.row_groups
    for f in range(args.files):
        lengths = rng.geometric(1 / args.mean_tokens, rows)
        tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        table = pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
                "id": pa.array(np.arange(f * rows, (f + 1) * rows, dtype=np.int64)),
                "source": pa.array([f"source-{i % 8}" for i in range(rows)]),
            }
        )
        pq.write_table(
            table,
            folder / f"train-{f:05d}.parquet",
            row_group_size=args.rows,
            write_page_index=indexed,
            data_page_size=args.page_kib << 10,
            use_dictionary=["source"],
            compression="zstd",
        )


def measure(root: Path, args: argparse.Namespace, prefetch: int | None) -> dict[str, float]:
    dataset = ab.open_dataset(str(root))
    start = time.perf_counter()
    with ab.Loader(dataset, batch_size=args.batch_size, shuffle=True, prefetch=prefetch) as it:
        batches = delivered = 0
        for batch in it:
            batches += 1
            tokens, source = batch["input_ids"], batch["source"]
            assert isinstance(tokens, Jagged) and isinstance(source, Strings)
            delivered += tokens.values.nbytes + batch["id"].nbytes + source.data.nbytes
            if batches == args.batches:
                break
        elapsed = time.perf_counter() - start
        stats = it.statistics()
    return {
        "fetched": stats.bytes_fetched / batches,
        "requests": stats.requests / batches,
        "ratio": stats.bytes_fetched / delivered,
        "rate": batches / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=positive, default=8)
    parser.add_argument("--row-groups", type=positive, default=2)
    parser.add_argument("--rows", type=positive, default=8192)
    parser.add_argument("--mean-tokens", type=positive, default=128)
    parser.add_argument("--page-kib", type=positive, default=64)
    parser.add_argument("--batch-size", type=positive, default=32)
    parser.add_argument("--batches", type=positive, default=64)
    args = parser.parse_args()
    print(f"asyncbatch {git_revision()}, pyarrow {pa.__version__}, {platform.platform()}")
    with tempfile.TemporaryDirectory() as tmp:
        roots = {}
        for indexed in (False, True):
            roots[indexed] = Path(tmp) / ("indexed" if indexed else "plain")
            write_corpus(roots[indexed], args, indexed)
        total = sum(p.stat().st_size for p in roots[False].iterdir())
        meta = pq.read_metadata(next(roots[False].iterdir()))
        chunk = meta.row_group(0).column(0).total_compressed_size
        print(
            f"{args.files} files, {total / 2**20:.1f} MiB; an input_ids chunk {chunk / 2**20:.2f}"
            f" MiB; batches of {args.batch_size} rows, {args.batches} read"
        )
        print("| offset index | prefetch | KiB fetched / batch | requests / batch |", end="")
        print(" fetched / delivered | batches/s |")
        print("|---|---|---:|---:|---:|---:|")
        for prefetch in (2, None):
            for indexed in (False, True):
                m = measure(roots[indexed], args, prefetch)
                print(
                    f"| {'yes' if indexed else 'no'} | {prefetch or 'default'} |"
                    f" {m['fetched'] / 1024:,.0f} | {m['requests']:.1f} | {m['ratio']:.1f} |"
                    f" {m['rate']:.0f} |"
                )


if __name__ == "__main__":
    main()
