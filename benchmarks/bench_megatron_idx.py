"""Opening a large Megatron ``.idx``: the whole index read at open (the reader before pages)
beside its header and page summary, then the first shuffled batch.

A synthetic Megatron dataset of ``--documents`` documents (one sequence each, 1 to 400
uint16 tokens, about 200: a 10^7-document ``.idx`` is 200 MB; the ``.bin`` is a sparse file,
since the tokens read are the same for both lines) is written once to a cache folder. Each
round, in rotating order, each line opens it through asyncbatch's local store (counting the
bytes the open reads; the peak of Python memory it allocates, by ``tracemalloc``, is taken in
an untimed open before, since tracing slows every allocation) and
reads the first batch of ``ab.Loader(ds, batch_size=16, seq_len=2048, shuffle=True)``
(``statistics().bytes_fetched``, prefetch included):

* ``whole``: the reader before pages: the whole ``.idx`` in one range read, every array
  parsed and checked, the offsets of all sequences in memory, read as the ``documents``
  format;
* ``paged``: ``ab.open_dataset`` (the header, one pointer a page of 4096 sequences), pages
  fetched by the batches.

The OS page cache holds the files after the first round (both lines alike): these are warm
figures, bound by CPU and memory, not by the disk. Prints medians and the paired ratios of
``whole`` to ``paged``.

Usage: ``.venv/bin/python benchmarks/bench_megatron_idx.py [--documents 10000000]
[--rounds 3] [--lines whole paged]`` (``--lines paged`` alone for sizes whose whole index
would not fit in memory)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import git_revision, paired_ratio, positive

import asyncbatch as ab
from asyncbatch._dataset import Dataset
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch.formats._megatron import HEADER, open_megatron
from asyncbatch.formats._npy import object_infos
from asyncbatch.stores import open_store
from asyncbatch.stores._base import Buffer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from make_megatron import write_megatron_lengths  # noqa: E402

LINES = ("whole", "paged")


class Counting:
    """A store's ``read_ranges`` and ``size``, counting the bytes read."""

    def __init__(self, store: Any) -> None:
        self.store, self.bytes, self.reads = store, 0, 0

    async def size(self, url: str) -> int:
        return int(await self.store.size(url))

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        self.bytes += sum(e - s for s, e in zip(starts, ends, strict=True))
        self.reads += len(starts)
        await self.store.read_ranges(url, starts=starts, ends=ends, buffers=buffers)


async def open_whole(prefix: Path, store: Counting) -> Dataset:
    """The reader before pages: the whole ``.idx`` read and checked at open, the offsets of
    all sequences in memory, a ``documents`` dataset."""
    url = f"{prefix}.idx"
    idx, _ = await object_infos(store, [url, f"{prefix}.bin"])  # type: ignore[arg-type]
    size = idx.size
    index = np.empty(size, dtype=np.uint8)
    await store.read_ranges(url, starts=[0], ends=[size], buffers=[memoryview(index)])  # type: ignore[arg-type]
    _, _, _, sequences, entries = HEADER.unpack(index[: HEADER.size].tobytes())
    at = HEADER.size
    lengths = index[at : at + 4 * sequences].view("<i4").astype(np.int64)
    pointers = index[at + 4 * sequences : at + 12 * sequences].view("<i8").astype(np.int64)
    documents = index[at + 12 * sequences : at + 12 * sequences + 8 * entries].view("<i8")
    ends = np.cumsum(lengths * 2)
    if lengths.min() < 0 or (pointers != np.concatenate([[0], ends[:-1]])).any():
        raise ValueError("bad index")
    if documents[0] != 0 or documents[-1] != sequences or (np.diff(documents) < 0).any():
        raise ValueError("bad document indices")
    offsets = np.concatenate([[0], ends]) // 2
    total = int(offsets[-1])
    shard = ShardInfo(f"{prefix.name}.bin", total * 2, total)
    manifest = Manifest("documents", np.dtype(np.uint16), (shard,), {})
    return Dataset(str(prefix.parent), manifest, {}, {"document_offsets": offsets})


