"""Bytes fetched per rank on S3 at world sizes 1..64, beside litData and MosaicML streaming,
and a cached second epoch.

The script starts s3rver (installed with npm if missing) on 127.0.0.1 behind
``delayproxy.py`` (10 ms per request, ``--delay-ms``), which counts the requests and the bytes
it passes back. It writes the same random uint16 tokens (64 MiB, ``--size-mb``) three times,
in shards / chunks of 4 MiB (``--shard-mb``): with ``ab.write_tokens``, in litData's format
(``litdata.optimize`` with ``TokensLoader``) and in MosaicML streaming's MDS format
(``MDSWriter``, one sample per window of 2048 tokens), plus a local copy of asyncbatch's.

**Rank sweep.** For each world size N (``--world-sizes``, default 1,4,16,64) each simulated
rank r reads its share of one epoch, one rank after another, each as its own node with its own
cache, counted at the proxy between its construction and its end:

* ``asyncbatch block`` / ``asyncbatch global``: ``ab.Loader(url, batch_size=16, seq_len=2048,
  shuffle="block" | True, rank=r, world_size=N, storage_options=...)``, the library's
  defaults otherwise, in this process (``--global-batches`` caps the global shuffle's batches
  per rank; its counts then include the read-ahead past the last batch);
* ``litData``: ``StreamingDataset(url, item_loader=TokensLoader(block_size=2048),
  shuffle=True)`` read by ``StreamingDataLoader(batch_size=16)``, its rank given by the
  environment variables its ``_DistributedEnv.detect()`` reads (``WORLD_SIZE``,
  ``GLOBAL_RANK``, ``NNODES``=N), the N ranks one after another in one child process;
* ``MosaicML``: ``streaming.StreamingDataset(remote=url, local=<empty>, shuffle=True,
  batch_size=16)`` read by ``DataLoader(batch_size=16)``, its rank from ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``=0, ``LOCAL_WORLD_SIZE``=1, likewise.

Per rank: bytes fetched / bytes delivered (object bytes: asyncbatch's own count from
``statistics()``, the proxy's for the peers, whose 4 MiB GETs carry negligible headers; the
proxy's bytes with headers in a ``wire`` column), requests per sample, tokens/s and time to
first batch; per N the max and mean over ranks. Bytes do not depend on timing, so the sweep
runs once. Every rank is measured (``--max-ranks K``: K of each N, evenly spaced).

**Cached second epoch.** ``ab.Loader(url, shuffle="block", cache=<empty dir>)`` reads two
epochs; the second epoch's requests at the proxy and its tokens/s, as a ratio to the same
Loader on the local copy (also its second epoch), in ``--rounds`` interleaved rounds (median of
the paired ratios). A tree whose Loader has no ``cache=`` says so and measures the uncached
Loader's second epoch instead.

It prints a table, writes the figures as JSON (``--json``) and plots bytes fetched / delivered
(max over ranks) against N (``--plot``).

Usage: ``.venv/bin/python benchmarks/bench_scale.py [--size-mb 64] [--shard-mb 4]
[--world-sizes 1,4,16,64] [--max-ranks 0] [--global-batches N] [--rounds 5] [--lines ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import s3fs
import torch
from bench_remote import check_batch, litdata_version, node_version, request_latency
from common import REPO, git_revision, paired_ratio, positive, run_child
from delayproxy import Counts, Proxy, read_counts, running_proxy
from plot import plot_scale
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
SAMPLE_BYTES = SEQ_LEN * 2  # uint16
#: One child process (all the ranks of one world size) is stopped after this long.
CHILD_TIMEOUT = 900
LINES = ("block", "global", "litdata", "mosaicml", "cache")
LINE_NAMES = {
    "block": "asyncbatch block",
    "global": "asyncbatch global",
    "litdata": "litData",
    "mosaicml": "MosaicML",
}


@dataclass(frozen=True)
class RankRun:
    """One rank's share of an epoch: from constructing its loader to its end."""

    rank: int
    seconds: float
    first_batch: float
    samples: int
    #: The proxy's counts over the run.
    counts: Counts
    #: Object bytes the loader fetched, as it counts them (asyncbatch: ``statistics()``);
    #: None for the peers, whose 4 MiB GETs make the proxy's count the same to 0.01%.
    payload: int | None = None

    @property
    def fetched_per_delivered(self) -> float:
        """Object bytes fetched over bytes delivered (the proxy's bytes for the peers)."""
        fetched = self.counts.down_bytes if self.payload is None else self.payload
        return fetched / (self.samples * SAMPLE_BYTES)

    @property
    def wire_per_delivered(self) -> float:
        """Every byte the proxy passed back, HTTP headers included, over bytes delivered."""
        return self.counts.down_bytes / (self.samples * SAMPLE_BYTES)

    @property
    def requests_per_sample(self) -> float:
        return self.counts.requests / self.samples

    @property
    def tokens_per_s(self) -> float:
        return self.samples * SEQ_LEN / self.seconds

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "seconds": self.seconds,
            "first_batch": self.first_batch,
            "samples": self.samples,
            "counts": self.counts.as_tuple(),
            "payload": self.payload,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankRun:
        return cls(
            data["rank"],
            data["seconds"],
            data["first_batch"],
            data["samples"],
            Counts(*data["counts"]),
            data.get("payload"),
        )


