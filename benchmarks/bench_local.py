"""Local-file throughput of ``asyncbatch.Loader`` beside a preadv ceiling and a DataLoader baseline.

One run on a local token dataset (uint16, >= 1 GB by default, created once in a cache folder
outside the repository), ``seq_len`` 2048, batch 16, global shuffle, page cache warm. Every
approach reads the same windows: the sample ids of the first ``--batches`` batches of epoch 0,
as given by :class:`asyncbatch.sampling._order.EpochOrder`.

Measured, in interleaved rounds (the median is reported; the machine is shared and noisy):

* ``loader uint16`` / ``loader int64``: ``ab.Loader`` with the stored dtype, and with
  ``dtype=torch.int64``; timed from constructing the Loader to the last batch in hand;
* ``loader pread``: ``loader uint16`` with ``storage_options={"mmap": False}`` (``pread``
  instead of copies out of the files' mappings);
* ``ceiling preadv``: the same windows read with ``os.preadv`` into one preallocated batch
  buffer in a tight Python loop (files opened once, offsets computed beforehand, no checks);
* ``DataLoader w0`` / ``w2``: ``torch.utils.data.DataLoader`` over a map-style dataset of
  ``np.memmap`` shards, batch 16, ``num_workers`` 0 and 2 (worker start-up included), fed
  the loader's shuffled order as its sampler;
* ``loader infinite`` / ``loader loops``: steady state across epochs, the figure training
  sees: one ``infinite=True`` Loader timed over ``--batches`` batches after a whole untimed
  epoch, and one Loader whose second ``for`` loop (a new run of the same loader) is timed
  after a first, untimed one;
* ``litData w0``: litData's ``StreamingDataset`` with ``TokensLoader(block_size=2048)`` and
  ``shuffle=True`` over the same tokens written with ``litdata.optimize`` (64 MiB chunks, once,
  beside the dataset), ``StreamingDataLoader(batch_size=16, num_workers=0)``; skipped when
  litdata is not installed (``scripts/bench-setup`` installs it);
* CPU seconds per GB delivered: the process's CPU time (all its threads) over the bytes of
  the batches, for every line measured in this process (all but ``DataLoader w2``);
* the Loader's time to first batch and the consumer-thread time of ``next()`` when batches
  are already waiting in the prefetch queue.

Usage: ``.venv/bin/python benchmarks/bench_local.py [--size-gb 1] [--rounds 5] [--batches 16384]``
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from common import git_revision, positive, write_rates
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

import asyncbatch as ab
from asyncbatch.sampling._order import EpochOrder

SEQ_LEN = 2048
BATCH_SIZE = 16
PREFETCH = None  # the Loader default: as many batches as fit in 64 MiB
MAX_INFLIGHT = 64
SEED = 0
VOCAB = 50_257
SHARD_SIZE = 64 * 2**20
CHUNK_TOKENS = 16 * 2**20

IdArray = npt.NDArray[np.int64]


def default_data_dir(size_gb: float) -> Path:
    """``~/.cache/asyncbatch/bench-local-<size>g`` (``$XDG_CACHE_HOME`` respected)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "asyncbatch" / f"bench-local-{size_gb:g}g"


def token_chunks(total: int, seed: int = 0) -> Iterator[npt.NDArray[np.uint16]]:
    """``total`` random uint16 tokens below ``VOCAB``, in chunks, with a progress line."""
    rng = np.random.default_rng(seed)
    for start in range(0, total, CHUNK_TOKENS):
        done, size = start * 2 / 1e9, total * 2 / 1e9
        print(f"\r  writing {done:.2f} / {size:.2f} GB", end="", file=sys.stderr)
        yield rng.integers(0, VOCAB, min(CHUNK_TOKENS, total - start), dtype=np.uint16)
    print(file=sys.stderr)


def ensure_dataset(root: Path, size_gb: float) -> ab.Dataset:
    """Open the cached dataset at ``root``, writing it first if its manifest is missing."""
    tokens = int(size_gb * 2**30) // 2
    if not (root / "manifest.json").exists():
        print(f"creating {tokens * 2 / 1e9:.2f} GB of uint16 tokens in {root}", file=sys.stderr)
        ab.write_tokens(str(root), token_chunks(tokens), dtype=np.uint16, shard_size=SHARD_SIZE)
    dataset = ab.open_dataset(str(root))
    if dataset.manifest.total_elements != tokens:
        raise SystemExit(
            f"{root} holds {dataset.manifest.total_elements} tokens, not {tokens}:"
            " pass --data-dir, or delete it to re-create it"
        )
    return dataset


