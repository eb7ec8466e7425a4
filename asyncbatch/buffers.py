"""Batch buffers recycled once nothing refers to them any more.

A group's batches are views of one buffer of several MiB. A buffer that size is a fresh
mapping from the kernel every time, and each first touch of it costs a page fault and a
zeroed page: for ``dtype=torch.int64`` batches that is as much time again as the copy that
fills them. A :class:`BufferPool` keeps the memory of buffers whose batches are gone and
fills later groups into it.

A buffer is handed out as a numpy array over a slab the pool owns. Every view of it (numpy
views, ``torch.from_numpy`` tensors and their views, memoryviews, ``tensor.numpy()``) refers
to that array, never to the slab behind it, so the slab returns to the pool only when the
last of them is gone, in whichever thread drops it: a batch the user keeps is never written
over.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref

import numpy as np
import numpy.typing as npt

#: Buffers smaller than this come from numpy (malloc serves them from memory it keeps).
POOLED_FROM = 2**20
#: Slabs are whole multiples of this many bytes.
GRAIN = 2**16


class BufferPool:
    """Uninitialised byte buffers, from slabs reused once their buffer is gone.

    A slab serves a request of at least half its size. Free slabs are kept up to the most
    bytes the pool has had handed out at once (the most its loader held), the smallest
    dropped first; :meth:`clear` drops them all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Free slabs, by size, and what they hold together.
        self._free: list[tuple[int, int, mmap.mmap]] = []
        self._free_bytes = 0
        #: Bytes of the slabs handed out now, and the most at once.
        self._out_bytes = 0
        self._peak_out = 0
        self._leases: dict[
            int, weakref.ref[npt.NDArray[np.uint8]]
        ] = {}  # by id (arrays do not hash)
        self._serial = 0  # orders slabs of one size in the free list
        #: Slabs created and buffers served from a free slab (for tests and benchmarks).
        self.created = 0
        self.reused = 0

    def empty(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A writable uint8 array of ``nbytes``, its contents undefined (as ``np.empty``)."""
        if nbytes < POOLED_FROM:
            return np.empty(nbytes, dtype=np.uint8)
        slab = self._take(nbytes)
        if slab is None:
            slab = mmap.mmap(-1, -(-nbytes // GRAIN) * GRAIN)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                slab.madvise(mmap.MADV_HUGEPAGE)
            with self._lock:
                self.created += 1
        buffer = np.frombuffer(slab, dtype=np.uint8, count=nbytes)
        # Views of ``buffer`` refer to it (its base is no array), so its death is theirs.
        lease = weakref.ref(buffer, _Returned(self, slab))
        with self._lock:
            self._leases[id(lease)] = lease
            self._out_bytes += len(slab)
            self._peak_out = max(self._peak_out, self._out_bytes)
        return buffer

    def _take(self, nbytes: int) -> mmap.mmap | None:
        """The smallest free slab of ``nbytes`` to twice that, taken from the free list."""
        with self._lock:
            at = bisect.bisect_left(self._free, (nbytes,))
            if at == len(self._free) or self._free[at][0] > 2 * nbytes:
                return None
            size, _, slab = self._free.pop(at)
            self._free_bytes -= size
            self.reused += 1
            return slab

    def _give_back(self, lease: weakref.ref[npt.NDArray[np.uint8]], slab: mmap.mmap) -> None:
        size = len(slab)
        with self._lock:
            self._leases.pop(id(lease), None)
            self._out_bytes -= size
            while self._free and self._free_bytes + size > self._peak_out:
                if self._free[0][0] > size:  # keep the larger slabs
                    return
                dropped, *_ = self._free.pop(0)
                self._free_bytes -= dropped
            if self._free_bytes + size > self._peak_out:
                return
            self._serial += 1
            bisect.insort(self._free, (size, self._serial, slab))
            self._free_bytes += size

    def clear(self) -> None:
        """Drop the free slabs (those handed out are freed with their last view)."""
        with self._lock:
            self._free, self._free_bytes, self._peak_out = [], 0, self._out_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes of the free slabs."""
        return self._free_bytes


class _Returned:
    """A buffer's death callback: its slab goes back to the pool, if the pool is still there."""

    __slots__ = ("_pool", "_slab")

    def __init__(self, pool: BufferPool, slab: mmap.mmap) -> None:
        self._pool = weakref.ref(pool)
        self._slab = slab

    def __call__(self, lease: weakref.ref[npt.NDArray[np.uint8]]) -> None:
        pool = self._pool()
        if pool is not None:
            pool._give_back(lease, self._slab)
