"""Local and HPC filesystem store: reads straight into the caller's buffers.

Reads that may wait for a disk run in a bounded thread pool, never on the event loop (a few
small ones of bytes in memory are made on the loop). The engine's path for token
windows, :meth:`LocalStore.read_windows`, plans and copies a whole group in a single call of
the small C helper ``_preadv`` with the GIL released: it finds each window's shard by binary
search over the cumulative counts and copies (and widens, with ``dtype=``) straight out of the
files' mappings, so no Python runs per window and no read plan is built.
:meth:`LocalStore.read_into` does the same for any group of planned byte ranges. By default the
helper copies from a read-only mapping of each file (``mmap``): for the small windows of a
global shuffle this costs about half a ``pread`` call, which is mostly system-call overhead.
A file is mapped for the first read that copies many ranges from it; a few reads (headers, a
first batch's rows) use ``pread``, which costs less than a mapping, its page faults and its
unmapping. A few small reads of bytes in memory are made on the loop itself (see
:meth:`LocalFiles.copy_resident`). A
file truncated under its mapping would kill the process with SIGBUS; the helper catches the
fault inside its copy loop and the read fails with a
:class:`~asyncbatch._errors.ShardChangedError` instead. ``storage_options= {"mmap": False}``
reads with ``pread`` (e.g. on a parallel filesystem that maps poorly), as does a file that
cannot be mapped; without the helper (no compiler at install time) a Python loop of
``os.preadv`` calls reads, slower. Open files (and their mappings) are kept in a small LRU
(:class:`LocalFiles`) so that thousands of shards do not exhaust the process's descriptor
limit; the store lives as long as its loader, across its runs (epochs, ``for`` loops), so
later epochs neither map the files again nor pay first-touch page faults again, and the
loader's ``close()`` closes them.

Each file is pinned when it is first opened: its (inode, size, mtime) are recorded, checked
again whenever it is reopened after leaving the LRU, against its path on its first use in
each later run, and with one ``fstat`` per file after each group of reads. A file replaced,
resized or rewritten during training is a :class:`~asyncbatch._errors.ShardChangedError`,
not a silent mix of old and new bytes.

The registry stacks the guards of :mod:`~asyncbatch.stores._stack` over this store like any
transport: a plain ``OSError`` (``EIO``, a parallel filesystem's hiccup) is retried under
the :class:`~asyncbatch.stores._retry.RetryPolicy`; a missing or denied file, or a changed
one, is not. Its calls get no time bound (:class:`~asyncbatch.stores._base.Unbounded`): a
read runs in a thread no timeout can stop, and a large group on a slow filesystem is slow,
not stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from stat import S_ISREG
from typing import Any
from urllib.parse import unquote, urlsplit

import aiofiles
import aiofiles.os
import numpy as np
import numpy.typing as npt

from .._errors import (
    ConfigError,
    ShardChangedError,
    StoreError,
    describe_range,
)
from ._base import Buffer, Conversion, ObjectInfo, Unbounded, check_length
from ._copying import c_conversion, copy_pieces
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._runs import current_run
from ._stack import is_transient, map_error
from ._validate import check_options

#: What pins a local file: (inode, size, mtime in ns).
Version = tuple[int, int, int]


def file_version(stat: os.stat_result) -> Version:
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def object_info(stat: os.stat_result) -> ObjectInfo:
    """The size and the identity a local file is pinned at, as :meth:`LocalStore.stat` says."""
    return ObjectInfo(stat.st_size, "{:x}-{:x}-{:x}".format(*file_version(stat)))


try:
    from . import _preadv
except ImportError:  # pragma: no cover - built without a C compiler
    _preadv = None  # type: ignore[assignment]

Int64Array = npt.NDArray[np.int64]
#: One ask waiting for its turn's shared job: its URL, what is asked, where the answer goes.
Asked = tuple[str, Any, asyncio.Future[Any]]

#: Reads (``pread``) one pool job does before a group is split across threads: fewer, larger
#: jobs win on few cores, since each job costs a thread hop and the reads run without the GIL.
RANGES_PER_JOB = 512
#: Reads of at most this many ranges and bytes, of files open and bytes in memory, are made on
#: the event loop itself (a copy of a few KiB costs microseconds, a thread's hop ~100 us); a
#: file is mapped for a read of more ranges than this.
INLINE_READS = 16
INLINE_BYTES = 1 << 20
#: :class:`LocalFiles` entries' mapped bytes of a file not mapped yet, and of one that cannot
#: be (read with ``pread``).
NOT_MAPPED = -1
UNMAPPABLE = -2
#: ``pread`` that fails with EAGAIN where it would wait for the disk (Linux 4.14), if any.
RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: :attr:`LocalStore.coalesce_gap` when it copies from mappings.
MAPPED_COALESCE_GAP = 512
#: Destination bytes per thread job of :meth:`LocalStore.read_windows`, and of copies from
#: mappings: a group that writes more (a widening ``dtype`` writes 4x what it reads) copies
#: in parallel parts; smaller ones in one call, since each job costs a thread hop and its own
#: look-ups (thousands of small ranges copy in a fraction of that).
GATHER_JOB_BYTES = 8 * 2**20


def _write_file(path: str, data: Buffer | bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def local_path(url: str) -> str:
    """Filesystem path of a ``file://`` URL or a plain path."""
    if url.startswith("file://"):
        return unquote(urlsplit(url).path)
    return url


