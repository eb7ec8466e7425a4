"""What the store stack's layers cost per group read, over a transport that returns at once.

The engine reads a group of ranges with one ``read_into`` call; over the local store that
call crosses the counter, the retrying layer and the transport layer of
``stores/stack.py`` before the C copy. This times that call over a ``LocalStore`` whose
``read_into`` does nothing, bare (counted only, as the engine saw it before the store was
stacked) and stacked as ``open_store`` stacks it, interleaved; prints the medians and the
median of the per-round differences.

    .venv/bin/python benchmarks/bench_stack_overhead.py --rounds 21
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np
from common import positive

from asyncbatch.stores.base import ReadsInto, Store
from asyncbatch.stores.counting import ReadCounts, counting
from asyncbatch.stores.local import LocalStore
from asyncbatch.stores.stack import stacked


class InstantStore(LocalStore):
    """A local store whose group reads return at once: only the layers above are timed."""

    async def read_into(self, *args: Any) -> None:
        return None


async def per_call(store: Store, calls: int) -> float:
    """Microseconds per ``read_into`` call of one 4 KiB range."""
    assert isinstance(store, ReadsInto)
    which, starts = np.zeros(1, np.int64), np.array([4096], np.int64)
    dest, offsets = np.empty(4096, np.uint8), np.zeros(1, np.int64)
    began = time.perf_counter()
    for _ in range(calls):
        await store.read_into(["/x"], which, starts, starts + 4096, dest, offsets)
    return (time.perf_counter() - began) / calls * 1e6


async def main(rounds: int, calls: int) -> None:
    bare = counting(InstantStore(), ReadCounts())
    stack = counting(stacked(InstantStore()), ReadCounts())
    times: dict[str, list[float]] = {"bare": [], "stacked": []}
    for _ in range(rounds):
        times["bare"].append(await per_call(bare, calls))
        times["stacked"].append(await per_call(stack, calls))
    await bare.close()
    await stack.close()
    added = [s - b for b, s in zip(times["bare"], times["stacked"], strict=True)]
    print(
        f"bare {statistics.median(times['bare']):.2f} us/call,"
        f" stacked {statistics.median(times['stacked']):.2f} us/call;"
        f" the stack adds {statistics.median(added):.2f} us per group read"
        " (median of per-round differences)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=21)
    parser.add_argument("--calls", type=positive, default=5000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.calls))