def warm_page_cache(dataset: ab.Dataset) -> tuple[int, float]:
    """Read every shard once, sequentially; returns (bytes, seconds)."""
    buffer = bytearray(16 * 2**20)
    total, start = 0, time.perf_counter()
    for url in dataset.shard_urls:
        with open(url, "rb", buffering=0) as file:
            while got := file.readinto(buffer):
                total += got
    return total, time.perf_counter() - start


def batch_ids(dataset: ab.Dataset, batches: int) -> IdArray:
    """Sample ids of batches ``[0, batches)`` of epoch 0, shape ``(batches, BATCH_SIZE)``."""
    num_windows = dataset.manifest.total_elements // SEQ_LEN
    order = EpochOrder(num_windows, BATCH_SIZE, shuffle=True, seed=SEED)
    return order.sample_ids(0, 0, batches).reshape(batches, BATCH_SIZE)


def bench_loader(dataset: ab.Dataset, dtype: torch.dtype | None = None) -> ab.Loader:
    """The Loader every line of this script measures (global shuffle, the script's settings)."""
    return ab.Loader(
        dataset,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        shuffle=True,
        seed=SEED,
        prefetch=PREFETCH,
        max_inflight=MAX_INFLIGHT,
        dtype=dtype,
    )


#: Wall and process CPU seconds of one measurement (CPU: every thread of this process).
Timing = tuple[float, float]


def start_clock() -> Callable[[], Timing]:
    """A function giving the (wall, process CPU) seconds since this call."""
    wall, cpu = time.perf_counter(), time.process_time()
    return lambda: (time.perf_counter() - wall, time.process_time() - cpu)


def take(batches: Iterable[object], count: int, what: str) -> None:
    """Take ``count`` items of ``batches``; an error if there are fewer."""
    done = 0
    for done, _batch in enumerate(batches, 1):
        if done == count:
            return
    raise RuntimeError(f"{what} ended after {done} of {count} batches")


def time_loader(dataset: ab.Dataset, batches: int, dtype: torch.dtype | None) -> Timing:
    """From constructing a Loader to holding its ``batches``-th batch."""
    clock = start_clock()
    with bench_loader(dataset, dtype) as loader:
        take(loader, batches, "the loader")
        return clock()


def time_loader_infinite(dataset: ab.Dataset, batches: int) -> Timing:
    """``batches`` batches of an ``infinite=True`` Loader after one whole untimed epoch."""
    with ab.Loader(
        dataset,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        shuffle=True,
        seed=SEED,
        prefetch=PREFETCH,
        max_inflight=MAX_INFLIGHT,
        infinite=True,
    ) as loader:
        iterator = iter(loader)
        take(iterator, len(loader), "the loader")
        clock = start_clock()
        take(iterator, batches, "the loader")
        return clock()


def time_loader_loops(dataset: ab.Dataset, batches: int) -> Timing:
    """The second ``for`` loop over one Loader (a new run, epoch 1), after an untimed first."""
    with bench_loader(dataset) as loader:
        for _batch in loader:
            pass
        clock = start_clock()
        take(loader, batches, "the loader's second epoch")
        return clock()


def loader_latency(dataset: ab.Dataset, samples: int, settle: float) -> tuple[float, list[float]]:
    """Time to first batch (s) and consumer-side ``next()`` times (s) with a full queue."""
    start = time.perf_counter()
    with bench_loader(dataset) as loader:
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter() - start
        time.sleep(settle)  # let the engine fill the prefetch queue
        stats = loader.statistics()
        ready = stats.ready if stats is not None else 0
        times = []
        clock = time.perf_counter_ns
        for _ in range(min(samples, ready)):
            before = clock()
            next(iterator)
            times.append((clock() - before) / 1e9)
    return first, times


