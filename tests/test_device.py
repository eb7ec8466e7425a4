"""``device=``: batches moved to a device on the transform thread, ahead of the consumer.

The CUDA path (a side stream, the consumer's stream waiting for the copy) runs only where
torch sees a GPU; this machine has none, so those tests are skipped with that reason.
Everything else runs here: the stage on PyTorch's ``meta`` device (a real device type that
``Tensor.to`` moves to, holding no data), its thread, order and position, resume, the
refusals, and the side stream's switches (with torch's CUDA stream calls replaced by
recorders)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncbatch as ab
from asyncbatch._batch import Batch, FieldSchema
from asyncbatch._device import READY, ToDevice, ready

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (CPU torch, no GPU lent)"
)


@pytest.fixture
def dataset(tmp_path: Path) -> ab.Dataset:
    tokens = np.random.default_rng(2).integers(0, 60_000, 4_000, dtype=np.uint16)
    return ab.write_tokens(str(tmp_path / "t"), tokens, shard_size=1_500)


def test_cpu_is_no_stage(dataset: ab.Dataset) -> None:
    with ab.Loader(dataset, batch_size=4, seq_len=16, device="cpu") as loader:
        assert loader.device is None
        batch = next(iter(loader))
    assert batch["tokens"].device.type == "cpu"


def test_batches_move_on_the_transform_thread_in_order(dataset: ab.Dataset) -> None:
    threads: list[str] = []

    def note(batch: ab.Batch) -> ab.Batch:
        threads.append(threading.current_thread().name)
        assert batch["tokens"].device.type == "cpu"  # the user's transform runs first
        return batch

    args = {"batch_size": 4, "seq_len": 16, "shuffle": True, "seed": 1}
    with ab.Loader(dataset, **args) as plain:
        expected = [(b.global_indexes.tolist(), b["tokens"].shape) for b in plain]
    with ab.Loader(dataset, **args, device="meta", transform=note) as loader:
        got = list(loader)
    assert [(b.global_indexes.tolist(), b["tokens"].shape) for b in got] == expected
    assert all(b["tokens"].device.type == "meta" for b in got)
    assert all(READY not in b.extra for b in got)
    assert set(threads) and all(name.startswith("asyncbatch-transform") for name in threads)


def test_resume_with_a_device_is_exact(dataset: ab.Dataset) -> None:
    args = {"batch_size": 4, "seq_len": 16, "shuffle": True, "seed": 3, "device": "meta"}
    with ab.Loader(dataset, **args) as first:
        it = iter(first)
        for _ in range(5):
            next(it)
        state = first.state_dict()
        rest = [b.global_indexes.tolist() for b in it]
    with ab.Loader(dataset, **args) as resumed:
        resumed.load_state_dict(state)
        assert [b.global_indexes.tolist() for b in resumed] == rest


def test_async_loader_moves_batches_too(dataset: ab.Dataset) -> None:
    async def main() -> list[str]:
        async with ab.AsyncLoader(dataset, batch_size=4, seq_len=16, device="meta") as loader:
            return [b["tokens"].device.type async for b in loader]

    assert set(asyncio.run(main())) == {"meta"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused_at_construction(dataset: ab.Dataset) -> None:
    with pytest.raises(ab.ConfigError, match=r"device='cuda'.*is_available\(\) is False"):
        ab.Loader(dataset, batch_size=4, seq_len=16, device="cuda")


def one_batch(values: torch.Tensor, number: int = 0) -> Batch:
    schema = {"tokens": FieldSchema(str(values.dtype), tuple(values.shape[1:]))}
    indexes = np.arange(values.shape[0], dtype=np.int64)
    return Batch(indexes, {"tokens": values}, schema, {"epoch": 0, "batch": number})


class StreamCalls:
    """Stand-ins for torch's CUDA stream calls, noting which thread switched to what."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.switches: list[tuple[str, object]] = []
        self.contexts: list[str] = []
        self.recorded = 0
        calls = self

        class Event:
            def record(self, stream: object) -> None:
                calls.recorded += 1

        class Context:
            def __init__(self, stream: object) -> None:
                pass

            def __enter__(self) -> None:
                calls.contexts.append(threading.current_thread().name)

            def __exit__(self, *exc: object) -> None:
                pass

        def switch(stream: object) -> None:
            self.switches.append((threading.current_thread().name, stream))

        monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", Context)
        monkeypatch.setattr(torch.cuda, "set_stream", switch)
        monkeypatch.setattr(Batch, "to", lambda batch, device, non_blocking=False: batch)


def run_on_new_threads(stage: Any, runs: int, batches: int) -> list[Batch]:
    """``stage`` over ``batches`` batches on each of ``runs`` fresh threads, as the engine
    runs its transform: one new thread per run."""
    out = []
    for run in range(runs):
        with ThreadPoolExecutor(1, thread_name_prefix=f"run{run}") as thread:
            for number in range(batches):
                out.append(thread.submit(stage, one_batch(torch.ones(2, 3), number)).result())
    return out


