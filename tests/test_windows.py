"""The block shuffle's rank windows: coverage at any world size, elastic resume through a
history of world sizes, and bytes fetched per byte delivered as the planner reads them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import asyncbatch as ab
from asyncbatch._loader import default_block_size
from asyncbatch.formats._tokens import TokenWindows
from asyncbatch.sampling._order import EpochOrder
from asyncbatch.sampling._windows import History, extend_history

Int64Array = npt.NDArray[np.int64]
WORLDS = [1, 2, 4, 8, 16, 64]


def order(samples: int, batch: int, world: int, rank: int, **kwargs: Any) -> EpochOrder:
    kwargs = {"block_size": 7, "window": 3, "seed": 5, **kwargs}
    return EpochOrder(samples, batch, shuffle="block", rank=rank, world_size=world, **kwargs)


def epoch_ids(
    samples: int, batch: int, world: int, first: int = 0, history: History = (), **kwargs: Any
) -> list[Int64Array]:
    """Each rank's ids from batch ``first`` to the end of epoch 1."""
    out = []
    for rank in range(world):
        o = order(samples, batch, world, rank, **kwargs)
        out.append(o.sample_ids(1, first, o.batches_per_epoch, history))
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("samples", [1, 97, 1003, 20_011])
@pytest.mark.parametrize(("tail", "drop_last"), [("drop", True), ("drop", False), ("wrap", True)])
def test_every_sample_once_at_any_world_size(
    world: int, samples: int, tail: str, drop_last: bool
) -> None:
    batch = 3
    per_rank = epoch_ids(samples, batch, world, tail=tail, drop_last=drop_last)
    assert len({ids.size for ids in per_rank}) == 1  # every rank the same number of batches
    joined = np.concatenate(per_rank)
    positions = order(samples, batch, world, 0, tail=tail, drop_last=drop_last).positions_per_epoch
    assert joined.size == positions
    if tail == "drop":
        assert np.unique(joined).size == joined.size
    else:  # every sample, and only the wrapped tail twice
        assert np.array_equal(np.unique(joined), np.arange(samples))
        assert joined.size - samples < batch * world


