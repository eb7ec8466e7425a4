"""``index_webdataset``: the sidecar index of every WebDataset tar shard, written beside it
(``000000.tar`` → ``000000.tar.abidx``; the layout: :mod:`._webdataset_index`).

Every shard is scanned (its headers, in large sequential ranges) and its sidecar written,
:data:`~._webdataset_shards.CONCURRENT_SHARDS` shards at once, on the store's own event loop: the
work is reading, and parsing the headers is small beside it. A sidecar already there is
written again, from the shard as it is now.

``write_webdataset``: samples (dicts as webdataset's ``TarWriter`` takes them, encoded as in
:mod:`._webdataset_encode`) into uncompressed tar shards, each followed by its sidecar, made
from the members as they are laid out: no shard is read back. A shard is built in memory up
to ``shard_size`` bytes, then written while the next one is built.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._dataset import Dataset, join_url
from .._errors import ConfigError, NotFoundError
from .._portal import run_sync
from .._writer import DEFAULT_SHARD_SIZE
from ..stores import open_store
from ..stores._base import ListsInfo, ObjectInfo, Store
from ._npy import may_list
from ._webdataset import webdataset_dataset
from ._webdataset_encode import END_OF_ARCHIVE, Value, member_header, padded, sample_members
from ._webdataset_index import ShardIndex, _Member, group_members, scan_shard, sidecar_url
from ._webdataset_shards import TAR_SUFFIX, find_shards, limited

#: webdataset's ``ShardWriter`` names: ``pattern % shard_number``.
DEFAULT_PATTERN = "shard-%06d.tar"


@dataclass(frozen=True, slots=True)
class IndexReport:
    """What :func:`index_webdataset` wrote: one sidecar per shard."""

    shards: int
    samples: int
    #: Bytes of the shards scanned and of the sidecars written.
    shard_bytes: int
    index_bytes: int
    sidecars: tuple[str, ...]


async def index_webdataset_async(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> IndexReport:
    """:func:`index_webdataset` in the running event loop."""
    options = dict(storage_options or {})
    first = url if isinstance(url, str) else (list(url) or [""])[0]
    store = open_store(first, options)
    try:
        _, shards, known, _ = await find_shards(url, store)
        count = [0]

        def one_done() -> None:
            count[0] += 1
            if progress is not None:
                progress(count[0], len(shards))

        if progress is not None:
            progress(0, len(shards))
        done = await limited([_index_one(store, u, known.get(u), one_done) for u in shards])
    finally:
        await store.close()
    return IndexReport(
        shards=len(shards),
        samples=sum(samples for samples, _, _ in done),
        shard_bytes=sum(size for _, size, _ in done),
        index_bytes=sum(nbytes for _, _, nbytes in done),
        sidecars=tuple(sidecar_url(u) for u in shards),
    )


async def _index_one(
    store: Store,
    url: str,
    info: ObjectInfo | None,
    done: Callable[[], None],
) -> tuple[int, int, int]:
    size = info.size if info is not None else await store.size(url)
    index = await scan_shard(store, url, size)
    data = index.pack()
    await store.write(sidecar_url(url), data)
    done()
    return index.num_samples, size, len(data)


def index_webdataset(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> IndexReport:
    """Write the sidecar index of every WebDataset tar shard at ``url`` beside it.

    ``url`` is what :func:`~asyncbatch.open_dataset` takes for shards: a ``.tar``, a folder
    or prefix, a glob, a brace pattern (``s3://b/laion/{000000..000123}.tar``) or a list.
    Each shard is scanned once with large sequential reads, all shards at once (up to 16),
    and ``<shard>.abidx`` written beside it; ``progress(done, shards)`` is called once the
    shards are found (``done`` 0) and as each one is written. Opening the shards then reads
    the sidecars only.
    """
    return run_sync(index_webdataset_async(url, storage_options, progress=progress))


# ---------------------------------------------------------------------------------------------
# Writing shards


class _Shard:
    """One tar shard being built in memory, with the members its sidecar will list."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.data = bytearray()
        self.members: list[_Member] = []
        self.samples = 0

    @property
    def size(self) -> int:
        """Bytes of the shard were it closed now (its end-of-archive blocks counted)."""
        return len(self.data) + len(END_OF_ARCHIVE)

    def add(self, members: Sequence[tuple[bytes, str, Value]]) -> None:
        for header, name, value in members:
            at = len(self.data)
            self.data += header
            length = memoryview(value).nbytes
            self.members.append(_Member(name, at, len(self.data), length))
            self.data += value
            self.data += bytes(padded(length) - length)
        self.samples += 1

    def close(self) -> tuple[bytearray, ShardIndex]:
        """The shard's bytes and its index, grouped as the reader groups them."""
        self.data += END_OF_ARCHIVE
        return self.data, group_members(self.url, len(self.data), self.members)


class _Shards:
    """Cuts the samples into shards: each call of :meth:`next` (in a worker thread, so the
    event loop goes on writing the shards before it) takes samples from the iterable until
    the next one would not fit, and keeps that one for the shard after."""

    def __init__(
        self, samples: Iterable[Mapping[str, Any]], shard_size: int, max_count: int | None
    ) -> None:
        self.samples = enumerate(samples)
        self.shard_size, self.max_count = shard_size, max_count
        self.pending: tuple[list[tuple[bytes, str, Value]], int] | None = None
        self.last_key: str | None = None

    def _encode(self, position: int, sample: Any) -> tuple[list[tuple[bytes, str, Value]], int]:
        """The sample's members (header, name, data) and the bytes they take in a shard."""
        key, fields = sample_members(position, sample)
        if key == self.last_key:
            raise ConfigError(
                f"sample {position} (key {key!r}): the same key as the sample before it;"
                " webdataset would read the two as one sample"
            )
        self.last_key = key
        members = [(member_header(name, memoryview(v).nbytes), name, v) for name, v in fields]
        return members, sum(len(h) + padded(memoryview(v).nbytes) for h, _, v in members)

    def next(self, url: str) -> tuple[bytearray, ShardIndex] | None:
        """The next shard's bytes and index, to be written at ``url``; None after the last."""
        shard = _Shard(url)
        while True:
            if self.pending is None:
                item = next(self.samples, None)
                if item is None:
                    break
                self.pending = self._encode(*item)
            members, need = self.pending
            full = self.max_count is not None and shard.samples >= self.max_count
            if shard.samples and (full or shard.size + need > self.shard_size):
                break
            shard.add(members)
            self.pending = None
        return shard.close() if shard.samples else None


def _check_write_args(shard_size: Any, max_count: Any, pattern: Any, max_concurrency: Any) -> None:
    for name, value, none_ok in (
        ("shard_size", shard_size, False),
        ("max_count", max_count, True),
        ("max_concurrency", max_concurrency, False),
    ):
        if value is None and none_ok:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    try:
        names = {pattern % 0, pattern % 1}
    except (TypeError, ValueError):
        names = set()
    if (
        not isinstance(pattern, str)
        or len(names) != 2
        or "/" in pattern
        or not pattern.endswith(TAR_SUFFIX)
        or pattern.startswith((".", "_"))
    ):
        raise ConfigError(
            f"pattern={pattern!r}: expected a file name with one integer field ending in"
            f" {TAR_SUFFIX}, as webdataset's ShardWriter takes (default {DEFAULT_PATTERN!r});"
            " no '/', not starting with '.' or '_' (a listing skips those)"
        )


async def write_webdataset_async(
    url: str,
    samples: Iterable[Mapping[str, Any]],
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_count: int | None = None,
    pattern: str = DEFAULT_PATTERN,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 1,
) -> Dataset:
    """Async form of :func:`write_webdataset`, in the running loop."""
    _check_write_args(shard_size, max_count, pattern, max_concurrency)
    root = url.rstrip("/")
    options = dict(storage_options or {})
    store = open_store(root, options, max_inflight=2 * max_concurrency)
    urls: list[str] = []
    indexes: list[ShardIndex] = []
    slots = asyncio.Semaphore(max_concurrency)
    writes: set[asyncio.Task[None]] = set()
    source = _Shards(samples, shard_size, max_count)

    async def write(url: str, data: bytearray, index: ShardIndex) -> None:
        try:
            sidecar = await asyncio.to_thread(index.pack)
            await store.write(url, memoryview(data))
            await store.write(sidecar_url(url), sidecar)  # after its shard
        finally:
            slots.release()

    try:
        while True:
            shard_url = join_url(root, pattern % len(urls))
            shard = await asyncio.to_thread(source.next, shard_url)
            if shard is None:
                break
            for done in [t for t in writes if t.done()]:
                writes.discard(done)
                done.result()  # the error of a shard written before, if one failed
            await slots.acquire()  # bounds the shards held in memory
            urls.append(shard_url)
            indexes.append(shard[1])
            writes.add(asyncio.create_task(write(shard_url, *shard)))
        if not urls:
            raise ConfigError("no samples given: a WebDataset needs at least one shard")
        await asyncio.gather(*writes)
        dataset = await asyncio.to_thread(_dataset, root, urls, indexes, options)
        versions = await _listed_versions(store, root, urls)
    except BaseException:
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        raise
    finally:
        await store.close()
    return dataset if versions is None else replace(dataset, versions=versions)


def _dataset(
    root: str, urls: list[str], indexes: list[ShardIndex], options: Mapping[str, Any]
) -> Dataset:
    """The dataset written: every field, or where samples hold other fields, those every
    sample holds (a batch has a value of each of its fields for every sample)."""
    try:
        return webdataset_dataset(root, urls, indexes, options, None, len(urls))
    except ConfigError:
        common: set[str] | None = None
        for index in indexes:
            bounds = np.cumsum(np.append(0, index.members)).tolist()
            for a, b in itertools.pairwise(bounds):
                held = {index.fields[f] for f in index.field[a:b].tolist()}
                common = held if common is None else common & held
        if not common:
            raise
        order = dict.fromkeys(name for index in indexes for name in index.fields)
        columns = [name for name in order if name in common]
        return webdataset_dataset(root, urls, indexes, options, columns, len(urls))


async def _listed_versions(
    store: Store, root: str, urls: Sequence[str]
) -> tuple[str | None, ...] | None:
    """The shards' versions from one listing of ``root``, as opening it finds them (they
    identify the bytes for resume states); None where the store does not tell them all."""
    if not isinstance(store, ListsInfo) or not may_list(root + "/"):
        return None
    try:
        entries = dict(await store.list_info(root))
    except (NotFoundError, NotADirectoryError):
        return None
    versions = tuple(info.version if (info := entries.get(u)) is not None else None for u in urls)
    return None if None in versions else versions


def write_webdataset(
    url: str,
    samples: Iterable[Mapping[str, Any]],
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_count: int | None = None,
    pattern: str = DEFAULT_PATTERN,
    storage_options: Mapping[str, Any] | None = None,
    max_concurrency: int = 1,
) -> Dataset:
    """Write ``samples`` as WebDataset tar shards in the folder or prefix ``url``, each with
    its sidecar index (``shard-000000.tar`` and ``shard-000000.tar.abidx``); the dataset as
    :func:`~asyncbatch.open_dataset` opens it.

    A sample is a dict as webdataset's ``TarWriter`` takes it: ``__key__`` (a str whose
    base name holds no dot) and one entry per field, named by its extension (``jpg``,
    ``cls``, ``seg.png``): bytes or str, or values webdataset encodes by extension (a
    number in ``cls``, a JSON value in ``json``, a numpy array in ``npy``); keys starting
    with ``_`` are not written. Shards are named ``pattern % n`` (webdataset's
    ``ShardWriter`` pattern) and a shard closes before the sample that would take it past
    ``shard_size`` bytes or ``max_count`` samples; a sample is never split, and one larger
    than ``shard_size`` makes a shard of its own. Members are plain ustar (mode 0o444, mtime
    0, owner 0), so the same samples make the same bytes.

    Samples may hold other fields (webdataset writes them all); the dataset returned then
    reads the fields every sample holds, as ``open_dataset(url, options={"columns":
    [...]})`` would. Memory holds the shard being built and up to ``max_concurrency`` being
    written. A
    sample webdataset would not read back as given (no key, a key with a dot, the key of
    the sample before, a value no encoder takes) is a ConfigError naming its position.
    ``open_dataset(url)`` reads every ``.tar`` under ``url``: write to a fresh folder.
    """
    return run_sync(
        write_webdataset_async(
            url,
            samples,
            shard_size=shard_size,
            max_count=max_count,
            pattern=pattern,
            storage_options=storage_options,
            max_concurrency=max_concurrency,
        )
    )
