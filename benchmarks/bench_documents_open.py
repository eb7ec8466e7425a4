"""Opening a documents dataset of millions of documents over S3: per-shard indexes beside the
single ``documents.idx``.

The same ``--documents`` short documents (0 to 5 uint16 tokens each: the index, not the
tokens, is what grows with the document count) in shards of ``--per-shard`` documents, written
once to a cache folder in both layouts (documents never cross shard ends in either):

* ``per_shard``: a whole ``shard-K.idx`` beside each shard (``ab.write_documents``' layout
  before paged indexes, ``page_documents=None``; paged ones: ``bench_documents_index.py``);
* ``single``: one ``documents.idx`` of 8 bytes per document (``index="single"``), the
  baseline.

Both are uploaded to moto's S3 server (started here, ``python -m moto.server``), read through
``delayproxy.py`` (``--delay-ms``, default 0), which counts the requests and the bytes it
passes back (headers included). Each round, for each line in rotating order:
``ab.open_dataset(url)`` (timed, counted), then ``ab.Loader(ds, batch_size=64, shuffle=S,
seed=0, ...)`` up to its first batch (timed from the start of the open, counted between the
open's end and the first batch: reads under way for the next batches are included), for
``S`` = ``False``, ``"block"`` (``block_size=512``: about 1 MiB of documents of 1,000 tokens,
as the default block would be on a real corpus; these documents are 400 times shorter) and
``True``; with ``True``, per-shard indexes once more with ``index_cache_bytes`` below their
total, so that each document's two offsets are read by range instead of whole indexes.
Prints medians, and per shuffle the paired ratio of the time to the first batch of per-shard
indexes to the single index.

Usage: ``.venv/bin/python benchmarks/bench_documents_open.py [--documents 5000000]
[--per-shard 100000] [--rounds 5] [--delay-ms 0]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import s3fs
from common import git_revision, paired_ratio, positive, settle
from common import moto_server as start_moto
from delayproxy import Counts, running_proxy

import asyncbatch as ab
from asyncbatch._checksums import ALGORITHM, DEFAULT_CHECKSUM_BLOCK, block_digests, digest
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch.formats._documents_index import (
    index_path,
    per_shard_metadata,
    shard_index_bytes,
    shard_index_info,
)

BUCKET = "bench-documents"
LAYOUTS = ("per_shard", "single")
SHUFFLES: tuple[Any, ...] = (False, "block", True)
BATCH_SIZE = 64
BLOCK_SIZE = 512
#: (name, layout, shuffle, format_options) of each line.
LINES: tuple[tuple[str, str, Any, dict[str, Any]], ...] = (
    *((layout, layout, shuffle, {}) for shuffle in SHUFFLES for layout in LAYOUTS),
    ("by range", "per_shard", True, {"index_cache_bytes": 8 * 2**20}),
)


def write_layouts(root: Path, count: int, per_shard: int) -> None:
    """Both layouts of the same documents under ``root/per_shard`` and ``root/single``,
    written with numpy and the writers' helpers (fast for millions of documents)."""
    lengths = np.random.default_rng(0).integers(0, 6, count)
    tokens = np.repeat(np.arange(count) % 60_000, lengths).astype(np.uint16)
    ends = np.cumsum(lengths)
    for layout in LAYOUTS:
        (root / layout).mkdir(parents=True, exist_ok=True)
    shards, infos, counts = [], [], []
    for k, first in enumerate(range(0, count, per_shard)):
        last = min(count, first + per_shard)
        start = int(ends[first - 1]) if first else 0
        data = tokens[start : int(ends[last - 1])].tobytes()
        name = f"shard-{k:05d}.bin"
        for layout in LAYOUTS:
            (root / layout / name).write_bytes(data)
        blocks = block_digests(data, DEFAULT_CHECKSUM_BLOCK)
        shards.append(ShardInfo(name, len(data), len(data) // 2, 0, digest(data), blocks))
        # Whole per-shard indexes, as this section measured them (paged ones:
        # bench_documents_index.py).
        raw = shard_index_bytes(
            np.concatenate([[0], ends[first:last] - start]), page_documents=None
        )
        (root / "per_shard" / index_path(name)).write_bytes(raw)
        infos.append(shard_index_info(index_path(name), raw))
        counts.append(last - first)
    offsets = np.concatenate([[0], ends]).astype("<i8")
    (root / "single" / "documents.idx").write_bytes(offsets.tobytes())
    metadata = {
        "per_shard": per_shard_metadata(counts, infos),
        "single": {"document_index": "documents.idx", "documents": count},
    }
    for layout in LAYOUTS:
        manifest = Manifest(
            "documents",
            np.dtype(np.uint16),
            tuple(shards),
            metadata[layout],
            checksum=ALGORITHM,
            checksum_block=DEFAULT_CHECKSUM_BLOCK,
        )
        (root / layout / "manifest.json").write_text(manifest.to_json())


def ensure_layouts(count: int, per_shard: int) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache) / "asyncbatch" / f"bench-documents-open-{count}x{per_shard}"
    if not (root / "single" / "manifest.json").exists():
        print(f"writing {count} documents in both layouts to {root}", file=sys.stderr)
        write_layouts(root, count, per_shard)
    return root


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in its own process; its URL."""
    with start_moto() as (url, _):
        yield url


def measure(
    url: str, options: dict[str, Any], shuffle: Any, format_options: dict[str, Any], proxy: Any
) -> dict[str, float]:
    """Open ``url`` and read the first batch: seconds, requests and bytes of each step."""
    settle(proxy)
    before = proxy.counts()
    start = time.perf_counter()
    dataset = ab.open_dataset(url, options)
    opened = time.perf_counter()
    after_open: Counts = proxy.counts()
    extra = {"block_size": BLOCK_SIZE} if shuffle == "block" else {}
    with ab.Loader(
        dataset,
        batch_size=BATCH_SIZE,
        shuffle=shuffle,
        seed=0,
        format_options=format_options,
        **extra,
    ) as loader:
        batch = next(iter(loader))
        first = time.perf_counter()
        after_first: Counts = proxy.counts()
    assert batch["tokens"].lengths.numel() == BATCH_SIZE
    open_counts, first_counts = after_open - before, after_first - after_open
    return {
        "open_s": opened - start,
        "open_requests": open_counts.requests,
        "open_bytes": open_counts.down_bytes,
        "first_s": first - start,
        "first_requests": first_counts.requests,
        "first_bytes": first_counts.down_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=positive, default=5_000_000)
    parser.add_argument("--per-shard", type=positive, default=100_000)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    root = ensure_layouts(args.documents, args.per_shard)
    with moto_server() as endpoint, running_proxy(endpoint, args.delay_ms / 1e3) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
        fs.mkdir(BUCKET)
        for layout in LAYOUTS:
            fs.put(str(root / layout), f"{BUCKET}/{layout}", recursive=True)
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        urls = {layout: f"s3://{BUCKET}/{layout}" for layout in LAYOUTS}
        measure(urls["per_shard"], options, False, {}, proxy)  # imports, clients warm: untimed
        results: list[list[dict[str, float]]] = [[] for _ in LINES]
        for round_ in range(args.rounds):
            turn = round_ % len(LINES)
            for number in [*range(turn, len(LINES)), *range(turn)]:
                _, layout, shuffle, format_options = LINES[number]
                run = measure(urls[layout], options, shuffle, format_options, proxy)
                results[number].append(run)
    shards = -(-args.documents // args.per_shard)
    print(f"# bench_documents_open {datetime.date.today()} commit {git_revision()}")
    print(f"# {platform.machine()} Python {platform.python_version()}, {os.cpu_count()} cpus")
    print(
        f"# {args.documents} documents in {shards} shards, moto S3 through a counting proxy"
        f" (+{args.delay_ms:g} ms), batch {BATCH_SIZE}, {args.rounds} rounds, medians"
    )
    print(
        f"{'index':<10}{'shuffle':<8}{'open req':>9}{'open KiB':>11}{'open ms':>9}"
        f"{'1st req':>9}{'1st KiB':>11}{'to 1st batch ms':>17}"
    )
    for (name, _, shuffle, _), runs in zip(LINES, results, strict=True):

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[key] for run in runs)

        print(
            f"{name:<10}{shuffle!s:<8}{median('open_requests'):>9.0f}"
            f"{median('open_bytes') / 1024:>11.1f}{median('open_s') * 1e3:>9.1f}"
            f"{median('first_requests'):>9.0f}{median('first_bytes') / 1024:>11.1f}"
            f"{median('first_s') * 1e3:>17.1f}"
        )
    names = [(name, shuffle) for name, _, shuffle, _ in LINES]
    for name in ("per_shard", "by range"):
        for shuffle in SHUFFLES:
            if (name, shuffle) not in names:
                continue
            ratio = paired_ratio(
                [run["first_s"] for run in results[names.index((name, shuffle))]],
                [run["first_s"] for run in results[names.index(("single", shuffle))]],
            )
            print(f"shuffle={shuffle!s}: to first batch, {name} / single: {ratio:.2f} (paired)")


if __name__ == "__main__":
    main()
