"""S3 read rate of ``asyncbatch.Loader`` beside raw s3fs, against a local s3rver, same concurrency.

The script installs s3rver (npm) into ``~/.cache/asyncbatch/s3rver`` if it is not there,
starts it on 127.0.0.1 (a free port, a temporary data directory), writes a token dataset
(uint16, 256 MB by default) to ``s3://bench/...`` with ``ab.write_tokens``, and stops the
server at the end, error or not. With ``seq_len`` 2048, batch 16, global shuffle and
``max_inflight`` N (default 64), it then measures in interleaved rounds (median reported):

* ``loader``: ``ab.Loader`` reading the first ``--batches`` batches of epoch 0, timed from
  constructing the Loader to the last batch in hand. Its range requests (and the bytes they
  return) are counted at the aiobotocore client (``AioBaseClient._make_api_call``), which
  both the Loader's store and s3fs call, as are its HEADs (sizes, ``verify="size"``): the
  Loader merges neighbouring windows closer than its store's coalescing gap into one
  request, so requests <= windows, and its prefetching requests count when they complete
  within the timed interval;
* ``loader gap 0``: the same with ``coalesce_gap=0`` (only touching windows are merged);
* ``loader botocore``: ``loader`` with the store's GETs sent through botocore's
  ``get_object`` (``S3Store.sign_gets = False``) instead of signed by asyncbatch;
* ``s3fs per window``: one ``s3fs.S3FileSystem(asynchronous=True)`` calling
  ``await fs._cat_ranges(paths, starts, ends, batch_size=N)`` with one range per window, for
  the same windows (its connection pool raised to N, as the Loader does);
* ``s3fs loader reqs``: the same call on exactly the ranges the Loader's first (untimed)
  run completed, to compare request for request;
* the Loader's time to first batch (construction to first batch in hand).

Rates are windows/s, range requests/s, MB/s of window payload (2048 tokens x 2 bytes per
window) and MB/s fetched. The headline ratio is Loader / raw s3fs per window: both deliver
the same windows at the same concurrency. The raw s3fs timing starts once its session is
set up; the Loader's includes its start-up.

Usage: ``.venv/bin/python benchmarks/bench_s3.py [--size-mb 256] [--inflight 64] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import s3fs
import torch
from aiobotocore.client import AioBaseClient
from common import git_revision, paired_ratio, positive
from s3rver import (
    BUCKET,
    KEY,
    SECRET,
    default_s3rver_dir,
    ensure_s3rver,
    running_s3rver,
    token_chunks,
)

import asyncbatch as ab
from asyncbatch.sampling._order import EpochOrder
from asyncbatch.stores import open_store
from asyncbatch.stores._s3 import S3Store
from asyncbatch.stores._s3_signed import SignedGets

SEQ_LEN = 2048
BATCH_SIZE = 16
PREFETCH = None  # the Loader default: as many batches as fit in 64 MiB
SEED = 0
SHARD_SIZE = 64 * 2**20


@dataclass
class Ranges:
    """Byte ranges of shard objects: ``paths[i]`` bytes ``[starts[i], ends[i])``."""

    paths: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.ends) - sum(self.starts)

    def head(self, count: int) -> Ranges:
        return Ranges(self.paths[:count], self.starts[:count], self.ends[:count])

    def tail(self, count: int) -> Ranges:
        return Ranges(self.paths[-count:], self.starts[-count:], self.ends[-count:])


@dataclass(frozen=True)
class Sample:
    """One measurement: seconds, range requests completed, bytes those requests returned,
    HEAD requests."""

    seconds: float
    requests: int
    fetched: int
    heads: int = 0


class RequestLog:
    """Counts this process's S3 range GETs and HEADs at the aiobotocore client and at the
    store's signed GETs.

    Wraps ``AioBaseClient._make_api_call``, which every botocore request goes through, whether
    it comes from s3fs (``_cat_file``) or from the Loader's store (its HEADs, and its GETs
    with ``S3Store.sign_gets`` off), and ``SignedGets.get_object`` (the store's GETs), so the
    figures stay true whatever the Loader's read planning or store does. A GET counts when
    its response headers arrive, with the ``ContentLength`` it announces; ``recording`` (when
    set) also collects the ranges, in that order.
    """

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.heads = 0
        self.recording: Ranges | None = None
        original = AioBaseClient._make_api_call
        original_signed = SignedGets.get_object

        async def counted(client: Any, operation: str, params: dict[str, Any]) -> Any:
            response = await original(client, operation, params)
            self._record(operation, params, response)
            return response

        async def counted_signed(gets: SignedGets, **params: Any) -> Any:
            response = await original_signed(gets, **params)
            if gets._buckets.get(params["Bucket"]) is not None:  # else botocore's, counted
                self._record("GetObject", params, response)
            return response

        AioBaseClient._make_api_call = counted  # type: ignore[method-assign]
        SignedGets.get_object = counted_signed  # type: ignore[method-assign]

    def _record(self, operation: str, params: dict[str, Any], response: Any) -> None:
        if operation == "HeadObject":
            self.heads += 1
        elif operation == "GetObject":
            self.count += 1
            self.nbytes += int(response.get("ContentLength") or 0)
            recording = self.recording
            spec = params.get("Range")
            if recording is not None and spec:
                first, last = spec.removeprefix("bytes=").split("-")
                recording.paths.append(f"{params['Bucket']}/{params['Key']}")
                recording.starts.append(int(first))
                recording.ends.append(int(last) + 1)


def window_ranges(dataset: ab.Dataset, ids: npt.NDArray[np.int64]) -> Ranges:
    """One range per window of ``ids``, in order (no merging; split where it crosses shards)."""
    shard_map = dataset.shard_map
    ends = shard_map.ends.tolist()
    starts = shard_map.starts.tolist()
    itemsize = shard_map.itemsize
    urls = dataset.shard_urls
    ranges = Ranges()
    for sample in ids.tolist():
        first, last = sample * SEQ_LEN, sample * SEQ_LEN + SEQ_LEN
        while first < last:
            shard = bisect.bisect_right(ends, first)
            stop = min(last, ends[shard])
            ranges.paths.append(urls[shard])
            ranges.starts.append((first - starts[shard]) * itemsize)
            ranges.ends.append((stop - starts[shard]) * itemsize)
            first = stop
    return ranges


def make_loader(dataset: ab.Dataset, inflight: int, gap: int | None = None) -> ab.Loader:
    """The Loader measured: seq_len 2048, batch 16, global shuffle, ``max_inflight`` N."""
    return ab.Loader(
        dataset,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        shuffle=True,
        seed=SEED,
        prefetch=PREFETCH,
        max_inflight=inflight,
        coalesce_gap=gap,
    )


def time_loader(
    dataset: ab.Dataset,
    batches: int,
    inflight: int,
    log: RequestLog,
    gap: int | None = None,
    reference: list[bytes] | None = None,
    signed: bool = True,
) -> Sample:
    """From constructing a Loader to holding its ``batches``-th batch: time and requests.

    With ``reference``, the last batch must hold exactly those rows (bytes). ``signed=False``
    sends the store's GETs through botocore's ``get_object``.
    """
    S3Store.sign_gets = signed
    try:
        return _time_loader(dataset, batches, inflight, log, gap, reference)
    finally:
        S3Store.sign_gets = True


def _time_loader(
    dataset: ab.Dataset,
    batches: int,
    inflight: int,
    log: RequestLog,
    gap: int | None,
    reference: list[bytes] | None,
) -> Sample:
    count, nbytes, heads = log.count, log.nbytes, log.heads
    start = time.perf_counter()
    with make_loader(dataset, inflight, gap) as loader:
        for done, batch in enumerate(loader, 1):
            if done == batches:
                sample = Sample(
                    time.perf_counter() - start,
                    log.count - count,
                    log.nbytes - nbytes,
                    log.heads - heads,
                )
                if reference is not None:
                    tokens: torch.Tensor = batch["tokens"]
                    if [row.numpy().tobytes() for row in tokens] != reference:
                        raise SystemExit("the Loader's last batch differs from raw s3fs's bytes")
                return sample
    raise RuntimeError(f"the loader ended after fewer than {batches} batches")


def loader_first_batch(dataset: ab.Dataset, inflight: int) -> float:
    """Seconds from constructing a Loader to holding its first batch."""
    start = time.perf_counter()
    with make_loader(dataset, inflight) as loader:
        next(iter(loader))
        return time.perf_counter() - start


async def _cat_ranges(
    options: dict[str, Any], ranges: Ranges, inflight: int
) -> tuple[float, list[bytes]]:
    fs = s3fs.S3FileSystem(
        asynchronous=True,
        skip_instance_cache=True,
        config_kwargs={"max_pool_connections": inflight},
        **options,
    )
    await fs.set_session()
    try:
        start = time.perf_counter()
        data: list[bytes] = await fs._cat_ranges(
            ranges.paths, ranges.starts, ranges.ends, batch_size=inflight, on_error="raise"
        )
        elapsed = time.perf_counter() - start
    finally:
        await fs._s3.close()
    for piece, first, last in zip(data, ranges.starts, ranges.ends, strict=True):
        if len(piece) != last - first:
            raise RuntimeError(f"short read: {len(piece)} bytes for [{first}, {last})")
    return elapsed, data


def time_s3fs(options: dict[str, Any], ranges: Ranges, inflight: int) -> Sample:
    """Raw s3fs ``_cat_ranges`` fetching ``ranges``, ``inflight`` at once (session set up)."""
    seconds = asyncio.run(_cat_ranges(options, ranges, inflight))[0]
    return Sample(seconds, len(ranges.paths), ranges.nbytes)


def coalesce_gap(url: str, options: dict[str, Any]) -> int:
    """The Loader's default coalescing gap for ``url`` (its store's ``coalesce_gap``)."""
    store = open_store(url, options)
    try:
        return int(store.coalesce_gap)
    finally:
        asyncio.run(store.close())


def main() -> None:
    """Start s3rver, write the dataset, run the rounds, print the figures, stop s3rver."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=256, help="dataset size in MiB")
    parser.add_argument("--inflight", type=positive, default=64, help="requests in flight (N)")
    parser.add_argument("--batches", type=positive, default=256, help="batches per measurement")
    parser.add_argument("--rounds", type=positive, default=5, help="interleaved rounds (median)")
    parser.add_argument("--s3rver-dir", type=Path, default=None, help="npm prefix for s3rver")
    args = parser.parse_args()

    script = ensure_s3rver(args.s3rver_dir or default_s3rver_dir())
    log = RequestLog()
    with running_s3rver(script) as endpoint:
        run(endpoint, args, log)


