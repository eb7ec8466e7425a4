"""``shuffle="batch"``: an LLMBATCH file's batches whole, in a new order every epoch, split
between ranks, one read each, resumable on any world size with the same global batch."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, WriteDataset, s3_options

import asyncbatch as ab
from asyncbatch._errors import ConfigError, ResumeStateError
from asyncbatch._layout import ReadPlan
from asyncbatch.formats._llmbatch import LLMBatchRecords
from asyncbatch.sampling._batches import BatchOrder

ROWS = 8  # records per file batch (slot)
SLOTS = 13
SEQ_LEN = 24  # 768 bytes of tokens per slot, padded to 4096: neighbouring slots never touch

_names = itertools.count()


@pytest.fixture
def records() -> npt.NDArray[np.uint32]:
    return np.random.default_rng(4).integers(0, 2**32, (SLOTS * ROWS, SEQ_LEN), dtype=np.uint32)


@pytest.fixture
def batch_file(
    store: str, tmp_path: Path, request: pytest.FixtureRequest, records: npt.NDArray[np.uint32]
) -> tuple[str, dict[str, Any]]:
    """The records as a ``.batch`` file of the current store, in order (slot ``s`` holds
    records ``8s .. 8s+7``); ``(url, storage_options)``."""
    name = f"b-{next(_names)}.batch"
    options: dict[str, Any] = {}
    if store == "local":
        url = read_url = str(tmp_path / name)
    elif store == "s3":
        options = s3_options(request.getfixturevalue("s3_endpoint"))
        url = read_url = f"s3://{BUCKET}/{name}"
    else:  # the HTTP server is read-only: write to its folder, read through it
        root, server = request.getfixturevalue("http_root")
        url, read_url = str(root / name), f"{server.url}/{name}"
    ab.write_llmbatch(url, records, batch_size=ROWS, shuffle=False, storage_options=options)
    return read_url, options


def slots_of(batch: ab.Batch) -> list[int]:
    """The file batches (slots) ``batch`` holds, checking that each is whole and in order."""
    ids = batch.global_indexes.reshape(-1, ROWS)
    np.testing.assert_array_equal(ids, ids[:, :1] + np.arange(ROWS))
    assert (ids[:, 0] % ROWS == 0).all()
    return (ids[:, 0] // ROWS).tolist()


def check_tokens(batches: list[ab.Batch], records: npt.NDArray[np.uint32]) -> None:
    for batch in batches:
        np.testing.assert_array_equal(batch["tokens"].numpy(), records[batch.global_indexes])


def test_whole_batches_once_per_epoch_one_read_each(
    store: str, batch_file: tuple[str, dict[str, Any]], records: npt.NDArray[np.uint32]
) -> None:
    url, options = batch_file
    epochs = []
    with ab.Loader(
        url, storage_options=options, batch_size=ROWS, shuffle="batch", seed=3, coalesce_gap=0
    ) as loader:
        for _ in range(2):
            batches = list(loader)
            check_tokens(batches, records)
            epochs.append([s for b in batches for s in slots_of(b)])
        stats = loader.statistics()
    for order in epochs:
        assert sorted(order) == list(range(SLOTS))  # every file batch exactly once
    assert epochs[0] != epochs[1]  # a new order each epoch
    assert epochs[0] != list(range(SLOTS))
    # One range read of one slot per batch, nothing more fetched than delivered.
    assert stats.requests == 2 * SLOTS
    assert stats.bytes_fetched == stats.bytes_delivered == 2 * SLOTS * ROWS * SEQ_LEN * 4


def test_default_gap_reads_at_most_one_request_per_batch(
    store: str, batch_file: tuple[str, dict[str, Any]]
) -> None:
    url, options = batch_file
    with ab.Loader(url, storage_options=options, batch_size=2 * ROWS, shuffle="batch") as loader:
        batches = list(loader)
        requests = loader.statistics().requests
    assert len(batches) == SLOTS // 2
    # Two slots per batch: each one read, bar neighbours the store's gap merges.
    assert 0 < requests <= 2 * len(batches)


@pytest.mark.parametrize("store", ["local"])
@pytest.mark.parametrize(("drop_last", "tail"), [(True, "drop"), (False, "drop"), (True, "wrap")])
def test_ranks_split_whole_batches(
    batch_file: tuple[str, dict[str, Any]],
    records: npt.NDArray[np.uint32],
    drop_last: bool,
    tail: str,
) -> None:
    url, _ = batch_file
    args: dict[str, Any] = {"shuffle": "batch", "seed": 7, "drop_last": drop_last, "tail": tail}
    with ab.Loader(url, batch_size=ROWS, **args) as loader:
        single = [s for b in loader for s in slots_of(b)]
    world = 3
    ranks = []
    for rank in range(world):
        with ab.Loader(url, batch_size=ROWS, rank=rank, world_size=world, **args) as loader:
            batches = list(loader)
        check_tokens(batches, records)
        ranks.append([s for b in batches for s in slots_of(b)])
    counts = {len(r) for r in ranks}
    assert len(counts) == 1  # every rank the same number of batches
    # Rank r's batch g is slot g*W + r of the one-rank order (wrapping past its end): no
    # communication needed.
    for rank, mine in enumerate(ranks):
        assert mine == (single + single)[rank::world][: len(mine)]
    everything = [s for r in ranks for s in r]
    if tail == "wrap":  # 13 slots, 3 ranks: 15 positions, the first two slots again
        assert len(everything) == 15
        assert sorted(everything) == sorted([*range(SLOTS), *single[:2]])
    else:  # 12: the last slot of the epoch's order left out
        assert len(everything) == 12
        assert len(set(everything)) == 12


def test_resume_and_elastic_resume(
    store: str, batch_file: tuple[str, dict[str, Any]], records: npt.NDArray[np.uint32]
) -> None:
    url, options = batch_file
    args: dict[str, Any] = {"storage_options": options, "shuffle": "batch", "seed": 11}
    # Global batch: 4 slots. The uninterrupted run on one rank.
    with ab.Loader(url, batch_size=4 * ROWS, **args) as loader:
        full = [slots_of(b) for b in loader]
    # Two ranks of 2 slots take one batch each; rank 1's state resumes.
    taken = []
    for rank in (0, 1):
        with ab.Loader(url, batch_size=2 * ROWS, rank=rank, world_size=2, **args) as loader:
            taken.append(slots_of(next(loader)))
            state = loader.state_dict()
    assert sorted(taken[0] + taken[1]) == sorted(full[0])
    # The same world size: the rest of each rank's batches.
    with ab.Loader(url, batch_size=2 * ROWS, rank=0, world_size=2, **args) as loader:
        loader.load_state_dict(state)
        same = [slots_of(b) for b in loader]
    assert [taken[0], *same] == [g[0::2] for g in full]
    # Elastic: four ranks of one slot go on with exactly the global batches not yet read.
    rest: list[list[int]] = []
    for rank in range(4):
        with ab.Loader(url, batch_size=ROWS, rank=rank, world_size=4, **args) as loader:
            loader.load_state_dict(state)
            batches = list(loader)
        check_tokens(batches, records)
        rest.append([s for b in batches for s in slots_of(b)])
    for g, want in enumerate(full[1:]):
        assert sorted(r[g] for r in rest) == sorted(want)
    # The next epoch starts afresh, the same on any world size.
    with ab.Loader(url, batch_size=ROWS, rank=2, world_size=4, **args) as loader:
        loader.set_epoch(1)
        mine = [slots_of(b)[0] for b in loader]
    with ab.Loader(url, batch_size=4 * ROWS, **args) as loader:
        loader.set_epoch(1)
        assert mine == [slots_of(b)[2] for b in loader]


@pytest.mark.parametrize("store", ["local"])
def test_resume_mid_epoch_and_workers(batch_file: tuple[str, dict[str, Any]]) -> None:
    url, _ = batch_file
    args: dict[str, Any] = {"batch_size": ROWS, "shuffle": "batch", "seed": 2, "prefetch": 4}
    with ab.Loader(url, **args) as loader:
        full = list(loader)
    for stop in (1, 5, 12):
        with ab.Loader(url, **args) as loader:
            taken = list(itertools.islice(loader, stop))
            state = loader.state_dict()
        with ab.Loader(url, **args) as loader:
            loader.load_state_dict(state)
            rest = list(loader)
        for got, want in zip(taken + rest, full, strict=True):
            assert torch.equal(got["tokens"], want["tokens"])
    source = ab.LoaderDataset(url, **args)
    got = sorted(slots_of(b)[0] for b in source.dataloader(num_workers=2))
    assert got == list(range(SLOTS))


@pytest.mark.parametrize("store", ["local"])
def test_refused_where_it_does_not_fit(
    batch_file: tuple[str, dict[str, Any]],
    tmp_path: Path,
    write_dataset: WriteDataset,
    records: npt.NDArray[np.uint32],
) -> None:
    url, _ = batch_file
    tokens_url, _ = write_dataset(np.arange(4096, dtype=np.uint16))
    with pytest.raises(ConfigError, match="format 'tokens'"):
        ab.Loader(tokens_url, batch_size=4, seq_len=16, shuffle="batch")
    with pytest.raises(ConfigError, match="batch_size=12 must be a multiple of 8"):
        ab.Loader(url, batch_size=12, shuffle="batch")
    other = str(tmp_path / "other.batch")
    ab.write_llmbatch(other, records, batch_size=ROWS)
    mixture = ab.Mixture([ab.open_dataset(url), ab.open_dataset(other)])
    with pytest.raises(ConfigError, match="mixture of 2 datasets"):
        ab.Loader(mixture, batch_size=ROWS, shuffle="batch")
    with pytest.raises(ConfigError, match="apply to shuffle='block'"):
        ab.Loader(url, batch_size=ROWS, shuffle="batch", window=2)
    with pytest.raises(ConfigError, match="nothing to read"):
        ab.Loader(url, batch_size=ROWS, shuffle="batch", world_size=14, rank=0)
    # A state is for its shuffle and its dataset.
    with ab.Loader(url, batch_size=ROWS, shuffle="batch") as loader:
        next(loader)
        state = loader.state_dict()
    with (
        ab.Loader(url, batch_size=ROWS, shuffle=True) as loader,
        pytest.raises(ResumeStateError, match="shuffle='batch'"),
    ):
        loader.load_state_dict(state)
    smaller = str(tmp_path / "smaller.batch")
    ab.write_llmbatch(smaller, records[: 5 * ROWS], batch_size=ROWS)
    with (
        ab.Loader(smaller, batch_size=ROWS, shuffle="batch") as loader,
        pytest.raises(ResumeStateError, match="dataset"),
    ):
        loader.load_state_dict(state)


def test_order_is_whole_slots_of_the_slot_permutation() -> None:
    order = BatchOrder(1000, 4, 12, seed=5, rank=1, world_size=2)
    assert order.batches_per_epoch == 1000 // 6
    ids = order.sample_ids(3, 10, 12)
    assert ids.size == 2 * 12 == order.batch_length(10) + order.batch_length(11)
    slots = ids.reshape(-1, 4)[:, 0] // 4
    np.testing.assert_array_equal(ids.reshape(-1, 4), slots[:, None] * 4 + np.arange(4))
    one = BatchOrder(1000, 4, 4, seed=5)
    # Global batch 10 (six slots) on two ranks: rank 1 holds slots 61, 63, 65 of the order.
    whole = one.sample_ids(3, 60, 66).reshape(-1, 4)[:, 0] // 4
    np.testing.assert_array_equal(
        order.sample_ids(3, 10, 11).reshape(-1, 4)[:, 0] // 4, whole[1::2]
    )


def carry_out(plan: ReadPlan, data: bytes) -> npt.NDArray[np.uint8]:
    """The buffer ``plan`` fills from the one object ``data`` (a reference, read by read)."""
    file = np.frombuffer(data, dtype=np.uint8)
    out = np.full(plan.nbytes, 0xAB, dtype=np.uint8)
    for r in range(plan.num_reads):
        got = file[plan.read_start[r] : plan.read_end[r]]
        if plan.read_dest[r] >= 0:
            out[plan.read_dest[r] : plan.read_dest[r] + got.size] = got
        for p in np.flatnonzero(plan.piece_read == r):
            src, dest, n = plan.piece_src[p], plan.piece_dest[p], plan.piece_length[p]
            out[dest : dest + n] = got[src : src + n]
    return out


@pytest.mark.parametrize("seq_len", [SEQ_LEN, 512])  # padded slots, and slots of whole pages
def test_slot_plans_read_exactly_the_slots(tmp_path: Path, seq_len: int) -> None:
    records = np.random.default_rng(6).integers(0, 2**32, (SLOTS * ROWS, seq_len), np.uint32)
    url = str(tmp_path / "p.batch")
    ab.write_llmbatch(url, records, batch_size=ROWS, shuffle=False)
    data = Path(url).read_bytes()
    source = LLMBatchRecords([ab.open_dataset(url)])
    padded = seq_len == SEQ_LEN
    for slots, gap, reads, direct in [
        ([7, 2, 11, 0], 2**17, 4, 4),  # shuffled: one read per slot, each straight into place
        ([3, 4, 5, 9, 8], 0, 5 if padded else 3, 5 if padded else 3),  # 3, 4, 5 in a row
        ([3, 4, 5, 9, 8], 2**17, 3, 2 if padded else 3),  # ... read across the padding
        ([12, 0, 1], 2**17, 2, 1 if padded else 2),
    ]:
        ids = (np.asarray(slots)[:, None] * ROWS + np.arange(ROWS)).reshape(-1)
        plan = source.plan(ids, gap)
        assert plan.num_reads == reads
        assert (plan.read_dest >= 0).sum() == direct
        want = records[ids].astype("<u4").view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(carry_out(plan, data), want)
    # Not whole slots (a row missing, rows out of order): the record planner, same bytes.
    for ids in (np.arange(8, 15), np.r_[np.arange(8, 16)[::-1]], np.arange(4, 12)):
        plan = source.plan(ids.astype(np.int64), 0)
        want = records[ids].astype("<u4").view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(carry_out(plan, data), want)


@pytest.mark.parametrize("store", ["local"])
def test_async_loader_and_infinite_runs_give_the_same_batches(
    batch_file: tuple[str, dict[str, Any]],
) -> None:
    url, _ = batch_file
    args: dict[str, Any] = {"batch_size": ROWS, "shuffle": "batch", "seed": 5}
    with ab.Loader(url, **args) as loader:
        epochs = [[slots_of(b)[0] for b in loader] for _ in range(2)]

    async def read_async() -> list[int]:
        async with ab.AsyncLoader(url, **args) as loader:
            return [slots_of(b)[0] async for b in loader]

    assert asyncio.run(read_async()) == epochs[0]
    with ab.Loader(url, infinite=True, **args) as loader:
        endless = [slots_of(b)[0] for b in itertools.islice(loader, 2 * SLOTS)]
    assert endless == epochs[0] + epochs[1]
