"""Opening WebDataset shards with sidecar indexes over S3: summaries read at open and the
rest fetched per shard as batches need it (sidecar version 2), beside whole sidecars read at
open (version 1, what every rank did before; still read that way).

The same ``--shards`` shards of ``--per-shard`` small samples (``bin``: 64 random bytes,
``cls``: a label; small samples make the index large beside the data, as in LAION's
captions or audio clips) are written once to a cache folder by ``ab.write_webdataset``,
then copied with version 1 sidecars made from the same indexes. Both are uploaded to moto's
S3 server (started here) and read through ``delayproxy.py`` (``--delay-ms``, default 10),
which counts requests and the bytes it passes back (headers included). Each round, for each
line in rotating order: ``ab.open_dataset(url)`` (timed, counted), then rank 0 of 4 reads up
to its first batch of 64 (timed from the start of the open, counted after the open) under
``shuffle="block"`` (``block_size=512``) and ``shuffle=True``. Prints medians and the paired
ratio of version 1 to version 2 for the open's bytes and time and the time to the first
batch (from the open's start, and from its end: version 2 fetches sidecars there).

Usage: ``.venv/bin/python benchmarks/bench_webdataset_open.py [--shards 32]
[--per-shard 2000] [--rounds 3] [--delay-ms 10]``
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import s3fs
from common import (
    cache_folder,
    git_revision,
    machine,
    moto_server,
    paired_ratio,
    positive,
    rotated,
    settle,
)
from delayproxy import Counts, running_proxy

import asyncbatch as ab
from asyncbatch._checksums import digest
from asyncbatch.formats._webdataset_index import ShardIndex, sidecar_url

BUCKET = "bench-webdataset"
LAYOUTS = ("v2", "v1")
SHUFFLES: tuple[Any, ...] = ("block", True)
BATCH_SIZE = 64
BLOCK_SIZE = 512


def pack_v1(index: ShardIndex) -> bytes:
    """``index`` as a version 1 sidecar: no summary, the field names closing the body."""
    names = [n.encode() for n in index.fields]
    name_offsets = np.cumsum([0, *(len(n) for n in names)]).astype("<u4")
    body = b"".join(
        (
            index.starts.astype("<u8").tobytes(),
            index.ends.astype("<u8").tobytes(),
            index.key_offsets.astype("<u8").tobytes(),
            index.offsets.astype("<u8").tobytes(),
            index.lengths.astype("<u8").tobytes(),
            index.members.astype("<u4").tobytes(),
            name_offsets.tobytes(),
            index.field.astype("<u4").tobytes(),
            index.keys.tobytes(),
            b"".join(names),
        )
    )
    counts = (index.size, index.num_samples, index.offsets.size, index.keys.size)
    header = struct.pack(
        "<8sIIQQQQQQ", b"ABTARIDX", 1, len(names), *counts, int(name_offsets[-1]), digest(body)
    )
    return header + body


def ensure_layouts(shards: int, per_shard: int) -> Path:
    root = cache_folder(f"bench-webdataset-open-{shards}x{per_shard}")
    if (root / "done").exists():
        return root
    print(f"writing {shards} shards of {per_shard} samples to {root}", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    samples = (
        {"__key__": f"{i:09d}", "bin": rng.bytes(64), "cls": i % 1000}
        for i in range(shards * per_shard)
    )
    ab.write_webdataset(str(root / "v2"), samples, shard_size=2**40, max_count=per_shard)
    (root / "v1").mkdir()
    for tar in sorted((root / "v2").glob("*.tar")):
        shutil.copy(tar, root / "v1" / tar.name)
        index = ShardIndex.parse(Path(sidecar_url(str(tar))).read_bytes(), str(tar))
        Path(sidecar_url(str(root / "v1" / tar.name))).write_bytes(pack_v1(index))
    (root / "done").touch()
    return root


def measure(url: str, options: dict[str, Any], shuffle: Any, proxy: Any) -> dict[str, float]:
    """Open ``url`` and read rank 0's first batch of 4 ranks: seconds, requests, bytes."""
    settle(proxy)
    before = proxy.counts()
    start = time.perf_counter()
    dataset = ab.open_dataset(url, options)
    opened = time.perf_counter()
    after_open: Counts = proxy.counts()
    extra = {"block_size": BLOCK_SIZE} if shuffle == "block" else {}
    with ab.Loader(
        dataset, batch_size=BATCH_SIZE, shuffle=shuffle, seed=0, rank=0, world_size=4, **extra
    ) as loader:
        batch = next(iter(loader))
        first = time.perf_counter()
    assert batch.batch_size == BATCH_SIZE
    open_counts = after_open - before
    return {
        "open_s": opened - start,
        "open_requests": open_counts.requests,
        "open_bytes": open_counts.down_bytes,
        "first_s": first - start,
        "after_open_s": first - opened,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=positive, default=32)
    parser.add_argument("--per-shard", type=positive, default=2000)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    args = parser.parse_args()
    root = ensure_layouts(args.shards, args.per_shard)
    lines = [(layout, shuffle) for shuffle in SHUFFLES for layout in LAYOUTS]
    with moto_server() as (endpoint, _), running_proxy(endpoint, args.delay_ms / 1e3) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
        fs.mkdir(BUCKET)
        for layout in LAYOUTS:
            fs.put(str(root / layout), f"{BUCKET}/{layout}", recursive=True)
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        urls = {layout: f"s3://{BUCKET}/{layout}" for layout in LAYOUTS}
        measure(urls["v2"], options, "block", proxy)  # imports, clients warm: untimed
        results: list[list[dict[str, float]]] = [[] for _ in lines]
        for round_ in range(args.rounds):
            for number in rotated(len(lines), round_):
                layout, shuffle = lines[number]
                results[number].append(measure(urls[layout], options, shuffle, proxy))
    sidecar = Path(sidecar_url(str(next((root / "v2").glob("*.tar"))))).stat().st_size
    print(f"# bench_webdataset_open {datetime.date.today()} commit {git_revision()}")
    print(f"# {machine()}")
    print(
        f"# {args.shards} shards of {args.per_shard} samples (sidecars of {sidecar} bytes), moto"
        f" S3 through a counting proxy (+{args.delay_ms:g} ms), rank 0 of 4, batch"
        f" {BATCH_SIZE}, {args.rounds} rounds, medians"
    )
    heads = ("open req", "open KiB", "open ms", "to 1st ms", "open→1st")
    print(f"{'sidecars':<9}{'shuffle':<8}" + "".join(f"{h:>11}" for h in heads))
    for (layout, shuffle), runs in zip(lines, results, strict=True):

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[key] for run in runs)

        print(
            f"{layout:<9}{shuffle!s:<8}{median('open_requests'):>11.0f}"
            f"{median('open_bytes') / 1024:>11.1f}{median('open_s') * 1e3:>11.1f}"
            f"{median('first_s') * 1e3:>11.1f}{median('after_open_s') * 1e3:>11.1f}"
        )
    for shuffle in SHUFFLES:
        v2, v1 = (results[lines.index((layout, shuffle))] for layout in LAYOUTS)
        ratios = {
            key: paired_ratio([r[key] for r in v1], [r[key] for r in v2])
            for key in ("open_bytes", "open_s", "first_s", "after_open_s")
        }
        print(
            f"# shuffle={shuffle!s}: v1 / v2 open bytes {ratios['open_bytes']:.1f}x, open time"
            f" {ratios['open_s']:.2f}x, time to the first batch {ratios['first_s']:.2f}x (after"
            f" the open: {ratios['after_open_s']:.2f}x)"
        )


if __name__ == "__main__":
    main()
