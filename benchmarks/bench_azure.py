"""Azure read rate of ``asyncbatch.Loader``: the built-in ``az://`` store beside adlfs through
the fsspec path, on Azurite, under an exact (global) shuffle, same concurrency.

The script starts Azurite (npm; ``scripts/bootstrap`` installs it into ``.venv/azurite``) on
127.0.0.1 with its blobs in memory, writes a uint16 token dataset (``--size-mb``, default
32) to ``az://bench/tokens`` with ``ab.write_tokens``, and stops Azurite at the end, error or
not. With ``seq_len`` 2048, batch 16, global shuffle and ``max_inflight`` N (default 64), it
measures in interleaved rounds (the order rotated each round; medians and paired ratios):

* ``az://``: ``ab.Loader`` over the built-in store (Shared Key signed aiohttp GETs), from
  constructing the Loader to holding its ``--batches``-th batch;
* ``az://, gap 0``: the same with ``coalesce_gap=0`` (about one request per window);
* ``adlfs (fsspec)``: the same Loader with ``az://`` served by the fsspec transport over
  adlfs (``AzureBlobFileSystem(asynchronous=True)``, azure-storage-blob's aio client), as
  asyncbatch served Azure before it had a store of its own; the same default gap.

Every line's last batch is checked against the others' (the same bytes). Azurite shares the
2 cores with the reader, so this compares per-request cost, not Azure's latency.

Usage: ``.venv/bin/python benchmarks/bench_azure.py [--size-mb 32] [--inflight 64]
[--batches 128] [--rounds 3] [--json PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO, git_revision, paired_ratio, positive, stop_process, write_rates

import asyncbatch as ab
from asyncbatch.stores._azure_auth import DEV_ACCOUNT, DEV_KEY
from asyncbatch.stores._fsspec_store import FsspecStore

SEQ_LEN = 2048
BATCH_SIZE = 16
SEED = 0
AZURITE = REPO / ".venv/azurite/node_modules/.bin/azurite-blob"
BUILT_IN = "asyncbatch.stores._azure:azure_store"
LINES = ["az://", "az://, gap 0", "adlfs (fsspec)"]


@contextlib.contextmanager
def running_azurite() -> Iterator[str]:
    """Azurite's Blob service on a free port, blobs in memory: the dev account's endpoint."""
    binary = os.environ.get("AZURITE") or str(AZURITE)
    if not Path(binary).exists():
        raise SystemExit(f"Azurite is not installed at {binary}: run scripts/bootstrap")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    command += ["--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--silent"]
    with tempfile.TemporaryDirectory(prefix="bench-azurite-") as scratch:
        process = subprocess.Popen(
            command, cwd=scratch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("Azurite did not start") from None
                    time.sleep(0.05)
            yield f"http://127.0.0.1:{port}/{DEV_ACCOUNT}"
        finally:
            stop_process(process)


def adlfs_store(
    scheme: str, storage_options: dict[str, Any], *, max_inflight: int, retry: Any = None
) -> FsspecStore:
    """``az://`` through fsspec's transport over adlfs, with the same Azurite account."""
    options = {"connection_string": storage_options["connection_string"]}
    return FsspecStore("az", options, max_inflight=max_inflight)


def time_loader(
    url: str, options: dict[str, Any], batches: int, inflight: int, gap: int | None, fsspec: bool
) -> tuple[float, int, bytes]:
    """Seconds from constructing the Loader to its ``batches``-th batch, the range requests
    it made by then (``loader.statistics()``), and that batch."""
    ab.register_store("az", adlfs_store if fsspec else BUILT_IN, clobber=True)
    try:
        start = time.perf_counter()
        with ab.Loader(
            url,
            batch_size=BATCH_SIZE,
            seq_len=SEQ_LEN,
            shuffle=True,
            seed=SEED,
            max_inflight=inflight,
            coalesce_gap=gap,
            storage_options=options,
        ) as loader:
            for done, batch in enumerate(loader, 1):
                if done == batches:
                    seconds = time.perf_counter() - start
                    stats = loader.statistics()
                    requests = 0 if stats is None else stats.requests
                    return seconds, requests, batch["tokens"].numpy().tobytes()
    finally:
        ab.register_store("az", BUILT_IN, clobber=True)
    raise RuntimeError(f"the loader ended after fewer than {batches} batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=32, help="dataset size in MiB")
    parser.add_argument("--inflight", type=positive, default=64, help="requests in flight (N)")
    parser.add_argument("--batches", type=positive, default=128, help="batches per measurement")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (median)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    print(f"asyncbatch bench_azure  git {git_revision()}  cpus {os.cpu_count()}")
    with running_azurite() as endpoint:
        run(endpoint, args)


def run(endpoint: str, args: argparse.Namespace) -> None:
    import adlfs

    built_in = {"account_name": DEV_ACCOUNT, "account_key": DEV_KEY, "endpoint": endpoint}
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
        f"BlobEndpoint={endpoint};"
    )
    tokens = np.random.default_rng(0).integers(0, 60_000, args.size_mb << 19, dtype=np.uint16)
    url = "az://bench/tokens"
    began = time.perf_counter()
    ab.write_tokens(url, tokens, storage_options=built_in, shard_size=32 << 20)
    seconds = time.perf_counter() - began
    print(f"wrote {args.size_mb} MiB in {seconds:.1f} s; adlfs {adlfs.__version__}")
    windows = args.batches * BATCH_SIZE
    runs: dict[str, list[float]] = {line: [] for line in LINES}
    requests: dict[str, list[int]] = {line: [] for line in LINES}
    last: dict[str, bytes] = {}
    for round_number in range(args.rounds + 1):  # round 0 warms up, untimed
        shift = round_number % len(LINES)
        for line in LINES[shift:] + LINES[:shift]:
            fsspec = line.startswith("adlfs")
            options = {"connection_string": connection} if fsspec else built_in
            gap = 0 if line.endswith("gap 0") else None
            seconds, made, batch = time_loader(
                url, options, args.batches, args.inflight, gap, fsspec
            )
            last[line] = batch
            if round_number == 0:
                continue
            runs[line].append(windows / seconds)
            requests[line].append(made)
            print(
                f"round {round_number} {line:16s} {windows / seconds:8.0f} windows/s"
                f" {made:6d} requests"
            )
    if len(set(last.values())) != 1:
        raise SystemExit("the lines' last batches differ")
    print(
        f"\n{windows} windows of {SEQ_LEN} tokens per run, N={args.inflight},"
        f" {args.rounds} rounds, git {git_revision()}"
    )
    header = f"{'line':16s} {'windows/s':>10s} {'min-max':>14s} {'requests':>9s}"
    print(f"{header} {'this / adlfs (paired)':>22s}")
    for line in LINES:
        rates = runs[line]
        ratio = paired_ratio(rates, runs["adlfs (fsspec)"])
        print(
            f"{line:16s} {statistics.median(rates):10.0f}"
            f" {min(rates):6.0f}-{max(rates):<7.0f} {statistics.median(requests[line]):9.0f}"
            f" {ratio:22.2f}"
        )
    if args.json is not None:
        write_rates(
            args.json,
            "bench_azure.py",
            runs,
            unit="windows/s",
            baseline="adlfs (fsspec)",
            title="Azure (Azurite): the built-in az:// store beside adlfs through fsspec",
        )


if __name__ == "__main__":
    sys.exit(main())