def ceiling_plan(
    dataset: ab.Dataset, ids: IdArray, rows: list[memoryview], fds: list[int]
) -> list[list[tuple[int, memoryview, int]]]:
    """Per batch, the ``(fd, destination, offset)`` reads of its windows (split at shard ends)."""
    shard_map = dataset.shard_map
    ends = shard_map.ends.tolist()
    starts = shard_map.starts.tolist()
    itemsize = shard_map.itemsize
    plan = []
    for batch in ids.tolist():
        reads = []
        for row, sample in zip(rows, batch, strict=True):
            base = sample * SEQ_LEN
            first, last = base, base + SEQ_LEN
            while first < last:
                shard = bisect.bisect_right(ends, first)
                stop = min(last, ends[shard])
                dest = row[(first - base) * itemsize : (stop - base) * itemsize]
                reads.append((fds[shard], dest, (first - starts[shard]) * itemsize))
                first = stop
        plan.append(reads)
    return plan


def time_ceiling(dataset: ab.Dataset, ids: IdArray, check: npt.NDArray[np.uint16] | None) -> Timing:
    """Time to read the windows of ``ids`` with ``os.preadv``, one reused batch buffer."""
    fds = [os.open(url, os.O_RDONLY | os.O_CLOEXEC) for url in dataset.shard_urls]
    try:
        buffer = np.empty((BATCH_SIZE, SEQ_LEN), dtype=dataset.manifest.dtype)
        rows = [memoryview(row).cast("B") for row in buffer]
        plan = ceiling_plan(dataset, ids, rows, fds)
        preadv = os.preadv
        clock = start_clock()
        for reads in plan:
            for fd, dest, offset in reads:
                preadv(fd, (dest,), offset)
        elapsed = clock()
        if check is not None:  # the last batch read must be the reference
            np.testing.assert_array_equal(buffer, check)
        return elapsed
    finally:
        for fd in fds:
            os.close(fd)


class MemmapWindows(TorchDataset[torch.Tensor]):
    """Map-style dataset: sample ``i`` is tokens ``[i*L, (i+1)*L)`` of memmapped shards."""

    def __init__(self, paths: list[str], counts: list[int], dtype: np.dtype[np.generic]) -> None:
        self.paths = paths
        self.dtype = dtype
        self.ends = np.cumsum(counts).tolist()
        self.starts = [end - count for end, count in zip(self.ends, counts, strict=True)]
        self.length = self.ends[-1] // SEQ_LEN if counts else 0
        self._maps: list[np.memmap] | None = None  # opened lazily, in each worker

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._maps is None:
            self._maps = [np.memmap(path, dtype=self.dtype, mode="r") for path in self.paths]
        first = index * SEQ_LEN
        shard = bisect.bisect_right(self.ends, first)
        offset = first - self.starts[shard]
        if first + SEQ_LEN <= self.ends[shard]:
            return torch.from_numpy(np.array(self._maps[shard][offset : offset + SEQ_LEN]))
        head = self._maps[shard][offset:]
        tail = self._maps[shard + 1][: SEQ_LEN - head.size]
        return torch.from_numpy(np.concatenate([head, tail]))


def time_dataloader(dataset: ab.Dataset, ids: IdArray, workers: int) -> Timing:
    """Time for a DataLoader (``workers`` processes) to yield the batches of ``ids`` (CPU: of
    this process only)."""
    windows = MemmapWindows(
        dataset.shard_urls,
        [shard.elements for shard in dataset.manifest.shards],
        dataset.manifest.dtype,
    )
    batches = ids.shape[0]
    clock = start_clock()
    loader = DataLoader(
        windows,
        batch_size=BATCH_SIZE,
        sampler=ids.reshape(-1).tolist(),
        num_workers=workers,
        drop_last=True,
    )
    iterator = iter(loader)
    try:
        take(iterator, batches, "the DataLoader")
        return clock()
    finally:
        del iterator  # shuts the workers down (not timed)


def litdata_dir(dataset: ab.Dataset, root: Path) -> Path | None:
    """The dataset's tokens in litData's format beside ``root`` (written once, 64 MiB chunks);
    None when litdata is not installed."""
    try:
        from litdata import TokensLoader, optimize
    except ImportError:
        return None
    folder = root.parent / f"{root.name}-litdata"
    if not (folder / "index.json").exists():
        print(f"writing the tokens in litData's format to {folder}", file=sys.stderr)
        shards = [
            np.memmap(url, dtype=dataset.manifest.dtype, mode="r") for url in dataset.shard_urls
        ]
        optimize(
            fn=functools.partial(_shard_items, shards),
            inputs=list(range(len(shards))),
            output_dir=str(folder),
            chunk_size=SHARD_SIZE // 2,
            item_loader=TokensLoader(),
            num_workers=1,
        )
    return folder


