"""Shuffles through a slow S3: asyncbatch exact and block shuffle beside litData's StreamingDataset.

The script starts s3rver (installed with npm into ``~/.cache/asyncbatch/s3rver`` if missing)
on 127.0.0.1 and, in front of it, ``delayproxy.py`` in a separate process, which holds every
request 10 ms (``--delay-ms``) before passing it on and counts the requests. It writes the
same random uint16 tokens (512 MiB by default) twice, straight to s3rver: with
``ab.write_tokens`` (64 MiB shards) and in litData's format (``litdata.optimize`` with
``TokensLoader``, 64 MiB chunks, written locally then uploaded). Every reader then goes
through the proxy, with ``seq_len`` 2048 and batch 16, in interleaved rounds (median):

* ``asyncbatch block``: ``ab.Loader(url, shuffle="block", block_size=B, window=W,
  max_inflight=N)``, skipped with a note when the installed asyncbatch has no block shuffle;
* ``asyncbatch exact``: the same with ``shuffle=True`` (an exact global shuffle);
* ``litData wK``: ``StreamingDataset(url, item_loader=TokensLoader(block_size=2048),
  shuffle=True)`` read by ``StreamingDataLoader(batch_size=16, num_workers=K)``, each run in
  a fresh process with an empty chunk cache (litData downloads whole chunks to a local cache
  and reads them from there).

Each line reads a fixed number of batches (default: one epoch; the exact shuffle, slow, reads
``--exact-batches``), timed from constructing the loader (dataset opening included) to
holding the last one; its time to first batch is measured in the same run.
Requests per sample and MB fetched come from the proxy's counters, read at the first and
last batch. The ratios are medians over rounds of the ratio within a round.

Usage: ``.venv/bin/python benchmarks/bench_remote.py [--size-mb 256] [--delay-ms 10]
[--rounds 3] [--batches <one epoch>] [--exact-batches 256] [--block-size 256] [--window 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import s3fs
import torch
from common import git_revision, paired_ratio, positive
from common import run_child as common_run_child
from delayproxy import Counts, Proxy, read_counts, running_proxy
from s3rver import (
    BUCKET,
    KEY,
    SECRET,
    default_s3rver_dir,
    ensure_s3rver,
    running_s3rver,
    s3rver_version,
    token_chunks,
    upload_folder,
)

import asyncbatch as ab
from asyncbatch._errors import ConfigError

SEQ_LEN = 2048
BATCH_SIZE = 16
SEED = 0
SHARD_SIZE = 64 * 2**20
#: Tokens per litData chunk: 64 MiB of uint16, as asyncbatch's shards.
LIT_CHUNK_TOKENS = SHARD_SIZE // 2
#: A run that takes longer than this is stopped (litData runs in a child process).
RUN_TIMEOUT = 600


@dataclass(frozen=True)
class Sample:
    """One run: seconds to the last batch and to the first, and the proxy's counts between."""

    seconds: float
    first_batch: float
    batches: int
    counts: Counts
    #: The proxy's counts from construction to the first batch in hand.
    first_counts: Counts

    @property
    def tokens_per_s(self) -> float:
        return self.batches * BATCH_SIZE * SEQ_LEN / self.seconds

    @property
    def steady_tokens_per_s(self) -> float:
        """The rate after the first batch: start-up left out."""
        return (self.batches - 1) * BATCH_SIZE * SEQ_LEN / (self.seconds - self.first_batch)

    @property
    def requests_per_sample(self) -> float:
        return self.counts.requests / (self.batches * BATCH_SIZE)

    @property
    def fetched_per_payload(self) -> float:
        """Bytes the proxy passed back / bytes of the batches delivered (uint16)."""
        return self.counts.down_bytes / (self.batches * BATCH_SIZE * SEQ_LEN * 2)


# ---------------------------------------------------------------------------------------------
# asyncbatch


