"""TablePool, where a WebDataset source holds its shards' tables: a batch's rows and keys
are one gather, equal to each shard's own table, through drops and the compactions that
reclaim their room."""

from __future__ import annotations

import numpy as np

from asyncbatch.formats._webdataset_tables import ShardTable, TablePool

WIDTH = 2 + 2 * 2 + 1  # two fields: start, end, offsets, lengths, key length


def table(rng: np.random.Generator, shard: int) -> ShardTable:
    samples = int(rng.integers(1, 40))
    key_lengths = rng.integers(0, 12, samples)
    rows = rng.integers(0, 2**40, (samples, WIDTH))
    rows[:, -1] = key_lengths
    keys = rng.integers(0, 256, int(key_lengths.sum()), dtype=np.uint8)
    keys[:1] = shard  # tables of other shards differ
    return ShardTable(rows, keys)


def test_a_batch_gathers_its_rows_and_keys_from_the_tables_held() -> None:
    rng = np.random.default_rng(5)
    shards = 30
    pool = TablePool(shards, WIDTH)
    tables: dict[int, ShardTable] = {}
    peak = 0
    for step in range(200):
        shard = int(rng.integers(shards))
        if shard in tables and rng.random() < 0.5:
            pool.drop(shard)
            del tables[shard]
        else:  # a new table, or a shard's again (it replaces the one held)
            tables[shard] = table(rng, shard)
            pool.add(shard, tables[shard])
        held = np.array(sorted(tables), dtype=np.int64)
        peak = max(peak, sum(t.rows.shape[0] for t in tables.values()))
        # Compactions keep the pool within half as much again as it held at most.
        assert pool.rows.shape[0] <= 1.5 * peak
        assert ((pool.base >= 0) == np.isin(np.arange(shards), held)).all()
        if step % 5 or not held.size:
            continue
        picked = rng.choice(held, 64)
        samples = np.array([rng.integers(tables[int(s)].rows.shape[0]) for s in picked])
        rows, keys, offsets = pool.pick(picked, samples)
        for i, (s, k) in enumerate(zip(picked.tolist(), samples.tolist(), strict=True)):
            mine = tables[s]
            assert (rows[i] == mine.rows[k]).all()
            start = int(mine.rows[:k, -1].sum())
            expected = mine.keys[start : start + int(mine.rows[k, -1])]
            assert (keys[offsets[i] : offsets[i + 1]] == expected).all()