def read_rank(
    rank: int,
    open_loader: Callable[[], contextlib.AbstractContextManager[Iterable[Any]]],
    tokens_of: Callable[[Any], torch.Tensor],
    counts: Callable[[], Counts],
    max_batches: int | None = None,
) -> RankRun:
    """Read one rank's batches (all of them, or ``max_batches``) and count them."""
    before = counts()
    start = time.perf_counter()
    first, samples, done = 0.0, 0, 0
    with open_loader() as loader:
        for done, batch in enumerate(loader, 1):
            tokens = tokens_of(batch)
            if done == 1:
                first = time.perf_counter() - start
                check_batch(tokens)
            samples += tokens.shape[0]
            if done == max_batches:
                break
        seconds = time.perf_counter() - start
        payload = loader.statistics().bytes_fetched if isinstance(loader, ab.Loader) else None
    if samples == 0:
        raise RuntimeError(f"rank {rank} read no batch")
    return RankRun(rank, seconds, first, samples, counts() - before, payload)


# ---------------------------------------------------------------------------------------------
# asyncbatch, in this process


def make_loader(url: str, options: dict[str, Any], shuffle: str, **extra: Any) -> ab.Loader:
    """The Loader measured, at the library's defaults; ``shuffle`` is "block" or "global"."""
    return ab.Loader(
        url,
        batch_size=BATCH_SIZE,
        seq_len=SEQ_LEN,
        shuffle="block" if shuffle == "block" else True,
        storage_options=options,
        **extra,
    )


def ranks_measured(world: int, most: int) -> list[int]:
    """Every rank of ``world``, or ``most`` of them evenly spaced (the first and the last among
    them) when ``most`` is smaller; 0 means every rank."""
    if most == 0 or world <= most:
        return list(range(world))
    if most == 1:
        return [0]
    return sorted({round(i * (world - 1) / (most - 1)) for i in range(most)})


def sweep_asyncbatch(
    url: str,
    options: dict[str, Any],
    proxy: Proxy,
    shuffle: str,
    world: int,
    ranks: list[int],
    batches: int | None,
) -> list[RankRun]:
    return [
        read_rank(
            rank,
            functools.partial(make_loader, url, options, shuffle, rank=rank, world_size=world),
            lambda batch: batch["tokens"],
            proxy.counts,
            batches,
        )
        for rank in ranks
    ]