def block_shuffle_error(url: str, options: dict[str, Any], args: argparse.Namespace) -> str | None:
    """Why the installed asyncbatch cannot run a block shuffle here, or None if it can."""
    try:
        loader = make_loader(url, options, args, "block")
    except (ConfigError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    loader.close()
    return None


def make_loader(
    url: str, options: dict[str, Any], args: argparse.Namespace, shuffle: str
) -> ab.Loader:
    """The Loader measured; ``shuffle`` is "exact" or "block"."""
    extra: dict[str, Any] = {}
    if shuffle == "block":
        extra = {"shuffle": "block", "block_size": args.block_size, "window": args.window}
    else:
        extra = {"shuffle": True}
    return ab.Loader(
        url,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        seed=SEED,
        max_inflight=args.inflight,
        storage_options=options,
        **extra,
    )


def time_asyncbatch(
    url: str,
    options: dict[str, Any],
    args: argparse.Namespace,
    proxy: Proxy,
    shuffle: str,
    batches: int,
) -> Sample:
    """From constructing a Loader (dataset opening included) to holding its last batch."""
    before = proxy.counts()
    start = time.perf_counter()
    first, first_counts = 0.0, Counts()
    with make_loader(url, options, args, shuffle) as loader:
        for done, batch in enumerate(loader, 1):
            if done == 1:
                first, first_counts = time.perf_counter() - start, proxy.counts() - before
                check_batch(batch["tokens"])
            if done == batches:
                seconds = time.perf_counter() - start
                return Sample(seconds, first, batches, proxy.counts() - before, first_counts)
    raise RuntimeError(f"the Loader ended after fewer than {batches} batches")


def check_batch(tokens: torch.Tensor) -> None:
    if tuple(tokens.shape) != (BATCH_SIZE, SEQ_LEN) or tokens.dtype != torch.uint16:
        raise RuntimeError(f"unexpected batch: {tuple(tokens.shape)} {tokens.dtype}")


# ---------------------------------------------------------------------------------------------
# litData, in child processes: python bench_remote.py --child '{"mode": ..., ...}'


def litdata_version() -> str | None:
    try:
        import litdata
    except ImportError:
        return None
    return str(litdata.__version__)


def child_write_litdata(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the tokens in litData's format to a local folder, then upload it to s3rver.

    ``spec["chunk_tokens"]`` (default ``LIT_CHUNK_TOKENS``) sets the tokens per chunk.
    """
    from functools import partial

    from litdata import TokensLoader, optimize

    folder = spec["folder"]
    chunk_tokens = spec.get("chunk_tokens", LIT_CHUNK_TOKENS)
    optimize(
        fn=partial(_items, spec["tokens"], chunk_tokens),
        inputs=[0],
        output_dir=folder,
        chunk_size=chunk_tokens,
        item_loader=TokensLoader(),
        num_workers=1,
    )
    upload_folder(spec["endpoint"], folder, spec["path"])
    with open(os.path.join(folder, "index.json")) as file:
        chunks = json.load(file)["chunks"]
    first = chunks[0]
    return {
        "chunks": len(chunks),
        "tokens": sum(chunk["dim"] for chunk in chunks),
        "first_chunk": f"{spec['path']}/{first['filename']}",
        "header": first["chunk_bytes"] - first["dim"] * 2,  # the chunk's item offsets
    }


def _items(tokens: int, most: int, _input: int) -> Iterator[npt.NDArray[np.uint16]]:
    """The tokens in items of at most ``most`` tokens: an item is never split across chunks."""
    for chunk in token_chunks(tokens):
        for start in range(0, len(chunk), most):
            yield chunk[start : start + most]


def child_read_litdata(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed litData run: construction to the ``batches``-th batch, fresh cache."""
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    # litData fetches chunks with obstore, which refuses plain-HTTP endpoints unless told.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    options = {
        "endpoint_url": spec["endpoint"],
        "aws_access_key_id": KEY,
        "aws_secret_access_key": SECRET,
    }
    counters = Path(spec["counters"])
    batches = spec["batches"]
    cache = spec["cache"]
    before = read_counts(counters)
    start = time.perf_counter()
    dataset = StreamingDataset(
        spec["url"],
        item_loader=TokensLoader(block_size=SEQ_LEN),
        shuffle=True,
        seed=SEED,
        storage_options=options,
        cache_dir=cache,
        max_pre_download=spec["pre_download"],
    )
    loader = StreamingDataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=spec["workers"], drop_last=True
    )
    first, first_counts = 0.0, Counts()
    done = 0
    for done, batch in enumerate(loader, 1):
        if done == 1:
            first, first_counts = time.perf_counter() - start, read_counts(counters) - before
            check_batch(batch)
        if done == batches:
            break
    seconds = time.perf_counter() - start
    counts = read_counts(counters) - before
    return {
        "seconds": seconds,
        "first_batch": first,
        "batches": done,
        "counts": counts.as_tuple(),
        "first_counts": first_counts.as_tuple(),
    }


