"""``index_webdataset``: the sidecar index of every WebDataset tar shard, written beside it
(``000000.tar`` → ``000000.tar.abidx``; the layout: :mod:`._webdataset_index`).

Every shard is scanned (its headers, in large sequential ranges) and its sidecar written,
:data:`~._webdataset_shards.CONCURRENT_SHARDS` shards at once, on one event loop; with more
workers, shards in tasks of :data:`SHARDS_PER_TASK` on a process pool or Ray (parsing the
headers is Python: ~60 us a sample of three members as webdataset writes them, so a core
scans ~2 GB/s of 110 KB images but ~135 MB/s of 8 KB samples). A sidecar already there is
written again, from the shard as it is now.

``write_webdataset``: samples (dicts as webdataset's ``TarWriter`` takes them, encoded as in
:mod:`._webdataset_encode`) into uncompressed tar shards, each followed by its sidecar, made
from the members as they are laid out: no shard is read back. A shard is built in memory up
to ``shard_size`` bytes, then written while the next one is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as futures
import itertools
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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


#: Where :func:`index_webdataset` runs: this process's event loop, a local process pool, or
#: Ray tasks (a local cluster or a running one).
INDEX_ENGINES = ("local", "ray")
#: Shards per task of a pool or Ray run: each task opens its own store and loop once for
#: them, and the progress moves task by task.
SHARDS_PER_TASK = 4

#: One shard's ``(samples, shard bytes, sidecar bytes)``.
Indexed = tuple[int, int, int]


async def index_webdataset_async(
    url: str | Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> IndexReport:
    """:func:`index_webdataset` in the running event loop (one process)."""
    shards, known = await _find(url, dict(storage_options or {}))
    done = await _index_shards(shards, dict(storage_options or {}), known, progress)
    return _report(shards, done)


async def _find(
    url: str | Sequence[str], options: dict[str, Any]
) -> tuple[list[str], dict[str, ObjectInfo]]:
    """The shards ``url`` names, and what a listing told of them."""
    first = url if isinstance(url, str) else (list(url) or [""])[0]
    store = open_store(first, options)
    try:
        _, shards, known, _ = await find_shards(url, store)
    finally:
        await store.close()
    return shards, dict(known)


async def _index_shards(
    shards: Sequence[str],
    options: dict[str, Any],
    known: Mapping[str, ObjectInfo] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Indexed]:
    """Scan ``shards`` and write their sidecars, up to 16 at once, through one store."""
    if not shards:
        return []
    store = open_store(shards[0], options)
    count = [0]

    def one_done() -> None:
        count[0] += 1
        if progress is not None:
            progress(count[0], len(shards))

    if progress is not None:
        progress(0, len(shards))
    try:
        return await limited([_index_one(store, u, (known or {}).get(u), one_done) for u in shards])
    finally:
        await store.close()


def _index_task(shards: list[str], options: dict[str, Any]) -> list[Indexed]:
    """A pool worker's or Ray task's part: ``shards`` indexed on a loop of its own."""
    return asyncio.run(_index_shards(shards, options))


def _report(shards: Sequence[str], done: Sequence[Indexed]) -> IndexReport:
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
) -> Indexed:
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
    workers: int = 1,
    engine: str = "local",
    address: str | None = None,
) -> IndexReport:
    """Write the sidecar index of every WebDataset tar shard at ``url`` beside it.

    ``url`` is what :func:`~asyncbatch.open_dataset` takes for shards: a ``.tar``, a folder
    or prefix, a glob, a brace pattern (``s3://b/laion/{000000..000123}.tar``) or a list.
    Each shard is scanned once with large sequential reads and ``<shard>.abidx`` written
    beside it; ``progress(done, shards)`` is called once the shards are found (``done`` 0)
    and as shards are written. Opening the shards then reads the sidecars only.

    ``workers=1`` (``engine="local"``): this process, up to 16 shards at once on one event
    loop. More workers, for small samples (parsing the headers costs ~60 us a sample, one
    core), or many shards: they are spread, :data:`SHARDS_PER_TASK` a task, over a pool of
    ``workers`` spawned processes, or with ``engine="ray"`` over Ray tasks (``ray.init()``
    of a local cluster of ``workers`` CPUs, or ``address``'s, unless Ray is initialised
    already). The sidecars are the same bytes whatever the engine.
    """
    if engine not in INDEX_ENGINES:
        raise ConfigError(f"engine={engine!r}: expected one of {INDEX_ENGINES}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers={workers!r}: expected an integer >= 1")
    if engine == "local" and workers == 1:
        return run_sync(index_webdataset_async(url, storage_options, progress=progress))
    options = dict(storage_options or {})
    shards, _ = run_sync(_find(url, options))
    parts = [shards[i : i + SHARDS_PER_TASK] for i in range(0, len(shards), SHARDS_PER_TASK)]
    if progress is not None:
        progress(0, len(shards))
    run = _run_ray if engine == "ray" else _run_pool
    done: dict[int, list[Indexed]] = {}
    for number, result in run(parts, options, workers, address):
        done[number] = result
        if progress is not None:
            progress(sum(len(parts[n]) for n in done), len(shards))
    return _report(shards, [one for n in sorted(done) for one in done[n]])


def _run_pool(
    parts: Sequence[list[str]], options: dict[str, Any], workers: int, address: str | None
) -> Iterator[tuple[int, list[Indexed]]]:
    """Each part's result as it finishes, on ``workers`` spawned processes; on the first
    failure the parts not started are cancelled and it is raised."""
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        running = {pool.submit(_index_task, part, options): n for n, part in enumerate(parts)}
        try:
            for future in futures.as_completed(running):
                yield running[future], future.result()
        finally:
            for future in running:
                future.cancel()


def _run_ray(
    parts: Sequence[list[str]], options: dict[str, Any], workers: int, address: str | None
) -> Iterator[tuple[int, list[Indexed]]]:
    """Each part's result as it finishes, a Ray task each (one CPU); Ray initialised here
    (and shut down after) unless it already was."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("engine='ray' needs Ray: pip install 'asyncbatch[ray]'") from exc
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"address": address, "log_to_driver": False}
        if address is None:
            kwargs["num_cpus"] = workers
        ray.init(**kwargs)
    try:
        remote = ray.remote(num_cpus=1, max_retries=2)(_index_task)  # a redo writes the same
        running = {remote.remote(part, options): n for n, part in enumerate(parts)}
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            number = running.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                for ref in running:
                    ray.cancel(ref)
                cause = getattr(exc, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from None
                raise
            yield number, result
    finally:
        if started:
            ray.shutdown()


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
    """The dataset written, as opening it finds it (the sidecars' summaries): every field,
    or where samples hold other fields, those every sample holds (a batch has a value of
    each of its fields for every sample)."""
    common: set[str] | None = None
    for index in indexes:
        bounds = np.cumsum(np.append(0, index.members)).tolist()
        for a, b in itertools.pairwise(bounds):
            held = {index.fields[f] for f in index.field[a:b].tolist()}
            common = held if common is None else common & held
    order = dict.fromkeys(name for index in indexes for name in index.fields)
    if not common:  # the error that names a sample without the fields
        return webdataset_dataset(root, urls, indexes, options, None, len(urls))
    columns = None if set(order) == common else [name for name in order if name in common]
    summaries = [index.summary() for index in indexes]
    return webdataset_dataset(root, urls, summaries, options, columns, len(urls))


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
