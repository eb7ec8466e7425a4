"""The node-local cache on disk: blocks of objects kept as files, shared by the processes of
a node; :class:`DiskCache` is what ``cache=`` takes.

Layout under the cache's path::

    cache.json                      {"max_bytes": ..., "block_size": ...} (for ``cache info``)
    objects/<key>/<n>               block n of one object version: bytes [n*B, (n+1)*B)
    objects/<key>/<n>.tmp-<...>     a block being written (never read)

``<key>`` hashes the object's URL, its version (the ETag or file identity its store pins)
and the block size ``B``: a new version of an object is a new key, never a stale hit.

Processes coordinate only through the filesystem. A block is written to a temporary file in
its directory and renamed into place (``os.replace`` is atomic), so a reader sees a whole
entry or none, and a process killed mid-write leaves only a temporary file, which readers
ignore and scans delete once it is older than :data:`STALE_TEMP_SECONDS`. A read checks
the entry's length against the block's; a wrong one is deleted and counts as a miss. Every
hit touches the entry's mtime (at most once a minute), and eviction (when ``max_bytes`` is
set) deletes the entries with the oldest mtimes; a file another process removed meanwhile
is simply a miss.

The cache never fails a read: the first failure to write (a full disk, an unwritable or
deleted directory) warns once with :class:`~asyncbatch._errors.CacheWarning` and stops
writing for the life of the :class:`DiskCache` in this process; reads go on from the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._defaults import CACHE_BLOCK_SIZE
from .._errors import CacheWarning, ConfigError
from ._base import Buffer

#: Bytes per cached block unless the cache says otherwise.
DEFAULT_BLOCK_SIZE = CACHE_BLOCK_SIZE
#: A temporary file older than this (seconds) belongs to a writer that died: scans delete it.
STALE_TEMP_SECONDS = 600.0
#: A hit marks its entry as used now unless it was marked this recently (seconds): one
#: metadata write per entry and minute, not one per read, orders the LRU well enough.
TOUCH_AFTER_SECONDS = 60.0
#: Eviction brings the cache down to this share of ``max_bytes``, so that it does not run
#: again after every block.
LOW_WATER = 0.9
#: A process looks at the whole cache again after writing this share of ``max_bytes``:
#: other processes fill it too, and only a scan sees their entries.
RESCAN_SHARE = 1 / 16

_META = "cache.json"
_OBJECTS = "objects"
_TEMP = ".tmp-"


#: A piece of a read inside one block: (offset in the block, length, buffer, offset in it).
Piece = tuple[int, int, Buffer, int]
#: What to read of one entry: (block, its length, the pieces).
Wanted = tuple[int, int, Sequence[Piece]]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


class DiskCache:
    """A node-local cache of remote bytes at ``path``, shared by every process that opens it.

    ``max_bytes``: evict least recently used blocks to stay under it (None: no limit but the
    disk's). ``block_size``: bytes per entry; a read fetches whole blocks, so it may fetch a
    little more than asked. Counters (``hits``, ``misses`` in blocks; ``hit_bytes`` read
    from entries; ``fetched_bytes`` read from the store below) add up over this object's
    life in this process. Pickles as its arguments.

    Directories and entries are the owner's alone (0700 and 0600): the cache holds bytes of
    private buckets, and a node is often shared. ``shared=True`` opens them to the group
    (2770, group-inherited, and 0660) for jobs of several users of one group.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        shared: bool = False,
    ) -> None:
        if not isinstance(shared, bool):
            raise ConfigError(f"shared must be True or False, got {shared!r}")
        self.shared = shared
        self._dir_mode, self._file_mode = (0o2770, 0o660) if shared else (0o700, 0o600)
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError(f"cache path must be a non-empty str or os.PathLike, got {path!r}")
        self.block_size = _positive_int("block_size", block_size)
        if max_bytes is not None:
            max_bytes = _positive_int("max_bytes", max_bytes)
            if max_bytes < block_size:
                raise ConfigError(
                    f"max_bytes={max_bytes} holds not even one block of block_size={block_size}"
                )
        self.max_bytes = max_bytes
        self.path = os.path.abspath(os.fspath(path))
        self.hits = 0
        self.misses = 0
        self.hit_bytes = 0
        self.fetched_bytes = 0
        self._reset()

    def _reset(self) -> None:
        """Per-process state (a forked child starts its own)."""
        self._pid = os.getpid()
        # Scans and evictions hold _lock for a while; the event loop's counting must not
        # wait for them, so counters and warnings have a lock of their own.
        self._lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._ready = False
        self._writable = True
        self._warned: set[str] = set()
        self._used = 0  # bytes in the cache at the last scan, plus those written since
        self._written = 0  # bytes written since the last scan
        self._writing = 0  # bytes of writes under way in this process's threads
        self._names = itertools.count()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    @classmethod
    def of(cls, value: DiskCache | str | os.PathLike[str] | None) -> DiskCache | None:
        """``value`` as a cache: a path opens one with the defaults; None is no cache."""
        if value is None or isinstance(value, DiskCache):
            return value
        if isinstance(value, str | os.PathLike):
            return cls(value)
        raise ConfigError(f"cache must be a path or an asyncbatch.DiskCache, got {value!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self.path, self.max_bytes, self.block_size, self.shared))

    def __repr__(self) -> str:
        shared = ", shared=True" if self.shared else ""
        return (
            f"DiskCache({self.path!r}, max_bytes={self.max_bytes},"
            f" block_size={self.block_size}{shared})"
        )

    def statistics(self) -> dict[str, int]:
        """The counters, as one dict."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_bytes": self.hit_bytes,
            "fetched_bytes": self.fetched_bytes,
        }

    def count(
        self, *, hits: int = 0, misses: int = 0, hit_bytes: int = 0, fetched: int = 0
    ) -> None:
        with self._counters_lock:
            self.hits += hits
            self.misses += misses
            self.hit_bytes += hit_bytes
            self.fetched_bytes += fetched

    def warn_once(self, cause: str, message: str) -> None:
        """Warn with :class:`CacheWarning` the first time ``cause`` happens in this process."""
        self._check_pid()
        with self._counters_lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        warnings.warn(message, CacheWarning, stacklevel=3)

    def object_dir(self, url: str, version: str) -> str:
        """The directory holding the blocks of ``url`` at ``version``."""
        key = hashlib.sha256(f"{url}\0{version}\0{self.block_size}".encode()).hexdigest()
        return os.path.join(self.path, _OBJECTS, key[:32])

    # Everything below does blocking file I/O: callers run it in a thread.

    def read(self, directory: str, wanted: Sequence[Wanted]) -> set[int]:
        """For each ``(block, length, pieces)`` of ``wanted`` whose entry holds ``length``
        bytes, read each piece ``(offset, n, buffer, at)`` of it into ``buffer[at:at + n]``;
        the blocks read (the others are misses; an entry of the wrong length is deleted)."""
        return {
            block
            for block, length, pieces in wanted
            if self._read(directory, block, length, pieces)
        }

    def _read(self, directory: str, block: int, length: int, pieces: Sequence[Piece]) -> bool:
        path = os.path.join(directory, str(block))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # missing (never written, evicted, cleared) or unreadable: a miss
            return False
        try:
            stat = os.fstat(fd)
            if stat.st_size != length:
                raise ValueError(path)  # not a block this cache wrote whole: drop it
            for offset, n, buffer, at in pieces:
                view = buffer[at : at + n]
                got = 0
                while got < n:
                    more = os.preadv(fd, [view[got:]], offset + got)
                    if more == 0:
                        raise ValueError(path)  # shrank under the read
                    got += more
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False  # what was read into the buffers is overwritten by the fetch
        finally:
            os.close(fd)
        if stat.st_mtime < time.time() - TOUCH_AFTER_SECONDS:
            with contextlib.suppress(OSError):  # recently used: evicted last
                os.utime(path)
        return True

    def store(self, directory: str, blocks: dict[int, Buffer]) -> None:
        """Write each block as an entry of ``directory``; on failure warn once and stop."""
        self._check_pid()
        if not self._writable:
            return
        for block, data in blocks.items():
            try:
                self._prepare()
                self._reserve(len(data))
                try:
                    self._mkdir(directory)  # not makedirs: a deleted cache stays deleted
                    self._store(os.path.join(directory, str(block)), data)
                finally:
                    with self._lock:
                        self._writing -= len(data)
            except OSError as exc:
                with self._lock:
                    self._writable = False
                self.warn_once(
                    "write",
                    f"the cache at {self.path} cannot be written ({exc}); reads go on from"
                    " the store without it",
                )
                return

    def _store(self, path: str, data: Buffer | bytes) -> None:
        temp = f"{path}{_TEMP}{os.getpid()}-{threading.get_ident()}-{next(self._names)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._file_mode)
        try:
            try:
                if self.shared:
                    os.fchmod(fd, self._file_mode)  # past the umask (022 drops group writes)
                self._write(fd, data)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def _mkdir(self, directory: str) -> None:
        """Create ``directory`` with the cache's mode (an existing one is left as it is)."""
        try:
            os.mkdir(directory, self._dir_mode)
        except FileExistsError:
            return
        if self.shared:
            os.chmod(directory, self._dir_mode)  # past the umask

    def _write(self, fd: int, data: Buffer | bytes) -> None:
        """Write all of ``data`` to ``fd`` (not fsynced: an entry can be fetched again)."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def _prepare(self) -> None:
        """Once per process: create the cache, record its settings, scan it."""
        with self._lock:
            if self._ready:
                return
            if not os.path.isdir(self.path):
                parent = os.path.dirname(self.path)
                os.makedirs(parent, exist_ok=True)
                self._mkdir(self.path)
            self._mkdir(os.path.join(self.path, _OBJECTS))
            meta = {"max_bytes": self.max_bytes, "block_size": self.block_size}
            self._store(os.path.join(self.path, _META), json.dumps(meta).encode())
            self._scan(0)
            self._ready = True

    def _reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` about to be written, first evicting to make room if needed."""
        with self._lock:
            limit = self.max_bytes
            if limit is not None and (
                self._used + nbytes > limit or self._written >= limit * RESCAN_SHARE
            ):
                self._scan(nbytes)
            self._used += nbytes
            self._written += nbytes
            self._writing += nbytes

    def _scan(self, nbytes: int) -> None:
        """Count the cache's bytes, delete stale temporary files, and evict the least
        recently used entries until ``nbytes`` more fit; called with the lock held."""
        entries, used = scan(self.path, clean=True)
        used += self._writing  # this process's writes under way (not yet, or partly, on disk)
        if self.max_bytes is not None and used + nbytes > self.max_bytes:
            target = max(0, min(int(self.max_bytes * LOW_WATER), self.max_bytes - nbytes))
            entries.sort()
            for _, size, path in entries:
                if used <= target:
                    break
                with contextlib.suppress(FileNotFoundError):  # another process evicted it
                    os.unlink(path)
                used -= size
        self._used, self._written = used, 0

    def remove(self, directory: str, blocks: Sequence[int]) -> None:
        """Delete the entries of ``blocks`` (gone already: nothing to do)."""
        for block in blocks:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, str(block)))


