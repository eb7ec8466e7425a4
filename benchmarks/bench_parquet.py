"""Parquet on S3: open time of many files, tokens/s under block shuffle, bytes fetched /
delivered and time to first batch, beside Hugging Face ``datasets`` and ``pyarrow.dataset``.

The script starts s3rver (installed with npm if missing) on 127.0.0.1 behind
``delayproxy.py`` (10 ms per request, ``--delay-ms``), which counts the requests. It writes a
pre-tokenised corpus with pyarrow: ``--files`` files (default 1,000) named as on the Hugging
Face Hub (``data/train-00000-of-01000.parquet``), each ``--row-groups`` row groups of
``--rows`` rows, with an ``input_ids`` list<int32> column (documents of geometric length, mean
``--mean-tokens``), an ``id`` int64 and a ``source`` string column; then uploads it.

**Open** (every file's row count known, the index asyncbatch builds):

* ``asyncbatch``: ``ab.open_dataset("s3://bucket/corpus/data/train-*.parquet", storage_options)``,
  ``--open-rounds`` times (median) and as often, alternating, with the S3 store's GETs sent
  through botocore's ``get_object`` (``asyncbatch_botocore``) instead of signed by asyncbatch;
* ``pyarrow.dataset``: ``pyarrow.dataset.dataset([key, ...], filesystem=S3FileSystem(...))``
  then ``count_rows()`` (reads every footer; given the file list, as pyarrow's listing fails on
  s3rver);
* ``datasets``: ``load_dataset("parquet", data_files=[...], streaming=True)`` (resolves the
  files; knows no row counts) and, with ``--datasets-download``, the map-style
  ``load_dataset`` that downloads everything;
* ``litdata``: ``litdata.index_parquet_dataset(folder URL)`` (reads every footer with s3fs and
  writes ``index.json`` beside the files: what its ``StreamingDataset`` needs to read them).

**Read** ``input_ids`` only, batches of ``--batch-size`` rows:

* ``asyncbatch block``: ``ab.Loader(ds, shuffle="block", window=W)``; blocks are row groups,
  so its shuffle buffer is ``W x rows`` rows;
* ``datasets streaming``: ``IterableDataset.shuffle(buffer_size=W x rows)`` over the same
  files, batched in Python the way a collate function would (``--datasets-rows`` caps the rows
  read; the rate is over the rows read);
* ``litdata``: ``StreamingDataset(folder URL, item_loader=ParquetLoader(columns=["input_ids"]),
  shuffle=True)`` (files in random order, rows shuffled within each) in a
  ``StreamingDataLoader`` with no worker process, as the other lines (``--datasets-rows`` caps
  its rows too); it downloads each file whole before reading it;
* ``pyarrow.dataset`` scan: ``to_batches(columns=["input_ids"])``, no shuffle.

Tokens/s, time to first batch (from the first ``next()``, the loader built), requests and
bytes through the proxy, and bytes fetched / delivered for asyncbatch (``statistics()``: the
column chunks fetched against those of the rows delivered).

Usage: ``.venv/bin/python benchmarks/bench_parquet.py [--files 1000] [--rows 64]
[--row-groups 2] [--mean-tokens 128] [--window 8] [--datasets-rows 20000]
[--json docs/img/bench_parquet.json]`` (``scripts/bench-setup`` installs ``datasets``, litData
and the polars its Parquet reader needs; ``plot.py`` draws the JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import git_revision, positive
from delayproxy import Counts, Proxy, running_proxy
from s3rver import (
    BUCKET,
    KEY,
    SECRET,
    VOCAB,
    default_s3rver_dir,
    ensure_s3rver,
    running_s3rver,
    s3rver_version,
    upload_folder,
)

import asyncbatch as ab
from asyncbatch.stores._s3 import S3Store


def write_corpus(folder: Path, args: argparse.Namespace) -> int:
    """The files of the corpus under ``folder``; returns the tokens written."""
    rng = np.random.default_rng(0)
    tokens = 0
    rows = args.rows * args.row_groups
    for number in range(args.files):
        lengths = rng.geometric(1 / args.mean_tokens, rows).astype(np.int64)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
        table = pa.table(
            {
                "id": pa.array(np.arange(number * rows, (number + 1) * rows)),
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                "source": pa.array([f"doc-{number}-{i}" for i in range(rows)]),
            }
        )
        name = f"train-{number:05d}-of-{args.files:05d}.parquet"
        pq.write_table(table, folder / name, row_group_size=args.rows)
        tokens += int(offsets[-1])
    return tokens


def timed(work: Callable[[], Any], proxy: Proxy) -> tuple[float, Counts, Any]:
    before = proxy.counts()
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, proxy.counts() - before, result


def count_tokens(batches: Iterator[Any], tokens_of: Callable[[Any], int]) -> dict[str, float]:
    """Reads ``batches``; seconds, time to first batch, tokens and rows."""
    start = time.perf_counter()
    first, tokens, count = 0.0, 0, 0
    for count, batch in enumerate(batches, 1):
        tokens += tokens_of(batch)
        if count == 1:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "first_batch_s": first, "tokens": tokens, "batches": count}


def datasets_batches(stream: Any, batch_size: int, limit: int) -> Iterator[list[Any]]:
    """Rows of a ``datasets`` stream grouped into batches, as a collate function would."""
    batch: list[Any] = []
    for number, row in enumerate(stream):
        if number >= limit:
            break
        batch.append(row["input_ids"])
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def through_proxy(read: dict[str, Any], proxy: Proxy, before: Counts) -> dict[str, Any]:
    """``read`` with the requests and bytes the proxy served since ``before``."""
    counts = proxy.counts() - before
    read["requests"], read["bytes_down"] = counts.requests, counts.down_bytes
    return read


def litdata_lines(
    prefix: str, proxy: Proxy, args: argparse.Namespace, scratch: Path, results: dict[str, Any]
) -> None:
    """litData's Parquet support: its index of the footers (open), then a shuffled read of
    ``--datasets-rows`` rows; a failure is recorded in ``results["litdata_error"]``."""
    try:
        import litdata
        import litdata.streaming.downloader as downloader
        from litdata.streaming.item_loader import ParquetLoader
    except ImportError as exc:
        results["litdata_error"] = f"not installed (scripts/bench-setup installs it): {exc}"
        return
    results["litdata_version"] = litdata.__version__
    # litData fetches files with obstore, which refuses plain-HTTP endpoints unless told.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    s3fs_options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": proxy.url}}
    obstore_options = {
        "endpoint_url": proxy.url,
        "aws_access_key_id": KEY,
        "aws_secret_access_key": SECRET,
    }
    try:
        seconds, counts, _ = timed(
            lambda: litdata.index_parquet_dataset(prefix, storage_options=s3fs_options), proxy
        )
        results["open_litdata_index"] = {"seconds": seconds, "requests": counts.requests}
        dataset = litdata.StreamingDataset(
            prefix,
            item_loader=ParquetLoader(columns=["input_ids"]),
            shuffle=True,
            seed=0,
            storage_options=obstore_options,
            cache_dir=str(scratch / "litdata-cache"),
        )
        loader = litdata.StreamingDataLoader(
            dataset,
            batch_size=args.batch_size,
            collate_fn=lambda rows: [row["input_ids"] for row in rows],
        )
        before = proxy.counts()
        batches = -(-args.datasets_rows // args.batch_size)
        read = count_tokens(
            itertools.islice(iter(loader), batches), lambda b: sum(len(row) for row in b)
        )
        results["read_litdata"] = through_proxy(read, proxy, before)
    except Exception as exc:  # any failure of the peer is a result to report, not a crash
        results["litdata_error"] = f"{type(exc).__name__}: {exc}"


def run(endpoint: str, proxy: Proxy, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    folder = scratch / "data"
    folder.mkdir()
    total_tokens = write_corpus(folder, args)
    prefix = f"s3://{BUCKET}/corpus/data"
    upload_folder(endpoint, str(folder), prefix)
    files = [f"{prefix}/{p.name}" for p in sorted(folder.iterdir())]
    options = {"endpoint_url": proxy.url, "key": KEY, "secret": SECRET}
    results: dict[str, Any] = {"tokens": total_tokens, "files": len(files)}
    shuffle_rows = args.window * args.rows

    # Open, after one untimed open of one file by each (imports, clients, connections).
    # asyncbatch's open is timed --open-rounds times with its S3 GETs signed by asyncbatch
    # (the default) and, alternating, sent through botocore's get_object: medians, and the
    # median of the per-round ratios.
    ab.open_dataset(files[:1], options)
    opens: dict[str, list[tuple[float, int]]] = {"asyncbatch": [], "asyncbatch_botocore": []}
    for _ in range(args.open_rounds):
        for name, signed in (("asyncbatch", True), ("asyncbatch_botocore", False)):
            S3Store.sign_gets = signed
            try:
                seconds, counts, dataset = timed(
                    lambda: ab.open_dataset(f"{prefix}/train-*.parquet", options), proxy
                )
            finally:
                S3Store.sign_gets = True
            opens[name].append((seconds, counts.requests))
    for name, runs in opens.items():
        seconds = statistics.median(run[0] for run in runs)
        results[f"open_{name}"] = {"seconds": seconds, "requests": runs[-1][1]}
    results["open_botocore_over_signed"] = statistics.median(
        b[0] / a[0] for a, b in zip(opens["asyncbatch"], opens["asyncbatch_botocore"], strict=True)
    )
    import pyarrow.dataset as pads
    from pyarrow import fs as pafs

    s3 = pafs.S3FileSystem(
        access_key=KEY,
        secret_key=SECRET,
        endpoint_override=proxy.url,
        scheme="http",
        region="us-east-1",
    )
    # The file list, as pyarrow's own listing fails on s3rver (ListObjectsV2: internal error).
    keys = [f.removeprefix("s3://") for f in files]
    pads.dataset(keys[:1], filesystem=s3).count_rows()
    seconds, counts, rows = timed(lambda: pads.dataset(keys, filesystem=s3).count_rows(), proxy)
    assert rows == dataset.manifest.total_elements, (rows, dataset.manifest.total_elements)
    results["open_pyarrow_dataset"] = {"seconds": seconds, "requests": counts.requests}
    import datasets

    datasets.disable_progress_bars()
    hf_options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": proxy.url}}

    def hf_stream() -> Any:
        loaded = datasets.load_dataset(
            "parquet", data_files=files, streaming=True, storage_options=hf_options
        )
        return loaded["train"]

    datasets.load_dataset(
        "parquet", data_files=files[:1], streaming=True, storage_options=hf_options
    )
    seconds, counts, stream = timed(hf_stream, proxy)
    results["open_datasets_streaming"] = {"seconds": seconds, "requests": counts.requests}
    if args.datasets_download:
        cache = scratch / "hf-cache"
        seconds, counts, _ = timed(
            lambda: datasets.load_dataset(
                "parquet", data_files=files, storage_options=hf_options, cache_dir=str(cache)
            ),
            proxy,
        )
        results["open_datasets_download"] = {"seconds": seconds, "requests": counts.requests}

    # Read
    projected = ab.open_dataset(
        f"{prefix}/train-*.parquet", options, options={"columns": ["input_ids"]}
    )
    before = proxy.counts()
    with ab.Loader(
        projected, batch_size=args.batch_size, shuffle="block", window=args.window, seed=0
    ) as loader:
        read = count_tokens(iter(loader), lambda b: int(b["input_ids"].values.numel()))
        stats = loader.statistics()
    through_proxy(read, proxy, before)
    read["bytes_fetched"] = stats.bytes_fetched
    read["bytes_delivered"] = stats.bytes_delivered
    results["read_asyncbatch_block"] = read

    shuffled = stream.select_columns(["input_ids"]).shuffle(seed=0, buffer_size=shuffle_rows)
    before = proxy.counts()
    read = count_tokens(
        datasets_batches(shuffled, args.batch_size, args.datasets_rows),
        lambda b: sum(len(row) for row in b),
    )
    results["read_datasets_streaming"] = through_proxy(read, proxy, before)

    scan = pads.dataset(keys, filesystem=s3)
    before = proxy.counts()
    read = count_tokens(
        scan.to_batches(columns=["input_ids"], batch_size=args.batch_size),
        lambda b: len(b.column(0).flatten()),
    )
    results["read_pyarrow_dataset"] = through_proxy(read, proxy, before)
    # Last: its index.json lands beside the files (the globs above match .parquet only).
    litdata_lines(prefix, proxy, args, scratch, results)
    return results


def report(results: dict[str, Any]) -> str:
    lines = [f"{results['files']} files, {results['tokens']:,} tokens"]
    lines.append("| open | seconds | requests |")
    lines.append("|---|---:|---:|")
    for key, value in results.items():
        if key.startswith("open_") and isinstance(value, dict):
            lines.append(f"| {key[5:]} | {value['seconds']:.2f} | {value['requests']} |")
    ratio = results["open_botocore_over_signed"]
    lines.append(f"asyncbatch open, botocore GETs / signed GETs (paired): {ratio:.2f}")
    lines.append("")
    lines.append(
        "| read | M tokens/s | first batch (s) | requests | MB through the proxy"
        " | fetched / delivered |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|")
    for key, value in results.items():
        if key.startswith("read_"):
            rate = value["tokens"] / value["seconds"] / 1e6
            ratio = (
                f"{value['bytes_fetched'] / max(1, value['bytes_delivered']):.2f}"
                if "bytes_fetched" in value
                else "-"
            )
            lines.append(
                f"| {key[5:]} | {rate:.2f} | {value['first_batch_s']:.3f} |"
                f" {value['requests']} | {value['bytes_down'] / 1e6:.1f} | {ratio} |"
            )
    if "litdata_error" in results:
        lines.append(f"\nlitdata: {results['litdata_error']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=positive, default=1000)
    parser.add_argument("--rows", type=positive, default=64, help="rows per row group")
    parser.add_argument("--row-groups", type=positive, default=2, help="row groups per file")
    parser.add_argument("--mean-tokens", type=positive, default=128)
    parser.add_argument("--batch-size", type=positive, default=32)
    parser.add_argument("--window", type=positive, default=8, help="row groups per window")
    parser.add_argument("--datasets-rows", type=positive, default=20_000)
    parser.add_argument("--datasets-download", action="store_true")
    parser.add_argument(
        "--open-rounds", type=positive, default=3, help="asyncbatch opens, each way (median)"
    )
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--s3rver-dir", type=Path, default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    script = ensure_s3rver(args.s3rver_dir or default_s3rver_dir())
    started = time.perf_counter()
    with (
        running_s3rver(script) as endpoint,
        running_proxy(endpoint, args.delay_ms / 1e3) as proxy,
        # litData's download threads may still be writing files into its cache folder.
        tempfile.TemporaryDirectory(prefix="bench-parquet-", ignore_cleanup_errors=True) as scratch,
    ):
        results = run(endpoint, proxy, args, Path(scratch))
    results["machine"] = {
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "s3rver": s3rver_version(script),
        "revision": git_revision(),
        "delay_ms": args.delay_ms,
    }
    print(report(results))
    print(f"(run time {time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
