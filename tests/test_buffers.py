"""Recycled batch buffers: memory goes back to the pool only when nothing refers to it."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

import asyncbatch as ab
from asyncbatch.buffers import POOLED_FROM, BufferPool

MiB = 2**20


def test_a_buffer_returns_only_when_its_last_view_is_gone() -> None:
    pool = BufferPool()
    buffer = pool.empty(4 * MiB)
    assert buffer.nbytes == 4 * MiB and buffer.flags.writeable and buffer.dtype == np.uint8
    buffer[:] = 7
    address = buffer.ctypes.data
    # Every way a batch's memory is passed on: numpy views, tensors and their views,
    # a tensor's numpy array, memoryviews.
    rows = buffer.view(np.int64).reshape(64, -1)
    tensor = torch.from_numpy(rows)[3:5]
    views: list[object] = [
        buffer[10:20],
        rows[1],
        tensor,
        tensor[1, 2:],
        tensor.numpy(),
        memoryview(rows[2]),
        torch.frombuffer(memoryview(buffer[MiB:]), dtype=torch.uint8),
    ]
    del buffer, rows, tensor
    while views:
        assert pool.free_bytes == 0, f"returned while {type(views[-1])} refers to it"
        views.pop()
    assert pool.free_bytes == 4 * MiB
    again = pool.empty(4 * MiB)
    assert again.ctypes.data == address and (pool.created, pool.reused) == (1, 1)


def test_small_buffers_are_not_pooled() -> None:
    pool = BufferPool()
    small = pool.empty(POOLED_FROM - 1)
    assert small.nbytes == POOLED_FROM - 1 and small.flags.owndata
    del small
    assert (pool.created, pool.free_bytes) == (0, 0)


def test_a_slab_serves_requests_from_half_its_size_to_its_size() -> None:
    pool = BufferPool()
    first = pool.empty(8 * MiB)
    del first
    assert pool.free_bytes == 8 * MiB
    small = pool.empty(3 * MiB)  # under half: a slab of its own
    assert (pool.created, pool.reused, pool.free_bytes) == (2, 0, 8 * MiB)
    larger = pool.empty(5 * MiB)
    assert (pool.created, pool.reused, pool.free_bytes) == (2, 1, 0)
    assert larger.nbytes == 5 * MiB
    del small, larger


def test_free_memory_is_kept_up_to_the_most_handed_out_at_once() -> None:
    pool = BufferPool()
    held = [pool.empty(2 * MiB) for _ in range(3)]
    del held
    assert pool.free_bytes == 6 * MiB
    # One at a time from here on: the free slabs stay (up to the peak), and serve.
    for _ in range(10):
        buffer = pool.empty(2 * MiB)
        del buffer
    assert (pool.created, pool.free_bytes) == (3, 6 * MiB)
    pool.clear()
    assert pool.free_bytes == 0
    # After clear() the peak counts anew, from what is out then.
    held = [pool.empty(2 * MiB) for _ in range(2)]
    del held
    assert (pool.created, pool.free_bytes) == (5, 4 * MiB)


def test_a_buffer_dropped_in_another_thread_returns() -> None:
    pool = BufferPool()
    box = [torch.from_numpy(pool.empty(2 * MiB))]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join(timeout=10)
    assert pool.free_bytes == 2 * MiB


def test_a_buffer_in_a_reference_cycle_returns_when_collected() -> None:
    pool = BufferPool()
    cycle: list[object] = [pool.empty(2 * MiB)]
    cycle.append(cycle)
    del cycle
    assert pool.free_bytes == 0
    gc.collect()
    assert pool.free_bytes == 2 * MiB


def test_kept_batches_stay_intact_while_later_epochs_reuse_memory(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    """Batches the user holds are never written over, though every later group is filled
    into memory of groups already taken (int64 batches: 1 MiB groups and more)."""
    ab.write_tokens(str(tmp_path / "ds"), np.resize(tokens, 2**20), shard_size=2**19)
    stream = np.resize(tokens, 2**20).astype(np.int64)
    kept: list[ab.Batch] = []
    with ab.Loader(
        str(tmp_path / "ds"), batch_size=8, seq_len=256, shuffle=True, seed=1, dtype=torch.int64
    ) as loader:
        for epoch in range(3):
            for step, batch in enumerate(loader):
                if epoch == 0 and step % 5 == 0:
                    kept.append(batch)
        pool = loader._engine.buffers if loader._engine is not None else None
        assert pool is not None and pool.reused > 0, "no buffer was reused: nothing tested"
    assert kept
    for batch in kept:
        want = np.stack([stream[i * 256 : (i + 1) * 256] for i in batch.global_indexes.tolist()])
        np.testing.assert_array_equal(batch["tokens"].numpy(), want)


@pytest.mark.parametrize("size", [POOLED_FROM, 3 * MiB + 5])
def test_buffers_of_any_size_are_whole_and_writable(size: int) -> None:
    pool = BufferPool()
    buffer = pool.empty(size)
    buffer[:] = 1
    buffer[-1] = 2
    assert buffer.nbytes == size and int(buffer.sum()) == size + 1
