"""The columnar batch: O(fields) objects, one buffer per field, pickles across processes."""

from __future__ import annotations

import gc
import pickle
import sys

import numpy as np
import pytest
import torch

from asyncbatch.batch import Batch, FieldSchema, Jagged


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


def make_jagged() -> Jagged:
    lengths = torch.tensor([3, 0, 5, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return Jagged(torch.arange(9, dtype=torch.int32) + 100, offsets)


def test_jagged_column_slices_pads_and_nests() -> None:
    column = make_jagged()
    assert len(column) == 4 and column.lengths.tolist() == [3, 0, 5, 1]
    assert column[2].tolist() == [103, 104, 105, 106, 107] and column[-1].tolist() == [108]
    tail = column[1:3]
    assert len(tail) == 2 and tail.offsets.tolist() == [0, 0, 5]
    assert tail[1].tolist() == [103, 104, 105, 106, 107]
    padded = column.to_padded(pad=-1)
    assert padded.shape == (4, 5)
    assert padded[0].tolist() == [100, 101, 102, -1, -1] and padded[1].tolist() == [-1] * 5
    assert column.mask().sum().item() == 9
    assert column.to_padded(length=2)[2].tolist() == [103, 104]
    nested = tail.to_nested()
    assert nested.is_nested and [t.tolist() for t in nested.unbind()] == [[], tail[1].tolist()]
    with pytest.raises(IndexError):
        column[4]


def test_jagged_and_object_fields_round_trip_as_buffers() -> None:
    objects = np.empty(3, dtype=object)
    objects[:] = [{"a": 1}, [1, 2], "x"]
    batch = Batch(
        np.arange(4, dtype=np.int64),
        {"docs": make_jagged(), "meta": Jagged(objects, torch.tensor([0, 1, 1, 3, 3]))},
        {
            "docs": FieldSchema("int32", (-1,), nested=True),
            "meta": FieldSchema("object", (-1,), nested=True, tensor=False),
        },
    )
    header, buffers = batch.to_buffers()
    assert len(buffers) == 1 + 2 + 2
    again = pickle.loads(pickle.dumps(batch))
    assert torch.equal(again["docs"].values, batch["docs"].values)
    assert torch.equal(again["docs"].offsets, batch["docs"].offsets)
    assert list(again["meta"][2]) == [[1, 2], "x"] and again["meta"].values[0] == {"a": 1}
