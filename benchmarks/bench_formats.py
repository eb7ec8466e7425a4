"""Tokens/s and read requests per batch of each format, beside the tokens format in the same run.

A table over formats: each format has one function below (``documents_cases``, ...) that
writes its dataset once (from the same random token stream) and returns the loaders to time;
``FORMATS`` lists them. The tokens format (``tokens_cases``) is the baseline of every ratio.

Every case is timed in interleaved rounds (the order rotated each round; the machine is
shared and noisy) from constructing its ``ab.Loader`` to holding its ``--batches``-th batch
(default: the whole epoch locally, 64 batches on S3). Reported: median tokens/s (tokens
actually delivered: a document batch counts its documents' lengths), reads per batch (the
ranges the engine asked the store for, counted by wrapping ``Reader.read_plan``: one GET each
on S3 or HTTP, one ``pread`` or copy locally; plus the windows the local store copies out of
its mappings itself, counted by wrapping ``LocalStore.read_windows``: one copy each), bytes
fetched per useful byte (merged reads fetch the gaps between neighbours too; a copied window
fetches its own bytes), and the median over rounds of the ratio to the tokens baseline of the
same round.

Data: ``--size-mb`` of uint16 tokens (random below 50257) cut into documents of geometric
lengths (mean ``--mean-doc`` tokens), written with ``ab.write_tokens`` and
``ab.write_documents`` (shards of 64 MiB), and as an LLMBATCH file, a metadata stream
(``numpy`` codec), ``.npy`` files and a Megatron ``.bin``/``.idx`` (``--formats`` picks),
to ``~/.cache/asyncbatch/bench-formats-<size>m`` (reused), or with ``--s3`` to a fresh
s3rver on 127.0.0.1 (see benchmarks/s3rver.py).

Usage: ``.venv/bin/python benchmarks/bench_formats.py [--size-mb 256] [--rounds 5] [--s3]``
``[--formats tokens documents llmbatch metadata npy megatron]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from common import REPO, git_revision, paired_ratio, positive, write_rates

import asyncbatch as ab
from asyncbatch._batch import Jagged
from asyncbatch._engine import Engine, Reader
from asyncbatch._layout import ReadPlan
from asyncbatch._portal import run_sync
from asyncbatch.stores._local import LocalStore
from asyncbatch.stores._registry import open_store

sys.path.insert(0, str(REPO / "tests"))
from make_megatron import write_megatron  # noqa: E402

SEQ_LEN = 2048
BATCH_SIZE = 16
VOCAB = 50_257
SHARD_SIZE = 64 * 2**20
SEED = 0


@dataclass(frozen=True)
class Place:
    """Where the benchmark datasets go: a root URL and its storage options."""

    root: str
    options: dict[str, Any]
    local: bool

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Case:
    """One line of the table: a loader to time (``make()``), under ``name``."""

    name: str
    make: Callable[[], ab.Loader]


class ReadCounter:
    """Counts what every engine of this process reads: ranges and bytes (wrapping
    ``Reader.read_plan``), windows the local store copies itself (wrapping
    ``LocalStore.read_windows``: each window one copy of its bytes, none fetched beside them;
    a call that declines is planned as ranges and counted there), and the batches they were
    for (wrapping ``Engine._read_group``), prefetched ones included, so that ratios of the
    two hold whatever the run's length. Install it before any store is opened: store layers
    bind ``read_windows`` when they are built."""

    def __init__(self) -> None:
        self.reads = self.fetched = self.useful = self.batches = 0
        read_plan, read_group = Reader.read_plan, Engine._read_group
        read_windows = LocalStore.read_windows

        async def counted_plan(
            reader: Reader, plan: ReadPlan, convert: Any = None
        ) -> npt.NDArray[np.uint8]:
            self.reads += plan.num_reads
            self.fetched += int((plan.read_end - plan.read_start).sum())
            self.useful += plan.nbytes
            return await read_plan(reader, plan, convert)

        async def counted_windows(
            store: LocalStore,
            urls: Sequence[str],
            ends: npt.NDArray[np.int64],
            offsets: npt.NDArray[np.int64],
            itemsize: int,
            starts: npt.NDArray[np.int64],
            window: int,
            dest: npt.NDArray[np.uint8],
            convert: Any = None,
        ) -> bool:
            copied = await read_windows(
                store, urls, ends, offsets, itemsize, starts, window, dest, convert
            )
            if copied:
                nbytes = int(starts.size) * window * itemsize
                self.reads += int(starts.size)
                self.fetched += nbytes
                self.useful += nbytes
            return copied

        async def counted_group(engine: Engine, *args: Any) -> Any:
            # The group's batches are its one range argument, wherever the signature puts it.
            self.batches += sum(len(arg) for arg in args if isinstance(arg, range))
            return await read_group(engine, *args)

        Reader.read_plan = counted_plan  # type: ignore[method-assign]
        LocalStore.read_windows = counted_windows  # type: ignore[method-assign]
        Engine._read_group = counted_group  # type: ignore[method-assign]

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.reads, self.fetched, self.useful, self.batches


def stream(tokens: int, seed: int = SEED) -> npt.NDArray[np.uint16]:
    return np.random.default_rng(seed).integers(0, VOCAB, tokens, dtype=np.uint16)


def document_lengths(total: int, mean: int, seed: int = SEED) -> npt.NDArray[np.int64]:
    """Geometric lengths (at least 1) of mean ``mean`` that sum to exactly ``total``."""
    rng = np.random.default_rng(seed + 1)
    lengths = rng.geometric(1 / mean, total // mean * 2)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, total))
    out = lengths[: count + 1].astype(np.int64)
    out[-1] = total - (int(ends[count - 1]) if count else 0)
    return out[out > 0]


def open_or_write(
    place: Place, name: str, write: Callable[[str], object], last: str = "/manifest.json"
) -> ab.Dataset:
    """The dataset ``name`` at ``place``, written first unless a local copy is there (its
    URL plus ``last``, the file written last, exists)."""
    url = place.url(name)
    if not (place.local and Path(url + last).exists()):
        start = time.perf_counter()
        print(f"  writing {url}", file=sys.stderr, end="", flush=True)
        write(url)
        print(f" ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return ab.open_dataset(url, place.options)


def put(url: str, data: bytes, options: dict[str, Any]) -> None:
    """Write one object (a local file: written, then renamed into place)."""

    async def write() -> None:
        store = open_store(url, options)
        try:
            await store.write(url, data)
        finally:
            await store.close()

    run_sync(write())


def documents_of(
    tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> tuple[npt.NDArray[np.int64], Iterator[npt.NDArray[np.uint16]]]:
    """The documents' start offsets (and the end), and the documents, of the token stream."""
    lengths = document_lengths(tokens.size, args.mean_doc)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pairs = zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    return offsets, (tokens[start:stop] for start, stop in pairs)