def _shard_items(shards: list[np.memmap], index: int) -> Iterator[npt.NDArray[np.uint16]]:
    """Shard ``index``'s tokens as items of at most ``CHUNK_TOKENS`` (never split by litData)."""
    shard = shards[index]
    for start in range(0, shard.size, CHUNK_TOKENS):
        yield np.array(shard[start : start + CHUNK_TOKENS])


def time_litdata(folder: Path, batches: int) -> Timing:
    """litData's TokensLoader over ``folder`` (global shuffle, no workers), to the
    ``batches``-th batch, construction included."""
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    clock = start_clock()
    windows = StreamingDataset(
        str(folder), item_loader=TokensLoader(block_size=SEQ_LEN), shuffle=True, seed=SEED
    )
    loader = StreamingDataLoader(windows, batch_size=BATCH_SIZE, num_workers=0, drop_last=True)
    take(loader, batches, "litData")
    return clock()


def reference_batch(dataset: ab.Dataset, ids: IdArray) -> npt.NDArray[np.uint16]:
    """The last batch of ``ids`` from the Loader, after checking its first batch's ids."""
    with ab.Loader(
        dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, shuffle=True, seed=SEED, prefetch=PREFETCH
    ) as loader:
        for index, batch in enumerate(loader):
            if not np.array_equal(batch.global_indexes, ids[index]):
                raise SystemExit(f"the Loader's batch {index} is not EpochOrder's: cannot compare")
            if index == ids.shape[0] - 1:
                return np.array(batch["tokens"].numpy())
    raise RuntimeError("the loader ended early")


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of the ratio of two figures measured side by side in each round."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def fmt_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:10.1f} M tok/s"


