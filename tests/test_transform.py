"""``transform=``: every format, off the consumer's thread, in order, inside the prefetch
bound, errors after the good batches, AsyncLoader, DataLoader workers, exact resume."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tokenizers
import torch
from conftest import WriteDataset
from make_megatron import random_documents, write_megatron
from test_metadata import make_spans

import asyncbatch as ab
from asyncbatch._errors import ConfigError

#: How long a test waits for an event the engine must cause before it calls the test failed.
WAIT = 20.0

#: (dataset, loader arguments) of one small dataset per format.
Case = tuple[ab.Dataset, dict[str, Any]]


def make_case(kind: str, root: Path) -> Case:
    rng = np.random.default_rng(1)
    if kind == "tokens":
        tokens = rng.integers(0, 60_000, 3_001, dtype=np.uint16)
        return ab.write_tokens(str(root / "t"), tokens, shard_size=1000), {"seq_len": 16}
    if kind == "documents":
        docs = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in rng.integers(1, 40, 90)]
        return ab.write_documents(str(root / "d"), docs, shard_size=700), {}
    if kind == "npy":
        np.save(root / "n.npy", rng.integers(0, 60_000, 2_000, dtype=np.uint16))
        return ab.open_dataset(str(root / "n.npy")), {"seq_len": 16}
    if kind == "megatron":
        write_megatron(root / "m", random_documents(3, 60, max_length=50))
        return ab.open_dataset(str(root / "m")), {}
    if kind == "llmbatch":
        records = rng.integers(0, 2**31, (96, 12), dtype=np.uint32)
        return ab.write_llmbatch(str(root / "l.batch"), records, batch_size=8), {}
    assert kind == "metadata_stream"
    spans = make_spans(0, 80)
    return ab.write_metadata_stream(str(root / "s"), spans, shard_size=4000), {"seq_len": 24}


FORMATS = ["tokens", "documents", "npy", "megatron", "llmbatch", "metadata_stream"]


def same(a: Any, b: Any) -> bool:
    """Whether two field values hold the same values (tensors, arrays, jagged columns)."""
    if isinstance(a, ab.Jagged):
        return isinstance(b, ab.Jagged) and same(a.values, b.values) and same(a.offsets, b.offsets)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a.shape == b.shape and list(a.ravel()) == list(b.ravel())


def row_ids(batch: ab.Batch) -> torch.Tensor:
    return torch.from_numpy(batch.global_indexes.copy())


def as_dict(batch: ab.Batch) -> dict[str, Any]:
    """A module-level transform (picklable): every field, plus ``rows``."""
    return {**batch.fields, "rows": row_ids(batch)}


def in_place(batch: ab.Batch) -> ab.Batch:
    batch.schema["rows"] = ab.FieldSchema("int64", ())
    batch["rows"] = row_ids(batch)
    return batch


def new_batch(batch: ab.Batch) -> ab.Batch:
    """A new Batch that knows nothing of the position: the loader sets it."""
    fields = {**batch.fields, "rows": row_ids(batch)}
    schema = {**batch.schema, "rows": ab.FieldSchema("int64", ())}
    return ab.Batch(batch.global_indexes, fields, schema)


class Recorder:
    """Wraps a transform; records, per call, the batch position and the calling thread."""

    def __init__(self, transform: Callable[[ab.Batch], Any]) -> None:
        self.transform = transform
        self.calls: list[tuple[int, int]] = []
        self.threads: set[str] = set()

    def __call__(self, batch: ab.Batch) -> Any:
        self.calls.append((batch.extra["epoch"], batch.extra["batch"]))
        self.threads.add(threading.current_thread().name)
        assert threading.get_ident() != threading.main_thread().ident
        return self.transform(batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transform", [as_dict, in_place, new_batch])
@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_delivers_its_transformed_batches_in_order(
    kind: str, transform: Callable[[ab.Batch], Any], tmp_path: Path
) -> None:
    dataset, kwargs = make_case(kind, tmp_path)
    kwargs.update(batch_size=4, shuffle=True, seed=2, prefetch=6)
    with ab.Loader(dataset, **kwargs) as loader:
        plain = list(loader)
    recorder = Recorder(transform)
    with ab.Loader(dataset, transform=recorder, **kwargs) as loader:
        consumer = threading.get_ident()
        got = []
        for batch in loader:
            assert threading.get_ident() == consumer
            got.append(batch)
    assert len(got) == len(plain) > 2
    # Called once per batch, in batch order, on the engine's transform thread only.
    assert recorder.calls == [(0, n) for n in range(len(plain))]
    assert recorder.threads == {"asyncbatch-transform_0"}
    for want, batch in zip(plain, got, strict=True):
        np.testing.assert_array_equal(batch.global_indexes, want.global_indexes)
        assert (batch.extra["epoch"], batch.extra["batch"]) == (
            want.extra["epoch"],
            want.extra["batch"],
        )
        assert torch.equal(batch["rows"], row_ids(want))
        assert batch.schema["rows"] == ab.FieldSchema("int64", ())
        assert set(batch) == {*want, "rows"}
        for name, value in want.fields.items():
            assert same(value, batch[name]), name
            # A wrapped mapping gets the schema the format gives the same values.
            assert batch.schema[name] == want.schema[name], name


@pytest.fixture
def dataset(tmp_path: Path) -> ab.Dataset:
    tokens = np.arange(64 * 200, dtype=np.uint16)
    return ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=2**20)


@pytest.mark.timeout(60)
def test_transform_overlaps_later_reads_and_runs_ahead_of_the_consumer(
    dataset: ab.Dataset,
) -> None:
    """Transform 0 does not return until later groups were read (a serial read-then-transform
    engine would never get there), and transform 3 runs before the consumer asks for batch 1."""
    ran = {k: threading.Event() for k in range(8)}
    loader: ab.Loader

    def transform(batch: ab.Batch) -> ab.Batch:
        number = batch.extra["batch"]
        if number == 0:
            # Sequential windows: one request per group. Groups 1 (batches 1-2) and 2
            # (3-6) read while this transform holds batch 0 back from the consumer.
            for _ in range(int(WAIT / 0.01)):
                if loader.statistics().requests >= 3:
                    break
                threading.Event().wait(0.01)  # a sleep that releases the GIL
            else:
                raise AssertionError("no later read happened while transform 0 ran")
        if number in ran:
            ran[number].set()
        return batch

    with ab.Loader(
        dataset, batch_size=4, seq_len=16, shuffle=False, prefetch=8, transform=transform
    ) as loader:
        it = iter(loader)
        assert next(it).extra["batch"] == 0
        assert ran[3].wait(WAIT), "batch 3 was not transformed ahead of the consumer"
        assert [next(it).extra["batch"] for _ in range(7)] == list(range(1, 8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [1, 3, 8])
def test_batches_in_transform_count_in_the_prefetch_bound(
    dataset: ab.Dataset, prefetch: int
) -> None:
    asked = [0]  # next() calls made so far: a batch is only freed by a next()
    ahead: list[int] = []

    def transform(batch: ab.Batch) -> ab.Batch:
        # Batches 0..k are read, in transform or waiting; only ``asked`` were freed.
        ahead.append(batch.extra["batch"] + 1 - asked[0])
        return batch

    with ab.Loader(
        dataset, batch_size=4, seq_len=16, shuffle=True, prefetch=prefetch, transform=transform
    ) as loader:
        for _ in range(40):
            asked[0] += 1
            next(loader)
            threading.Event().wait(0.002)  # a slow consumer: the engine runs ahead
        assert loader.statistics().peak_reserved <= prefetch
    assert len(ahead) >= 40
    assert max(ahead) <= prefetch


class FailOn:
    """Raises ValueError on batch ``number`` (the first ``times`` calls on it)."""

    def __init__(self, number: int, times: int = 1_000) -> None:
        self.number = number
        self.times = times

    def __call__(self, batch: ab.Batch) -> dict[str, Any]:
        if batch.extra["batch"] == self.number and self.times > 0:
            self.times -= 1
            raise ValueError(f"bad batch {batch.global_indexes.tolist()}")
        return as_dict(batch)


def ids_of(batches: Any) -> list[list[int]]:
    return [b.global_indexes.tolist() for b in batches]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [1, 4, 16])
def test_an_error_in_transform_reaches_next_after_every_good_batch(
    dataset: ab.Dataset, prefetch: int
) -> None:
    kwargs: dict[str, Any] = dict(batch_size=4, seq_len=16, seed=5, prefetch=prefetch)
    with ab.Loader(dataset, **kwargs) as loader:
        plain = ids_of(loader)
    with ab.Loader(dataset, transform=FailOn(5, times=2), **kwargs) as loader:
        got = []
        with pytest.raises(ab.TransformError, match="batch 5 of epoch 0") as caught:
            for batch in loader:
                got.append(batch)
        assert ids_of(got) == plain[:5]
        error = caught.value
        assert (error.epoch, error.batch) == (0, 5)
        assert isinstance(error.__cause__, ValueError)
        assert "ValueError: bad batch" in str(error)
        assert loader.state_dict()["batches_done"] == 5
        # The position stays after the last good batch: next() runs the transform on batch 5
        # again (here it fails once more, then succeeds) and goes on from there.
        with pytest.raises(ab.TransformError, match="batch 5"):
            next(loader)
        assert ids_of(loader) == plain[5:]
    restored = pickle.loads(pickle.dumps(error))
    assert (type(restored), str(restored), restored.epoch, restored.batch) == (
        ab.TransformError,
        str(error),
        0,
        5,
    )


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()])
def test_a_base_exception_in_transform_is_a_transform_error_too(
    dataset: ab.Dataset, raised: BaseException
) -> None:
    def transform(batch: ab.Batch) -> ab.Batch:
        if batch.extra["batch"] == 2:
            raise raised
        return batch

    with ab.Loader(dataset, batch_size=4, seq_len=16, prefetch=4, transform=transform) as loader:
        assert [next(loader).extra["batch"] for _ in range(2)] == [0, 1]
        with pytest.raises(ab.TransformError, match="batch 2") as caught:
            next(loader)
    assert caught.value.__cause__ is raised


@pytest.mark.timeout(60)
def test_transform_over_every_store(write_dataset: WriteDataset) -> None:
    tokens = np.arange(4_000, dtype=np.uint16)
    url, options = write_dataset(tokens, shard_size=1000)
    kwargs: dict[str, Any] = dict(batch_size=4, seq_len=50, seed=6, storage_options=options)
    with ab.Loader(url, **kwargs) as loader:
        plain = [(b.global_indexes.tolist(), b["tokens"].clone()) for b in loader]
    with ab.Loader(url, transform=as_dict, **kwargs) as loader:
        got = [(b.global_indexes.tolist(), b["tokens"], b["rows"].tolist()) for b in loader]
    assert [ids for ids, _ in plain] == [ids for ids, _, _ in got] == [r for _, _, r in got]
    assert all(torch.equal(a, b) for (_, a), (_, b, _) in zip(plain, got, strict=True))


def test_a_transform_returning_something_else_is_a_transform_error(dataset: ab.Dataset) -> None:
    with (
        ab.Loader(dataset, batch_size=4, seq_len=16, transform=lambda b: [1, 2]) as loader,
        pytest.raises(ab.TransformError, match="batch 0 .*returned list") as caught,
    ):
        next(loader)
    assert isinstance(caught.value.__cause__, TypeError)
    with (
        ab.Loader(dataset, batch_size=4, seq_len=16, transform=lambda b: {"x": [1, 2]}) as loader,
        pytest.raises(ab.TransformError, match="field 'x' as list"),
    ):
        next(loader)


def test_a_transform_that_is_not_callable_fails_at_construction(dataset: ab.Dataset) -> None:
    with pytest.raises(ConfigError, match="transform must be a callable"):
        ab.Loader(dataset, batch_size=4, seq_len=16, transform="tokenize")
    with pytest.raises(ConfigError, match="transform must be a callable"):
        ab.LoaderDataset(dataset, batch_size=4, seq_len=16, transform=3)


@pytest.mark.timeout(60)
def test_async_loader_transforms_off_its_event_loop(dataset: ab.Dataset) -> None:
    kwargs: dict[str, Any] = dict(batch_size=4, seq_len=16, seed=1, prefetch=4)
    with ab.Loader(dataset, transform=as_dict, **kwargs) as loader:
        want = [(b.global_indexes.tolist(), b["rows"].tolist()) for b in loader]

    async def collect() -> tuple[list[tuple[list[int], list[int]]], Recorder, str]:
        recorder = Recorder(as_dict)
        async with ab.AsyncLoader(dataset.url, transform=recorder, **kwargs) as loader:
            got = [(b.global_indexes.tolist(), b["rows"].tolist()) async for b in loader]
        return got, recorder, threading.current_thread().name

    got, recorder, loop_thread = asyncio.run(collect())
    assert got == want
    assert recorder.threads == {"asyncbatch-transform_0"} and loop_thread not in recorder.threads

    async def failing() -> list[list[int]]:
        seen = []
        async with ab.AsyncLoader(dataset, transform=FailOn(3), **kwargs) as loader:
            with pytest.raises(ab.TransformError, match="batch 3") as caught:
                async for batch in loader:
                    seen.append(batch.global_indexes.tolist())
            assert isinstance(caught.value.__cause__, ValueError)
        return seen

    assert asyncio.run(failing()) == [ids for ids, _ in want[:3]]


@pytest.mark.timeout(90)
def test_dataloader_workers_apply_the_transform(dataset: ab.Dataset) -> None:
    kwargs: dict[str, Any] = dict(batch_size=4, seq_len=16, seed=4, prefetch=4)
    with ab.Loader(dataset, transform=as_dict, **kwargs) as loader:
        want = [(b.global_indexes.tolist(), b["rows"].tolist()) for b in loader]
    source = ab.LoaderDataset(dataset, transform=as_dict, **kwargs)
    got = [
        (b.global_indexes.tolist(), b["rows"].tolist())
        for b in source.dataloader(num_workers=2, timeout=60)
    ]
    assert got == want
    # A worker's TransformError reaches the parent as one, naming the batch.
    failing = ab.LoaderDataset(dataset, transform=FailOn(6), **kwargs)
    seen = []
    iterator = iter(failing.dataloader(num_workers=2, timeout=60))
    try:
        with pytest.raises(ab.TransformError, match="batch 6 of epoch 0"):
            for batch in iterator:
                seen.append(batch.global_indexes.tolist())
    finally:
        # Now: the traceback keeps the iterator alive, and the garbage collector would stop
        # its workers later, during another test, taking seconds there.
        iterator._shutdown_workers()  # type: ignore[attr-defined]
    # The DataLoader takes batches from the workers in turn: batches 0-5 came first.
    assert seen == [ids for ids, _ in want[:6]]


def test_a_loader_with_a_transform_pickles_with_it(dataset: ab.Dataset) -> None:
    """What spawned DataLoader workers need: the transform travels with the loader."""
    with ab.Loader(dataset, batch_size=4, seq_len=16, transform=as_dict) as loader:
        assert next(loader).extra["batch"] == 0
        with pickle.loads(pickle.dumps(loader)) as copy:
            assert copy.transform is as_dict
            second = next(copy)
    assert second.extra["batch"] == 1 and "rows" in second


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shuffle", [False, True, "block"])
@pytest.mark.parametrize("prefetch", [1, 4])
def test_resume_with_a_transform_is_exact(
    dataset: ab.Dataset, shuffle: bool | str, prefetch: int
) -> None:
    kwargs: dict[str, Any] = dict(
        batch_size=4, seq_len=16, shuffle=shuffle, seed=8, prefetch=prefetch, transform=as_dict
    )
    if shuffle == "block":
        kwargs.update(block_size=6, window=3)

    def rows(batches: Any) -> list[list[int]]:
        return [b["rows"].tolist() for b in batches]

    with ab.Loader(dataset, **kwargs) as loader:
        full = rows(loader)
    for stop in (1, 7, 30):
        with ab.Loader(dataset, **kwargs) as loader:
            first = rows(next(loader) for _ in range(stop))
            state = loader.state_dict()
        assert state["batches_done"] == stop
        with ab.Loader(dataset, **kwargs) as loader:
            loader.load_state_dict(state)
            assert first + rows(loader) == full, (stop, shuffle, prefetch)


@pytest.mark.timeout(60)
def test_a_tokenizers_tokenizer_inside_transform(tmp_path: Path) -> None:
    """A real `tokenizers` tokenizer (Rust, releases the GIL), trained here on a few words:
    windows of token ids decode to text and encode back to the same ids."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "owls"]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([" ".join(words)] * 3, trainer=trainer)
    rng = np.random.default_rng(0)
    text = [words[i] for i in rng.integers(0, len(words), 4_000)]
    ids: npt.NDArray[np.uint16] = np.asarray(tokenizer.encode(" ".join(text)).ids, dtype=np.uint16)
    assert ids.size == len(text) and tokenizer.token_to_id("[UNK]") not in ids
    dataset = ab.write_tokens(str(tmp_path / "words"), ids, shard_size=1000)

    def retokenize(batch: ab.Batch) -> dict[str, Any]:
        lines = tokenizer.decode_batch(batch["tokens"].tolist())
        encoded = tokenizer.encode_batch(lines)
        return {
            "tokens": torch.tensor([e.ids for e in encoded], dtype=torch.int64),
            "text": np.array(lines, dtype=object),
        }

    with ab.Loader(
        dataset, batch_size=8, seq_len=32, dtype=torch.int64, transform=retokenize
    ) as loader:
        batches = list(loader)
    assert len(batches) == ids.size // 32 // 8
    for batch in batches:
        starts = batch.global_indexes * 32
        windows = np.stack([ids[s : s + 32] for s in starts.tolist()]).astype(np.int64)
        np.testing.assert_array_equal(batch["tokens"].numpy(), windows)
        assert list(batch["text"]) == [" ".join(text[s : s + 32]) for s in starts.tolist()]
        assert batch.schema["text"] == ab.FieldSchema("object", (), tensor=False)