def _restore(path: str, max_bytes: int | None, block_size: int, shared: bool) -> DiskCache:
    return DiskCache(path, max_bytes=max_bytes, block_size=block_size, shared=shared)


def scan(path: str, *, clean: bool = False) -> tuple[list[tuple[float, int, str]], int]:
    """``(mtime, bytes, path)`` of every entry of the cache at ``path``, and the bytes all its
    files hold; ``clean``: delete temporary files older than :data:`STALE_TEMP_SECONDS`.
    Files that vanish during the scan (other processes evict too) are skipped."""
    entries: list[tuple[float, int, str]] = []
    used = 0
    stale = time.time() - STALE_TEMP_SECONDS
    try:
        objects = list(os.scandir(os.path.join(path, _OBJECTS)))
    except FileNotFoundError:
        return entries, 0
    for folder in objects:
        try:
            files = list(os.scandir(folder.path))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for file in files:
            try:
                stat = file.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if _TEMP in file.name:
                if clean and stat.st_mtime < stale:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(file.path)
                    continue
            elif file.name.isdigit():
                entries.append((stat.st_mtime, stat.st_size, file.path))
            used += stat.st_size
    return entries, used


@dataclass(frozen=True)
class CacheInfo:
    """What ``asyncbatch cache info`` reports."""

    path: str
    entries: int
    objects: int
    bytes_used: int
    max_bytes: int | None
    block_size: int | None


def cache_info(path: str | os.PathLike[str]) -> CacheInfo:
    """Entries, objects and bytes of the cache at ``path`` (settings as last recorded)."""
    root = os.path.abspath(os.fspath(path))
    entries, used = scan(root)
    try:
        with open(os.path.join(root, _META), "rb") as file:
            meta = json.load(file)
    except (OSError, ValueError):
        meta = {}
    objects = len({os.path.dirname(entry[2]) for entry in entries})
    return CacheInfo(
        root, len(entries), objects, used, meta.get("max_bytes"), meta.get("block_size")
    )


def clear_cache(path: str | os.PathLike[str]) -> int:
    """Delete every entry of the cache at ``path``; returns the bytes freed."""
    root = os.path.abspath(os.fspath(path))
    _, used = scan(root)
    shutil.rmtree(os.path.join(root, _OBJECTS), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, _META))
    return used
