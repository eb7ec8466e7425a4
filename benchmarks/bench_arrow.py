"""A Hugging Face ``save_to_disk`` folder read in place, beside the ``datasets`` library.

Writes ``--rows`` rows (an ``input_ids`` list<int32> column of documents of geometric length,
mean ``--mean-tokens``, and a ``text`` column of ~100 bytes) with ``Dataset.save_to_disk``
in ``--shards`` shards (Arrow IPC streams, record batches of 1,000 rows), offline, then
reads the token column in batches of ``--batch-size`` (16) from local files, warm page cache,
no worker processes, each line for ``--batches`` batches (0, the default: one epoch), in
``--rounds`` rounds alternated
so that every ratio is paired within a round:

* ``datasets shuffle``: ``load_from_disk(...).select_columns(["input_ids"]).shuffle(seed)``
  (an indices mapping: an exact shuffle), read with ``.iter(batch_size)`` in the ``arrow``
  format (its fastest: pyarrow tables, no Python lists) and, as ``datasets shuffle torch``,
  in the ``torch`` format (a tensor per row, what a training loop is handed);
* ``asyncbatch exact``: ``ab.Loader(ds, shuffle=True)`` over ``open_dataset(folder,
  options={"columns": ["input_ids"]})``: single rows read by byte range;
* ``datasets iterable``: ``.to_iterable_dataset(num_shards).shuffle(seed, buffer_size=W x
  1000)`` (shards in random order, a shuffle buffer of ``W`` record batches), arrow and
  torch formats;
* ``asyncbatch block``: ``ab.Loader(ds, shuffle="block", window=W)`` (record batches as the
  blocks, ``W`` of them shuffled together: the same buffer).

Before the lines run, the objects of the imports (torch, pyarrow, datasets: a million or
more) are frozen out of the garbage collector's scans (``gc.freeze()``; ``--no-freeze``
leaves them), and each line starts after a ``gc.collect()`` and a ``gc.freeze()`` of what
the lines before it left alive: otherwise full collections over that heap, tens of
milliseconds each, fall into whichever line runs, most often into those that keep the most
objects in flight (the block shuffle's four windows of batches), and decide the ratios more
than the lines do.

Rows/s and tokens/s over the batches after the first (a whole epoch by default: every row
once), and the time to the first batch from nothing open (``load_from_disk`` /
``open_dataset`` and the first ``next()`` included), each line timed alike. Every batch is
made usable as the loader gives it: the tokens and offsets as numpy arrays (``datasets``) or
tensors (asyncbatch).
Then the folder is opened over the HTTP test server (``tests/servers.py``), counting the
requests and bytes it served at open, against the files' size.

Usage: ``.venv/bin/python benchmarks/bench_arrow.py [--rows 200000] [--mean-tokens 256]
[--shards 8] [--batches 0] [--window 8] [--rounds 3] [--no-freeze]`` (needs ``datasets``:
the dev extra).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from common import REPO, git_revision, paired_ratio, positive

import asyncbatch as ab

sys.path.insert(0, str(REPO / "tests"))
from servers import http_server  # noqa: E402

RECORD_BATCH = 1000


def write_folder(folder: Path, args: argparse.Namespace) -> int:
    """The ``save_to_disk`` folder; returns the tokens written."""
    import datasets  # type: ignore[import-untyped]

    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / args.mean_tokens, args.rows).astype(np.int64)
    offsets = np.zeros(args.rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "text": pa.array([f"document {i}: " + "lorem ipsum " * 7 for i in range(args.rows)]),
        }
    )
    dataset = datasets.Dataset(table)
    dataset.save_to_disk(str(folder), num_shards=args.shards)
    return int(offsets[-1])


def read(
    batches: Iterator[Any], limit: int, tokens_of: Callable[[Any], tuple[int, int]]
) -> dict[str, float]:
    """Reads ``limit`` batches (0: to the end of the epoch): the time to the first from the
    first ``next()``, and the seconds, rows and tokens of the batches after it."""
    start = time.perf_counter()
    first, after, tokens, rows = 0.0, 0.0, 0, 0
    for count, batch in enumerate(batches, 1):
        got, n = tokens_of(batch)
        if count == 1:
            after = time.perf_counter()
            first = after - start
        else:
            tokens, rows = tokens + got, rows + n
        if count == limit:
            break
    seconds = time.perf_counter() - after
    return {"seconds": seconds, "first": first, "rows": rows, "tokens": tokens}


def arrow_tokens(batch: Any) -> tuple[int, int]:
    """A ``datasets`` arrow-format batch made usable: tokens and offsets as numpy."""
    column = batch.column("input_ids").combine_chunks()
    values = column.flatten().to_numpy()
    offsets = np.asarray(column.offsets)
    return int(values.size), int(offsets.size - 1)


def torch_tokens(batch: ab.Batch) -> tuple[int, int]:
    tokens = batch["input_ids"]
    return int(tokens.values.numel()), int(batch.global_indexes.size)


def torch_list_tokens(batch: Any) -> tuple[int, int]:
    """A ``datasets`` torch-format batch: one tensor per row."""
    rows = batch["input_ids"]
    return sum(int(row.numel()) for row in rows), len(rows)


#: How each ``datasets`` format's batch is counted.
FORMATS: dict[str, Callable[[Any], tuple[int, int]]] = {
    "arrow": arrow_tokens,
    "torch": torch_list_tokens,
}


def datasets_shuffle(
    folder: Path, args: argparse.Namespace, seed: int, kind: str
) -> dict[str, float]:
    import datasets

    start = time.perf_counter()
    ds = datasets.load_from_disk(str(folder)).select_columns(["input_ids"]).shuffle(seed=seed)
    batches = ds.with_format(kind).iter(batch_size=args.batch_size)
    opened = time.perf_counter()
    out = read(batches, args.batches, FORMATS[kind])
    out["first"] += opened - start
    return out


def datasets_iterable(
    folder: Path, args: argparse.Namespace, seed: int, kind: str
) -> dict[str, float]:
    import datasets

    start = time.perf_counter()
    ds = datasets.load_from_disk(str(folder)).select_columns(["input_ids"])
    iterable = ds.to_iterable_dataset(num_shards=args.shards).shuffle(
        seed=seed, buffer_size=args.window * RECORD_BATCH
    )
    batches = iterable.with_format(kind).iter(batch_size=args.batch_size)
    opened = time.perf_counter()
    out = read(batches, args.batches, FORMATS[kind])
    out["first"] += opened - start
    return out


def asyncbatch_line(
    folder: Path, args: argparse.Namespace, seed: int, shuffle: Any
) -> dict[str, float]:
    start = time.perf_counter()
    dataset = ab.open_dataset(str(folder), options={"columns": ["input_ids"]})
    extra: dict[str, Any] = {"window": args.window} if shuffle == "block" else {}
    with ab.Loader(dataset, batch_size=args.batch_size, shuffle=shuffle, seed=seed, **extra) as lo:
        opened = time.perf_counter()
        out = read(iter(lo), args.batches, torch_tokens)
    out["first"] += opened - start
    return out


def open_over_http(folder: Path) -> dict[str, int]:
    """Requests and bytes the HTTP server served for ``open_dataset`` of the folder."""
    with http_server(folder.parent) as server:
        before = server.requests + server.heads, server.bytes_served
        dataset = ab.open_dataset(f"{server.url}/{folder.name}", format="arrow")
        requests = server.requests + server.heads - before[0]
        served = server.bytes_served - before[1]
    return {
        "files": len(dataset.manifest.shards),
        "record_batches": int(dataset.manifest.metadata["record_batches"]),
        "requests": requests,
        "bytes": served,
        "size": sum(s.nbytes for s in dataset.manifest.shards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=positive, default=200_000)
    parser.add_argument("--mean-tokens", type=positive, default=256)
    parser.add_argument("--shards", type=positive, default=8)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--batches", type=int, default=0, help="per line (0: an epoch)")
    parser.add_argument("--window", type=positive, default=8)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--no-freeze", action="store_true", help="leave gc.freeze() out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(
            HF_HOME=f"{tmp}/hf", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1"
        )
        import datasets

        datasets.disable_progress_bars()
        folder = Path(tmp) / "saved"
        tokens = write_folder(folder, args)
        size = sum(p.stat().st_size for p in folder.glob("*.arrow"))
        print(
            f"asyncbatch {git_revision()}, datasets {datasets.__version__}, pyarrow"
            f" {pa.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs;"
            f" {args.rows} rows, {tokens} tokens, {args.shards} shards, {size / 2**20:.0f} MiB;"
            f" batches of {args.batch_size}, {args.batches or 'an epoch of'} per line, window"
            f" {args.window}"
        )
        lines: dict[str, Callable[[int], dict[str, float]]] = {
            "datasets shuffle": lambda seed: datasets_shuffle(folder, args, seed, "arrow"),
            "datasets shuffle torch": lambda seed: datasets_shuffle(folder, args, seed, "torch"),
            "asyncbatch exact": lambda seed: asyncbatch_line(folder, args, seed, True),
            "datasets iterable": lambda seed: datasets_iterable(folder, args, seed, "arrow"),
            "datasets iterable torch": lambda seed: datasets_iterable(folder, args, seed, "torch"),
            "asyncbatch block": lambda seed: asyncbatch_line(folder, args, seed, "block"),
        }
        results: dict[str, list[dict[str, float]]] = {name: [] for name in lines}
        if not args.no_freeze:
            gc.collect()
            gc.freeze()
        for seed in range(args.rounds):
            for name, line in lines.items():
                gc.collect()
                if not args.no_freeze:  # what the lines before left alive too
                    gc.freeze()
                results[name].append(line(seed))
        print(f"{'line':<24} {'rows/s':>10} {'Mtok/s':>8} {'first batch':>12}")
        for name, runs in results.items():
            rate = statistics.median(r["rows"] / r["seconds"] for r in runs)
            tok = statistics.median(r["tokens"] / r["seconds"] for r in runs) / 1e6
            first = statistics.median(r["first"] for r in runs)
            print(f"{name:<24} {rate:>10.0f} {tok:>8.2f} {first * 1e3:>10.1f}ms")

        def rates(name: str) -> list[float]:
            return [r["rows"] / r["seconds"] for r in results[name]]

        def firsts(name: str) -> list[float]:
            return [r["first"] for r in results[name]]

        for ours, theirs in [
            ("asyncbatch exact", "datasets shuffle"),
            ("asyncbatch exact", "datasets shuffle torch"),
            ("asyncbatch block", "datasets iterable"),
            ("asyncbatch block", "datasets iterable torch"),
        ]:
            rate = paired_ratio(rates(ours), rates(theirs))
            first = paired_ratio(firsts(theirs), firsts(ours))
            print(
                f"{ours} / {theirs}: {rate:.2f}x the rows/s (target >= 2), first batch"
                f" {first:.1f}x sooner (target > 1)"
            )
        opened = open_over_http(folder)
        print(
            f"open over HTTP: {opened['files']} files, {opened['record_batches']} record"
            f" batches: {opened['requests']} requests, {opened['bytes'] / 1024:.0f} KiB served"
            f" of {opened['size'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