async def open_paged(prefix: Path, store: Counting) -> Dataset:
    return await open_megatron(str(prefix), store, {}, {})  # type: ignore[arg-type]


def measure(line: str, prefix: Path) -> dict[str, float]:
    """Open (timed, its bytes and peak Python memory), then the first shuffled batch."""
    opener = open_whole if line == "whole" else open_paged

    async def run() -> tuple[Dataset, Counting]:
        store = Counting(open_store(str(prefix)))
        try:
            return await opener(prefix, store), store
        finally:
            await store.store.close()

    # Memory first, in an open of its own: tracemalloc slows every allocation.
    tracemalloc.start()
    asyncio.run(run())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    start = time.perf_counter()
    dataset, store = asyncio.run(run())
    opened = time.perf_counter()
    with ab.Loader(dataset, batch_size=16, seq_len=2048, shuffle=True, seed=0) as loader:
        next(iter(loader))
        first = time.perf_counter()
        fetched = loader.statistics().bytes_fetched
    return {
        "open_s": opened - start,
        "first_batch_s": first - opened,
        "open_bytes": store.bytes,
        "open_reads": store.reads,
        "open_peak_mib": peak / 2**20,
        "batch_bytes": fetched,
    }


def ensure_dataset(count: int) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache) / "asyncbatch" / f"bench-megatron-idx-{count}"
    prefix = root / "corpus"
    if not Path(f"{prefix}.idx").exists():
        print(f"writing {count} documents to {prefix}.bin/.idx", file=sys.stderr)
        root.mkdir(parents=True, exist_ok=True)
        lengths = np.random.default_rng(0).integers(1, 401, count)
        write_megatron_lengths(prefix, lengths, sparse=True)
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=positive, default=10_000_000)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument(
        "--lines", nargs="+", choices=LINES, default=list(LINES), help="default: both"
    )
    args = parser.parse_args()
    lines = tuple(args.lines)
    prefix = ensure_dataset(args.documents)
    idx_bytes = Path(f"{prefix}.idx").stat().st_size
    print(
        f"# bench_megatron_idx at {git_revision()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
        f", {platform.machine()} {os.cpu_count()} cores, {args.documents:,} documents,"
        f" .idx {idx_bytes:,} bytes"
    )
    measure("paged", prefix)  # untimed: the first Loader of the process starts its threads
    results: dict[str, list[dict[str, float]]] = {line: [] for line in lines}
    for round_ in range(args.rounds):
        order = lines if round_ % 2 == 0 else lines[::-1]
        for line in order:
            got = measure(line, prefix)
            results[line].append(got)
            print(
                f"round {round_} {line:6s} open {got['open_s']:.3f} s"
                f" ({got['open_bytes']:,.0f} B in {got['open_reads']:.0f} reads, peak"
                f" {got['open_peak_mib']:.1f} MiB), first batch {got['first_batch_s']:.3f} s"
                f" ({got['batch_bytes']:,.0f} B fetched)",
                flush=True,
            )
    print("\nline    open s  open bytes      open peak MiB  first batch s  batch bytes")
    for line in lines:
        rows = results[line]

        def median(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        print(
            f"{line:6s}  {median('open_s'):6.3f}  {median('open_bytes'):14,.0f}"
            f"  {median('open_peak_mib'):13.1f}  {median('first_batch_s'):13.3f}"
            f"  {median('batch_bytes'):,.0f}"
        )
    for key in ("open_s", "first_batch_s", "open_bytes") if len(lines) == 2 else ():
        ratio = paired_ratio([r[key] for r in results["whole"]], [r[key] for r in results["paged"]])
        print(f"whole / paged, {key}: {ratio:.1f}x (paired over {args.rounds} rounds)")


if __name__ == "__main__":
    main()
