"""The obstore adapter (examples/adapter) against the built-in S3 store, on s3rver.

Both stores read the same random byte ranges of one object, one range per call, with the
same number of calls in flight, through asyncbatch's full store stack (``open_store``: the
guards, retries and counting every Loader read goes through). Rounds alternate the two
stores; the table gives the median ranges/s and MB/s and the paired ratio. ``--delay-ms``
puts the benchmarks' delay proxy (a fixed latency per request) in front of s3rver.

    python benchmarks/bench_adapter.py [--size-mib 64] [--range-kib 64 1024] [--inflight 32]

Needs ``pip install -e examples/adapter`` (scripts/bootstrap does) and node for s3rver.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator

import numpy as np
from common import git_revision, positive
from delayproxy import running_proxy
from s3rver import BUCKET, KEY, SECRET, default_s3rver_dir, ensure_s3rver, running_s3rver

from asyncbatch.stores import open_store

OBJECT = "blob.bin"


async def read_ranges(
    url: str, options: dict[str, object], starts: list[int], size: int, inflight: int
) -> float:
    """Seconds to read ``size`` bytes at each of ``starts``, ``inflight`` calls at a time."""
    store = open_store(url, options, max_inflight=inflight)
    limit = asyncio.Semaphore(inflight)

    async def one(start: int) -> None:
        async with limit:
            buffer = memoryview(bytearray(size))
            await store.read_ranges(url, starts=[start], ends=[start + size], buffers=[buffer])

    try:
        await one(0)  # a first request opens sessions and pins the object
        began = time.perf_counter()
        await asyncio.gather(*(one(start) for start in starts))
        return time.perf_counter() - began
    finally:
        await store.close()


@contextlib.contextmanager
def endpoint(delay_ms: float) -> Iterator[str]:
    with running_s3rver(ensure_s3rver(default_s3rver_dir())) as url:
        if delay_ms <= 0:
            yield url
            return
        with running_proxy(url, delay_ms / 1e3) as proxy:
            yield proxy.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=positive, default=64, help="object size (default 64)")
    parser.add_argument(
        "--range-kib",
        type=positive,
        nargs="+",
        default=[64, 1024],
        help="range sizes in KiB (default 64 1024)",
    )
    parser.add_argument("--ranges", type=positive, default=400, help="ranges per round (400)")
    parser.add_argument("--inflight", type=positive, default=32, help="calls in flight (32)")
    parser.add_argument("--rounds", type=positive, default=5, help="rounds per store (5)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="proxy latency (0: none)")
    args = parser.parse_args()
    import s3fs

    size = args.size_mib * 2**20
    with endpoint(args.delay_ms) as url:
        s3 = {"endpoint_url": url, "key": KEY, "secret": SECRET}
        fs = s3fs.S3FileSystem(**s3, skip_instance_cache=True)
        fs.pipe_file(f"{BUCKET}/{OBJECT}", np.random.default_rng(0).bytes(size))
        stores = {
            "s3 (built-in)": f"s3://{BUCKET}/{OBJECT}",
            "obstore+s3": f"obstore+s3://{BUCKET}/{OBJECT}",
        }
        print(
            f"# asyncbatch {git_revision()}: one {args.size_mib} MiB object on s3rver, "
            f"delay {args.delay_ms} ms, {args.inflight} calls in flight, "
            f"{args.ranges} ranges x {args.rounds} rounds"
        )
        print(f"{'range':>8} {'store':>14} {'ranges/s':>9} {'MB/s':>8} {'vs built-in':>11}")
        for kib in args.range_kib:
            length = kib * 1024
            rng = np.random.default_rng(kib)
            seconds: dict[str, list[float]] = {name: [] for name in stores}
            for _ in range(args.rounds):
                starts = rng.integers(0, size - length, args.ranges).tolist()
                for name, store_url in stores.items():
                    seconds[name].append(
                        asyncio.run(read_ranges(store_url, s3, starts, length, args.inflight))
                    )
            base = seconds["s3 (built-in)"]
            for name, runs in seconds.items():
                rate = args.ranges / statistics.median(runs)
                ratio = statistics.median(b / r for b, r in zip(base, runs, strict=True))
                print(
                    f"{kib:>5}KiB {name:>14} {rate:>9.0f} {rate * length / 1e6:>8.1f} "
                    f"{ratio:>10.2f}x"
                )


if __name__ == "__main__":
    main()