@pytest.mark.parametrize("world", [1, 4, 16])
def test_a_rank_reads_whole_windows_of_consecutive_blocks(world: int) -> None:
    """Each full window of a rank (block_size × window ids) is ``window`` runs of
    ``block_size`` consecutive samples (mod N): whole blocks, none shared with another rank."""
    samples, block, window = 50_000, 25, 4
    span = block * window
    for ids in epoch_ids(samples, 10, world, block_size=block, window=window, seed=3):
        for w in range(ids.size // span):
            part = np.sort(ids[w * span : (w + 1) * span])
            runs = np.count_nonzero(np.diff(part, prepend=-2) != 1)
            assert runs <= window + 1  # one per block (two for a block that wraps past N)


def test_history_keeps_only_changes_of_world_size() -> None:
    assert extend_history([(4, 0)], 4, 10) == ()
    assert extend_history([(4, 0)], 2, 10) == ((4, 0), (2, 10))
    assert extend_history([(4, 0), (2, 10)], 2, 30) == ((4, 0), (2, 10))
    # A stretch that delivered nothing is dropped; back on the first world size, no history.
    assert extend_history([(4, 0), (2, 10)], 4, 10) == ()
    assert extend_history([(4, 0), (2, 10)], 1, 10) == ((4, 0), (1, 10))
    assert extend_history([(4, 0)], 1, 0) == ()


def resumed_epoch(
    samples: int, global_batch: int, plan: list[tuple[int, int]], **kwargs: Any
) -> Int64Array:
    """Run epoch 1 on world size ``plan[i][0]`` from global batch ``plan[i][1]`` to the next
    start (the last to the end), every rank, resuming through the history; all ids."""
    delivered = []
    segments: list[tuple[int, int]] = []
    for (world, first), (_, stop) in itertools.pairwise([*plan, (0, -1)]):
        history = extend_history(segments or [(world, 0)], world, first)
        segments = list(history) or [(world, 0)]
        for rank in range(world):
            o = order(samples, global_batch // world, world, rank, **kwargs)
            end = o.batches_per_epoch if stop < 0 else stop
            delivered.append(o.sample_ids(1, first, end, history))
    return np.concatenate(delivered)


@pytest.mark.parametrize(("before", "after"), list(itertools.product([1, 2, 4], repeat=2)))
@pytest.mark.parametrize("tail", ["drop", "wrap"])
def test_resume_on_another_world_size_delivers_the_rest_once(
    before: int, after: int, tail: str
) -> None:
    samples, global_batch = 5003, 12  # windows of 21 samples; 5003 // (4 * 21) = 59 rounds
    whole = np.concatenate(epoch_ids(samples, global_batch, 1, tail=tail))
    per_rank = order(samples, global_batch // before, before, 0, tail=tail).batches_per_epoch
    # At the start, mid-window, on a window's edge (7 windows of 21 = 12 batches of 12 at
    # W = 1), in the last full round, in the remainder, at the end.
    for stop in [0, 1, 5, 12, 100, 410, 415, per_rank - 1, per_rank]:
        got = resumed_epoch(samples, global_batch, [(before, 0), (after, stop)], tail=tail)
        assert np.array_equal(np.sort(got), np.sort(whole)), (before, after, stop)


@pytest.mark.parametrize("worlds", [(4, 2, 1), (1, 4, 2), (2, 4, 4, 1), (4, 1, 4)])
def test_repeated_changes_replay_the_history(worlds: tuple[int, ...]) -> None:
    samples, global_batch = 4099, 8
    whole = np.concatenate(epoch_ids(samples, global_batch, 1, window=5))
    starts = [0, 33, 34, 200][: len(worlds)]
    got = resumed_epoch(samples, global_batch, list(zip(worlds, starts, strict=True)), window=5)
    assert np.array_equal(np.sort(got), np.sort(whole))


def test_default_block_makes_windows_whole_global_batches() -> None:
    # 4 KiB samples: 256 per MiB; a window of 8 blocks is then a multiple of any global
    # batch of 8·W (W up to 256), so of every rank's batch at any such W.
    for world in [1, 3, 16, 64]:
        block = default_block_size(4096, 8, 8 * world, 8)
        assert block * 8 % (8 * world) == 0 and 128 <= block <= 1024
    assert default_block_size(4096, 8, 48, 16) * 8 % 48 == 0
    # A global batch too large to fit: this rank's batch decides; else the byte size.
    assert default_block_size(4096, 8, 2**16, 24) * 8 % 24 == 0
    assert default_block_size(4096, 1, 2**16, 2**13) == 256


def sparse_tokens(root: Path, samples: int, seq_len: int, shard_samples: int) -> str:
    """A uint16 token dataset of zero bytes (sparse files): planning never reads them."""
    shards = []
    for n, first in enumerate(range(0, samples, shard_samples)):
        elements = min(shard_samples, samples - first) * seq_len
        name = f"shard-{n:05d}.bin"
        with open(root / name, "wb") as f:
            f.truncate(elements * 2)
        shards.append({"path": name, "bytes": elements * 2, "elements": elements})
    manifest = {"asyncbatch_manifest": 1, "format": "tokens", "dtype": "<u2", "shards": shards}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_fetches_only_its_own_bytes(tmp_path: Path, world: int) -> None:
    """Plans of every group the engine reads, per rank, with the remote stores' 128 KiB
    coalescing gap and the default block (1 MiB) and window (8 blocks): bytes fetched stay
    within 10% of bytes delivered, and about one read per block."""
    seq_len, batch = 2048, 8
    url = sparse_tokens(tmp_path, 200_000, seq_len, 16384)  # ~1.5 rounds of windows at W=64
    sample_bytes = seq_len * 2
    for rank in range(world):
        with ab.Loader(
            url, batch_size=batch, seq_len=seq_len, shuffle="block", rank=rank, world_size=world
        ) as loader:
            engine = loader._engine
            assert engine is not None and loader.block_size is not None
            source = engine.source
            assert isinstance(source, TokenWindows)
            fetched = delivered = reads = 0
            for group in engine.groups(0):
                ids = engine.order.sample_ids(0, group.start, group.stop)
                plan = source.plan(ids, 128 * 1024)
                fetched += int((plan.read_end - plan.read_start).sum())
                delivered += ids.size * sample_bytes
                reads += plan.num_reads
        assert delivered == len(loader) * batch * sample_bytes
        assert fetched / delivered <= 1.1, (world, rank, fetched / delivered)
        assert reads / (delivered / sample_bytes) <= 1.5 / loader.block_size, (world, rank, reads)
