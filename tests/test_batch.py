"""The columnar batch: O(fields) objects, one buffer per field, pickles across processes."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import asyncbatch as ab
from asyncbatch._batch import Batch, FieldSchema, Jagged


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
    # Counted by reachability from the batches, not by gc.get_objects() deltas, which other
    # threads (a test server left running) change at any moment.
    counts = {
        samples: objects_held([make_batch(samples, 10) for _ in range(20)]) for samples in (8, 1024)
    }
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


def objects_held(root: object) -> int:
    """Python objects reachable from ``root`` (types and modules excluded)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return len(seen)


def wide_batch(samples: int) -> Batch:
    """10 fields of every shape a format gives: dense, jagged numbers, jagged objects."""
    lengths = torch.arange(samples, dtype=torch.int64) % 7
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.arange(int(offsets[-1]), dtype=torch.int32)
    texts = np.empty(int(offsets[-1]), dtype=object)
    texts[:] = "x"  # one shared object: the count measures the batch, not the values
    fields: dict[str, object] = {
        f"dense{i}": torch.zeros(samples, 16, dtype=torch.int16) for i in range(4)
    }
    fields |= {f"jagged{i}": Jagged(values, offsets) for i in range(4)}
    fields |= {"texts": Jagged(texts, offsets), "index": np.arange(samples)}
    schema = {name: FieldSchema("int32", (-1,), nested=True) for name in fields}
    return Batch(np.arange(samples, dtype=np.int64), fields, schema, {"epoch": 0})


def test_wide_batches_hold_objects_per_field_not_per_sample() -> None:
    counts = {n: objects_held(wide_batch(n)) for n in (8, 1024)}
    assert counts[8] == counts[1024] < 200
    # Slicing every field (what the engine does per batch) stays O(fields) too.
    sliced = {n: objects_held(Batch(*_sliced(wide_batch(4 * n), n))) for n in (8, 1024)}
    assert sliced[8] == sliced[1024]
    header, buffers = wide_batch(1024).to_buffers()
    assert len(buffers) == 1 + 4 + 2 * 4 + 2 + 1


def _sliced(batch: Batch, n: int) -> tuple[object, ...]:
    return (
        batch.global_indexes[n : 2 * n],
        {name: value[n : 2 * n] for name, value in batch.fields.items()},
        batch.schema,
    )


def _metadata_batches(tmp_path: Path, codec: str, options: dict[str, object]) -> dict[int, Batch]:
    rng = np.random.default_rng(0)
    spans = []
    for k in range(2000):
        tokens = rng.integers(0, 1000, int(rng.integers(1, 12)), dtype=np.uint32)
        spans.append((tokens, k if codec == "numpy" else {"k": k}))
    ab.write_metadata_stream(
        str(tmp_path / codec), spans, codec=codec, codec_options=options, shard_size=4000 * 8
    )
    batches = {}
    for size in (8, 1024):
        with ab.Loader(str(tmp_path / codec), batch_size=size, seq_len=8, shuffle=True) as loader:
            batches[size] = next(iter(loader))
    return batches


@pytest.mark.timeout(60)
def test_metadata_batch_from_a_loader_holds_objects_per_field(tmp_path: Path) -> None:
    batches = _metadata_batches(tmp_path, "numpy", {"dtype": "<i8"})
    assert batches[1024]["meta"].values.numel() > 1024  # more spans than samples
    counts = {n: objects_held(b) for n, b in batches.items()}
    assert counts[8] == counts[1024]
    header, buffers = batches[1024].to_buffers()
    assert len(buffers) == 1 + 1 + 3 * 2  # indexes, tokens, three jagged columns