def loader_error(make: Callable[[], ab.Loader]) -> str | None:
    """Why this asyncbatch cannot build the Loader ``make`` builds, or None if it can."""
    try:
        loader = make()
    except (ConfigError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    loader.close()
    return None


# ---------------------------------------------------------------------------------------------
# litData and MosaicML, in child processes: python bench_scale.py --child '{"mode": ..., ...}'


def mosaicml_version() -> str | None:
    try:
        return importlib.metadata.version("mosaicml-streaming")
    except importlib.metadata.PackageNotFoundError:
        return None


def import_mosaicml() -> Any:
    """MosaicML's ``streaming.base``, without running ``streaming/__init__.py``.

    That file imports its vision datasets and with them torchvision, whose PyPI wheel does not
    import beside the CPU torch 2.13.0 (``scripts/bench-setup``); token streams need none of it.
    """
    spec = importlib.util.find_spec("streaming")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("mosaicml-streaming is not installed")
    if "streaming" not in sys.modules:
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    return __import__("streaming.base", fromlist=["StreamingDataset"])


def child_write_mds(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the tokens as MDS (one sample per window) to a local folder, then upload it."""
    base = import_mosaicml()
    folder = spec["folder"]
    windows = 0
    columns = {"tokens": f"ndarray:uint16:{SEQ_LEN}"}
    with base.MDSWriter(out=folder, columns=columns, size_limit=spec["shard_bytes"]) as writer:
        for chunk in token_chunks(spec["tokens"]):
            for window in chunk[: len(chunk) // SEQ_LEN * SEQ_LEN].reshape(-1, SEQ_LEN):
                writer.write({"tokens": window})
                windows += 1
    upload_folder(spec["endpoint"], folder, spec["path"])
    shards = [name for name in os.listdir(folder) if name.endswith(".mds")]
    return {"shards": len(shards), "windows": windows}


def child_sweep_litdata(spec: dict[str, Any]) -> dict[str, Any]:
    """The ranks of one world size read their shares, one after another, each cache empty."""
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    # litData fetches chunks with obstore, which refuses plain-HTTP endpoints unless told.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    options = {
        "endpoint_url": spec["endpoint"],
        "aws_access_key_id": KEY,
        "aws_secret_access_key": SECRET,
    }
    world = spec["world"]

    @contextlib.contextmanager
    def open_rank(rank: int) -> Iterator[Iterable[Any]]:
        # What _DistributedEnv.detect() reads when torch.distributed is not initialised.
        os.environ.update(WORLD_SIZE=str(world), GLOBAL_RANK=str(rank), NNODES=str(world))
        with tempfile.TemporaryDirectory(dir=spec["scratch"]) as cache:
            dataset = StreamingDataset(
                spec["url"],
                item_loader=TokensLoader(block_size=SEQ_LEN),
                shuffle=True,
                storage_options=options,
                cache_dir=cache,
            )
            yield StreamingDataLoader(dataset, batch_size=BATCH_SIZE)

    return sweep_ranks(spec, open_rank, lambda batch: batch)


def child_sweep_mosaicml(spec: dict[str, Any]) -> dict[str, Any]:
    """The same for MosaicML streaming."""
    os.environ.update(
        S3_ENDPOINT_URL=spec["endpoint"], AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET
    )
    base = import_mosaicml()
    import streaming.base.dataset

    # streaming initialises torch.distributed (gloo) when WORLD_SIZE > 1, only for barriers
    # (after the index download, around its shared memory); the simulated ranks run one after
    # another, so such a rendezvous would wait for ranks that never come.
    streaming.base.dataset.maybe_init_dist = lambda: False
    world = spec["world"]

    @contextlib.contextmanager
    def open_rank(rank: int) -> Iterator[Iterable[Any]]:
        # What streaming's World.detect() reads without torch.distributed: every rank a node.
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
        )
        with tempfile.TemporaryDirectory(dir=spec["scratch"]) as local:
            dataset = base.StreamingDataset(
                remote=spec["url"], local=local, shuffle=True, batch_size=BATCH_SIZE
            )
            yield torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)

    return sweep_ranks(spec, open_rank, lambda batch: batch["tokens"])


def sweep_ranks(
    spec: dict[str, Any],
    open_rank: Callable[[int], contextlib.AbstractContextManager[Iterable[Any]]],
    tokens_of: Callable[[Any], torch.Tensor],
) -> dict[str, Any]:
    """``read_rank`` for each of ``spec["ranks"]``, counted by the proxy's counter file."""
    counters = Path(spec["counters"])
    runs = [
        read_rank(
            rank, functools.partial(open_rank, rank), tokens_of, lambda: read_counts(counters)
        )
        for rank in spec["ranks"]
    ]
    return {"runs": [run.as_json() for run in runs]}


def child_main(text: str) -> None:
    spec = json.loads(text)
    modes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "write-mds": child_write_mds,
        "sweep-litdata": child_sweep_litdata,
        "sweep-mosaicml": child_sweep_mosaicml,
    }
    result = modes[spec["mode"]](spec)
    print(json.dumps(result), flush=True)


def sweep_child(mode: str, url: str, proxy: Proxy, world: int, ranks: list[int]) -> list[RankRun]:
    spec = {
        "mode": mode,
        "url": url,
        "endpoint": proxy.url,
        "counters": str(proxy.counters_path),
        "world": world,
        "ranks": ranks,
    }
    result = run_child(Path(__file__).resolve(), spec, "scratch", CHILD_TIMEOUT)
    return [RankRun.from_json(run) for run in result["runs"]]


# ---------------------------------------------------------------------------------------------
# The cached second epoch


@dataclass(frozen=True)
class SecondEpoch:
    seconds: float
    samples: int
    counts: Counts

    @property
    def tokens_per_s(self) -> float:
        return self.samples * SEQ_LEN / self.seconds


def second_epoch(make: Callable[[], ab.Loader], counts: Callable[[], Counts]) -> SecondEpoch:
    """Read one epoch untimed, then time the next one and count its requests."""
    with make() as loader:
        for _ in loader:
            pass
        before = counts()
        start = time.perf_counter()
        samples = sum(batch["tokens"].shape[0] for batch in loader)
        seconds = time.perf_counter() - start
    return SecondEpoch(seconds, samples, counts() - before)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    """Start s3rver and the proxy, write the datasets, measure, report, stop them all."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=positive, default=64, help="dataset size in MiB")
    parser.add_argument(
        "--shard-mb", type=positive, default=4, help="shard / chunk size of every format, MiB"
    )
    parser.add_argument("--delay-ms", type=float, default=10.0, help="proxy delay per request")
    parser.add_argument(
        "--world-sizes", default="1,4,16,64", help="world sizes to simulate, comma-separated"
    )
    parser.add_argument(
        "--global-batches",
        type=positive,
        default=None,
        help="global shuffle: batches per rank (default: the rank's whole share)",
    )
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=0,
        help="ranks measured per world size at most, evenly spaced (0: every rank)",
    )
    parser.add_argument(
        "--rounds", type=positive, default=5, help="interleaved rounds of the cache ratio"
    )
    parser.add_argument(
        "--lines", default=",".join(LINES), help=f"what to measure, among {','.join(LINES)}"
    )
    default_plot = REPO / "docs" / "img" / "bench_scale.png"
    parser.add_argument("--plot", type=Path, default=default_plot, help="PNG plot to write")
    parser.add_argument(
        "--json", type=Path, default=None, help="JSON of the figures (default: --plot as .json)"
    )
    parser.add_argument("--s3rver-dir", type=Path, default=None, help="npm prefix for s3rver")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    args.lines = [text.strip() for text in args.lines.split(",") if text.strip()]
    unknown = set(args.lines) - set(LINES)
    if unknown:
        parser.error(f"unknown lines {sorted(unknown)}; expected some of {LINES}")
    if args.max_ranks < 0:
        parser.error(f"--max-ranks must be >= 0, got {args.max_ranks}")
    args.world_sizes = [positive(text) for text in args.world_sizes.split(",") if text.strip()]

    # SIGTERM unwinds like Ctrl-C, so every server and child process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    script = ensure_s3rver(args.s3rver_dir or default_s3rver_dir())
    started = time.perf_counter()
    with (
        running_s3rver(script) as endpoint,
        running_proxy(endpoint, args.delay_ms / 1e3) as proxy,
        tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch,
    ):
        run(endpoint, proxy, args, s3rver_version(script), Path(scratch))
    print(f"(run time {time.perf_counter() - started:.0f} s)")


def run(endpoint: str, proxy: Proxy, args: argparse.Namespace, s3rver: str, scratch: Path) -> None:
    """Everything measured against s3rver at ``endpoint`` behind ``proxy``."""
    tokens = args.size_mb * 2**20 // 2
    shard_bytes = args.shard_mb * 2**20
    direct: dict[str, Any] = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    delayed: dict[str, Any] = {"endpoint_url": proxy.url, "key": KEY, "secret": SECRET}
    name = f"{args.size_mb}m-{args.shard_mb}m"
    ab_url = f"s3://{BUCKET}/asyncbatch-{name}"
    lit_url = f"s3://{BUCKET}/litdata-{name}"
    mds_url = f"s3://{BUCKET}/mds-{name}"
    local_path = str(scratch / "local")
    notes: list[str] = []

    ab.write_tokens(
        ab_url,
        token_chunks(tokens),
        dtype=np.uint16,
        shard_size=shard_bytes,
        storage_options=direct,
    )
    ab.write_tokens(local_path, token_chunks(tokens), dtype=np.uint16, shard_size=shard_bytes)
    dataset = ab.open_dataset(ab_url, storage_options=direct)
    notes.append(
        f"{ab_url}: {dataset.manifest.total_bytes / 2**20:.0f} MiB in {len(dataset.shard_urls)}"
        f" shards; the same tokens in {local_path} for the cache ratio"
    )

    lines: dict[str, str | None] = {}  # line -> why it is not measured (None: it is)
    for shuffle in ("block", "global"):
        if shuffle in args.lines:
            lines[shuffle] = loader_error(functools.partial(make_loader, ab_url, delayed, shuffle))
    lit = litdata_version()
    if "litdata" in args.lines:
        lines["litdata"] = None if lit else "litdata not installed (scripts/bench-setup)"
    if lines.get("litdata") is None and "litdata" in lines:
        written = run_child(
            REPO / "benchmarks" / "bench_remote.py",
            {
                "mode": "write-litdata",
                "tokens": tokens,
                "endpoint": endpoint,
                "path": lit_url,
                "chunk_tokens": shard_bytes // 2,
            },
            "folder",
            CHILD_TIMEOUT,
        )
        notes.append(f"{lit_url}: {written['chunks']} chunks of {args.shard_mb} MiB (litData)")
    mosaic = mosaicml_version()
    if "mosaicml" in args.lines:
        lines["mosaicml"] = None if mosaic else "mosaicml-streaming not installed (bench-setup)"
    if lines.get("mosaicml") is None and "mosaicml" in lines:
        written = run_child(
            Path(__file__).resolve(),
            {
                "mode": "write-mds",
                "tokens": tokens,
                "endpoint": endpoint,
                "path": mds_url,
                "shard_bytes": shard_bytes,
            },
            "folder",
            CHILD_TIMEOUT,
        )
        notes.append(
            f"{mds_url}: {written['shards']} MDS shards of <= {args.shard_mb} MiB,"
            f" {written['windows']} samples of {SEQ_LEN} tokens"
        )
    for line, why in lines.items():
        if why is not None:
            notes.append(f"{LINE_NAMES[line]}: not measured, {why}")

    latency = [request_latency(opts, dataset.shard_urls[0]) for opts in (direct, delayed)]
    header = [
        f"asyncbatch bench_scale  {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"  git {git_revision()}  python {platform.python_version()}  torch {torch.__version__}"
        f"  s3fs {s3fs.__version__}  litdata {lit}  mosaicml-streaming {mosaic}"
        f"  s3rver {s3rver}  node {node_version()}",
        f"  cpus {os.cpu_count()}, shared by s3rver, the proxy and the readers;"
        f" +{args.delay_ms:g} ms per request at the proxy; one 4 KiB range GET"
        f" {latency[0] * 1e3:.1f} ms direct, {latency[1] * 1e3:.1f} ms through the proxy",
        *(f"  {note}" for note in notes),
        f"  seq_len {SEQ_LEN}, batch {BATCH_SIZE}, uint16; world sizes {args.world_sizes},"
        f" {args.max_ranks or 'all'} ranks measured per world size at most;"
        f" global shuffle: {args.global_batches or 'all'} batches per rank",
    ]
    print("\n".join(header), flush=True)

    sweeps: dict[tuple[str, int], list[RankRun]] = {}
    for world in args.world_sizes:
        ranks = ranks_measured(world, args.max_ranks)
        for line in (line for line, why in lines.items() if why is None):
            start = time.perf_counter()
            if line in ("block", "global"):
                batches = args.global_batches if line == "global" else None
                runs = sweep_asyncbatch(ab_url, delayed, proxy, line, world, ranks, batches)
            elif line == "litdata":
                runs = sweep_child("sweep-litdata", lit_url, proxy, world, ranks)
            else:
                runs = sweep_child("sweep-mosaicml", mds_url, proxy, world, ranks)
            sweeps[line, world] = runs
            print(
                f"  {LINE_NAMES[line]} N={world}: {time.perf_counter() - start:.1f} s,"
                f" fetched/delivered max {max(run.fetched_per_delivered for run in runs):.2f}",
                file=sys.stderr,
                flush=True,
            )
    cache = measure_cache(ab_url, delayed, local_path, proxy, args) if "cache" in args.lines else {}

    print()
    print(scale_table(sweeps))
    if cache:
        print()
        print(cache_text(cache))
    path = args.json or args.plot.with_suffix(".json")
    figures = {
        "header": header,
        "title": (
            f"One epoch over N ranks from S3 (+{args.delay_ms:g} ms): {args.size_mb} MiB,"
            f" {args.shard_mb} MiB shards, git {git_revision()}"
        ),
        "settings": {
            "size_mb": args.size_mb,
            "shard_mb": args.shard_mb,
            "delay_ms": args.delay_ms,
            "seq_len": SEQ_LEN,
            "batch_size": BATCH_SIZE,
            "global_batches": args.global_batches,
            "max_ranks": args.max_ranks,
        },
        "scale": [
            {
                "loader": LINE_NAMES[line],
                "world_size": world,
                **summary(runs),
                "ranks": [run.as_json() for run in runs],
            }
            for (line, world), runs in sweeps.items()
        ],
        "cache": cache,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures: {path}")
    if sweeps:
        plot_scale(figures, args.plot)


def summary(runs: list[RankRun]) -> dict[str, float | int]:
    """Max and mean over ranks."""
    fetched = [run.fetched_per_delivered for run in runs]
    first = [run.first_batch for run in runs]
    return {
        "fetched_per_delivered_max": max(fetched),
        "fetched_per_delivered_mean": statistics.fmean(fetched),
        "wire_per_delivered_max": max(run.wire_per_delivered for run in runs),
        "requests_per_sample_max": max(run.requests_per_sample for run in runs),
        "requests_per_sample_mean": statistics.fmean(run.requests_per_sample for run in runs),
        "m_tokens_per_s_mean": statistics.fmean(run.tokens_per_s for run in runs) / 1e6,
        "first_batch_max": max(first),
        "first_batch_mean": statistics.fmean(first),
        "samples": sum(run.samples for run in runs),
        "ranks": len(runs),
    }


#: The table's columns after loader and N: heading, key of ``summary``, format.
COLUMNS = (
    ("ranks", "ranks", "5d"),
    ("fetched/delivered", "fetched_per_delivered_max", "17.2f"),
    ("(mean)", "fetched_per_delivered_mean", "7.2f"),
    ("wire", "wire_per_delivered_max", "5.2f"),
    ("requests/sample", "requests_per_sample_max", "15.4f"),
    ("(mean)", "requests_per_sample_mean", "7.4f"),
    ("M tok/s", "m_tokens_per_s_mean", "8.1f"),
    ("1st batch s", "first_batch_max", "11.2f"),
    ("(mean)", "first_batch_mean", "7.2f"),
    ("samples", "samples", "8d"),
)


def scale_table(sweeps: dict[tuple[str, int], list[RankRun]]) -> str:
    widths = [int(spec.split(".")[0].rstrip("d")) for _, _, spec in COLUMNS]
    heading = " ".join(
        f"{name:>{width}}" for (name, _, _), width in zip(COLUMNS, widths, strict=True)
    )
    rows = [f"{'loader':17} {'N':>3} {heading}"]
    for (line, world), runs in sorted(
        sweeps.items(), key=lambda item: (LINES.index(item[0][0]), item[0][1])
    ):
        values = summary(runs)
        cells = " ".join(format(values[key], spec) for _, key, spec in COLUMNS)
        rows.append(f"{LINE_NAMES[line]:17} {world:3d} {cells}")
    rows.append(
        "(per rank, from constructing the rank's loader to its end: fetched/delivered = object"
        " bytes fetched (asyncbatch: its statistics(); the peers: bytes at the proxy) / bytes of"
        " the batches it yielded; first column max over ranks, (mean) the mean; wire: every byte"
        " the proxy passed back, HTTP headers included, max over ranks; M tok/s: mean over ranks"
        " of a rank's rate, start-up included; ranks: how many were measured; samples: delivered"
        " by them together)"
    )
    return "\n".join(rows)


def measure_cache(
    url: str, options: dict[str, Any], local: str, proxy: Proxy, args: argparse.Namespace
) -> dict[str, Any]:
    """Epoch 2 of the cached Loader beside epoch 2 of the Loader on local files."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-cache-") as probe:
        why = loader_error(lambda: make_loader(url, options, "block", cache=probe))
    cached = why is None

    def remote() -> ab.Loader:
        if not cached:
            return make_loader(url, options, "block")
        folder = tempfile.mkdtemp(prefix="bench-scale-cache-")
        folders.append(folder)
        return make_loader(url, options, "block", cache=folder)

    folders: list[str] = []
    measures: dict[str, Callable[[], SecondEpoch]] = {
        "remote": lambda: second_epoch(remote, proxy.counts),
        "local": lambda: second_epoch(lambda: make_loader(local, {}, "block"), proxy.counts),
    }
    samples: dict[str, list[SecondEpoch]] = {name: [] for name in measures}
    try:
        for round_ in range(args.rounds):
            names = list(measures)[round_ % 2 :] + list(measures)[: round_ % 2]
            for name in names:
                samples[name].append(measures[name]())
            while folders:
                shutil.rmtree(folders.pop(), ignore_errors=True)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    rates = {name: [run.tokens_per_s for run in runs] for name, runs in samples.items()}
    return {
        "cache": cached,
        "note": None if cached else f"no cache in this tree ({why})",
        "rounds": args.rounds,
        "epoch2_requests": [run.counts.requests for run in samples["remote"]],
        "epoch2_gets": [run.counts.gets for run in samples["remote"]],
        "epoch2_mib_fetched": [run.counts.down_bytes / 2**20 for run in samples["remote"]],
        "epoch2_remote_tokens_per_s": rates["remote"],
        "epoch2_local_tokens_per_s": rates["local"],
        "remote_per_local": paired_ratio(rates["remote"], rates["local"]),
    }


def cache_text(cache: dict[str, Any]) -> str:
    label = "cache=<dir>" if cache["cache"] else "no cache"
    lines = []
    if cache["note"]:
        lines.append(f"{cache['note']}: measured the Loader without a cache instead")
    lines += [
        f"second epoch, asyncbatch block on S3 ({label}) beside the same Loader on local files,"
        f" {cache['rounds']} rounds:",
        f"  GETs at the proxy: {cache['epoch2_gets']} (requests {cache['epoch2_requests']},"
        f" MiB {', '.join(f'{mib:.1f}' for mib in cache['epoch2_mib_fetched'])})",
        f"  M tok/s: S3 {statistics.median(cache['epoch2_remote_tokens_per_s']) / 1e6:.1f},"
        f" local {statistics.median(cache['epoch2_local_tokens_per_s']) / 1e6:.1f};"
        f" S3 / local {cache['remote_per_local']:.2f} (median of paired ratios)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
