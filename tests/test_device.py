"""``device=``: batches moved to a device on the transform thread, ahead of the consumer.

The CUDA path (pinned memory, a side stream, the consumer's stream waiting for the copy)
runs only where torch sees a GPU; this machine has none, so those tests are skipped with
that reason. Everything else runs here: the stage on PyTorch's ``meta`` device (a real
device type that ``Tensor.to`` moves to, holding no data), its thread, order and position,
resume, and the refusals."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import asyncbatch as ab
from asyncbatch.device import READY

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
