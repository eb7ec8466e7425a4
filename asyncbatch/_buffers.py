"""Batch buffers recycled once nothing refers to them any more.

A group's batches are views of one buffer of several MiB. A buffer that size is a fresh
mapping from the kernel every time, and each first touch of it costs a page fault and a
zeroed page: for ``dtype=torch.int64`` batches that is as much time again as the copy that
fills them. A :class:`BufferPool` keeps the memory of buffers whose batches are gone and
fills later groups into it.

A buffer is handed out as a numpy array over a slab the pool owns (private anonymous memory,
copied on write in a forked child like any other). Every view of it (numpy views,
``torch.from_numpy`` tensors and their views, memoryviews, ``tensor.numpy()``, DLPack)
refers to that array, never to the slab behind it, so the slab returns to the pool only when
the last of them is gone, in whichever thread drops it: a batch the user keeps is never
written over. (A pointer that outlives what it points into, such as ``tensor.numpy()`` kept
after ``tensor.share_memory_()`` moved the tensor, reads whatever the memory holds next, as
with any allocator.)

A returned slab is only queued (an atomic append, no lock), since the last reference can go
anywhere, even inside a garbage collection that runs while the pool's lock is held; the pool
takes the queue in when it next hands out a buffer.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import threading
import weakref

import numpy as np
import numpy.typing as npt

#: Buffers smaller than this come from numpy (malloc serves them from memory it keeps).
POOLED_FROM = 2**20
#: Slabs are whole multiples of this many bytes.
GRAIN = 2**16

Slab = mmap.mmap


class BufferPool:
    """Uninitialised byte buffers, from slabs reused once their buffer is gone.

    A slab serves a request of at least half its size. Free slabs are kept up to
    ``keep_bytes`` together (the loader's prefetch bound), plus room for the scratch of two
    groups once a read asks for scratch (merged reads land there before their pieces are
    copied into place), the smallest dropped first; :meth:`close` drops them, and every slab
    returned after it.
    """

    def __init__(self, keep_bytes: int = 0) -> None:
        #: The most bytes of free slabs kept for later buffers.
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        #: Slabs whose buffer is gone, in the order they came back (appended by callbacks).
        self._returned: collections.deque[Slab] = collections.deque()
        #: Free slabs by size (with a serial, so that slabs are never compared).
        self._free: list[tuple[int, int, Slab]] = []
        self._free_bytes = 0
        #: Kept beside ``keep_bytes``: twice the largest scratch asked for.
        self._scratch_bytes = 0
        self._serial = 0
        self._closed = False
        #: The callbacks of the buffers handed out, by id (arrays do not hash).
        self._leases: dict[int, weakref.ref[npt.NDArray[np.uint8]]] = {}
        #: Slabs created and buffers served from a free slab (for tests and benchmarks).
        self.created = 0
        self.reused = 0
        _POOLS.add(self)

    def empty(self, nbytes: int, scratch: bool = False) -> npt.NDArray[np.uint8]:
        """A writable uint8 array of ``nbytes``, its contents undefined (as ``np.empty``);
        ``scratch``: for a group's merged reads (more free memory is kept for those)."""
        if nbytes < POOLED_FROM:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            if scratch:
                self._scratch_bytes = max(self._scratch_bytes, 2 * nbytes)
            self._take_returned()
            slab = self._take(nbytes)
            if slab is None:
                self.created += 1
        if slab is None:
            # No MADV_HUGEPAGE: once a process has fragmented its memory, a huge page fault
            # stalls on compaction (an Arrow block shuffle read at 0.6x its rate in a process
            # that had run other loaders), and reused slabs fault no more anyway.
            slab = mmap.mmap(
                -1, -(-nbytes // GRAIN) * GRAIN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        buffer = np.frombuffer(slab, dtype=np.uint8, count=nbytes)
        # Views of ``buffer`` refer to it (its base is no array), so its death is theirs.
        lease = weakref.ref(buffer, _Returned(self, slab))
        self._leases[id(lease)] = lease
        return buffer

    def close(self) -> None:
        """Drop the free slabs, and from now on every slab that comes back."""
        with self._lock:
            self._closed = True
            self._take_returned()

    @property
    def free_bytes(self) -> int:
        """Bytes of the free slabs (those returned since the last buffer handed out count)."""
        with self._lock:
            self._take_returned()
            return self._free_bytes

    def _take_returned(self) -> None:
        """Move the returned slabs to the free list, as far as ``keep_bytes`` allows."""
        keep = self.keep_bytes + self._scratch_bytes
        while self._returned:
            slab = self._returned.popleft()
            size = len(slab)
            if self._closed:
                continue
            while self._free and self._free_bytes + size > keep:
                if self._free[0][0] > size:  # keep the larger slabs
                    break
                dropped, *_ = self._free.pop(0)
                self._free_bytes -= dropped
            if self._free_bytes + size <= keep:
                self._serial += 1
                bisect.insort(self._free, (size, self._serial, slab))
                self._free_bytes += size
        if self._closed:
            self._free, self._free_bytes = [], 0

    def _take(self, nbytes: int) -> Slab | None:
        """The smallest free slab of ``nbytes`` to twice that, taken from the free list."""
        at = bisect.bisect_left(self._free, (nbytes,))
        if at == len(self._free) or self._free[at][0] > 2 * nbytes:
            return None
        size, _, slab = self._free.pop(at)
        self._free_bytes -= size
        self.reused += 1
        return slab

    def _after_fork(self) -> None:
        # The parent's threads may have held the lock when it forked: the child's is new.
        self._lock = threading.Lock()


class _Returned:
    """A buffer's death callback: its slab goes back to the pool, if the pool is still there."""

    __slots__ = ("_pool", "_slab")

    def __init__(self, pool: BufferPool, slab: Slab) -> None:
        self._pool = weakref.ref(pool)
        self._slab = slab

    def __call__(self, lease: weakref.ref[npt.NDArray[np.uint8]]) -> None:
        pool = self._pool()
        if pool is not None:
            pool._leases.pop(id(lease), None)
            pool._returned.append(self._slab)


_POOLS: weakref.WeakSet[BufferPool] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for pool in list(_POOLS):
        pool._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
