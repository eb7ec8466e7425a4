"""Property tests: the permutations are bijections; rank strides partition an epoch; the
global order does not depend on the world size; the tail policy gives every rank as much."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.errors import ConfigError
from asyncbatch.sampling import FeistelPermutation
from asyncbatch.sampling.order import ID_BLOCK, BlockShuffle, EpochOrder

SMALL_SIZES = st.one_of(
    st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 97, 1023, 1024, 1025, 65537]),
    st.integers(1, 5000),
)
SEEDS = st.integers(0, 2**64 - 1)


@settings(max_examples=60, deadline=None)
@given(size=SMALL_SIZES, seed=SEEDS)
def test_feistel_is_a_bijection_with_an_inverse(size: int, seed: int) -> None:
    perm = FeistelPermutation(size, seed)
    positions = np.arange(size, dtype=np.int64)
    values = perm(positions)
    assert np.array_equal(np.sort(values), positions)
    assert np.array_equal(perm.inverse(values), positions)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 63), delta=st.integers(-1, 1), seed=SEEDS, data=st.data())
def test_feistel_huge_sizes_stay_in_range_and_invert(
    bits: int, delta: int, seed: int, data: st.DataObject
) -> None:
    size = max(1, min(2**63 - 1, 2**bits + delta))
    perm = FeistelPermutation(size, seed)
    positions = np.array(
        data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=50)), dtype=np.int64
    )
    values = perm(positions)
    assert values.min() >= 0 and values.max() < size
    assert np.array_equal(perm.inverse(values), positions)
    assert np.unique(values).size == np.unique(positions).size


def test_seeds_give_different_orders() -> None:
    a, b = FeistelPermutation(1000, 1), FeistelPermutation(1000, 2)
    x = np.arange(1000)
    assert not np.array_equal(a(x), b(x))
    assert not np.array_equal(a(x), x)


@pytest.mark.parametrize("size", [0, -3, 2**63])
def test_feistel_rejects_bad_sizes(size: int) -> None:
    with pytest.raises(ConfigError, match="size"):
        FeistelPermutation(size, 0)


SHUFFLE_KINDS = st.sampled_from(["none", "global", "block"])


@settings(max_examples=80, deadline=None)
@given(
    samples=st.integers(1, 3 * ID_BLOCK),
    block_size=st.integers(1, 700),
    window=st.integers(1, 9),
    seed=SEEDS,
    epoch=st.integers(0, 5),
)
def test_block_shuffle_is_a_permutation(
    samples: int, block_size: int, window: int, seed: int, epoch: int
) -> None:
    order = BlockShuffle(samples, seed, block_size, window)
    positions = np.arange(samples, dtype=np.int64)
    ids = order(epoch, positions.copy())
    assert np.array_equal(np.sort(ids), positions)
    # Any subset of positions, in any order, maps to the same ids.
    picked = np.random.default_rng(seed % 1000).permutation(samples)[: min(samples, 500)]
    assert np.array_equal(order(epoch, picked.astype(np.int64)), ids[picked])


def test_block_shuffle_keeps_blocks_inside_windows() -> None:
    """Each window of positions holds whole blocks of consecutive samples (mod N)."""
    samples, block, window = 10_000, 50, 4
    order = BlockShuffle(samples, 7, block, window)
    ids = order(0, np.arange(samples, dtype=np.int64))
    span = block * window
    full_windows = samples // block // window  # windows made of whole blocks only
    first_of_block = set()
    for w in range(full_windows):
        part = np.sort(ids[w * span : (w + 1) * span])
        heads = part[(np.diff(part, prepend=-2) != 1)]
        first_of_block.update(heads.tolist())
        assert heads.size <= window + 1  # one run per block (two if a block wraps past N)
    # Two epochs cut blocks at different offsets and order them differently.
    assert not np.array_equal(order(1, np.arange(samples, dtype=np.int64)), ids)


def rank_ids(orders: list[EpochOrder], epoch: int = 0) -> list[npt.NDArray[np.int64]]:
    return [o.sample_ids(epoch, 0, o.batches_per_epoch) for o in orders]


@settings(max_examples=60, deadline=None)
@given(
    samples=st.integers(1, 3 * ID_BLOCK),
    world=st.integers(1, 4),
    batch=st.integers(1, 300),
    shuffle=SHUFFLE_KINDS,
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_rank_orders_partition_the_epoch(
    samples: int, world: int, batch: int, shuffle: str, drop_last: bool, seed: int
) -> None:
    orders = [
        EpochOrder(
            samples,
            batch,
            shuffle=shuffle,
            seed=seed,
            rank=r,
            world_size=world,
            drop_last=drop_last,
            block_size=37,
            window=3,
        )
        for r in range(world)
    ]
    per_rank = rank_ids(orders)
    assert len({ids.size for ids in per_rank}) == 1
    assert len({o.batches_per_epoch for o in orders}) == 1
    joined = np.concatenate(per_rank)
    assert np.unique(joined).size == joined.size
    if drop_last:
        assert joined.size == samples // (world * batch) * world * batch
    else:
        assert joined.size == samples // world * world
    # Any slice of batches equals the same slice of the whole epoch.
    order = orders[0]
    if order.batches_per_epoch >= 3:
        whole = order.sample_ids(0, 0, order.batches_per_epoch)
        part = order.sample_ids(0, 1, 3)
        assert np.array_equal(part, whole[batch : 3 * batch])


@settings(max_examples=40, deadline=None)
@given(
    samples=st.integers(1, 5000),
    world=st.integers(1, 4),
    batch=st.integers(1, 64),
    shuffle=SHUFFLE_KINDS,
    drop_last=st.booleans(),
)
def test_wrap_tail_sees_every_sample_and_repeats_only_the_first(
    samples: int, world: int, batch: int, shuffle: str, drop_last: bool
) -> None:
    kwargs = dict(shuffle=shuffle, seed=3, world_size=world, drop_last=drop_last, tail="wrap")
    orders = [EpochOrder(samples, batch, rank=r, **kwargs) for r in range(world)]  # type: ignore[arg-type]
    per_rank = rank_ids(orders)
    assert len({ids.size for ids in per_rank}) == 1
    # Interleave the ranks back into global positions: the epoch's order, then its start again.
    width = per_rank[0].size
    joined = np.stack(per_rank, axis=1).reshape(-1) if width else np.empty(0, np.int64)
    assert np.array_equal(np.sort(joined[:samples]), np.arange(samples))
    assert np.array_equal(joined[samples:], joined[: joined.size - samples])
    unit = world * batch if drop_last else world
    assert joined.size == -(-samples // unit) * unit


@settings(max_examples=40, deadline=None)
@given(
    samples=st.integers(1, 4000),
    global_batch=st.sampled_from([12, 24]),
    worlds=st.permutations([1, 2, 3, 4]),
    shuffle=SHUFFLE_KINDS,
    seed=st.integers(0, 100),
)
def test_global_batches_do_not_depend_on_the_world_size(
    samples: int, global_batch: int, worlds: list[int], shuffle: str, seed: int
) -> None:
    """Global batch g holds the same samples on any world size with the same global batch."""
    contents = []
    for world in worlds[:2]:
        orders = [
            EpochOrder(
                samples,
                global_batch // world,
                shuffle=shuffle,
                seed=seed,
                rank=r,
                world_size=world,
                block_size=10,
                window=4,
            )
            for r in range(world)
        ]
        per_rank = [ids.reshape(-1, global_batch // world) for ids in rank_ids(orders)]
        contents.append(
            [np.sort(np.concatenate(parts)).tolist() for parts in zip(*per_rank, strict=True)]
        )
    assert contents[0] == contents[1]
