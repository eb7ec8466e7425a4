"""A ``prepare`` run for tests/test_prepare.py to kill: ``prepare_child.py INPUTS OUTPUT``.

Its tokenizer (a module-level callable, so spawned workers can import it) splits on spaces
and sleeps a little per batch, so that the run is still going when the test kills it.
"""

from __future__ import annotations

import sys
import time

import asyncbatch as ab


def slow_tokenizer(texts: list[str]) -> list[list[int]]:
    time.sleep(0.2)
    return [[len(word) for word in text.split()] for text in texts]


def torch_free_tokenizer(texts: list[str]) -> list[list[int]]:
    """Splits on spaces, in a worker that must not have imported torch (2 s of CPU each)."""
    if "torch" in sys.modules:
        raise RuntimeError("a prepare worker imported torch")
    return [[len(word) for word in text.split()] for text in texts]


if __name__ == "__main__":
    report = ab.prepare(
        sys.argv[1],
        sys.argv[2],
        tokenizer=slow_tokenizer,
        eos=0,
        vocab_size=1000,
        workers=int(sys.argv[3]),
        unit_size=int(sys.argv[4]),
        shard_size=4096,
        progress=False,
    )
    print(report.summary())
