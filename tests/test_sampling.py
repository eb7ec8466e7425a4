"""Property tests: the permutation is a bijection; rank strides partition an epoch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.errors import ConfigError
from asyncbatch.sampling import FeistelPermutation
from asyncbatch.sampling.order import ID_BLOCK, EpochOrder

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


@settings(max_examples=30, deadline=None)
@given(
    samples=st.integers(1, 3 * ID_BLOCK),
    world=st.integers(1, 4),
    batch=st.integers(1, 300),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_rank_orders_partition_the_epoch(
    samples: int, world: int, batch: int, shuffle: bool, seed: int
) -> None:
    orders = [
        EpochOrder(samples, batch, shuffle=shuffle, seed=seed, rank=r, world_size=world)
        for r in range(world)
    ]
    per_rank = [o.sample_ids(0, 0, o.batches_per_epoch) for o in orders]
    assert len({ids.size for ids in per_rank}) == 1
    joined = np.concatenate(per_rank)
    assert np.unique(joined).size == joined.size
    assert joined.size == (samples // world) // batch * batch * world
    # Any slice of batches equals the same slice of the whole epoch.
    order = orders[0]
    if order.batches_per_epoch >= 3:
        whole = order.sample_ids(0, 0, order.batches_per_epoch)
        part = order.sample_ids(0, 1, 3)
        assert np.array_equal(part, whole[batch : 3 * batch])