def tokens_delivered(batch: ab.Batch) -> int:
    column = batch["tokens"]
    if isinstance(column, Jagged):
        return int(column.values.shape[0])
    return int(column.numel())


# ---------------------------------------------------------------------------------------------
# One function per format: write its dataset (from the shared token stream), return its cases


def tokens_cases(
    place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> list[Case]:
    """The baseline: token windows, global shuffle."""
    dataset = open_or_write(
        place,
        "tokens",
        lambda url: ab.write_tokens(
            url, tokens, shard_size=SHARD_SIZE, storage_options=place.options
        ),
    )
    common = dict(batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=SEED)
    return [Case("tokens (baseline)", lambda: ab.Loader(dataset, shuffle=True, **common))]


def documents_cases(
    place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> list[Case]:
    """Documents: packed windows (as the baseline's, plus boundaries), and documents as
    jagged samples (a batch of about as many tokens) with the global and block shuffles."""
    dataset = open_or_write(
        place,
        f"documents-mean{args.mean_doc}",
        lambda url: ab.write_documents(
            url, documents_of(tokens, args)[1], shard_size=SHARD_SIZE, storage_options=place.options
        ),
    )
    per_batch = max(1, BATCH_SIZE * SEQ_LEN // args.mean_doc)
    return [
        Case(
            "documents packed",
            lambda: ab.Loader(dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=SEED),
        ),
        Case(
            "documents packed, cu_seqlens only",
            lambda: ab.Loader(
                dataset,
                batch_size=BATCH_SIZE,
                seq_len=SEQ_LEN,
                seed=SEED,
                format_options={"token_ids": False},
            ),
        ),
        Case(
            f"documents jagged x{per_batch}",
            lambda: ab.Loader(dataset, batch_size=per_batch, shuffle=True, seed=SEED),
        ),
        Case(
            f"documents jagged x{per_batch} block",
            lambda: ab.Loader(dataset, batch_size=per_batch, shuffle="block", seed=SEED),
        ),
    ]


def llmbatch_cases(
    place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> list[Case]:
    """One LLMBATCH file of the baseline's windows in stream order (stored uint32, twice the
    bytes; batch 16), with the global shuffle and the block recipe (``shuffle="block"``, the
    file's default block: one file batch)."""
    records = tokens.size // SEQ_LEN // BATCH_SIZE * BATCH_SIZE
    dataset = open_or_write(
        place,
        "llmbatch.batch",
        lambda url: ab.write_llmbatch(
            url,
            tokens[: records * SEQ_LEN].reshape(records, SEQ_LEN),
            batch_size=BATCH_SIZE,
            shuffle=False,
            storage_options=place.options,
        ),
        last="",
    )
    return [
        Case(
            "llmbatch global",
            lambda: ab.Loader(dataset, batch_size=BATCH_SIZE, shuffle=True, seed=SEED),
        ),
        Case(
            "llmbatch block",
            lambda: ab.Loader(dataset, batch_size=BATCH_SIZE, shuffle="block", seed=SEED),
        ),
    ]


def metadata_cases(
    place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> list[Case]:
    """A metadata stream (u2 tokens, u4 ids; a document's start offset per document, numpy
    codec) in the baseline's windows, its metadata reads combined (the default) and not."""
    offsets = documents_of(tokens, args)[0]
    meta_ids = np.repeat(np.arange(offsets.size - 1, dtype=np.uint32), np.diff(offsets))
    dataset = open_or_write(
        place,
        f"metadata-numpy-mean{args.mean_doc}",
        lambda url: ab.write_metadata_stream(
            url,
            tokens=tokens,
            meta_ids=meta_ids,
            values=offsets[:-1].tolist(),
            codec="numpy",
            codec_options={"dtype": "<i8"},
            token_dtype="<u2",
            shard_size=SHARD_SIZE,
            storage_options=place.options,
        ),
    )
    common = dict(batch_size=BATCH_SIZE, seq_len=SEQ_LEN, shuffle=True, seed=SEED)
    return [
        Case("metadata numpy", lambda: ab.Loader(dataset, **common)),
        Case(
            "metadata numpy, per span",
            lambda: ab.Loader(dataset, format_options={"combine": False}, **common),
        ),
    ]


def npy_cases(place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace) -> list[Case]:
    """``.npy`` files of the baseline's shard size in one folder, read in place."""
    parts = np.array_split(tokens, -(-tokens.nbytes // SHARD_SIZE))

    def write(url: str) -> None:
        for i, part in enumerate(parts):
            buffer = io.BytesIO()
            np.save(buffer, part)
            put(f"{url}/part-{i:03d}.npy", buffer.getvalue(), place.options)

    dataset = open_or_write(place, "npy", write, last=f"/part-{len(parts) - 1:03d}.npy")
    common = dict(batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=SEED)
    return [Case(".npy", lambda: ab.Loader(dataset, shuffle=True, **common))]


def megatron_cases(
    place: Place, tokens: npt.NDArray[np.uint16], args: argparse.Namespace
) -> list[Case]:
    """A Megatron-LM ``prefix.bin``/``.idx`` of the documents (one sequence each, as
    tests/make_megatron.py writes it), opened as documents and packed into ``seq_len``."""

    def write(url: str) -> None:
        with tempfile.TemporaryDirectory(prefix="bench-formats-") as folder:
            write_megatron(Path(folder) / "m", [[doc] for doc in documents_of(tokens, args)[1]])
            for suffix in (".bin", ".idx"):
                put(url + suffix, (Path(folder) / f"m{suffix}").read_bytes(), place.options)

    dataset = open_or_write(place, f"megatron-mean{args.mean_doc}/m", write, last=".idx")
    return [
        Case(
            "megatron packed",
            lambda: ab.Loader(dataset, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=SEED),
        )
    ]


#: Formats measured, in order; the first is the baseline of the ratios.
FORMATS: dict[str, Callable[[Place, npt.NDArray[np.uint16], argparse.Namespace], list[Case]]] = {
    "tokens": tokens_cases,
    "documents": documents_cases,
    "llmbatch": llmbatch_cases,
    "metadata": metadata_cases,
    "npy": npy_cases,
    "megatron": megatron_cases,
}


# ---------------------------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: float
    tokens: int
    batches: int
    #: Per batch read (prefetched ones included): ranges, and bytes fetched per byte used.
    reads_per_batch: float
    excess: float


def time_case(case: Case, batches: int | None, counter: ReadCounter) -> Sample:
    """From constructing the loader to holding its ``batches``-th batch (or the epoch's last)."""
    before = counter.snapshot()
    delivered = done = 0
    start = time.perf_counter()
    with case.make() as loader:
        for batch in loader:
            delivered += tokens_delivered(batch)
            done += 1
            if done == batches:
                break
        seconds = time.perf_counter() - start
    reads, fetched, useful, batches_read = (
        now - then for now, then in zip(counter.snapshot(), before, strict=True)
    )
    return Sample(seconds, delivered, done, reads / batches_read, fetched / max(1, useful))


@contextlib.contextmanager
def place_for(args: argparse.Namespace) -> Iterator[Place]:
    if not args.s3:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = args.data_dir or Path(cache) / "asyncbatch" / f"bench-formats-{args.size_mb}m"
        yield Place(str(root), {}, True)
        return
    from s3rver import BUCKET, KEY, SECRET, default_s3rver_dir, ensure_s3rver, running_s3rver

    with running_s3rver(ensure_s3rver(default_s3rver_dir())) as endpoint:
        options = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
        yield Place(f"s3://{BUCKET}/formats", options, False)


def warm(place: Place, cases: list[Case]) -> None:
    """Read every local shard once, so that every case starts with a warm page cache."""
    if not place.local:
        return
    for path in Path(place.root).rglob("*.bin"):
        with open(path, "rb") as file:
            while file.read(64 * 2**20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=None, help="tokens, MiB (256; S3: 32)")
    parser.add_argument("--mean-doc", type=positive, default=600, help="mean document tokens")
    parser.add_argument("--rounds", type=positive, default=5, help="interleaved rounds (median)")
    parser.add_argument("--batches", type=positive, default=None, help="batches per measurement")
    parser.add_argument("--s3", action="store_true", help="read from a local s3rver instead")
    parser.add_argument("--data-dir", type=Path, default=None, help="local dataset folder")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.size_mb is None:
        args.size_mb = 32 if args.s3 else 256
    batches = args.batches or (64 if args.s3 else None)
    counter = ReadCounter()
    tokens = stream(args.size_mb * 2**20 // 2)
    with place_for(args) as place:
        print(f"asyncbatch bench_formats  {datetime.datetime.now().isoformat(timespec='seconds')}")
        print(
            f"  git {git_revision()}  python {platform.python_version()}  torch"
            f" {torch.__version__}  numpy {np.__version__}  cpus {os.cpu_count()}"
        )
        print(
            f"  {'s3rver ' + place.options['endpoint_url'] if args.s3 else 'local, warm'}:"
            f" {tokens.nbytes / 2**20:.0f} MiB uint16 tokens, mean document {args.mean_doc},"
            f" {args.rounds} rounds, {batches or 'all'} batches per measurement"
        )
        names = ["tokens", *(f for f in args.formats if f != "tokens")]
        cases = [case for name in names for case in FORMATS[name](place, tokens, args)]
        warm(place, cases)
        runs: dict[str, list[Sample]] = {case.name: [] for case in cases}
        for round_ in range(args.rounds):
            shift = round_ % len(cases)
            for case in cases[shift:] + cases[:shift]:
                runs[case.name].append(time_case(case, batches, counter))
        report(cases, runs)
    if args.json is not None:
        where = "S3 (s3rver)" if args.s3 else "local, warm"
        write_rates(
            args.json,
            "bench_formats",
            {name: [s.tokens / s.seconds for s in samples] for name, samples in runs.items()},
            unit="tokens/s",
            baseline=cases[0].name,
            title=f"Formats beside the tokens format, {where}: {args.size_mb} MiB",
        )


def report(cases: list[Case], runs: dict[str, list[Sample]]) -> None:
    baseline = [s.tokens / s.seconds for s in runs[cases[0].name]]
    print()
    print(
        f"  {'case':<34} {'M tok/s':>8} {'min-max':>13} {'reads/batch':>11} {'tok/batch':>9}"
        f" {'fetched/useful':>14} {'/ tokens':>8}"
    )
    for case in cases:
        samples = runs[case.name]
        rates = [s.tokens / s.seconds / 1e6 for s in samples]
        reads = statistics.median(s.reads_per_batch for s in samples)
        per_batch = statistics.median(s.tokens / s.batches for s in samples)
        excess = statistics.median(s.excess for s in samples)
        ratio = paired_ratio([r * 1e6 for r in rates], baseline)
        print(
            f"  {case.name:<34} {statistics.median(rates):>8.1f}"
            f" {min(rates):>6.1f}-{max(rates):<6.1f} {reads:>11.2f} {per_batch:>9.0f}"
            f" {excess:>14.2f} {ratio:>8.3f}"
        )


if __name__ == "__main__":
    main()