class LocalFiles:
    """Open local files, their mappings and their pins: a thread-safe LRU of descriptors.

    Each :class:`LocalStore` has one; it lives as long as the store (a loader's store lives
    as long as the loader), so a new epoch neither maps its files again nor pays their
    first-touch page faults again. Each new run of a loader (:meth:`follow`, with
    :func:`~asyncbatch.stores._runs.current_run`) checks every open file's path once more on
    its first use, so a file replaced or deleted between runs is still refused, not read
    from the old descriptor. A table nobody references releases its files when collected.
    """

    def __init__(self, max_open_files: int = 128, mmap: bool = True) -> None:
        self.max_open_files = max_open_files
        #: Whether reads copy from mappings (needs the C helper) rather than call pread.
        self.mmap = mmap and _preadv is not None
        #: url -> [fd, readers, mapping address, mapped bytes (NOT_MAPPED, UNMAPPABLE), run
        #: checked, size pinned]
        self._fds: OrderedDict[str, list[int]] = OrderedDict()
        self._pins: dict[str, Version] = {}  # url -> version when first opened
        self._lock = threading.Lock()
        self._run = 0
        self._closed = False
        finalizer = weakref.finalize(self, _close_entries, self._fds)
        # Not at interpreter exit: a loader still running then is closed by its own hook,
        # after this one would run, and its copies must not lose their mappings first.
        finalizer.atexit = False

    def follow(self, run: int) -> None:
        """Reads for ``run`` (a loader's run, see :mod:`~asyncbatch.stores._runs`) follow:
        when it is a new one, each open file's path is checked again on its next use."""
        if run != self._run:
            with self._lock:
                self._run = run

    def acquire(self, url: str) -> tuple[int, int, int]:
        """(descriptor, mapping address, mapped bytes or a negative value) of ``url``, held
        open until the matching :meth:`release`; not mapped by this call."""
        return self.acquire_many([url])[0]

    def acquire_many(self, urls: Sequence[str], mapped: bool = False) -> list[tuple[int, int, int]]:
        """:meth:`acquire` of each of ``urls`` (no repeats), held until :meth:`release_many`;
        files already open and checked in this run are taken under one hold of the lock.
        ``mapped``: map those not mapped yet (with ``mmap``). A file is mapped for the
        reads that copy many ranges from it, not for the first few: a few small reads cost
        less with ``pread`` than the mapping, its page faults and its unmapping."""
        with self._lock:
            entries = [self._held(url) for url in urls]
            run = self._run
        got: list[tuple[int, int, int]] = []
        try:
            for url, entry in zip(urls, entries, strict=True):
                if entry is None:
                    entry = self._open(url)
                else:
                    self._recheck(url, entry, run)
                if mapped:
                    self._map(entry)
                got.append((entry[0], entry[2], entry[3]))
        except BaseException:
            # Held: those acquired, and those taken above (the one that failed too).
            held = zip(urls, entries, strict=True)
            self.release_many([u for i, (u, e) in enumerate(held) if i < len(got) or e is not None])
            raise
        return got

    def _recheck(self, url: str, entry: list[int], run: int) -> None:
        """An open file's entry kept from an earlier run: checked against its path first."""
        if entry[4] != run:  # is the path still this file?
            self.check_pins([url], [_stat_path(url)])
            entry[4] = run

    def _open(self, url: str) -> list[int]:
        """Open and pin ``url`` into the LRU, held once: its entry."""
        try:
            fd = os.open(local_path(url), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # typed; EIO retried by the stack, a missing file not
            raise map_error(exc, url) from exc
        opened = [fd, 1, 0, NOT_MAPPED, self._run, 0]
        try:
            stat = os.fstat(fd)
            self.check_pins([url], [stat])
            opened[5] = stat.st_size
        except BaseException:
            _close_entry(opened)
            raise
        with self._lock:
            entry = self._held(url)
            if entry is not None:  # another thread opened it meanwhile
                _close_entry(opened)
                return entry
            self._fds[url] = opened
            self._evict_idle()
        return opened

    def _map(self, entry: list[int]) -> None:
        """Map a held file's pinned size, once; one that cannot be mapped is read with
        pread."""
        if entry[3] != NOT_MAPPED or not self.mmap:
            return
        assert _preadv is not None
        size = entry[5]
        try:
            address = _preadv.map_file(entry[0], size)
        except OSError:
            address, size = 0, UNMAPPABLE
        with self._lock:
            if entry[3] == NOT_MAPPED:
                entry[2], entry[3] = address, size
                return
        if size > 0:  # another thread mapped it meanwhile
            _preadv.unmap_file(address, size)

    def _held(self, url: str) -> list[int] | None:
        """``url``'s entry with one more reader, if open; called with the lock held."""
        if self._closed:
            raise StoreError(f"store closed while reading {url}", url)
        entry = self._fds.get(url)
        if entry is not None:
            entry[1] += 1
            self._fds.move_to_end(url)
        return entry

    def copy_resident(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        lengths: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: str | None,
    ) -> bool:
        """Make a few reads of files open and checked in this run whose bytes are all in
        memory, here, under the lock (no other thread unmaps or closes them meanwhile):
        copied from the files' mappings when ``mincore`` finds every page in memory, or,
        from files not mapped, read with ``pread(RWF_NOWAIT)``, which fails rather than wait
        for the disk. Then the files' pins are checked, as after every read. False when one
        is not so: the caller reads as usual (and meets any error there)."""
        places = which.tolist()
        with self._lock:
            if self._closed:
                return False
            entries: dict[int, list[int]] = {}
            for i in set(places):
                entry = self._fds.get(urls[i])
                if entry is None or entry[4] != self._run:
                    return False
                entries[i] = entry
            mapped = [entry[3] >= 0 for entry in entries.values()]
            if all(mapped):
                assert _preadv is not None
                bases = np.array([entries[i][2] for i in places], dtype=np.int64)
                limits = np.array([entries[i][3] for i in places], dtype=np.int64)
                if (starts + lengths > limits).any() or not _preadv.resident(
                    bases, starts, lengths
                ):
                    return False
                extra = () if convert is None else (convert,)
                done, _, _ = _preadv.copy_many(
                    bases, limits, starts, lengths, dest, dest_offsets, *extra
                )
                if done < len(places):
                    return False
            else:
                fds = [entries[i][0] for i in places]
                if any(mapped) or convert is not None or RWF_NOWAIT is None:
                    return False
                if not _read_nowait(fds, starts, lengths, dest, dest_offsets):
                    return False
            stats = [os.fstat(entry[0]) for entry in entries.values()]
        self.check_pins([urls[i] for i in entries], stats)
        return True

    def check_pins(self, urls: Sequence[str], stats: Sequence[os.stat_result]) -> None:
        """Pin each of ``urls`` at its version in ``stats`` if not yet pinned, else require
        the same version."""
        versions = [file_version(stat) for stat in stats]
        with self._lock:
            pins = [self._pins.setdefault(u, v) for u, v in zip(urls, versions, strict=True)]
        for url, pinned, version in zip(urls, pins, versions, strict=True):
            if pinned != version:
                was = "inode {}, {} bytes, mtime {} ns".format(*pinned)
                now = "inode {}, {} bytes, mtime {} ns".format(*version)
                raise ShardChangedError(
                    f"the file changed since it was opened: {url} was {was}, is {now}", url
                )

    def release(self, url: str) -> None:
        self.release_many([url])

    def release_many(self, urls: Sequence[str]) -> None:
        with self._lock:
            for url in urls:
                entry = self._fds.get(url)
                if entry is not None:
                    entry[1] -= 1
            self._evict_idle()

    def forget(self, url: str) -> None:
        """Unpin ``url`` and close it if no read holds it (the store wrote it)."""
        with self._lock:
            self._pins.pop(url, None)
            entry = self._fds.get(url)
            if entry is not None and entry[1] == 0:
                _close_entry(self._fds.pop(url))

    def _evict_idle(self) -> None:
        """Close least recently used descriptors no read holds (all of them once closed);
        called with the lock held."""
        excess = len(self._fds) - (0 if self._closed else self.max_open_files)
        if excess <= 0:
            return
        for url in [u for u, entry in self._fds.items() if entry[1] == 0][:excess]:
            _close_entry(self._fds.pop(url))

    def close(self) -> None:
        """Close every file no read holds now; the others as their reads end. Idempotent."""
        with self._lock:
            self._closed = True
            self._evict_idle()


class LocalStore(Unbounded):
    """Store for local paths and ``file://`` URLs."""

    #: A read syscall costs about as much as copying ~10 KB from the page cache: merging
    #: neighbours further apart than that moves more bytes than it saves in calls. A copy
    #: from a mapping costs ~0.1 us a range, a few hundred bytes' copying (every byte copied
    #: also faults its pages in, at both ends): there only near neighbours are merged.
    coalesce_gap = 16 * 1024
    #: ``read_into`` and ``read_windows`` widen integers as they copy (``convert``).
    supports_convert = True

    def __init__(self, max_threads: int = 8, max_open_files: int = 128, mmap: bool = True) -> None:
        self._files = LocalFiles(max_open_files, mmap)
        if self._files.mmap:
            self.coalesce_gap = MAPPED_COALESCE_GAP
        self._threads = max_threads
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="asyncbatch-local")
        self._closed = False
        #: Per loop, the stat calls and the tails waiting for this turn's shared job (see
        #: :meth:`_in_turn`).
        self._stats: dict[asyncio.AbstractEventLoop, list[Asked]] = {}
        self._tails: dict[asyncio.AbstractEventLoop, list[Asked]] = {}

    async def size(self, url: str) -> int:
        return (await self._stat(url)).st_size

    async def stat(self, url: str) -> ObjectInfo:
        """Size and identity (inode, size, mtime); pins the file at that identity."""
        stat = await self._stat(url)
        self._files.check_pins([url], [stat])
        return object_info(stat)

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes with the size and identity: a ``stat`` and a
        ``pread`` in one pool job (one thread hop, not two); pins the file as :meth:`stat`.
        The tails asked for in one turn of the loop (a dataset's files, opened together)
        share one job."""
        if self._closed:
            raise StoreError(f"store closed before reading {url}", url)
        self._files.follow(current_run())
        tail: tuple[bytes, ObjectInfo] = await self._in_turn(
            self._tails, url, (url, length), self._read_tails, "reading"
        )
        return tail

    async def _in_turn(
        self,
        asked: dict[asyncio.AbstractEventLoop, list[Asked]],
        url: str,
        ask: Any,
        job: Callable[[list[Any]], list[Any]],
        what: str,
    ) -> Any:
        """What ``job`` gives for ``ask``: the asks made of ``job`` in one turn of the loop
        share one pool job (``job`` takes them all, and returns a result or an error for
        each), since a thread's hop each would cost more than their work."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        pending = asked.setdefault(loop, [])
        if not pending:
            loop.call_soon(self._run_turn, loop, asked, job, what)
        pending.append((url, ask, waiter))
        return await waiter

    def _run_turn(
        self,
        loop: asyncio.AbstractEventLoop,
        asked: dict[asyncio.AbstractEventLoop, list[Asked]],
        job: Callable[[list[Any]], list[Any]],
        what: str,
    ) -> None:
        pending = asked.pop(loop, [])
        waiters = [(url, waiter) for url, _, waiter in pending]
        try:
            done = loop.run_in_executor(self._pool, job, [ask for _, ask, _ in pending])
        except RuntimeError:  # the pool is shut down: the store closed meanwhile
            for url, waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(StoreError(f"store closed before {what} {url}", url))
            return
        done.add_done_callback(functools.partial(_hand_out, waiters))

    def _read_tails(self, asks: Sequence[tuple[str, int]]) -> list[Any]:
        """:meth:`_read_tail` of each ``(url, length)``, or the error it raised."""
        found: list[Any] = []
        for url, length in asks:
            try:
                found.append(self._read_tail(url, length))
            except Exception as exc:  # noqa: BLE001 - handed to that URL's caller
                found.append(exc)
        return found

    def _read_tail(self, url: str, length: int) -> tuple[bytes, ObjectInfo]:
        stat = _stat_path(url)
        # The path, as stat checks it: a descriptor held open would still read the old file.
        self._files.check_pins([url], [stat])
        if self._closed:
            raise StoreError(f"store closed while reading {url}", url)
        fd = self._files.acquire(url)[0]
        try:
            stat = os.fstat(fd)
            self._files.check_pins([url], [stat])
            count = max(0, min(length, stat.st_size))
            start = stat.st_size - count
            try:
                tail = os.pread(fd, count, start)
            except OSError as exc:
                raise _read_failed(url, start, stat.st_size, exc) from exc
            check_length(url, start, stat.st_size, len(tail))
        finally:
            self._files.release(url)
        return tail, object_info(stat)

    async def _stat(self, url: str) -> os.stat_result:
        """``os.stat`` of ``url``'s path, off the loop. The calls made in one turn of the loop
        share one thread job: a run's first groups check every shard they touch at once
        (thousands, in a global shuffle), and a job each cost about 0.2 ms of thread hops."""
        self._files.follow(current_run())
        stat: os.stat_result = await self._in_turn(
            self._stats, url, url, self._stat_files, "a stat of"
        )
        return stat

    def _stat_files(self, urls: Sequence[str]) -> list[os.stat_result | Exception]:
        """:func:`_stat_paths`; when they are few, the regular files among them are opened
        too, as their reads will (a loader checks the size of each shard before its first
        read of it): a small read of bytes in memory then needs no thread. A file that does
        not open is left to its read, which says why."""
        found = _stat_paths(urls)
        if len(urls) <= self._files.max_open_files // 4:
            for url, stat in zip(urls, found, strict=True):
                if isinstance(stat, os.stat_result) and S_ISREG(stat.st_mode):
                    with contextlib.suppress(Exception):
                        self._files.acquire(url)
                        self._files.release(url)
        return found

    async def list(self, url: str) -> list[str]:
        path = local_path(url)
        loop = asyncio.get_running_loop()
        try:
            names = await loop.run_in_executor(self._pool, os.listdir, path)
        except RuntimeError as exc:  # the pool is shut down: the store closed meanwhile
            raise StoreError(f"store closed before listing {url}", url) from exc
        except (FileNotFoundError, PermissionError) as exc:
            raise map_error(exc, url) from exc
        return sorted(os.path.join(url, name) for name in names)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        if not buffers:
            return
        # The engine calls read_into with one buffer per group; this protocol path (small
        # reads such as manifests) goes through it with one copy.
        sizes = np.array([len(b) for b in buffers], dtype=np.int64)
        dest = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.cumsum(sizes) - sizes
        await self.read_into(
            [url],
            np.zeros(len(buffers), dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
            np.asarray(ends, dtype=np.int64),
            dest,
            offsets,
        )
        for buffer, offset, size in zip(buffers, offsets.tolist(), sizes.tolist(), strict=True):
            buffer[:] = memoryview(dest[offset : offset + size])  # type: ignore[arg-type]

    async def read_into(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: Conversion | None = None,
    ) -> None:
        """Read ``[starts[i], ends[i])`` of ``urls[which[i]]`` into ``dest[dest_offsets[i]:]``.

        Reads of one file should be neighbours: the work is split into contiguous jobs, and
        each job opens (or looks up) every file it touches once. ``convert``: the C helper
        converts inside its copy loop, so each value is written once; without mapped copies
        the stored bytes are read into a staging buffer laid out like ``dest`` and cast in
        one call off the loop.
        """
        if convert is None:
            await self._read_jobs(urls, which, starts, ends, dest, dest_offsets, None)
            return
        source, target = convert
        name = c_conversion(source, target)
        if name is not None and self._files.mmap:
            await self._read_jobs(urls, which, starts, ends, dest, dest_offsets, name)
            return
        ratio_in, ratio_out = source.itemsize, target.itemsize
        staging = np.empty(dest.size // ratio_out * ratio_in, dtype=np.uint8)
        staged_at = dest_offsets // ratio_out * ratio_in
        await self._read_jobs(urls, which, starts, ends, staging, staged_at, None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, _cast, staging, dest, source, target)

    async def read_windows(
        self,
        urls: Sequence[str],
        ends: Int64Array,
        offsets: Int64Array,
        itemsize: int,
        starts: Int64Array,
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        """The group's windows planned and copied out of the files' mappings in one GIL-free
        call of the C helper (it finds each window's shard by binary search over the
        cumulative counts ``ends``), with the conversion in the copy, in parallel parts for
        groups that write more than ``GATHER_JOB_BYTES``; False without mappings or the
        conversion, or when a part touches more files than may be open at once."""
        name = None if convert is None else c_conversion(*convert)
        if not self._files.mmap or (convert is not None and name is None):
            return False
        count = int(starts.size)
        if not count:
            return True
        self._files.follow(current_run())
        # Large groups copy in parallel, each part in one call (the GIL is released in it).
        jobs = max(1, min(self._threads, count, int(dest.size) // GATHER_JOB_BYTES))
        cuts = [count * j // jobs for j in range(jobs + 1)]
        width = window * (dest.size // max(1, count * window))  # destination bytes per window
        loop = asyncio.get_running_loop()
        layout = (ends, offsets, itemsize)
        done = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._pool,
                    self._gather,
                    urls,
                    layout,
                    starts[a:b],
                    window,
                    dest[a * width : b * width],
                    name,
                )
                for a, b in itertools.pairwise(cuts)
            )
        )
        return all(done)

    def _gather(
        self,
        urls: Sequence[str],
        layout: tuple[Int64Array, Int64Array, int],
        starts: Int64Array,
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: str | None,
    ) -> bool:
        ends, offsets, itemsize = layout
        count = ends.size
        first = np.searchsorted(ends, starts, side="right")
        last = np.searchsorted(ends, starts + max(0, window - 1), side="right")
        if (last - first > 1).any():  # windows longer than a shard: every shard between too
            spans = np.bincount(first, minlength=count + 1)
            spans -= np.bincount(last + 1, minlength=count + 1)
            touched = np.cumsum(spans[:count]) > 0
        else:
            touched = np.zeros(count, dtype=bool)
            touched[first] = True
            touched[last] = True
        used = np.flatnonzero(touched)
        if used.size > self._files.max_open_files:
            return False
        if self._closed:  # a job queued before close(), which waits for it
            raise StoreError(f"store closed while reading {urls[int(used[0])]}", urls[int(used[0])])
        held = [urls[index] for index in used.tolist()]
        opened = np.array(self._files.acquire_many(held, mapped=True), dtype=np.int64)
        opened = opened.reshape(-1, 3).T
        try:
            if (opened[2] < 0).any():  # a file that could not be mapped: read with pread
                return False
            bases = np.zeros(count, dtype=np.int64)
            limits = np.full(count, -1, dtype=np.int64)
            bases[used], limits[used] = opened[1], opened[2]
            assert _preadv is not None
            extra = () if convert is None else (convert,)
            done, shard, start, end, error = _preadv.gather(
                bases,
                limits,
                ends,
                offsets,
                itemsize,
                starts,
                window,
                dest,
                *extra,
            )
            # A file changed under a read explains a short one too: check pins first.
            self._files.check_pins(held, [os.fstat(fd) for fd in opened[0].tolist()])
            if done < starts.size:
                url = urls[shard]
                if error == -1:
                    where = describe_range(url, start, end)
                    message = (
                        f"the file shrank under the read (a bus error in its mapping): {where}"
                    )
                    raise ShardChangedError(message, url, start, end)
                assert error == 0, "every shard a window touches is mapped"
                check_length(url, start, end, max(0, int(limits[shard]) - start))
        finally:
            self._files.release_many(held)
        return True

    async def _read_jobs(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: str | None,
    ) -> None:
        count = int(starts.size)
        if count == 0:
            return
        self._files.follow(current_run())
        if self._copied_here(urls, which, starts, ends, dest, dest_offsets, convert):
            return
        loop = asyncio.get_running_loop()
        if self._files.mmap:  # copies from mappings: a range costs far less than a pread
            # Parts of about equal bytes, each at least one range: a few large ranges give as
            # many jobs as ranges at most, never an empty one.
            done_by = np.cumsum(ends - starts)
            total = int(done_by[-1])
            jobs = max(1, min(self._threads, count, total // GATHER_JOB_BYTES))
            cuts = np.searchsorted(done_by, np.arange(1, jobs) * (total / jobs), side="left")
            bounds = np.unique(np.clip(np.r_[0, cuts + 1, count], 0, count)).tolist()
        else:
            jobs = max(1, min(self._threads, count // RANGES_PER_JOB))
            bounds = [count * j // jobs for j in range(jobs + 1)]
        await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._pool,
                    self._read_job,
                    urls,
                    which[a:b],
                    starts[a:b],
                    ends[a:b],
                    dest,
                    dest_offsets[a:b],
                    convert,
                )
                for a, b in itertools.pairwise(bounds)
            )
        )

    def _copied_here(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: str | None,
    ) -> bool:
        """Whether the reads were few and small, of files open in this run whose bytes are
        all in memory, and so were made here (:meth:`LocalFiles.copy_resident`): a read that
        waits for no disk and no file system call costs less on the loop than a hop to a
        thread and back (a header, a footer, a few rows). False: nothing was read."""
        if int(starts.size) > INLINE_READS:
            return False
        lengths = ends - starts
        if int(lengths.sum()) > INLINE_BYTES:
            return False
        return self._files.copy_resident(urls, which, starts, lengths, dest, dest_offsets, convert)

    def _read_job(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: str | None,
    ) -> None:
        # Each job holds at most its share of max_open_files at once (reads of one file are
        # neighbours, so runs of one file are counted): thousands of shards in one group
        # stay under a low descriptor limit.
        new_file = np.empty(which.size, dtype=bool)  # (np.r_ costs ~10x more)
        new_file[0] = True
        np.not_equal(which[1:], which[:-1], out=new_file[1:])
        runs = np.cumsum(new_file) - 1
        chunk = runs // max(1, self._files.max_open_files // self._threads)
        cuts = [0, *(np.flatnonzero(chunk[1:] != chunk[:-1]) + 1).tolist(), int(which.size)]
        for a, b in itertools.pairwise(cuts):
            self._read_chunk(
                urls, which[a:b], starts[a:b], ends[a:b], dest, dest_offsets[a:b], convert
            )

    def _read_chunk(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: str | None,
    ) -> None:
        """Reads of a few files; ``convert``: a conversion of the C helper (mapped files)."""
        used = np.unique(which).tolist()
        if self._closed:  # a job queued before close(), which waits for it
            raise StoreError(f"store closed while reading {urls[used[0]]}", urls[used[0]])
        held = [urls[index] for index in used]
        # Many ranges copy faster from a mapping; a few read with pread cost less than one.
        mapped = starts.size > INLINE_READS
        opened = np.array(self._files.acquire_many(held, mapped), dtype=np.int64).T
        try:
            fd_of = np.full(len(urls), -1, dtype=np.int32)
            base_of = np.zeros(len(urls), dtype=np.int64)
            limit_of = np.full(len(urls), -1, dtype=np.int64)
            fd_of[used], base_of[used], limit_of[used] = opened
            lengths = ends - starts
            if _preadv is None:
                done, got, error = _read_many_python(
                    fd_of[which], starts, lengths, dest, dest_offsets
                )
            elif self._files.mmap and (limit_of[used] >= 0).all():
                done, got, error = _preadv.copy_many(
                    base_of[which],
                    limit_of[which],
                    starts,
                    lengths,
                    dest,
                    dest_offsets,
                    *(() if convert is None else (convert,)),
                )
            elif convert is not None:  # a file that could not be mapped
                staging = np.empty(int(lengths.sum()), dtype=np.uint8)
                staged_at = np.cumsum(lengths) - lengths
                done, got, error = _preadv.read_many(
                    fd_of[which], starts, lengths, staging, staged_at
                )
                if done == starts.size:
                    copy_pieces(staging, staged_at, lengths, dest, dest_offsets, convert)
            else:
                done, got, error = _preadv.read_many(
                    fd_of[which], starts, lengths, dest, dest_offsets
                )
            # A file changed under a read explains a short one too: check pins first.
            self._files.check_pins(held, [os.fstat(fd) for fd in opened[0].tolist()])
            if done < starts.size:
                url = urls[int(which[done])]
                start, end = int(starts[done]), int(ends[done])
                where = describe_range(url, start, end)
                if error < 0:
                    message = (
                        f"the file shrank under the read (a bus error in its mapping): {where}"
                    )
                    raise ShardChangedError(message, url, start, end)
                if error:
                    cause = OSError(error, os.strerror(error))  # EIO stays a plain OSError
                    raise _read_failed(url, start, end, cause) from cause
                check_length(url, start, end, got)
        finally:
            self._files.release_many(held)

    async def write(self, url: str, data: Buffer | bytes) -> None:
        path = local_path(url)
        parent = os.path.dirname(path)
        if parent:
            await aiofiles.os.makedirs(parent, exist_ok=True)
        # One job in the pool writes, closes and renames: a caller cancelled meanwhile can
        # leave neither an open file nor a half-written object behind.
        if self._closed:
            raise StoreError(f"store closed before writing {url}", url)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, _write_file, path, data)
        self._files.forget(url)  # our own write: the next open pins the new file

    async def close(self) -> None:
        """Stop the reading threads (after the reads under way) and close the files."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._files.close()


def _read_failed(url: str, start: int, end: int, exc: OSError) -> StoreError:
    """The error of a failed read of ``[start, end)``, retried when ``exc`` may pass."""
    error = StoreError(
        f"read failed: {describe_range(url, start, end)}: {exc.strerror or exc}", url, start, end
    )
    error.retryable = is_transient(exc)  # type: ignore[attr-defined]
    return error


def _stat_paths(urls: Sequence[str]) -> list[os.stat_result | Exception]:
    """:func:`_stat_path` of each URL, or the error it raised."""
    found: list[os.stat_result | Exception] = []
    for url in urls:
        try:
            found.append(_stat_path(url))
        except Exception as exc:  # noqa: BLE001 - handed to that URL's caller
            found.append(exc)
    return found


def _hand_out(
    pending: Sequence[tuple[str, asyncio.Future[Any]]],
    job: asyncio.Future[list[Any]],
) -> None:
    """Each waiter of ``pending`` gets its result of ``job`` (a result or an error per
    waiter, in order), unless its caller stopped waiting."""
    failed = asyncio.CancelledError() if job.cancelled() else job.exception()
    if failed is not None:  # the job did not run (no executor left at the loop's end)
        for _, waiter in pending:
            if not waiter.done():
                waiter.set_exception(failed)
        return
    for (_, waiter), result in zip(pending, job.result(), strict=True):
        if waiter.done():
            continue
        if isinstance(result, Exception):
            waiter.set_exception(result)
        else:
            waiter.set_result(result)


def _stat_path(url: str) -> os.stat_result:
    try:
        return os.stat(local_path(url))
    except (FileNotFoundError, PermissionError) as exc:
        raise map_error(exc, url) from exc


def _close_entries(entries: OrderedDict[str, list[int]]) -> None:
    """Unmap and close every file of an LRU (its table was collected: no read holds one)."""
    while entries:
        _close_entry(entries.popitem()[1])


def _close_entry(entry: list[int]) -> None:
    """Unmap and close one open file of the LRU."""
    fd, _, address, length, _, _ = entry
    if length > 0 and _preadv is not None:
        _preadv.unmap_file(address, length)
    try:
        os.close(fd)
    except OSError as exc:  # pragma: no cover - already closed
        if exc.errno != errno.EBADF:
            raise


def _read_nowait(
    fds: Sequence[int],
    starts: Int64Array,
    lengths: Int64Array,
    dest: npt.NDArray[np.uint8],
    dest_offsets: Int64Array,
) -> bool:
    """``pread``s that take only bytes in memory (``RWF_NOWAIT``): False at the first that
    would wait for the disk, comes back short or fails (read again on a thread)."""
    assert RWF_NOWAIT is not None
    view = memoryview(dest)  # type: ignore[arg-type]
    places = zip(fds, starts.tolist(), lengths.tolist(), dest_offsets.tolist(), strict=True)
    for fd, start, length, at in places:
        try:
            if os.preadv(fd, [view[at : at + length]], start, RWF_NOWAIT) != length:
                return False
        except OSError:
            return False
    return True


def _read_many_python(
    fds: npt.NDArray[np.int32],
    starts: Int64Array,
    lengths: Int64Array,
    dest: npt.NDArray[np.uint8],
    dest_offsets: Int64Array,
) -> tuple[int, int, int]:
    """What ``_preadv.read_many`` does, with a Python loop (and the GIL held between reads)."""
    view = memoryview(dest)  # type: ignore[arg-type]
    preadv = os.preadv
    rows = zip(fds.tolist(), starts.tolist(), lengths.tolist(), dest_offsets.tolist(), strict=True)
    for index, (fd, start, length, at) in enumerate(rows):
        got = 0
        try:
            while got < length:
                more = preadv(fd, (view[at + got : at + length],), start + got)
                if more == 0:
                    break
                got += more
        except OSError as exc:
            return index, got, exc.errno or 5
        if got < length:
            return index, got, 0
    return len(fds), 0, 0


def _cast(
    source: npt.NDArray[np.uint8],
    dest: npt.NDArray[np.uint8],
    source_dtype: np.dtype[Any],
    dest_dtype: np.dtype[Any],
) -> None:
    """``source``'s elements of ``source_dtype`` cast into ``dest`` as ``dest_dtype``."""
    np.copyto(dest.view(dest_dtype), source.view(source_dtype), casting="safe")


def local_store(
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> LocalStore:
    """Registry factory: a :class:`LocalStore`; options ``max_open_files``, ``max_threads``,
    ``mmap`` (default True: copy from mappings; False: ``pread``).

    ``retry`` is accepted for a uniform signature: the stack above retries under it."""
    check_options("local files", storage_options, ("max_threads", "max_open_files", "mmap"))
    options = dict(storage_options)
    threads = int(options.pop("max_threads", min(max_inflight, 8)))
    max_open = int(options.pop("max_open_files", 128))
    mmap = options.pop("mmap", True)
    if not isinstance(mmap, bool):
        raise ConfigError(f"storage_options mmap must be True or False, got {mmap!r}")
    return LocalStore(max_threads=threads, max_open_files=max_open, mmap=mmap)
