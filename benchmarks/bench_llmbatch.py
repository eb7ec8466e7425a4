"""LLMBATCH files beside the tokens format and an mmap reader, local; read requests per batch
at an HTTP Range server.

One set of records (uint32, ``seq_len`` 512, 256 MiB by default) is written twice into a
temporary folder: as an LLMBATCH file (``ab.write_llmbatch``, batch 32, 64 KiB slots) and as
a token dataset holding the same records in the file's order (``ab.write_tokens``), so that
sample ``r`` is the same record in both and a global shuffle with one seed reads the same
batches. Page cache warm. Per round, interleaved (the order rotated each round):

* ``tokens global`` (the baseline): ``ab.Loader(tokens_dataset, batch_size=32,
  seq_len=512, shuffle=True, seed=0)``, the whole epoch;
* ``llmbatch global``: the same over the ``.batch`` file (same batches, checked);
* ``llmbatch block``: ``shuffle="block"`` (the format's default block: one file batch);
* ``llmbatch batch``: ``shuffle="batch"``: the file's batches whole, in a shuffled order (one
  read of one slot per batch);
* ``mmap view``: the layout's own reader: ``mmap`` the file, then per batch (file batches
  in a shuffled order) slice, ``np.frombuffer``, reshape, ``torch.from_numpy`` (no copy);
* ``mmap copy``: the same plus a copy into a fresh tensor (what the Loader hands over: a
  batch that owns its memory);
* ``preadv copy``: the same batches read with ``os.preadv`` into a fresh buffer each;
* with ``--int64``, the Loader lines with ``dtype=torch.int64`` and the mmap lines with
  ``.astype(np.int64)``.


Then, for ``shuffle="block"`` and ``shuffle=True``: the reads per batch the engine plans over
one epoch of the big file with the remote stores' coalescing gap (128 KiB), counted at the
source's planner (what it would send to S3 or HTTP), and the requests per batch counted at
tests/servers.py's HTTP Range server on 127.0.0.1 over one epoch of a small file (16 MiB: the
server reads the whole file per request), with the default gap and with ``coalesce_gap=0``.

Usage: ``.venv/bin/python benchmarks/bench_llmbatch.py [--size-mb 256] [--rounds 5] [--int64]
[--http-size-mb 16]``
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import REPO, git_revision, paired_ratio, positive

import asyncbatch as ab
from asyncbatch._layout import ReadPlan
from asyncbatch.formats._llmbatch import LLMBatchRecords
from asyncbatch.stores._fsspec_store import REMOTE_COALESCE_GAP

sys.path.insert(0, str(REPO / "tests"))
from servers import http_server  # noqa: E402

SEQ_LEN = 512
BATCH_SIZE = 32
HEADER = 4096


def write_data(root: Path, size_mb: int) -> tuple[ab.Dataset, ab.Dataset, Path]:
    records = size_mb * 2**20 // (SEQ_LEN * 4) // BATCH_SIZE * BATCH_SIZE
    data = np.random.default_rng(0).integers(0, 50_257, (records, SEQ_LEN), dtype=np.uint32)
    path = root / "data.batch"
    batch = ab.write_llmbatch(str(path), data, batch_size=BATCH_SIZE, seed=0, shuffle=False)
    tokens = ab.write_tokens(str(root / "tokens"), data.reshape(-1), shard_size=64 * 2**20)
    path.read_bytes()  # warm the page cache
    for url in tokens.shard_urls:
        Path(url).read_bytes()
    return batch, tokens, path


def time_loader(dataset: ab.Dataset, dtype: torch.dtype | None, **kwargs: object) -> float:
    start = time.perf_counter()
    with ab.Loader(dataset, batch_size=BATCH_SIZE, seed=0, dtype=dtype, **kwargs) as loader:
        for _ in loader:
            pass
    return time.perf_counter() - start


def time_mmap(path: Path, copy: bool, int64: bool) -> float:
    start = time.perf_counter()
    # Copy-on-write: torch warns about read-only arrays; pages are shared until written.
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        batch_size, seq_len, num_batches = struct.unpack_from("<IIQ", mm, 12)
        raw = batch_size * seq_len * 4
        slot = -(-raw // 4096) * 4096
        for b in np.random.default_rng(0).permutation(num_batches).tolist():
            offset = HEADER + b * slot
            array = np.frombuffer(mm, dtype=np.uint32, count=raw // 4, offset=offset)
            array = array.reshape(batch_size, seq_len)
            if int64:
                array = array.astype(np.int64)
            elif copy:
                array = array.copy()
            torch.from_numpy(array)
            del array
    return time.perf_counter() - start


def time_preadv(path: Path, int64: bool) -> float:
    """The same batches as :func:`time_mmap` read with ``os.preadv`` into fresh buffers."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        batch_size, seq_len, num_batches = struct.unpack("<IIQ", os.pread(fd, 16, 12))
        raw = batch_size * seq_len * 4
        slot = -(-raw // 4096) * 4096
        for b in np.random.default_rng(0).permutation(num_batches).tolist():
            array = np.empty((batch_size, seq_len), dtype=np.uint32)
            os.preadv(fd, [memoryview(array).cast("B")], HEADER + b * slot)
            torch.from_numpy(array.astype(np.int64) if int64 else array)
    return time.perf_counter() - start


def count_requests(folder: Path, size_mb: int) -> dict[str, float]:
    """Requests per batch over one epoch of a ``size_mb`` file at the HTTP test server."""
    records = size_mb * 2**20 // (SEQ_LEN * 4)
    data = np.random.default_rng(1).integers(0, 50_257, (records, SEQ_LEN), dtype=np.uint32)
    ab.write_llmbatch(str(folder / "http.batch"), data, batch_size=BATCH_SIZE)
    out = {}
    with http_server(folder) as server:
        dataset = ab.open_dataset(f"{server.url}/http.batch")
        for label, kwargs in [
            ("block", {"shuffle": "block"}),
            ("block gap 0", {"shuffle": "block", "coalesce_gap": 0}),
            ("global", {"shuffle": True}),
            ("global gap 0", {"shuffle": True, "coalesce_gap": 0}),
            ("batch", {"shuffle": "batch"}),
        ]:
            before = server.requests
            with ab.Loader(dataset, batch_size=BATCH_SIZE, seed=0, **kwargs) as loader:
                batches = sum(1 for _ in loader)
            out[label] = (server.requests - before) / batches
    return out


def planned_reads(dataset: ab.Dataset, **kwargs: object) -> float:
    """Reads per batch the engine plans over one epoch (counted at the source's planner),
    with the remote stores' coalescing gap: the requests it would send to S3 or HTTP."""
    counted = [0]
    plan = LLMBatchRecords.plan

    def counting(self: LLMBatchRecords, ids: np.ndarray, gap: int) -> ReadPlan:  # type: ignore[type-arg]
        out = plan(self, ids, gap)
        counted[0] += out.num_reads
        return out

    LLMBatchRecords.plan = counting  # type: ignore[method-assign]
    # Without mappings the local store declines to copy windows itself, and the engine plans
    # byte ranges as for any remote store.
    planned = ab.open_dataset(dataset.shard_urls[0], storage_options={"mmap": False})
    try:
        with ab.Loader(
            planned, batch_size=BATCH_SIZE, seed=0, coalesce_gap=REMOTE_COALESCE_GAP, **kwargs
        ) as loader:
            batches = sum(1 for _ in loader)
    finally:
        LLMBatchRecords.plan = plan  # type: ignore[method-assign]
    return counted[0] / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=256)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--int64", action="store_true", help="convert to int64 everywhere")
    parser.add_argument("--http-size-mb", type=positive, default=16)
    args = parser.parse_args()
    dtype = torch.int64 if args.int64 else None
    with tempfile.TemporaryDirectory(prefix="bench-llmbatch-") as folder:
        root = Path(folder)
        batch, tokens, path = write_data(root, args.size_mb)
        num_tokens = batch.manifest.metadata["llmbatch"]["num_batches"] * BATCH_SIZE * SEQ_LEN
        # The two formats give the same batches under one global shuffle.
        with (
            ab.Loader(batch, batch_size=BATCH_SIZE, shuffle=True) as a,
            ab.Loader(tokens, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, shuffle=True) as b,
        ):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x["tokens"], y["tokens"])
        runs: dict[str, Callable[[], float]] = {
            "tokens global": lambda: time_loader(tokens, dtype, seq_len=SEQ_LEN, shuffle=True),
            "llmbatch global": lambda: time_loader(batch, dtype, shuffle=True),
            "llmbatch block": lambda: time_loader(batch, dtype, shuffle="block"),
            "llmbatch batch": lambda: time_loader(batch, dtype, shuffle="batch"),
            "mmap view": lambda: time_mmap(path, copy=False, int64=args.int64),
            "mmap copy": lambda: time_mmap(path, copy=True, int64=args.int64),
            "preadv copy": lambda: time_preadv(path, int64=args.int64),
        }
        if args.int64:
            del runs["mmap view"]  # the conversion copies anyway
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(runs[name]())
        planned = {
            "block": planned_reads(batch, shuffle="block"),
            "global": planned_reads(batch, shuffle=True),
            "batch": planned_reads(batch, shuffle="batch"),
        }
        http_folder = root / "http"
        http_folder.mkdir()
        requests = count_requests(http_folder, args.http_size_mb)

    print(f"# bench_llmbatch {datetime.date.today()} commit {git_revision()}")
    print(f"# {platform.machine()} Python {platform.python_version()} torch {torch.__version__}")
    print(
        f"# {num_tokens / 1e6:.0f} M uint32 tokens, seq_len {SEQ_LEN}, batch {BATCH_SIZE},"
        f" {'int64' if args.int64 else 'stored uint32'}, {args.rounds} rounds, medians"
    )
    # Paired ratios (above 1: faster) against the baseline and the layout's own reader: its
    # view (no copy), and its copy (a batch that owns its memory, as the Loader's do).
    against = [name for name in ("tokens global", "mmap view", "mmap copy") if name in times]
    print(f"{'line':<18}{'M tokens/s':>12}" + "".join(f"{'vs ' + a:>18}" for a in against))
    for name, values in times.items():
        rate = num_tokens / statistics.median(values) / 1e6
        ratios = "".join(f"{paired_ratio(times[a], values):>17.2f}x" for a in against)
        print(f"{name:<18}{rate:>12.0f}{ratios}")
    print(f"# planned reads per batch, {args.size_mb} MiB file, coalesce_gap 128 KiB, one epoch")
    for name, value in planned.items():
        print(f"{'llmbatch ' + name:<24}{value:>8.3f}")
    print(f"# HTTP Range server, {args.http_size_mb} MiB file: requests per batch, one epoch")
    for name, value in requests.items():
        print(f"{'llmbatch ' + name:<24}{value:>8.3f}")


if __name__ == "__main__":
    main()