def main() -> None:
    """Parse options, prepare and warm the dataset, run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="dataset size in GiB")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the dataset is cached")
    parser.add_argument("--rounds", type=positive, default=5, help="interleaved rounds (median)")
    parser.add_argument("--batches", type=positive, default=16384, help="batches per measurement")
    parser.add_argument(
        "--worker-batches",
        type=positive,
        default=4096,
        help="batches per DataLoader measurement (the slowest ones)",
    )
    parser.add_argument("--latency-samples", type=positive, default=15, help="next() calls timed")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    root = args.data_dir or default_data_dir(args.size_gb)
    dataset = ensure_dataset(root, args.size_gb)
    num_batches = dataset.manifest.total_elements // SEQ_LEN // BATCH_SIZE
    batches = min(args.batches, num_batches)
    worker_batches = min(args.worker_batches, batches)
    ids = batch_ids(dataset, batches)
    tokens = BATCH_SIZE * SEQ_LEN

    nbytes, seconds = warm_page_cache(dataset)
    print(f"asyncbatch bench_local  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  git {git_revision()}  python {platform.python_version()}  torch {torch.__version__}")
    print(f"  numpy {np.__version__}  cpus {os.cpu_count()}  {platform.machine()}")
    print(
        f"  dataset {root}: {nbytes / 1e9:.2f} GB, {len(dataset.shard_urls)} shards,"
        f" {num_batches} batches/epoch; warm-up read {nbytes / seconds / 1e9:.1f} GB/s"
    )
    print(
        f"  seq_len {SEQ_LEN}, batch {BATCH_SIZE}, shuffle global, prefetch {PREFETCH},"
        f" max_inflight {MAX_INFLIGHT}; {batches} batches per measurement"
        f" ({worker_batches} for DataLoader), {args.rounds} rounds"
    )

    reference = reference_batch(dataset, ids)
    # The same files read with pread instead of copies out of their mappings.
    pread = ab.open_dataset(dataset.url, storage_options={"mmap": False})
    measures: dict[str, tuple[int, Callable[[], Timing]]] = {
        "ceiling preadv": (batches, lambda: time_ceiling(dataset, ids, reference)),
        "loader uint16": (batches, lambda: time_loader(dataset, batches, None)),
        "loader int64": (batches, lambda: time_loader(dataset, batches, torch.int64)),
        "loader pread": (batches, lambda: time_loader(pread, batches, None)),
        "loader infinite": (batches, lambda: time_loader_infinite(dataset, batches)),
        "loader loops": (batches, lambda: time_loader_loops(dataset, batches)),
        "DataLoader w0": (batches, lambda: time_dataloader(dataset, ids, 0)),
        "DataLoader w2": (
            worker_batches,
            lambda: time_dataloader(dataset, ids[:worker_batches], 2),
        ),
    }
    folder = litdata_dir(dataset, root)
    if folder is not None:
        measures["litData w0"] = (batches, lambda: time_litdata(folder, batches))
    else:
        print("  litData: not installed (scripts/bench-setup installs it): line skipped")
    #: Lines whose work runs partly in other processes: their CPU figure would be too low.
    other_processes = {"DataLoader w2"}
    rates: dict[str, list[float]] = {name: [] for name in measures}
    cpu_per_gb: dict[str, list[float]] = {name: [] for name in measures}
    first_batch: list[float] = []
    next_times: list[float] = []
    names = list(measures)
    batch_bytes = tokens * dataset.manifest.dtype.itemsize
    for round_ in range(args.rounds):
        shift = round_ % len(names)  # rotate the order so no approach always runs first
        for name in names[shift:] + names[:shift]:
            count, measure = measures[name]
            wall, cpu = measure()
            rates[name].append(count * tokens / wall)
            cpu_per_gb[name].append(cpu / (count * batch_bytes / 1e9))
        first, times = loader_latency(dataset, args.latency_samples, settle=0.5)
        first_batch.append(first)
        next_times.extend(times)
        print(
            f"  round {round_ + 1}: "
            + ", ".join(f"{name} {rates[name][-1] / 1e6:.0f}" for name in names)
            + " M tok/s",
            file=sys.stderr,
        )

    median = {name: statistics.median(values) for name, values in rates.items()}
    ceiling = median["ceiling preadv"]
    baseline_name = max(("DataLoader w0", "DataLoader w2"), key=median.__getitem__)
    baseline = median[baseline_name]
    print()
    print(
        f"{'approach':16} {'median':>16} {'min':>9} {'max':>9} {'us/batch':>9}"
        f" {'/ceiling':>9} {'/best baseline':>15} {'CPU s/GB':>9}"
    )
    for name in names:
        value, low, high = median[name], min(rates[name]) / 1e6, max(rates[name]) / 1e6
        cpu = "n/a" if name in other_processes else f"{statistics.median(cpu_per_gb[name]):.3f}"
        print(
            f"{name:16} {fmt_rate(value)} {low:9.1f} {high:9.1f}"
            f" {tokens / value * 1e6:9.1f} {value / ceiling:9.3f} {value / baseline:15.2f}"
            f" {cpu:>9}"
        )
    print(
        f"(best baseline: {baseline_name}; min/max in M tok/s over {args.rounds} rounds;"
        " CPU s/GB: process CPU seconds, all threads, per GB delivered as stored, median)"
    )
    print()
    print("paired ratios (median over rounds of the ratio within each round):")
    for name in (
        "loader uint16",
        "loader int64",
        "loader pread",
        "loader infinite",
        "loader loops",
    ):
        ceil = paired_ratio(rates[name], rates["ceiling preadv"])
        base = paired_ratio(rates[name], rates[baseline_name])
        print(f"  {name}: / ceiling {ceil:.3f}, / {baseline_name} {base:.2f}")
    int64 = paired_ratio(rates["loader int64"], rates["loader uint16"])
    print(f"  loader int64 / loader uint16 {int64:.3f}")
    for name in ("DataLoader w0", "litData w0"):
        if name in cpu_per_gb:
            cpu = paired_ratio(cpu_per_gb[name], cpu_per_gb["loader uint16"])
            print(f"  CPU per GB: {name} / loader uint16 {cpu:.2f}")
    print()
    print(
        f"loader time to first batch: median {statistics.median(first_batch) * 1e3:.1f} ms"
        f" (min {min(first_batch) * 1e3:.1f}, max {max(first_batch) * 1e3:.1f})"
    )
    if next_times:
        print(
            f"loader next() with batches ready: median {statistics.median(next_times) * 1e6:.1f} us"
            f" (min {min(next_times) * 1e6:.1f}, max {max(next_times) * 1e6:.1f},"
            f" {len(next_times)} calls)"
        )
    else:
        print("loader next() with batches ready: no batch was ready after the settle time")
    if args.json is not None:
        title = f"Local files, page cache warm: {nbytes / 2**30:.2f} GiB, {BATCH_SIZE} x {SEQ_LEN}"
        write_rates(
            args.json, "bench_local", rates, unit="tokens/s", baseline=baseline_name, title=title
        )


if __name__ == "__main__":
    main()
