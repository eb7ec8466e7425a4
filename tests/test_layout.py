"""Property test: planned reads reassemble any spans, across shard ends, with any gap."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch._layout import ShardMap


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda c: sum(c) > 0),
    itemsize=st.sampled_from([1, 2, 4, 6]),
    gap=st.sampled_from([0, 1, 8, 64, 10**6]),
    header=st.sampled_from([0, 3, 128]),
    data=st.data(),
)
def test_plan_reassembles_spans(
    counts: list[int], itemsize: int, gap: int, header: int, data: st.DataObject
) -> None:
    """Shards may start their elements after a header of ``header`` bytes (as .npy files)."""
    total = sum(counts)
    stream = np.random.default_rng(total).integers(0, 256, total * itemsize, dtype=np.uint8)
    shards, offset = [], 0
    for count in counts:
        body = stream[offset * itemsize : (offset + count) * itemsize]
        shards.append(np.concatenate([np.full(header, 0x55, dtype=np.uint8), body]))
        offset += count
    length = data.draw(st.integers(1, total))
    starts = np.array(
        data.draw(st.lists(st.integers(0, total - length), min_size=1, max_size=20)), dtype=np.int64
    )
    plan = ShardMap(counts, itemsize, [header] * len(counts)).plan(starts, length, gap)

    buffer = np.full(plan.nbytes, 0xAA, dtype=np.uint8)
    scratch = {}
    for read in range(plan.num_reads):
        shard = shards[plan.read_shard[read]]
        data_read = shard[plan.read_start[read] : plan.read_end[read]]
        assert data_read.size == plan.read_end[read] - plan.read_start[read] > 0
        if plan.read_dest[read] >= 0:
            buffer[plan.read_dest[read] : plan.read_dest[read] + data_read.size] = data_read
        else:
            scratch[read] = data_read
    for read, src, dest, size in zip(
        plan.piece_read, plan.piece_src, plan.piece_dest, plan.piece_length, strict=True
    ):
        buffer[dest : dest + size] = scratch[read][src : src + size]

    expected = np.concatenate(
        [stream[s * itemsize : (s + length) * itemsize] for s in starts.tolist()]
    )
    np.testing.assert_array_equal(buffer, expected)
    # Reads never overlap one another within a shard.
    for shard in set(plan.read_shard.tolist()):
        mine = plan.read_shard == shard
        order = np.argsort(plan.read_start[mine])
        assert np.all(plan.read_start[mine][order][1:] >= plan.read_end[mine][order][:-1])


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 5000),
    length=st.integers(1, 64),
    density=st.floats(0.001, 1.0),
    gap=st.sampled_from([0, 64, 4096, 128 * 1024, 10**9]),
    seed=st.integers(0, 2**32 - 1),
)
def test_plan_fetches_at_most_twice_what_it_needs(
    total: int, length: int, density: float, gap: int, seed: int
) -> None:
    """The cost model bridges gaps only within a budget of the plan's own bytes: a random
    subset of windows of any density (a rank's share of a shuffled group) costs at most twice
    its bytes, whatever the store's request cost."""
    windows = max(1, (total + length - 1) // length)
    rng = np.random.default_rng(seed)
    picked = np.flatnonzero(rng.random(windows) < density)
    if not picked.size:
        picked = np.array([0])
    starts = np.minimum(picked * length, total - length if total > length else 0)
    size = min(length, total)
    plan = ShardMap([total // 2, total - total // 2], 2).plan(rng.permutation(starts), size, gap)
    fetched = int((plan.read_end - plan.read_start).sum())
    assert fetched <= 2 * plan.nbytes


def test_plan_merges_neighbours_cheaper_than_a_request() -> None:
    """Windows one element apart are one read per shard when the gap costs less than a
    request, and one read each when a request is cheaper than any gap."""
    shard_map = ShardMap([1000, 1000], 4)
    starts = np.arange(0, 2000, 10)
    merged = shard_map.plan(starts, 9, gap_bytes=4096)
    assert merged.num_reads == 2
    apart = shard_map.plan(starts, 9, gap_bytes=0)
    assert apart.num_reads == starts.size
