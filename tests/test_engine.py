"""The engine (``_engine.py``): an error reaches the consumer after every good batch before
it; the default prefetch fits its memory budget; the local fast path is as short as
docs/design.md says; a group's fields cut into batches as slicing would, with the bytes the
queue counts; a run's first batch handed over before more is read."""

from __future__ import annotations

import inspect
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import asyncbatch as ab
from asyncbatch._batch import Jagged
from asyncbatch._engine import split_sized
from asyncbatch._handoff import fields_bytes


@pytest.fixture
def dataset(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> ab.Dataset:
    return ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=2222)


def test_engine_error_reaches_the_consumer_after_good_batches(tmp_path: Path) -> None:
    dataset = ab.write_tokens(
        str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16), shard_size=2000
    )
    os.remove(dataset.shard_urls[1])
    with ab.Loader(dataset, batch_size=2, seq_len=100, shuffle=False, prefetch=2) as loader:
        got = []
        with pytest.raises(FileNotFoundError, match="shard-00001.bin") as caught:
            for batch in loader:
                got.append(batch.global_indexes.tolist())
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # every batch of the first shard
    assert isinstance(caught.value, ab.NotFoundError)
    assert caught.value.__cause__ is not None


def test_default_prefetch_fits_in_a_memory_budget(dataset: ab.Dataset) -> None:
    with ab.Loader(dataset, batch_size=4, seq_len=16) as small:
        assert small.prefetch == 1024  # local files: up to 1024 (remote stores: 128)
    # 4096 windows × 10000 tokens × 2 bytes = 78 MiB per batch: the minimum of 2. (The data
    # holds fewer samples: drop_last=False keeps the one short batch the loader needs.)
    with ab.Loader(dataset, batch_size=4096, seq_len=10_000, drop_last=False) as big:
        assert big.prefetch == 2
    # 64 × 2048 × (2 stored + 8 as int64) bytes = 1.25 MiB per batch: 51 fit.
    with ab.Loader(
        dataset, batch_size=64, seq_len=2048, dtype=torch.int64, drop_last=False
    ) as wide:
        assert wide.prefetch == 51
    with ab.Loader(dataset, batch_size=8, seq_len=16, prefetch=3) as chosen:
        assert chosen.prefetch == 3


def test_the_local_fast_path_is_the_documented_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the group's task and the local store, a batch of windows passes only the
    engine's read and the retrying layer (docs/design.md, "The path of one batch"): the
    checks layer, once every shard passed, binds its reads straight through."""
    from asyncbatch.stores._local import LocalStore

    stacks: list[list[str]] = []
    original = LocalStore.read_windows

    async def traced(self: LocalStore, *args: Any, **kwargs: Any) -> bool:
        # Frames of the package's modules, told by module name: a path test would also keep
        # this test's own frame in a checkout named asyncbatch (git clone's default).
        names = []
        frame = inspect.currentframe()
        while frame is not None:
            if str(frame.f_globals.get("__name__", "")).startswith("asyncbatch."):
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        names.reverse()
        stacks.append(names[names.index("_deliver") :])
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "read_windows", traced)
    dataset = ab.write_tokens(
        str(tmp_path / "ds"), np.arange(4000, dtype=np.uint16), shard_size=2000
    )
    with ab.Loader(dataset, batch_size=2, seq_len=50, prefetch=4) as loader:
        for _ in range(2):  # two epochs: every shard has passed its size check in the first
            for _ in loader:
                pass
    # Until then the checks layer is on the path; from then on the path is the short one.
    assert stacks[0] == ["_deliver", "_read_group", "read", "read_windows", "read_windows"]
    assert stacks[-1] == ["_deliver", "_read_group", "read", "read_windows"]


@pytest.mark.parametrize(
    "lengths", [[4, 4, 4], [3, 3, 3, 1], [2, 5, 2, 0, 3], [0, 0], [6]], ids=str
)
def test_a_group_cut_into_batches_as_slicing_would(lengths: list[int]) -> None:
    rows = sum(lengths)
    counts = np.arange(rows) % 4
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    jagged = Jagged(torch.arange(int(offsets[-1]) * 2, dtype=torch.int32).reshape(-1, 2), offsets)
    dense = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
    cuts = np.cumsum([0, *lengths]).tolist()
    for value in (jagged, dense):
        parts, sizes = split_sized(value, lengths)
        assert len(parts) == len(lengths)
        if sizes is None:  # no rows at all: the queue counts each part itself
            assert rows == 0
            sizes = [fields_bytes({"x": part}) for part in parts]
        for part, size, a, b in zip(parts, sizes, cuts[:-1], cuts[1:], strict=True):
            want = value[a:b]
            if isinstance(value, Jagged):
                assert torch.equal(part.values, want.values)
                assert torch.equal(part.offsets, want.offsets)
                assert part.offsets.is_contiguous()
            else:
                assert torch.equal(part, want)
            assert size == fields_bytes({"x": part})


def _traced_run(
    dataset: ab.Dataset, monkeypatch: pytest.MonkeyPatch, wait: float, take_after: float
) -> list[tuple[str, int]]:
    """The order of a run's group reads (by first batch) and of the batches taken, the
    engine waiting ``wait`` seconds for its first batch to be taken and the consumer
    taking each ``take_after`` seconds after it is asked for."""
    import time

    from asyncbatch import _engine
    from asyncbatch._handoff import BatchQueue

    events: list[tuple[str, int]] = []
    read_group, get = _engine.Engine._read_group, BatchQueue.get

    async def traced(self: Any, *args: Any) -> Any:
        events.append(("read", args[5].start))
        return await read_group(self, *args)

    def taken(self: BatchQueue, *args: Any) -> Any:
        time.sleep(take_after)
        item = get(self, *args)
        events.append(("taken", int(item.extra["batch"])))
        return item

    monkeypatch.setattr(_engine, "FIRST_TAKEN_WAIT", wait)
    monkeypatch.setattr(_engine.Engine, "_read_group", traced)
    monkeypatch.setattr(BatchQueue, "get", taken)
    with ab.Loader(dataset, batch_size=2, seq_len=16, shuffle=True, seed=3) as loader:
        got = [batch.global_indexes.tolist() for batch in itertools.islice(loader, 3)]
    with ab.Loader(dataset, batch_size=2, seq_len=16, shuffle=True, seed=3) as loader:
        assert got == [batch.global_indexes.tolist() for batch in itertools.islice(loader, 3)]
    return events


def test_a_runs_first_batch_is_taken_before_the_engine_reads_more(
    dataset: ab.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's first group is read alone and its batch handed over before the next group is
    planned and read: beside that work, the consumer would wait for a core or the GIL."""
    events = _traced_run(dataset, monkeypatch, wait=60.0, take_after=0.0)
    assert events[:3] == [("read", 0), ("taken", 0), ("read", 1)]


def test_a_consumer_late_for_the_first_batch_holds_the_run_up_briefly(
    dataset: ab.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine waits for the first batch to be taken for a bounded time only."""
    events = _traced_run(dataset, monkeypatch, wait=0.001, take_after=0.2)
    assert events[:2] == [("read", 0), ("read", 1)]
    assert events.index(("read", 1)) < events.index(("taken", 0))