def run_child(spec: dict[str, Any], folder: str) -> dict[str, Any]:
    """Run ``spec`` in a child process of this script (see ``common.run_child``)."""
    return common_run_child(Path(__file__).resolve(), spec, folder, RUN_TIMEOUT)


def time_litdata(url: str, proxy: Proxy, workers: int, batches: int, pre_download: int) -> Sample:
    result = run_child(
        {
            "mode": "read-litdata",
            "url": url,
            "endpoint": proxy.url,
            "counters": str(proxy.counters_path),
            "workers": workers,
            "batches": batches,
            "pre_download": pre_download,
        },
        "cache",
    )
    if result["batches"] != batches:
        raise RuntimeError(f"litData ended after {result['batches']} of {batches} batches")
    return Sample(
        result["seconds"],
        result["first_batch"],
        batches,
        Counts(*result["counts"]),
        Counts(*result["first_counts"]),
    )


def child_main(text: str) -> None:
    spec = json.loads(text)
    modes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "write-litdata": child_write_litdata,
        "read-litdata": child_read_litdata,
    }
    result = modes[spec["mode"]](spec)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    """Start s3rver and the proxy, write both datasets, run the rounds, print, stop them all."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=512, help="dataset size in MiB")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="proxy delay per request")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (median)")
    parser.add_argument(
        "--batches", type=positive, default=None, help="batches per run (default: one epoch)"
    )
    parser.add_argument(
        "--exact-batches", type=positive, default=256, help="batches per exact-shuffle run"
    )
    parser.add_argument("--inflight", type=positive, default=64, help="Loader max_inflight")
    parser.add_argument(
        "--block-size", type=positive, default=256, help="block shuffle: samples per block"
    )
    parser.add_argument(
        "--window", type=positive, default=8, help="block shuffle: blocks per window"
    )
    parser.add_argument(
        "--lit-workers",
        default="0,2",
        help="litData StreamingDataLoader num_workers to measure, comma-separated",
    )
    parser.add_argument(
        "--lit-pre-download", type=positive, default=2, help="litData max_pre_download"
    )
    parser.add_argument(
        "--lines",
        default="block,exact,litdata",
        help="lines to measure, comma-separated, among block, exact and litdata",
    )
    parser.add_argument("--s3rver-dir", type=Path, default=None, help="npm prefix for s3rver")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args.child)
        return

    # SIGTERM unwinds like Ctrl-C, so every server and child process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    script = ensure_s3rver(args.s3rver_dir or default_s3rver_dir())
    with (
        running_s3rver(script) as endpoint,
        running_proxy(endpoint, args.delay_ms / 1e3) as proxy,
    ):
        run(endpoint, proxy, args, s3rver_version(script))


def run(endpoint: str, proxy: Proxy, args: argparse.Namespace, s3rver: str) -> None:
    """Everything measured against s3rver at ``endpoint`` behind ``proxy``."""
    tokens = args.size_mb * 2**20 // 2
    direct: dict[str, Any] = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    delayed: dict[str, Any] = {"endpoint_url": proxy.url, "key": KEY, "secret": SECRET}
    ab_url = f"s3://{BUCKET}/asyncbatch-{args.size_mb}m"
    lit_url = f"s3://{BUCKET}/litdata-{args.size_mb}m"
    lit_workers = [int(text) for text in args.lit_workers.split(",") if text.strip()]
    lit = litdata_version()

    start = time.perf_counter()
    ab.write_tokens(
        ab_url, token_chunks(tokens), dtype=np.uint16, shard_size=SHARD_SIZE, storage_options=direct
    )
    ab_written = time.perf_counter() - start
    dataset = ab.open_dataset(ab_url, storage_options=direct)
    lit_note = "litdata not installed (scripts/bench-setup installs it): its lines are skipped"
    if lit is not None:
        start = time.perf_counter()
        written = run_child(
            {"mode": "write-litdata", "tokens": tokens, "endpoint": endpoint, "path": lit_url},
            "folder",
        )
        lit_note = (
            f"{lit_url}: {written['chunks']} chunks of {LIT_CHUNK_TOKENS * 2 // 2**20} MiB,"
            f" written and uploaded in {time.perf_counter() - start:.1f} s"
        )
        if written["tokens"] != tokens:
            raise RuntimeError(f"litData wrote {written['tokens']} tokens, not {tokens}")
        same_tokens(dataset.shard_urls[0], written["first_chunk"], written["header"], direct)
    else:
        lit_workers = []

    block_error = block_shuffle_error(ab_url, delayed, args)
    latency = [request_latency(opts, dataset.shard_urls[0]) for opts in (direct, delayed)]
    batches_per_epoch = tokens // SEQ_LEN // BATCH_SIZE
    batches = min(args.batches or batches_per_epoch, batches_per_epoch)
    exact_batches = min(args.exact_batches, batches_per_epoch)

    print(f"asyncbatch bench_remote  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(
        f"  git {git_revision()}  python {platform.python_version()}  torch {torch.__version__}"
        f"  s3fs {s3fs.__version__}  litdata {lit}  s3rver {s3rver}  node {node_version()}"
    )
    print(
        f"  cpus {os.cpu_count()}, shared by s3rver, the proxy process and the readers;"
        f" s3rver {endpoint}, proxy {proxy.url} (+{args.delay_ms:g} ms per request)"
    )
    print(
        f"  one 4 KiB range GET (s3fs, median of 20): {latency[0] * 1e3:.1f} ms direct,"
        f" {latency[1] * 1e3:.1f} ms through the proxy"
    )
    print(
        f"  {ab_url}: {dataset.manifest.total_bytes / 2**20:.0f} MiB, {len(dataset.shard_urls)}"
        f" shards, written in {ab_written:.1f} s"
    )
    print(f"  {lit_note}")
    print(
        f"  seq_len {SEQ_LEN}, batch {BATCH_SIZE}, uint16; {batches} batches per run"
        f" ({exact_batches} for exact shuffle), {args.rounds} rounds; Loader max_inflight"
        f" {args.inflight}, block_size {args.block_size} samples"
        f" ({args.block_size * SEQ_LEN * 2 / 2**20:g} MiB), window {args.window} blocks;"
        f" litData max_pre_download {args.lit_pre_download}, fresh cache per run"
    )
    if block_error is not None:
        print(f"  asyncbatch block: not measured, this asyncbatch rejects it ({block_error})")

    lines = {text.strip() for text in args.lines.split(",")}
    if "litdata" not in lines:
        lit_workers = []
    measures: dict[str, Callable[[], Sample]] = {}
    if block_error is None and "block" in lines:
        measures["asyncbatch block"] = lambda: time_asyncbatch(
            ab_url, delayed, args, proxy, "block", batches
        )
    if "exact" in lines:
        measures["asyncbatch exact"] = lambda: time_asyncbatch(
            ab_url, delayed, args, proxy, "exact", exact_batches
        )
    for workers in lit_workers:
        measures[f"litData w{workers}"] = lambda workers=workers: time_litdata(  # type: ignore[misc]
            lit_url, proxy, workers, batches, args.lit_pre_download
        )
    names = list(measures)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(measures[name]())
        print(
            f"  round {round_ + 1}: "
            + ", ".join(
                f"{name} {samples[name][-1].tokens_per_s / 1e6:.1f}"
                f" ({samples[name][-1].first_batch:.2f} s)"
                for name in names
            )
            + " M tok/s (first batch)",
            file=sys.stderr,
        )
    report(samples, names)


def report(samples: dict[str, list[Sample]], names: list[str]) -> None:
    lit_names = [name for name in names if name.startswith("litData")]
    best_lit = max(
        lit_names,
        key=lambda name: statistics.median(run.tokens_per_s for run in samples[name]),
        default=None,
    )
    print()
    print(
        f"{'approach':17} {'M tok/s':>8} {'min-max':>12} {'after 1st':>10} {'1st batch s':>12}"
        f" {'MiB by 1st':>11} {'requests/sample':>16} {'fetched/payload':>16}"
        f" {'/ best litData':>15}"
    )
    for name in names:
        runs = samples[name]
        rates = [run.tokens_per_s / 1e6 for run in runs]
        ratio = (
            f"{paired_ratio(token_rates(runs), token_rates(samples[best_lit])):15.2f}"
            if best_lit is not None
            else ""
        )
        print(
            f"{name:17} {statistics.median(rates):8.1f}"
            f" {f'{min(rates):.1f}-{max(rates):.1f}':>12}"
            f" {statistics.median(run.steady_tokens_per_s for run in runs) / 1e6:10.1f}"
            f" {statistics.median(run.first_batch for run in runs):12.2f}"
            f" {statistics.median(run.first_counts.down_bytes for run in runs) / 2**20:11.1f}"
            f" {statistics.median(run.requests_per_sample for run in runs):16.4f}"
            f" {statistics.median(run.fetched_per_payload for run in runs):16.2f}"
            f"{ratio}"
        )
    if best_lit is not None:
        print(f"best litData line: {best_lit}")
        for name in names:
            if name.startswith("asyncbatch"):
                speedup = paired_ratio(token_rates(samples[name]), token_rates(samples[best_lit]))
                print(
                    f"  {name} / {best_lit}: {speedup:.2f} (tokens/s, median of per-round ratios)"
                )
    if "asyncbatch block" in samples and "asyncbatch exact" in samples:
        block = statistics.median(run.requests_per_sample for run in samples["asyncbatch block"])
        exact = statistics.median(run.requests_per_sample for run in samples["asyncbatch exact"])
        print(f"  requests per sample, block / exact: {block / exact:.4f}")
    print(
        "(M tok/s: median over rounds, from constructing the loader to its last batch; after"
        " 1st: the same from the first batch on; 1st batch s: median, from construction;"
        " MiB by 1st: bytes the proxy passed back by then;"
        " requests/sample and fetched/payload: the proxy's counts over the run / samples and"
        " bytes delivered)"
    )


def token_rates(runs: list[Sample]) -> list[float]:
    return [run.tokens_per_s for run in runs]


def same_tokens(shard: str, chunk: str, header: int, options: dict[str, Any]) -> None:
    """Check that litData's first chunk starts with the tokens of asyncbatch's first shard."""

    async def read() -> list[bytes]:
        fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **options)
        await fs.set_session()
        try:
            size = 2**20
            pieces: list[bytes] = await fs._cat_ranges(
                [shard, chunk], [0, header], [size, header + size]
            )
            return pieces
        finally:
            await fs._s3.close()

    ours, theirs = asyncio.run(read())
    if ours != theirs:
        raise RuntimeError(f"{chunk} does not hold the tokens of {shard}")


def request_latency(options: dict[str, Any], key: str, count: int = 20) -> float:
    """Median seconds of one 4 KiB range GET of ``key`` (one warm-up request first)."""

    async def measure() -> float:
        fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **options)
        await fs.set_session()
        try:
            await fs._cat_file(key, start=0, end=4096)
            times = []
            for _ in range(count):
                start = time.perf_counter()
                await fs._cat_file(key, start=0, end=4096)
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            await fs._s3.close()

    return asyncio.run(measure())


def node_version() -> str:
    node = shutil.which("node")
    if node is None:
        return "unknown"
    done = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
