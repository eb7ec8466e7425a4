"""Recycled batch buffers: memory goes back to the pool only when nothing refers to it."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

import asyncbatch as ab
from asyncbatch._buffers import POOLED_FROM, BufferPool

MiB = 2**20


def test_a_buffer_returns_only_when_its_last_view_is_gone() -> None:
    pool = BufferPool(64 * MiB)
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
    pool = BufferPool(64 * MiB)
    small = pool.empty(POOLED_FROM - 1)
    assert small.nbytes == POOLED_FROM - 1 and small.flags.owndata
    del small
    assert (pool.created, pool.free_bytes) == (0, 0)


def test_a_slab_serves_requests_from_half_its_size_to_its_size() -> None:
    pool = BufferPool(64 * MiB)
    first = pool.empty(8 * MiB)
    del first
    assert pool.free_bytes == 8 * MiB
    small = pool.empty(3 * MiB)  # under half: a slab of its own
    assert (pool.created, pool.reused, pool.free_bytes) == (2, 0, 8 * MiB)
    larger = pool.empty(5 * MiB)
    assert (pool.created, pool.reused, pool.free_bytes) == (2, 1, 0)
    assert larger.nbytes == 5 * MiB
    del small, larger


def test_free_memory_is_kept_up_to_keep_bytes_and_dropped_by_close() -> None:
    pool = BufferPool(5 * MiB)
    held = [pool.empty(2 * MiB) for _ in range(3)]
    del held
    assert pool.free_bytes == 4 * MiB  # the third would pass keep_bytes: dropped
    # One at a time from here on: the free slabs serve, none is created.
    for _ in range(10):
        buffer = pool.empty(2 * MiB)
        del buffer
    assert (pool.created, pool.free_bytes) == (3, 4 * MiB)
    # A larger slab coming back pushes out smaller free ones.
    large = pool.empty(4 * MiB)
    del large
    assert pool.free_bytes == 4 * MiB and pool.empty(4 * MiB) is not None
    kept = pool.empty(2 * MiB)
    pool.close()
    assert pool.free_bytes == 0
    del kept  # comes back after close(): dropped, not kept
    assert pool.free_bytes == 0


def test_scratch_of_merged_reads_is_kept_beside_the_batches() -> None:
    """A group reading through scratch holds its buffer and its scratch: with only the batches'
    bound kept, every other group mapped (and faulted in) fresh memory."""
    pool = BufferPool(4 * MiB)  # two groups of 2 MiB batches
    for _ in range(5):  # two groups at a time, each a buffer and its scratch
        held = [pool.empty(2 * MiB), pool.empty(2 * MiB, scratch=True)]
        held += [pool.empty(2 * MiB), pool.empty(2 * MiB, scratch=True)]
        del held
    assert pool.created == 4 and pool.free_bytes == 8 * MiB
    without = BufferPool(4 * MiB)
    for _ in range(5):
        held = [without.empty(2 * MiB) for _ in range(4)]
        del held
    assert without.created > 4 and without.free_bytes == 4 * MiB


def test_a_batch_is_not_shared_with_a_forked_child() -> None:
    """Slabs are private memory: a child's writes stay its own, and a slab the parent fills
    again after handing the child a batch leaves the child's copy as it was."""
    pool = BufferPool(64 * MiB)
    batch = torch.from_numpy(pool.empty(4 * MiB)).view(torch.int64)
    batch.fill_(1)
    to_child, to_parent = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes its copy, waits for the parent, reports its copy
        try:  # numpy only: torch's thread pool does not survive a fork
            values = batch.numpy()
            values += 41
            os.read(to_child[0], 1)
            os.write(to_parent[1], str(int(values.min())).encode())
        finally:
            os._exit(0)
    try:
        del batch
        again = pool.empty(4 * MiB)
        again[:] = 99
        assert pool.reused == 1
        os.write(to_child[1], b"x")
        answer = os.read(to_parent[0], 64)
    finally:
        os.waitpid(pid, 0)
        for fd in (*to_child, *to_parent):
            os.close(fd)
    assert answer == b"42"


def test_a_forked_child_uses_the_pool_its_parent_held_locked() -> None:
    """A fork while another thread holds the pool's lock: the child's pool still works."""
    pool = BufferPool(64 * MiB)
    kept = pool.empty(2 * MiB)
    with pool._lock:
        pid = os.fork()
        if pid == 0:
            try:
                del kept
                assert pool.empty(2 * MiB).nbytes == 2 * MiB and pool.reused == 1
                pool.close()
            finally:
                os._exit(0 if pool.free_bytes == 0 else 1)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung on the lock it inherited")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_slab_dropped_during_a_collection_under_the_pool_lock_returns() -> None:
    """The last reference may go inside a garbage collection that runs while the pool holds
    its lock (in any thread): the slab is queued, and taken in by the next call."""
    pool = BufferPool(64 * MiB)
    cycle: list[object] = [pool.empty(2 * MiB)]
    cycle.append(cycle)
    del cycle
    dropped: list[bool] = []

    def collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and pool._lock.locked() and not dropped:
            dropped.append(True)

    gc.callbacks.append(collect)
    try:
        with pool._lock:  # a collection here frees the cycle and runs the callback
            gc.collect()
    finally:
        gc.callbacks.remove(collect)
    assert dropped
    assert pool.free_bytes == 2 * MiB


def test_a_buffer_dropped_in_another_thread_returns() -> None:
    pool = BufferPool(64 * MiB)
    box = [torch.from_numpy(pool.empty(2 * MiB))]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join(timeout=10)
    assert pool.free_bytes == 2 * MiB


def test_a_buffer_in_a_reference_cycle_returns_when_collected() -> None:
    pool = BufferPool(64 * MiB)
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
    pool = BufferPool(64 * MiB)
    buffer = pool.empty(size)
    buffer[:] = 1
    buffer[-1] = 2
    assert buffer.nbytes == size and int(buffer.sum()) == size + 1
