"""Property tests: the permutations are bijections; rank strides partition an epoch; the
global order does not depend on the world size; the tail policy gives every rank as much."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch._errors import ConfigError
from asyncbatch.sampling import FeistelPermutation
from asyncbatch.sampling._order import ID_BLOCK, BlockShuffle, EpochOrder

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


@pytest.mark.parametrize("positions", [[-1], [5], [0, 2**62], [[1, 2], [3, 7]]])
def test_feistel_rejects_positions_out_of_range(positions: list[int]) -> None:
    perm = FeistelPermutation(5, 0)
    with pytest.raises(ConfigError, match="positions"):
        perm(positions)
    with pytest.raises(ConfigError, match="positions"):
        perm.inverse(positions)


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("delta", [1, 2, 3])
def test_feistel_walk_just_above_a_power_of_two_whole_range(bits: int, delta: int) -> None:
    # 2**bits + delta needs bits + 1 bits: the worst case for a power-of-two domain.
    size = 2**bits + delta
    perm = FeistelPermutation(size, bits * 7 + delta)
    assert size <= perm.domain < 2 * size
    positions = np.arange(size, dtype=np.int64)
    values = perm(positions)
    assert values.min() >= 0 and values.max() < size
    assert np.array_equal(np.sort(values), positions)
    assert np.array_equal(perm.inverse(values), positions)


@pytest.mark.parametrize("bits", [17, 20, 31, 32, 33, 47, 61, 62])
@pytest.mark.parametrize("delta", [1, 2, 1000])
def test_feistel_walk_just_above_a_power_of_two_huge(bits: int, delta: int) -> None:
    size = 2**bits + delta
    perm = FeistelPermutation(size, bits)
    assert size < perm.domain < 2 * size
    # The positions whose first pass through the network lands outside range(size): the
    # network's inverse images of the domain's tail. Cycle walking must bring them inside.
    tail = np.arange(size, min(perm.domain, size + 4096), dtype=np.uint64)
    images = np.empty_like(tail)
    perm._apply(tail, images, inverse=True)
    walked = images[images < size].view(np.int64)
    assert walked.size  # there are such positions
    edges = np.array([0, 1, size // 2, size - 2, size - 1], dtype=np.int64)
    positions = np.concatenate([walked, edges])
    values = perm(positions)
    assert values.min() >= 0 and values.max() < size
    assert np.unique(values).size == np.unique(positions).size
    assert np.array_equal(perm.inverse(values), positions)


@pytest.mark.parametrize("size", [1000, 2**20 + 1, 10**9, 2**62, 2**63 - 1])
def test_two_seeds_give_different_permutations(size: int) -> None:
    positions = np.arange(min(size, 4096), dtype=np.int64)
    seeds = [0, 1, 2, 2**63, 2**64 - 1]
    outputs = [FeistelPermutation(size, seed)(positions) for seed in seeds]
    for i, first in enumerate(outputs):
        for second in outputs[i + 1 :]:
            # Unrelated permutations agree on about positions.size / size positions.
            assert np.count_nonzero(first == second) <= 16
    # Seeds are taken modulo 2**64.
    same = FeistelPermutation(size, 2**64 + 1)(positions)
    assert np.array_equal(same, outputs[1])
    assert np.array_equal(FeistelPermutation(size, -1)(positions), outputs[-1])


def test_feistel_keeps_the_shape() -> None:
    perm = FeistelPermutation(100, 3)
    grid = np.arange(60, dtype=np.int64).reshape(3, 4, 5)
    assert np.array_equal(perm(grid), perm(grid.ravel()).reshape(3, 4, 5))
    assert np.array_equal(perm.inverse(perm(grid[:, ::2])), grid[:, ::2])
    assert perm(np.int64(7)).shape == ()


def test_feistel_order_is_pinned() -> None:
    # The same values in every process and on every platform: integer arithmetic only.
    # (Changing the construction changes these values: update them deliberately.)
    small = FeistelPermutation(1000, 42)(np.arange(8))
    assert small.tolist() == [92, 923, 19, 316, 896, 994, 673, 205]
    big = FeistelPermutation(2**62 + 5, 2**64 - 3)(np.arange(4))
    assert big.tolist() == [
        4084536680678005684,
        444552331121677792,
        2171162134575302497,
        1766240669773045869,
    ]


def lag_spread(values: npt.NDArray[np.int64], lag: int) -> float:
    """Spread over rows of the correlation of ``row[i]`` and ``row[i + lag]``, times sqrt(n)."""
    z = values.astype(np.float64)
    z -= z.mean(axis=1, keepdims=True)
    z /= z.std(axis=1, keepdims=True)
    correlation = (z[:, :-lag] * z[:, lag:]).mean(axis=1)
    return float(correlation.std() * np.sqrt(values.shape[1] - lag))


@pytest.mark.parametrize("size", [1000, 5000, 10**6])
def test_feistel_neighbours_are_uncorrelated(size: int) -> None:
    # For a random permutation the spread over seeds of this correlation is 1 / sqrt(n)
    # (lag_spread about 1, up to ~1.15 for the worst of these lags). A network with too few
    # rounds measures 2x to 13x at some lag, in the values or in their lowest bit.
    n = min(size, 4096)
    positions = np.arange(size // 3, size // 3 + n, dtype=np.int64) % size
    values = np.stack([FeistelPermutation(size, seed)(positions) for seed in range(200)])
    for lag in [1, 2, 3, 5, *(2**k for k in range(2, 12) if 2**k < n // 2)]:
        assert lag_spread(values, lag) < 1.4, lag
        assert lag_spread(values & 1, lag) < 1.4, lag


SHUFFLE_KINDS = st.sampled_from(["none", "global", "block"])
#: The orders split by position ``q % W``; the block shuffle deals whole rank windows out
#: instead (tests/test_windows.py).
POSITION_SPLIT = st.sampled_from(["none", "global"])


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


def rank_orders(samples: int, batch: int, world: int, **kwargs: Any) -> list[EpochOrder]:
    """The order of every rank of ``world``."""
    return [EpochOrder(samples, batch, rank=r, world_size=world, **kwargs) for r in range(world)]


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
    orders = rank_orders(
        samples,
        batch,
        world,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        block_size=37,
        window=3,
    )
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
    shuffle=POSITION_SPLIT,
    drop_last=st.booleans(),
)
def test_wrap_tail_sees_every_sample_and_repeats_only_the_first(
    samples: int, world: int, batch: int, shuffle: str, drop_last: bool
) -> None:
    orders = rank_orders(
        samples, batch, world, shuffle=shuffle, seed=3, drop_last=drop_last, tail="wrap"
    )
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
    shuffle=POSITION_SPLIT,
    seed=st.integers(0, 100),
)
def test_global_batches_do_not_depend_on_the_world_size(
    samples: int, global_batch: int, worlds: list[int], shuffle: str, seed: int
) -> None:
    """Global batch g holds the same samples on any world size with the same global batch."""
    contents = []
    for world in worlds[:2]:
        orders = rank_orders(
            samples,
            global_batch // world,
            world,
            shuffle=shuffle,
            seed=seed,
            block_size=10,
            window=4,
        )
        per_rank = [ids.reshape(-1, global_batch // world) for ids in rank_ids(orders)]
        contents.append(
            [np.sort(np.concatenate(parts)).tolist() for parts in zip(*per_rank, strict=True)]
        )
    assert contents[0] == contents[1]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_a_few_ids_alone_are_those_of_their_block(shuffle: str) -> None:
    """A small group (a run's first batch) computes its ids alone, not its whole block of
    ``ID_BLOCK``: they are the same ids as the block's, which larger groups slice."""
    options: dict[str, Any] = dict(
        shuffle=shuffle, seed=7, rank=1, world_size=3, block_size=64, window=4
    )
    whole = EpochOrder(3 * ID_BLOCK + 1000, 16, **options)
    want = whole.sample_ids(2, 0, whole.batches_per_epoch)
    for first in [0, 5, ID_BLOCK // 16 + 3, whole.batches_per_epoch - 2]:
        order = EpochOrder(3 * ID_BLOCK + 1000, 16, **options)
        got = [order.sample_ids(2, first, first + 1), order.sample_ids(2, first + 1, first + 40)]
        np.testing.assert_array_equal(np.concatenate(got), want[first * 16 : (first + 40) * 16])
