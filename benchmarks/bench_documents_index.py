"""Paged per-shard document indexes against whole ones: index bytes that grow with what a
rank reads.

Three parts (``--part``, default all):

* ``s3``: ``--documents`` (5×10^6) short documents (0 to 5 uint16 tokens) in ONE shard,
  written with the writers' helpers in both layouts (``paged``: 512 documents a page, the
  writers' default; ``whole``: the earlier per-shard index of 8 bytes a document, the
  baseline), uploaded to moto's S3 server (started here) and read through ``delayproxy.py``,
  which counts requests and bytes. Each round, each layout in rotating order:
  ``ab.open_dataset`` plus ``ab.Loader(batch_size=16, seq_len=2048, shuffle=True)`` up to its
  first batch: seconds, requests and bytes (headers included) from the open to the first
  batch, the open's seconds, and the CPU seconds the server and this process spent over it
  (moto reads a whole object again for every range it serves: its CPU grows with the GETs of
  large objects; ``--server s3rver`` runs the same against s3rver, which reads only the range
  asked for). Also one 4 KiB range GET of each object, straight to the server; ``--trace``
  prints one paged round's requests with their times. Medians; the paired ratio of the
  times. Target: ≤ 1 MiB + 64 KiB, < 1 s.
* ``epoch``: an exact global shuffle epoch of packed windows (``--seq-len`` 2048, uint16) over
  ``--epoch-documents`` (10^7) documents of 100 to 300 tokens in shards of 256 MiB, at world
  size ``--world`` (64), simulated: for ``--ranks`` of the ranks, the rank's windows in the
  loader's order (``GlobalShuffle``, positions ``q % W``), 16 a batch, are given to the
  source's own :class:`DocumentIndex` (the code a loader runs), whose reads are served from
  the local index files and counted. Token bytes are the windows' own (``seq_len`` × 2 bytes
  a window). Per layout (``--layouts``: ``slots``, the paged index of 512 a page with the
  slot table the writers choose, which packed windows read instead of pages; ``paged`` at
  each of ``--pages``, no slot table; ``whole``): index bytes per rank, their ratio to the
  token bytes, requests, the cache's peak bytes (``index_cache_bytes`` at its 64 MiB
  default), and ranges fetched more than once. Target: ≤ 2 % of the token bytes, no piece
  fetched twice while it fits.
* ``local``: ``--local-documents`` (10^6, 10^7, 10^8) documents of 0 to 5 tokens on local
  disk, paged, each in a fresh process (warmed by the same steps on 5×10^4 documents:
  imports, threads): seconds to open, to the first exact-shuffle batch of 16 × 2048 and to
  the first batch of 64 documents as samples, the process's peak RSS growth over the warm-up
  (``ru_maxrss``: with the local store's mappings, it counts the page-cache pages of the
  files mapped, shared and reclaimable) and its anonymous memory's growth (``RssAnon``).
  Target: open < 1 s, first batch < 1 s, memory not growing with the documents.

Datasets are written once to ``~/.cache/asyncbatch/bench-documents-index-*``.

Usage: ``.venv/bin/python benchmarks/bench_documents_index.py [--part s3|epoch|local]
[--rounds 5] [--ranks 8]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import s3fs
from common import git_revision, paired_ratio, positive, read_plan_files
from common import moto_server as start_moto
from delayproxy import running_proxy

import asyncbatch as ab
from asyncbatch._checksums import ALGORITHM, digest
from asyncbatch._layout import ReadPlan
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch.formats._base import Read, Wait
from asyncbatch.formats._documents_index import (
    PAGE_DOCUMENTS,
    DocumentIndex,
    index_path,
    per_shard_metadata,
    shard_index_bytes,
    shard_index_info,
)
from asyncbatch.sampling._order import GlobalShuffle
from asyncbatch.stores._s3 import S3Store

BUCKET = "bench-documents-index"
LAYOUTS = {"paged": PAGE_DOCUMENTS, "whole": None}
SHARD_BYTES = 256 * 2**20


def cache_root(name: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "asyncbatch" / f"bench-documents-index-{name}"


def write_dataset(
    root: Path,
    count: int,
    low: int,
    high: int,
    page: int | None,
    *,
    data: bool = True,
    seed: int = 1,
    slots: bool = False,
) -> None:
    """``count`` documents of ``low`` to ``high - 1`` uint16 tokens in shards of at most
    256 MiB (documents never cross shard ends), indexes written with the writers' helpers
    (``page``: documents a page; None: whole; ``slots``: with the slot table the writers
    choose). ``data=False`` writes no shard files (the epoch simulation reads only
    indexes)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = max(1, SHARD_BYTES // (2 * (low + high) // 2 or 1))
    shards, infos, counts = [], [], []
    for k, first in enumerate(range(0, count, per_shard)):
        n = min(count, first + per_shard) - first
        lengths = rng.integers(low, high, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        name = f"shard-{k:05d}.bin"
        elements = int(offsets[-1])
        checksum = None
        if not data:  # sparse: opening checks that the first shard is there
            with open(root / name, "wb") as handle:
                handle.truncate(2 * elements)
        else:
            tokens = np.repeat((np.arange(first, first + n) % 60_000).astype(np.uint16), lengths)
            raw = tokens.tobytes()
            (root / name).write_bytes(raw)
            checksum = digest(raw)
        shards.append(ShardInfo(name, 2 * elements, elements, 0, checksum, None))
        index = shard_index_bytes(offsets, page_documents=page, slots=slots)
        (root / index_path(name)).write_bytes(index)
        infos.append(shard_index_info(index_path(name), index))
        counts.append(n)
    manifest = Manifest(
        "documents",
        np.dtype(np.uint16),
        tuple(shards),
        per_shard_metadata(counts, infos),
        checksum=ALGORITHM if data else None,
        checksum_block=None,
    )
    (root / "manifest.json").write_text(manifest.to_json())


def ensure(
    name: str, count: int, low: int, high: int, page: int | None, data: bool, slots: bool = False
) -> Path:
    root = cache_root(f"{name}-{count}-{page}" + ("-slots" if slots else ""))
    if not (root / "manifest.json").exists():
        print(f"writing {count} documents ({name}, pages of {page}) to {root}", file=sys.stderr)
        write_dataset(root, count, low, high, page, data=data, slots=slots)
    return root


# ---------------------------------------------------------------------------------------------
# s3: the first shuffled batch of 5×10^6 documents in one shard


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(pid: int | None, timeout: float = 30.0) -> None:
    """Wait until process ``pid`` uses no CPU for 0.2 s, so that a server still serving
    requests a closed loader left behind would not be timed in the next round (a guard:
    checked by hand, moto was already idle 0.3 s after each round)."""
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = cpu_seconds(pid)
        if now == before:
            return
        before = now


def child_pid(marker: str) -> int | None:
    """The pid of this process's child whose command line holds ``marker`` (Linux)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == os.getpid() and marker.encode() in command:
            return int(entry.name)
    return None


@contextlib.contextmanager
def s3_server(kind: str) -> Iterator[tuple[str, int | None, str, str, str]]:
    """An S3 server of ``kind`` (``moto``, or ``s3rver``: Node, reads only the range asked
    for) with an empty bucket: endpoint, server pid, key, secret, bucket."""
    if kind == "moto":
        with start_moto() as (endpoint, pid):
            s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing").mkdir(BUCKET)
            yield endpoint, pid, "testing", "testing", BUCKET
        return
    from s3rver import BUCKET as S3RVER_BUCKET
    from s3rver import KEY, SECRET, default_s3rver_dir, ensure_s3rver, running_s3rver

    with running_s3rver(ensure_s3rver(default_s3rver_dir())) as endpoint:
        yield endpoint, child_pid("s3rver"), KEY, SECRET, S3RVER_BUCKET


def one_range_ms(fs: s3fs.S3FileSystem, path: str, rounds: int = 7) -> float:
    """Median milliseconds of one 4 KiB range GET of ``path``, straight to the server."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fs.cat_file(path, start=4096, end=8192)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def traced_requests() -> Iterator[list[tuple[str, str, float, float]]]:
    """Record every HEAD and ranged GET of the S3 transport while the block runs: kind,
    object and range, start and end (``time.perf_counter``). For ``--trace`` only."""
    log: list[tuple[str, str, float, float]] = []
    read_range, stat = S3Store.read_range, S3Store.stat

    async def traced_read(self: S3Store, url: str, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            await read_range(self, url, **kwargs)
        finally:
            where = f"{url.rsplit('/', 1)[-1]} [{kwargs['start']}, {kwargs['end']})"
            log.append(("GET", where, start, time.perf_counter()))

    async def traced_stat(self: S3Store, url: str) -> Any:
        start = time.perf_counter()
        try:
            return await stat(self, url)
        finally:
            log.append(("HEAD", url.rsplit("/", 1)[-1], start, time.perf_counter()))

    S3Store.read_range, S3Store.stat = traced_read, traced_stat  # type: ignore[method-assign]
    try:
        yield log
    finally:
        S3Store.read_range, S3Store.stat = read_range, stat  # type: ignore[method-assign]


def part_s3(args: argparse.Namespace) -> None:
    roots = {
        layout: ensure("s3", args.documents, 0, 6, page, True) for layout, page in LAYOUTS.items()
    }
    results: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    with (
        s3_server(args.server) as (endpoint, server_pid, key, secret, bucket),
        running_proxy(endpoint, args.delay_ms / 1e3) as proxy,
    ):
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=key, secret=secret)
        for layout, root in roots.items():
            fs.put(str(root), f"{bucket}/{layout}", recursive=True)
        options = {"endpoint_url": proxy.url, "key": key, "secret": secret}
        single = {
            name: one_range_ms(fs, f"{bucket}/paged/{name}")
            for name in ("shard-00000.idx", "shard-00000.bin")
        }

        def measure(layout: str, trace: bool = False) -> dict[str, float]:
            time.sleep(0.3)  # earlier reads' last bytes pass the proxy first
            wait_idle(server_pid)
            before = proxy.counts()
            server_before = float("nan") if server_pid is None else cpu_seconds(server_pid)
            with contextlib.ExitStack() as stack:
                log = stack.enter_context(traced_requests()) if trace else []
                start, cpu_before = time.perf_counter(), time.process_time()
                dataset = ab.open_dataset(f"s3://{bucket}/{layout}", options)
                opened = time.perf_counter() - start
                with ab.Loader(
                    dataset, batch_size=16, seq_len=2048, shuffle=True, prefetch=1
                ) as ld:
                    next(iter(ld))
                    seconds = time.perf_counter() - start
                    after = proxy.counts()
                    server_after = float("nan") if server_pid is None else cpu_seconds(server_pid)
                    cpu = time.process_time() - cpu_before
                    done = list(log)
            for kind, where, a, b in sorted(done, key=lambda entry: entry[2]):
                began, ended = (a - start) * 1e3, (b - start) * 1e3
                print(f"  {kind:<5}{where:<44}{began:>8.1f} ->{ended:>8.1f} ms")
            counted = after - before
            return {
                "s": seconds,
                "open_s": opened,
                "requests": counted.requests,
                "bytes": counted.down_bytes,
                "server_cpu_s": server_after - server_before,
                "cpu_s": cpu,
            }

        measure("paged")  # imports, clients warm: untimed
        if args.trace:
            print("# one paged round, every request from the open (start -> end):")
            measure("paged", trace=True)
        for round_ in range(args.rounds):
            order = list(LAYOUTS)[round_ % 2 :] + list(LAYOUTS)[: round_ % 2]
            for layout in order:
                results[layout].append(measure(layout))
    print(
        f"# s3: {args.documents} documents (0-5 tokens) in one shard, {args.server} through a"
        " counting"
        f" proxy (+{args.delay_ms:g} ms); open + first batch of 16 x 2048, exact shuffle,"
        f" prefetch=1; {args.rounds} rounds, medians; load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"# {args.server} alone, one 4 KiB range GET (median of 7): the index object"
        f" {single['shard-00000.idx']:.1f} ms, the shard {single['shard-00000.bin']:.1f} ms"
    )
    print(
        f"{'index':<8}{'requests':>10}{'KiB':>10}{'ms':>9}{'open ms':>9}"
        f"{'server CPU ms':>15}{'client CPU ms':>15}"
    )
    for layout, runs in results.items():

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"{layout:<8}{median('requests'):>10.0f}{median('bytes') / 1024:>10.1f}"
            f"{median('s') * 1e3:>9.1f}{median('open_s') * 1e3:>9.1f}"
            f"{median('server_cpu_s') * 1e3:>15.0f}{median('cpu_s') * 1e3:>15.0f}"
        )
    ratio = paired_ratio([r["s"] for r in results["paged"]], [r["s"] for r in results["whole"]])
    print(f"time to first batch, paged / whole: {ratio:.2f} (paired)")


# ---------------------------------------------------------------------------------------------
# epoch: simulated ranks of an exact global shuffle


def drive(steps: Generator[Any, Any, Any], files: list[str], counts: dict[str, Any]) -> Any:
    """Run a source's index generator to its end, serving its reads from local files."""
    try:
        step = next(steps)
        while True:
            if isinstance(step, Wait):  # one batch at a time: nothing to wait for
                step = steps.send(None)
                continue
            assert isinstance(step, Read)
            plan = step.plan
            assert isinstance(plan, ReadPlan)  # index reads are byte ranges
            buffer = read_plan_files(plan, files)
            for f, a, b in zip(
                plan.read_shard.tolist(),
                plan.read_start.tolist(),
                plan.read_end.tolist(),
                strict=True,
            ):
                counts["bytes"] += b - a
                counts["requests"] += 1
                key = (f, a, b)
                counts["repeats"] += key in counts["seen"]
                counts["seen"].add(key)
            step = steps.send(buffer)
    except StopIteration as stop:
        return stop.value


def simulate_rank(
    dataset: ab.Dataset, rank: int, world: int, seq_len: int, budget: int
) -> dict[str, float]:
    index = DocumentIndex([dataset], [None], 0, budget)
    files = [u.removeprefix("file://") for u in index.index_urls]
    windows = dataset.shard_map.total // seq_len
    positions = np.arange(rank, windows // world * world, world, dtype=np.int64)
    ids = GlobalShuffle(windows, 0)(0, positions)
    counts: dict[str, Any] = {"bytes": 0, "requests": 0, "repeats": 0, "seen": set()}
    peak = 0
    start = time.perf_counter()
    for batch in np.array_split(ids, max(1, ids.size // 16)):
        drive(index.window_offsets(batch * seq_len, seq_len), files, counts)
        peak = max(peak, index.cached_bytes)
    return {
        "index_bytes": counts["bytes"],
        "token_bytes": ids.size * seq_len * 2,
        "requests": counts["requests"],
        "repeats": counts["repeats"],
        "peak_cache": peak,
        "seconds": time.perf_counter() - start,
    }


def part_epoch(args: argparse.Namespace) -> None:
    print(
        f"# epoch: exact global shuffle of windows of {args.seq_len} (uint16) over"
        f" {args.epoch_documents} documents of 100-299 tokens, shards of 256 MiB, world"
        f" {args.world}, ranks 0..{args.ranks - 1} simulated, 16 windows a batch,"
        f" index_cache_bytes {args.budget / 2**20:g} MiB"
    )
    print(
        f"{'index':<8}{'page':>6}{'rank':>5}{'index MiB':>11}{'token MiB':>11}{'ratio':>8}"
        f"{'requests':>10}{'refetched':>10}{'peak cache MiB':>16}{'s':>7}"
    )
    layouts: list[tuple[str, int | None]] = []
    if "slots" in args.layouts:
        layouts.append(("slots", PAGE_DOCUMENTS))
    if "paged" in args.layouts:
        layouts += [("paged", page) for page in args.pages]
    if "whole" in args.layouts:
        layouts.append(("whole", None))
    for layout, page in layouts:
        slotted = layout == "slots"
        root = ensure("epoch", args.epoch_documents, 100, 300, page, False, slotted)
        dataset = ab.open_dataset(str(root))
        if slotted:
            entries = dataset.manifest.metadata["shard_indexes"]
            tables = {
                (e["slots"]["block_tokens"], e["slots"]["starts"]) for e in entries if "slots" in e
            }
            kept = sum(1 for e in entries if "slots" in e)
            print(
                f"# slots: {kept} of {len(entries)} shards, (block tokens, starts a slot):"
                f" {sorted(tables)}; bytes per shard index file (median)"
                f" {int(statistics.median(e['bytes'] for e in entries)):,}"
            )
        rows = [
            simulate_rank(dataset, rank, args.world, args.seq_len, args.budget)
            for rank in range(args.ranks)
        ]
        for rank, row in enumerate(rows):
            print(
                f"{layout:<8}{page or '-':>6}{rank:>5}"
                f"{row['index_bytes'] / 2**20:>11.2f}{row['token_bytes'] / 2**20:>11.2f}"
                f"{row['index_bytes'] / row['token_bytes']:>8.1%}{row['requests']:>10}"
                f"{row['repeats']:>10}{row['peak_cache'] / 2**20:>16.2f}{row['seconds']:>7.1f}"
            )


# ---------------------------------------------------------------------------------------------
# local: open and first batch at 10^6 .. 10^8 documents, in a fresh process each


def first_batches(root: str) -> tuple[float, float, float]:
    """Seconds to open ``root``, to the first packed batch, to the first batch of
    documents."""
    start = time.perf_counter()
    dataset = ab.open_dataset(root)
    opened = time.perf_counter()
    with ab.Loader(dataset, batch_size=16, seq_len=2048, shuffle=True, prefetch=1) as loader:
        next(iter(loader))
    packed = time.perf_counter()
    with ab.Loader(dataset, batch_size=64, shuffle=True, prefetch=1) as loader:
        next(iter(loader))
    return opened - start, packed - opened, time.perf_counter() - packed


def anonymous_kib() -> int:
    """The process's anonymous resident memory (``RssAnon``: not the file pages it maps)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(root: str, warm: str) -> None:
    """In a fresh process, after the same steps on a small dataset (imports, threads):
    open, first packed batch, first batch of documents (JSON out)."""
    first_batches(warm)
    base, anonymous = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, anonymous_kib()
    opened, packed, samples = first_batches(root)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(
        json.dumps(
            {
                "open_s": opened,
                "packed_s": packed,
                "samples_s": samples,
                "rss_mib": grown / 1024,
                "anon_mib": (anonymous_kib() - anonymous) / 1024,
            }
        )
    )


def part_local(args: argparse.Namespace) -> None:
    print(
        "# local: documents of 0-5 tokens, paged (512 a page), shards of 256 MiB; a fresh"
        f" process each, {args.rounds} rounds, medians; peak RSS (mapped file pages included)"
        " and anonymous memory grown over a warm-up"
    )
    print(
        f"{'documents':>12}{'shards':>8}{'open ms':>9}{'16x2048 ms':>12}{'64 docs ms':>12}"
        f"{'RSS MiB':>9}{'anon MiB':>10}"
    )
    warm = ensure("local", 50_000, 0, 6, PAGE_DOCUMENTS, True)
    for count in args.local_documents:
        root = ensure("local", count, 0, 6, PAGE_DOCUMENTS, True)
        shards = len(json.loads((root / "manifest.json").read_text())["shards"])
        runs = []
        for _ in range(args.rounds):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(root), str(warm)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"{count:>12}{shards:>8}{median('open_s') * 1e3:>9.1f}"
            f"{median('packed_s') * 1e3:>12.1f}{median('samples_s') * 1e3:>12.1f}"
            f"{median('rss_mib'):>9.1f}{median('anon_mib'):>10.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["s3", "epoch", "local", "all"], default="all")
    parser.add_argument("--documents", type=positive, default=5_000_000)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--server",
        choices=["moto", "s3rver"],
        default="moto",
        help="s3: the S3 server (s3rver: Node, installed with npm on first use)",
    )
    parser.add_argument(
        "--trace", action="store_true", help="s3: print one paged round's requests, timed"
    )
    parser.add_argument("--epoch-documents", type=positive, default=10_000_000)
    parser.add_argument("--world", type=positive, default=64)
    parser.add_argument("--ranks", type=positive, default=4)
    parser.add_argument("--seq-len", type=positive, default=2048)
    parser.add_argument("--budget", type=positive, default=64 * 2**20)
    parser.add_argument("--pages", type=positive, nargs="+", default=[PAGE_DOCUMENTS])
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["slots", "paged", "whole"],
        default=["slots", "paged", "whole"],
        help="epoch: the index layouts simulated (slots: paged at 512 plus the slot table)",
    )
    parser.add_argument(
        "--local-documents",
        type=positive,
        nargs="+",
        default=[1_000_000, 10_000_000, 100_000_000],
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"# bench_documents_index {datetime.date.today()} commit {git_revision()}")
    print(f"# {platform.machine()} Python {platform.python_version()}, {os.cpu_count()} cpus")
    if args.part in ("s3", "all"):
        part_s3(args)
    if args.part in ("epoch", "all"):
        part_epoch(args)
    if args.part in ("local", "all"):
        part_local(args)


if __name__ == "__main__":
    main()