def run(endpoint: str, args: argparse.Namespace, log: RequestLog) -> None:
    """Everything measured against the running server at ``endpoint``."""
    options: dict[str, Any] = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    url = f"s3://{BUCKET}/tokens-{args.size_mb}m"
    tokens = args.size_mb * 2**20 // 2
    start = time.perf_counter()
    ab.write_tokens(
        url, token_chunks(tokens), dtype=np.uint16, shard_size=SHARD_SIZE, storage_options=options
    )
    written = time.perf_counter() - start
    dataset = ab.open_dataset(url, storage_options=options)

    order = EpochOrder(dataset.manifest.total_elements // SEQ_LEN, BATCH_SIZE, shuffle=True)
    batches = min(args.batches, order.batches_per_epoch)
    windows = batches * BATCH_SIZE
    payload = windows * SEQ_LEN * dataset.manifest.dtype.itemsize
    per_window = window_ranges(dataset, order.sample_ids(0, 0, batches))
    inflight = args.inflight

    print(f"asyncbatch bench_s3  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  python {platform.python_version()}  s3fs {s3fs.__version__}")
    print(f"  cpus {os.cpu_count()}  s3rver at {endpoint} (same machine)")
    print(
        f"  dataset {url}: {dataset.manifest.total_bytes / 1e6:.0f} MB,"
        f" {len(dataset.shard_urls)} shards, written in {written:.1f} s"
    )
    print(
        f"  seq_len {SEQ_LEN}, batch {BATCH_SIZE}, shuffle global, prefetch {PREFETCH},"
        f" Loader max_inflight = s3fs batch_size = {inflight}; {batches} batches = {windows}"
        f" windows per measurement, {args.rounds} rounds"
    )

    # A first Loader run, not timed: checks its last batch against raw s3fs's bytes for the
    # same windows, and records the range requests it completed up to that batch.
    reference = None
    if len(per_window.paths) == windows:  # no window crosses a shard end: rows line up
        reference = asyncio.run(_cat_ranges(options, per_window.tail(BATCH_SIZE), inflight))[1]
    log.recording = recording = Ranges()
    first_run = time_loader(dataset, batches, inflight, log, reference=reference)
    log.recording = None
    loader_requests = recording.head(first_run.requests)
    print(
        f"  Loader (coalescing gap {coalesce_gap(url, options) // 1024} KiB):"
        f" {first_run.requests} range requests and {first_run.heads} HEADs completed by batch"
        f" {batches}"
        f" ({windows} windows), {first_run.fetched / payload:.2f}x the window bytes"
        + (", last batch checked against s3fs" if reference is not None else "")
    )

    measures: dict[str, Callable[[], Sample]] = {
        "loader": lambda: time_loader(dataset, batches, inflight, log),
        "loader gap 0": lambda: time_loader(dataset, batches, inflight, log, gap=0),
        "loader botocore": lambda: time_loader(dataset, batches, inflight, log, signed=False),
        "s3fs per window": lambda: time_s3fs(options, per_window, inflight),
        "s3fs loader reqs": lambda: time_s3fs(options, loader_requests, inflight),
    }
    samples: dict[str, list[Sample]] = {name: [] for name in measures}
    names = list(measures)
    first_batch: list[float] = []
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(measures[name]())
        first_batch.append(loader_first_batch(dataset, inflight))
        print(
            f"  round {round_ + 1}: "
            + ", ".join(f"{name} {windows / samples[name][-1].seconds:.0f}" for name in names)
            + " windows/s",
            file=sys.stderr,
        )

    print()
    print(
        f"{'approach':17} {'windows/s':>10} {'requests/s':>11} {'MB/s':>8} {'fetched MB/s':>13}"
        f" {'min-max windows/s':>18} {'loader/this':>12}"
    )
    for name in names:
        runs = samples[name]
        rate = [windows / run.seconds for run in runs]
        print(
            f"{name:17} {statistics.median(rate):10.0f}"
            f" {statistics.median(run.requests / run.seconds for run in runs):11.0f}"
            f" {statistics.median(payload / run.seconds for run in runs) / 1e6:8.1f}"
            f" {statistics.median(run.fetched / run.seconds for run in runs) / 1e6:13.1f}"
            f" {f'{min(rate):.0f}-{max(rate):.0f}':>18}"
            f" {paired_ratio(speeds(samples['loader']), speeds(runs)):12.2f}"
        )
    ratio = paired_ratio(speeds(samples["loader"]), speeds(samples["s3fs per window"]))
    print(
        f"Loader / raw s3fs (same windows, one request per window for s3fs, same concurrency"
        f" {inflight}): {ratio:.2f}"
    )
    print(
        "  loader gap 0 / s3fs per window (both about one request per window):"
        f" {paired_ratio(speeds(samples['loader gap 0']), speeds(samples['s3fs per window'])):.2f}"
    )
    print(
        f"Loader time to first batch: median {statistics.median(first_batch) * 1e3:.0f} ms"
        f" (min {min(first_batch) * 1e3:.0f}, max {max(first_batch) * 1e3:.0f})"
    )
    print(
        "(windows/s, requests/s, MB/s: medians over rounds. MB/s: window payload delivered;"
        " fetched MB/s: bytes the requests returned, coalescing gaps included. loader/this and"
        " the ratios: median over rounds of the ratio of the runs side by side)"
    )


def speeds(runs: list[Sample]) -> list[float]:
    """1 / seconds of each run (every run of a line does the same work)."""
    return [1 / run.seconds for run in runs]


if __name__ == "__main__":
    main()