@pytest.mark.timeout(60)
def test_metadata_batch_pickles_across_processes(tmp_path: Path) -> None:
    batch = _metadata_batches(tmp_path, "json", {})[1024]
    # The child unpickles (a Batch rebuilt from header + buffers), checks, and sends it back.
    child = (
        "import pickle, sys\n"
        "batch = pickle.load(sys.stdin.buffer)\n"
        "assert type(batch).__name__ == 'Batch' and batch.batch_size == 1024\n"
        "assert len(batch.to_buffers()[1]) == 8\n"
        "sys.stdout.buffer.write(pickle.dumps(batch))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        input=pickle.dumps(batch),
        capture_output=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    again = pickle.loads(done.stdout)
    assert np.array_equal(again.global_indexes, batch.global_indexes)
    assert torch.equal(again["tokens"], batch["tokens"])
    for name in ("meta_start", "meta_end"):
        assert torch.equal(again[name].values, batch[name].values)
        assert torch.equal(again[name].offsets, batch[name].offsets)
    assert list(again["meta"].values) == list(batch["meta"].values)
    assert again.schema == batch.schema and again.extra == batch.extra


def mixed_batch() -> Batch:
    """Dense and jagged tensors, a jagged column of objects and a numpy field."""
    objects = np.empty(3, dtype=object)
    objects[:] = [{"a": 1}, [1, 2], "x"]
    return Batch(
        np.arange(10, 14, dtype=np.int64),
        {
            "tokens": torch.arange(12, dtype=torch.int32).reshape(4, 3),
            "docs": make_jagged(),
            "meta": Jagged(objects, torch.tensor([0, 1, 1, 3, 3])),
            "index": np.arange(4),
        },
        {
            "tokens": FieldSchema("int32", (3,)),
            "docs": FieldSchema("int32", (-1,), nested=True),
            "meta": FieldSchema("object", (-1,), nested=True, tensor=False),
            "index": FieldSchema("int64", ()),
        },
        {"epoch": 2, "batch": 7},
    )


def test_to_moves_every_tensor_and_keeps_indexes_schema_and_position() -> None:
    batch = mixed_batch()
    moved = batch.to("meta")  # a device every torch build has
    assert isinstance(moved, Batch) and moved is not batch
    assert moved["tokens"].device.type == "meta" and moved["tokens"].shape == (4, 3)
    assert moved["docs"].values.device.type == "meta"
    assert moved["docs"].offsets.device.type == "meta"
    assert moved["meta"].values is batch["meta"].values  # objects stay where they are
    assert moved["meta"].offsets.device.type == "meta"
    assert moved["index"] is batch["index"]
    assert np.array_equal(moved.global_indexes, batch.global_indexes)
    assert moved.schema == batch.schema and moved.extra == {"epoch": 2, "batch": 7}
    assert moved.extra is not batch.extra
    # The source batch is untouched, and a copy to its own device keeps the values.
    assert batch["tokens"].device.type == "cpu"
    same = batch.to(torch.device("cpu"), non_blocking=True)
    assert torch.equal(same["tokens"], batch["tokens"])
    assert torch.equal(same["docs"].values, batch["docs"].values)


def test_torch_pin_memory_keeps_a_batch_whole() -> None:
    # What DataLoader's pin-memory thread calls on each item: without Batch.pin_memory it
    # rebuilt the Mapping as a plain dict, losing global_indexes and the position. Objects
    # only, so this runs without an accelerator (pinning a tensor needs one).
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = mixed_batch()
    batch.fields = {"meta": batch["meta"].values}
    batch.schema = {"meta": batch.schema["meta"]}
    pinned = pin_memory(batch)
    assert isinstance(pinned, Batch)
    assert np.array_equal(pinned.global_indexes, batch.global_indexes)
    assert pinned.extra == {"epoch": 2, "batch": 7} and pinned.schema == batch.schema


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_dataloader_with_pin_memory_yields_batches(tmp_path: Path) -> None:
    tokens = np.arange(4000, dtype=np.uint16)
    dataset = ab.write_tokens(str(tmp_path / "ds"), tokens)
    source = ab.LoaderDataset(dataset, batch_size=4, seq_len=50, shuffle=False)
    # Without an accelerator, torch skips pinning (and warns); with one, it pins each Batch.
    accelerator = torch.accelerator.is_available()
    for step, batch in enumerate(source.dataloader(pin_memory=True)):
        assert isinstance(batch, Batch) and batch.extra["batch"] == step
        assert batch.global_indexes.tolist() == list(range(4 * step, 4 * step + 4))
        assert batch["tokens"].is_pinned() == accelerator
        if step == 2:
            break
    if accelerator:
        pinned = mixed_batch().pin_memory()
        assert pinned["tokens"].is_pinned() and pinned["docs"].values.is_pinned()
        assert pinned["docs"].offsets.is_pinned() and pinned.extra["batch"] == 7


def test_default_convert_keeps_a_batch() -> None:
    # DataLoader(batch_size=None) and StatefulDataLoader pass each item through it.
    from torch.utils.data._utils.collate import default_convert

    batch = mixed_batch()
    converted = default_convert(batch)
    assert isinstance(converted, Batch) and converted is not batch
    assert np.array_equal(converted.global_indexes, batch.global_indexes)
    assert converted.extra == batch.extra and converted.schema == batch.schema
    assert converted["tokens"] is batch["tokens"] and converted["docs"] is batch["docs"]
    assert torch.equal(converted["index"], torch.arange(4))  # numbers become tensors
    assert list(batch) == list(converted) and isinstance(batch["index"], np.ndarray)
    with pytest.raises(KeyError, match="schema"):
        batch["new"] = torch.zeros(4)
