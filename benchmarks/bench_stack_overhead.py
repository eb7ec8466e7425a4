"""What the store stack's layers cost per group read, over a transport that returns at once.

The engine reads a group of ranges with one ``read_into`` call; over the local store that
call crosses the checks (``verify="size"``, the default), the retrying layer (which counts
the ranges) and the transport layer of ``stores/stack.py`` before the C copy. This times
that call over a ``LocalStore`` whose ``read_into`` does nothing, bare, stacked and counted,
and with the checks on top (every object passed, as after its first use), as
``open_store`` stacks them, interleaved; prints the medians and the median of the per-round
differences.

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

from asyncbatch.stores._base import Store
from asyncbatch.stores._checked import CheckedStore, Expected
from asyncbatch.stores._counting import ReadCounts
from asyncbatch.stores._local import LocalStore
from asyncbatch.stores._stack import stacked


class InstantStore(LocalStore):
    """A local store whose group reads return at once: only the layers above are timed.
    Its flags let it be timed bare, as the engine would call a store."""

    supports_read_into = True
    supports_windows = True
    supports_discard = False

    async def read_into(self, *args: Any) -> None:
        return None


async def per_call(store: Store, calls: int) -> float:
    """Microseconds per ``read_into`` call of one 4 KiB range."""
    assert store.supports_read_into
    which, starts = np.zeros(1, np.int64), np.array([4096], np.int64)
    dest, offsets = np.empty(4096, np.uint8), np.zeros(1, np.int64)
    began = time.perf_counter()
    for _ in range(calls):
        await store.read_into(["/x"], which, starts, starts + 4096, dest, offsets)
    return (time.perf_counter() - began) / calls * 1e6


async def main(rounds: int, calls: int) -> None:
    bare = InstantStore()
    stack = stacked(InstantStore(), counts=ReadCounts())
    expected = Expected(["/x"], np.array([8192], np.int64), level="size")
    expected.passed[:] = True
    checked = CheckedStore(stacked(InstantStore(), counts=ReadCounts()), expected)
    stores = {"bare": bare, "stacked": stack, "checked": checked}
    times: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(rounds):
        for name, store in stores.items():
            times[name].append(await per_call(store, calls))
    for store in stores.values():
        await store.close()

    def added(name: str) -> float:
        return statistics.median(s - b for b, s in zip(times["bare"], times[name], strict=True))

    print(
        f"bare {statistics.median(times['bare']):.2f} us/call,"
        f" stacked {statistics.median(times['stacked']):.2f} us/call,"
        f" with checks {statistics.median(times['checked']):.2f} us/call;"
        f" the stack adds {added('stacked'):.2f} us per group read,"
        f" {added('checked'):.2f} us with the checks (medians of per-round differences)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=21)
    parser.add_argument("--calls", type=positive, default=5000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.calls))
