"""The columnar batch: O(fields) objects, one buffer per field, pickles across processes."""

from __future__ import annotations

import gc
import pickle
import sys

import numpy as np
import torch

from asyncbatch.batch import Batch, FieldSchema


def make_batch(samples: int, fields: int) -> Batch:
    return Batch(
        np.arange(samples, dtype=np.int64),
        {
            f"f{i}": torch.arange(samples * 8, dtype=torch.int32).reshape(samples, 8)
            for i in range(fields)
        },
        {f"f{i}": FieldSchema("int32", (8,)) for i in range(fields)},
        {"epoch": 0},
    )


def test_objects_grow_with_fields_not_samples() -> None:
    counts = {}
    for samples in (8, 1024):
        gc.collect()
        before = len(gc.get_objects())
        batches = [make_batch(samples, 10) for _ in range(20)]
        counts[samples] = len(gc.get_objects()) - before
        del batches
    # 20 batches × 10 fields: the count must not depend on the batch size.
    assert counts[1024] == counts[8]
    assert counts[8] < 20 * 10 * 4


def test_serialises_as_header_plus_one_buffer_per_field() -> None:
    batch = make_batch(1024, 10)
    header, buffers = batch.to_buffers()
    assert len(buffers) == 1 + 10
    assert sum(b.nbytes for b in buffers) == 1024 * 8 + 10 * 1024 * 8 * 4
    assert sys.getsizeof(pickle.dumps(header)) < 4096
    again = Batch.from_buffers(header, buffers)
    assert all(torch.equal(again[name], batch[name]) for name in batch)


def test_pickle_round_trip() -> None:
    batch = make_batch(16, 3)
    again = pickle.loads(pickle.dumps(batch))
    assert np.array_equal(again.global_indexes, batch.global_indexes)
    assert again.schema == batch.schema and again.extra == batch.extra
    assert all(torch.equal(again[name], batch[name]) for name in batch)