def test_the_side_stream_is_entered_once_per_run_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = StreamCalls(monkeypatch)
    to_cuda = ToDevice(torch.device("cuda"))
    out = run_on_new_threads(to_cuda, runs=2, batches=5)
    assert [name.split("_")[0] for name, _ in calls.switches] == ["run0", "run1"]
    assert all(stream is to_cuda._stream for _, stream in calls.switches)
    assert calls.contexts == []
    assert calls.recorded == 10
    assert [b.extra["batch"] for b in out] == [0, 1, 2, 3, 4] * 2
    assert all(b.extra[READY][1] == torch.device("cuda") for b in out)


def test_a_transform_keeps_its_threads_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = StreamCalls(monkeypatch)
    seen: list[int] = []

    def note(batch: Batch) -> Batch:
        seen.append(len(calls.contexts))  # the side stream is not entered yet
        return batch

    out = run_on_new_threads(ToDevice(torch.device("cuda"), note), runs=1, batches=4)
    assert calls.switches == []
    assert seen == [0, 1, 2, 3]
    assert len(calls.contexts) == 4
    assert calls.recorded == 4
    assert [b.extra["batch"] for b in out] == [0, 1, 2, 3]


def test_a_bad_device_and_a_dataset_device_are_refused(dataset: ab.Dataset) -> None:
    with pytest.raises(ab.ConfigError, match="device='gpu0': not a torch device"):
        ab.Loader(dataset, batch_size=4, seq_len=16, device="gpu0")
    with pytest.raises(ab.ConfigError, match="LoaderDataset takes no device="):
        ab.LoaderDataset(dataset, batch_size=4, seq_len=16, device="meta")


@needs_cuda
def test_cuda_batches_equal_the_cpu_ones_and_arrive_before_use(dataset: ab.Dataset) -> None:
    args = {"batch_size": 4, "seq_len": 16, "shuffle": True, "seed": 5}
    with ab.Loader(dataset, **args) as plain:
        expected = [b["tokens"].clone() for b in plain]
    side_streams = set()
    with ab.Loader(dataset, **args, device="cuda") as loader:
        for batch, want in zip(loader, expected, strict=True):
            tokens = batch["tokens"]
            assert tokens.is_cuda
            assert READY not in batch.extra
            # Used on the consumer's stream right away: the wait makes this exact.
            assert torch.equal((tokens.long() + 1).cpu(), want.long() + 1)
            stream = loader._engine.transform._stream  # type: ignore[union-attr]
            side_streams.add(stream)
    assert len(side_streams) == 1
    assert next(iter(side_streams)) != torch.cuda.current_stream()


@needs_cuda
def test_cuda_source_memory_may_be_reused_once_the_copy_returns() -> None:
    """What the engine relies on: once the stage returns, the batch's CPU memory may be
    filled again (the BufferPool does), even while the side stream is still busy."""
    to_cuda = ToDevice(torch.device("cuda"))
    source = torch.empty(64, 1024, dtype=torch.int64)
    got = []
    with ThreadPoolExecutor(1) as thread:  # the stage's thread (it switches its stream)
        for number in range(20):
            source.fill_(number)
            if to_cuda._stream is not None:
                with torch.cuda.stream(to_cuda._stream):
                    torch.cuda._sleep(1_000_000)  # the side stream is busy: the DMA waits
            moved = ready(thread.submit(to_cuda, one_batch(source, number)).result())
            source.fill_(-1)  # the engine reuses the memory
            got.append(moved["tokens"].clone())
    torch.cuda.synchronize()
    for number, tokens in enumerate(got):
        assert torch.equal(tokens.cpu(), torch.full((64, 1024), number, dtype=torch.int64))


@needs_cuda
def test_cuda_with_a_transform_that_pins(dataset: ab.Dataset) -> None:
    args = {"batch_size": 8, "seq_len": 64, "shuffle": True, "seed": 6, "dtype": torch.int64}
    with ab.Loader(dataset, **args) as plain:
        expected = [b["tokens"].clone() for b in plain]

    def plus(batch: ab.Batch) -> dict[str, torch.Tensor]:
        assert batch["tokens"].device.type == "cpu"
        return {"tokens": batch["tokens"].pin_memory(), "plus": batch["tokens"] + 1}

    with ab.Loader(dataset, **args, device="cuda:0", transform=plus) as loader:
        for batch, want in zip(loader, expected, strict=True):
            assert batch["tokens"].device == torch.device("cuda", 0)
            assert torch.equal((batch["plus"] - batch["tokens"]).cpu(), torch.ones_like(want))
            assert torch.equal(batch["tokens"].cpu(), want)
