"""The per-shard document index: its manifest entries, the helpers a writer needs, and the
cache a source fetches shard indexes into as batches need them.

Layout (``metadata["document_index"] == "per_shard"``): documents never cross shard ends.
Shard ``s`` holds ``metadata["shard_documents"][s]`` documents and has an index file beside it
(``metadata["shard_indexes"][s]``: ``path``, ``bytes``, and ``checksum`` when the manifest
records checksums) of ``n_s + 1`` little-endian int64 offsets *local to the shard*: 0 first,
the shard's element count last, never decreasing. Global document ``d`` lives in shard
``searchsorted(cumsum(shard_documents), d, "right")``.

Opening reads the manifest only: O(shards) bytes, whatever the number of documents. A
source fetches the index of a shard whole (one range read through the engine) the first time
a batch touches that shard, checks it, and keeps it in a cache of at most
``index_cache_bytes`` (least recently used indexes dropped first); concurrent batches that
need one index share one fetch. Documents as samples, when the indexes of all shards do not
fit that cache, read instead just the two offsets of each document asked for, by range
(neighbouring documents' merged as the token reads are): a shuffle over more shards than the
cache holds then costs 16 bytes of index per document, not a whole index per shard touched.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._checksums import digest, format_digest, parse_digest
from .._dataset import join_url
from .._errors import ConfigError, FormatError, ManifestError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import MANIFEST_NAME
from ._base import Read, Step, Wait

if TYPE_CHECKING:
    from .._dataset import Dataset

Int64Array = npt.NDArray[np.int64]

#: ``metadata["document_index"]`` of the per-shard layout.
PER_SHARD = "per_shard"
#: The key of the per-shard document counts in ``Dataset.arrays``.
SHARD_DOCUMENTS = "shard_documents"
INDEX_DTYPE = np.dtype("<i8")
#: Bytes of shard indexes one source keeps (``format_options={"index_cache_bytes": ...}``).
DEFAULT_INDEX_CACHE_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------------------------
# For writers


def index_path(shard_path: str) -> str:
    """The index file of a shard: ``shard-00000.bin`` → ``shard-00000.idx``."""
    stem = shard_path[: -len(".bin")] if shard_path.endswith(".bin") else shard_path
    return f"{stem}.idx"


def shard_index_bytes(local_offsets: npt.ArrayLike) -> bytes:
    """One shard's index file: the ``n + 1`` offsets of its ``n`` documents, local to the
    shard (0 first, never decreasing, the shard's element count last), as little-endian
    int64."""
    offsets = np.asarray(local_offsets)
    if (
        offsets.ndim != 1
        or offsets.size == 0
        or (offsets.size > 1 and offsets.dtype.kind not in "iu")
    ):
        raise ConfigError(
            f"shard offsets must be a non-empty 1-D integer array, got {offsets.dtype}"
            f" of shape {offsets.shape}"
        )
    offsets = offsets.astype(INDEX_DTYPE)
    if offsets[0] != 0 or (offsets[1:] < offsets[:-1]).any():
        raise ConfigError("shard offsets must start at 0 and never decrease")
    return offsets.tobytes()


def shard_index_info(path: str, data: bytes, *, checksum: bool = True) -> dict[str, Any]:
    """The manifest entry of one shard's index file ``data`` written at ``path`` (relative to
    the dataset root); ``checksum``: record its xxh3-64 (as the shards' checksums are)."""
    info: dict[str, Any] = {"path": path, "bytes": len(data)}
    if checksum:
        info["checksum"] = format_digest(digest(data))
    return info


def per_shard_metadata(
    counts: Sequence[int], index_infos: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The manifest ``metadata`` of a per-shard document index: shard ``s`` holds
    ``counts[s]`` documents, its index file is ``index_infos[s]`` (see
    :func:`shard_index_info`)."""
    if len(counts) != len(index_infos):
        raise ConfigError(f"{len(counts)} document counts for {len(index_infos)} index files")
    numbers = [int(n) for n in counts]
    for n, info in zip(numbers, index_infos, strict=True):
        if n < 0 or int(info["bytes"]) != INDEX_DTYPE.itemsize * (n + 1):
            raise ConfigError(
                f"index file {info.get('path')!r} of {info['bytes']} bytes cannot hold the"
                f" {n + 1} offsets of {n} documents"
            )
    return {
        "documents": sum(numbers),
        "document_index": PER_SHARD,
        SHARD_DOCUMENTS: numbers,
        "shard_indexes": [dict(info) for info in index_infos],
    }


# ---------------------------------------------------------------------------------------------
# Reading the manifest


def is_per_shard(dataset: Dataset) -> bool:
    return dataset.manifest.metadata.get("document_index") == PER_SHARD


@dataclass(frozen=True)
class ShardIndexes:
    """The per-shard index entries of one dataset's manifest, checked."""

    counts: Int64Array
    urls: tuple[str, ...]
    nbytes: Int64Array
    checksums: tuple[int | None, ...]

    @classmethod
    def of(cls, dataset: Dataset) -> ShardIndexes:
        """Parse and check (O(shards)); a problem is a ManifestError naming the manifest."""
        where = join_url(dataset.url, MANIFEST_NAME)
        metadata, shards = dataset.manifest.metadata, dataset.manifest.shards
        try:
            total = metadata["documents"]
            counts = [int(n) for n in metadata[SHARD_DOCUMENTS]]
            entries = list(metadata["shard_indexes"])
            paths = [str(e["path"]) for e in entries]
            nbytes = [int(e["bytes"]) for e in entries]
            checksums = [
                None if e.get("checksum") is None else parse_digest(e["checksum"]) for e in entries
            ]
            if isinstance(total, bool) or not isinstance(total, int):
                raise TypeError(f"documents is {total!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: no valid per-shard document index: {exc!r}") from exc
        if not len(counts) == len(paths) == len(shards):
            raise ManifestError(
                f"{where}: {len(counts)} shard_documents and {len(paths)} shard_indexes"
                f" for {len(shards)} shards"
            )
        if any(n < 0 for n in counts) or sum(counts) != total:
            raise ManifestError(
                f"{where}: shard_documents {counts[:8]}{'...' if len(counts) > 8 else ''}"
                f" do not add up to the {total} documents"
            )
        for n, path, size, shard in zip(counts, paths, nbytes, shards, strict=True):
            url = join_url(dataset.url, path)
            if size != INDEX_DTYPE.itemsize * (n + 1):
                raise ManifestError(
                    f"{where}: the index {url} (bytes [0, {size})) cannot hold the {n + 1}"
                    f" int64 offsets of the {n} documents of {shard.path}"
                )
            if n == 0 and shard.elements:
                raise ManifestError(
                    f"{where}: shard {shard.path} holds {shard.elements} elements and no document"
                )
        return cls(
            np.array(counts, dtype=np.int64),
            tuple(join_url(dataset.url, p) for p in paths),
            np.array(nbytes, dtype=np.int64),
            tuple(checksums),
        )


def index_files(dataset: Dataset) -> list[tuple[str, int, int | None]]:
    """``(url, bytes, checksum)`` of the index files of a per-shard documents dataset (none
    for another), for the checks that cover the shards."""
    if dataset.manifest.format != "documents" or not is_per_shard(dataset):
        return []
    layout = ShardIndexes.of(dataset)
    return list(zip(layout.urls, layout.nbytes.tolist(), layout.checksums, strict=True))


def check_local(offsets: Int64Array, elements: int, url: str) -> None:
    """A FormatError naming ``url`` and the bytes at fault unless ``offsets`` are a shard's
    local offsets over ``elements`` elements."""
    size = INDEX_DTYPE.itemsize
    if offsets[0] != 0:
        raise FormatError(f"{url}: bytes [0, {size}): the first document offset is {offsets[0]}")
    falling = np.flatnonzero(offsets[1:] < offsets[:-1])
    if falling.size:
        d = int(falling[0])
        raise FormatError(
            f"{url}: bytes [{d * size}, {(d + 2) * size}): document offsets decrease"
            f" ({offsets[d]} then {offsets[d + 1]})"
        )
    if offsets[-1] != elements:
        end = offsets.size * size
        raise FormatError(
            f"{url}: bytes [{end - size}, {end}): the last document offset is {offsets[-1]},"
            f" but the shard holds {elements} elements"
        )


# ---------------------------------------------------------------------------------------------
# The source's view: segments, fetched on demand


class DocumentIndex:
    """Document offsets of datasets numbered one after another, by *segment*: a shard of a
    per-shard dataset (its offsets fetched when first needed) or a whole dataset whose offsets
    are in memory (a single ``documents.idx``, Megatron). Documents never cross segments.

    ``parts[k]``: dataset ``k``'s checked offsets if in memory, None if per-shard. Index files
    are numbered in the source's ``shard_urls`` from ``first_file`` on.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        parts: Sequence[Int64Array | None],
        first_file: int,
        budget: int = DEFAULT_INDEX_CACHE_BYTES,
    ) -> None:
        documents: list[int] = []
        elements: list[int] = []
        files: list[int] = []
        nbytes: list[int] = []
        checksums: list[int | None] = []
        self.urls: list[str] = []  # of each segment's index ("" when in memory)
        #: The index files, in the order of the source's ``shard_urls`` after the shards,
        #: and the dataset of each.
        self.index_urls: list[str] = []
        self.index_dataset: list[int] = []
        self._fixed: dict[int, Int64Array] = {}
        for k, (dataset, offsets) in enumerate(zip(datasets, parts, strict=True)):
            if offsets is not None:
                self._fixed[len(documents)] = offsets
                documents.append(offsets.size - 1)
                elements.append(int(offsets[-1]))
                files.append(-1)
                nbytes.append(0)
                checksums.append(None)
                self.urls.append("")
                continue
            layout = ShardIndexes.of(dataset)
            documents += layout.counts.tolist()
            elements += [s.elements for s in dataset.manifest.shards]
            files += range(
                first_file + len(self.index_urls),
                first_file + len(self.index_urls) + len(layout.urls),
            )
            nbytes += layout.nbytes.tolist()
            checksums += layout.checksums
            self.urls += layout.urls
            self.index_urls += layout.urls
            self.index_dataset += [k] * len(layout.urls)
        self.documents = np.array(documents, dtype=np.int64)
        self.document_ends = np.cumsum(self.documents)
        self.document_starts = self.document_ends - self.documents
        self.elements = np.array(elements, dtype=np.int64)
        self.element_ends = np.cumsum(self.elements)
        self.element_starts = self.element_ends - self.elements
        self.file = np.array(files, dtype=np.int64)
        self.nbytes = np.array(nbytes, dtype=np.int64)
        lazy = self.file >= 0
        #: The index files' entries as one stream (for reads of a few entries by range).
        self.entries = ShardMap(self.nbytes[lazy] // INDEX_DTYPE.itemsize, INDEX_DTYPE.itemsize)
        self.entry_base = np.zeros(len(documents), dtype=np.int64)
        self.entry_base[lazy] = self.entries.starts
        self.first_file = first_file
        self.checksums = checksums
        #: What the manifests record of each index file, for the engine's checks.
        self.described_files: dict[str, tuple[int, int | None]] = {
            url: (int(n), c)
            for url, n, c, f in zip(self.urls, nbytes, checksums, files, strict=True)
            if f >= 0
        }
        self.budget = budget
        #: Whether documents as samples read their offsets by range instead of whole indexes:
        #: when the indexes of all shards do not fit the cache.
        self.ranged = int(self.nbytes.sum()) > budget
        self._cache: OrderedDict[int, Int64Array] = OrderedDict()
        self._cached_bytes = 0
        #: Fetches of shard indexes under way, settled by the batch that fetches them.
        self._loading: dict[int, Future[Int64Array]] = {}
        self._pid = os.getpid()
        self.turns = Turns()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into a worker process: the cache and fetches under way stay behind.
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _cached_bytes=0, _loading={}, turns=Turns())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pid=os.getpid())

    def segments_of_documents(self, ids: Int64Array) -> Int64Array:
        return np.searchsorted(self.document_ends, ids, side="right").astype(np.int64)

    def segments_of_windows(self, starts: Int64Array, width: int) -> Int64Array:
        """The segments windows of ``width`` elements at ``starts`` touch, ascending."""
        ends = self.element_ends
        first = np.searchsorted(ends, starts, side="right")
        last = np.searchsorted(ends, starts + max(0, width - 1), side="right")
        count = last - first + 1
        if (count > 1).any():
            step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            first = np.repeat(first, count) + step
        return np.unique(first).astype(np.int64)

    def load(self, segments: Int64Array) -> Generator[Step, Any, dict[int, Int64Array]]:
        """The local offsets of ``segments`` (unique), fetching those not cached; a fetch
        another batch started is waited for, not repeated."""
        self._forked()
        table: dict[int, Int64Array] = {}
        todo = segments.tolist()
        while todo:
            missing: list[int] = []
            waiting: dict[int, Future[Int64Array]] = {}
            for s in todo:
                offsets = self._fixed.get(s)
                if offsets is None:
                    offsets = self._cache.get(s)
                    if offsets is not None:
                        self._cache.move_to_end(s)
                if offsets is not None:
                    table[s] = offsets
                elif s in self._loading:
                    waiting[s] = self._loading[s]
                else:
                    missing.append(s)
            if missing:
                table.update((yield from self._fetch(missing)))
            if waiting:
                yield Wait(tuple(waiting.values()))
            todo = []
            for s, future in waiting.items():
                if future.cancelled():  # the batch fetching it was stopped: fetch it here
                    todo.append(s)
                    continue
                error = future.exception()
                if error is not None:
                    raise error
                table[s] = future.result()
        return table

    def _fetch(self, segments: list[int]) -> Generator[Step, Any, dict[int, Int64Array]]:
        futures: dict[int, Future[Int64Array]] = {s: Future() for s in segments}
        self._loading.update(futures)
        try:
            chosen = np.array(segments, dtype=np.int64)
            sizes = self.nbytes[chosen]
            dest = np.cumsum(sizes) - sizes
            none = np.zeros(0, dtype=np.int64)
            plan = ReadPlan(
                self.file[chosen], np.zeros_like(sizes), sizes, dest, none, none, none, none,
                int(sizes.sum()),
            )  # fmt: skip
            try:
                buffer = yield Read(plan)
            except NotFoundError as exc:
                raise FormatError(
                    f"{exc.url or ', '.join(self.urls[s] for s in segments)}: a document index"
                    " the manifest names is missing"
                ) from exc
            got: dict[int, Int64Array] = {}
            for s, at, size in zip(segments, dest.tolist(), sizes.tolist(), strict=True):
                raw = buffer[at : at + size]
                expected = self.checksums[s]
                if expected is not None and digest(raw) != expected:
                    raise FormatError(
                        f"{self.urls[s]}: bytes [0, {size}): checksum"
                        f" {format_digest(digest(raw))}, the manifest says"
                        f" {format_digest(expected)}"
                    )
                offsets = raw.view(INDEX_DTYPE).astype(np.int64)  # a copy: the buffer is pooled
                check_local(offsets, int(self.elements[s]), self.urls[s])
                got[s] = offsets
        except BaseException as exc:
            # Stopped (cancelled, or the generator closed): the waiters fetch it themselves.
            for s, future in futures.items():
                del self._loading[s]
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            raise
        for s, offsets in got.items():
            del self._loading[s]
            futures[s].set_result(offsets)
            self._cache[s] = offsets
            self._cached_bytes += offsets.nbytes
        while self._cached_bytes > self.budget and len(self._cache) > len(got):
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes
        return got

    def _forked(self) -> None:
        """In a forked child, drop the fetches under way in the parent: no one there settles
        their futures."""
        if self._pid != os.getpid():
            self._loading, self._pid = {}, os.getpid()

    def read_spans(
        self, ids: Int64Array, gap: int
    ) -> Generator[Step, Any, tuple[Int64Array, Int64Array]]:
        """Global element start and end of documents ``ids``, their two offsets each read by
        range (merged as ``gap`` says), none cached."""
        segments = self.segments_of_documents(ids)
        local = ids - self.document_starts[segments]
        starts = np.empty(ids.size, dtype=np.int64)
        ends = np.empty(ids.size, dtype=np.int64)
        lazy = self.file[segments] >= 0
        if not lazy.all():  # datasets whose offsets are in memory
            fixed = np.flatnonzero(~lazy)
            table = {s: self._fixed[s] for s in np.unique(segments[fixed]).tolist()}
            starts[fixed], ends[fixed] = self.spans(ids[fixed], table)
        picked = np.flatnonzero(lazy)
        if not picked.size:
            return starts, ends
        seg, at = segments[picked], local[picked]
        plan = self.entries.plan(self.entry_base[seg] + at, 2, gap, extra_waste_bytes=max(0, gap))
        plan = replace(plan, read_shard=plan.read_shard + self.first_file)
        try:
            buffer = yield Read(plan)
        except NotFoundError as exc:
            raise FormatError(f"{exc.url}: a document index the manifest names is missing") from exc
        pairs = buffer.view(INDEX_DTYPE).astype(np.int64).reshape(-1, 2)
        first, last = pairs[:, 0], pairs[:, 1]
        size = self.elements[seg]
        bad = (
            (first < 0)
            | (last < first)
            | (last > size)
            | ((at == 0) & (first != 0))
            | ((at == self.documents[seg] - 1) & (last != size))
        )
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            s, entry = int(seg[i]), int(at[i])
            raise FormatError(
                f"{self.urls[s]}: bytes [{entry * 8}, {entry * 8 + 16}): document {entry}'s"
                f" offsets {int(first[i])}, {int(last[i])} do not lie in order in the"
                f" {int(size[i])} elements of its shard"
            )
        base = self.element_starts[seg]
        starts[picked], ends[picked] = base + first, base + last
        return starts, ends

    def spans(
        self, ids: Int64Array, table: Mapping[int, Int64Array]
    ) -> tuple[Int64Array, Int64Array]:
        """Global element start and end of documents ``ids``, their segments in ``table``."""
        segments = self.segments_of_documents(ids)
        local = ids - self.document_starts[segments]
        starts = np.empty(ids.size, dtype=np.int64)
        ends = np.empty(ids.size, dtype=np.int64)
        order = np.argsort(segments, kind="stable")
        cuts = np.flatnonzero(np.diff(segments[order])) + 1
        for picked in np.split(order, cuts) if ids.size else []:  # one pass per segment
            s = int(segments[picked[0]])
            offsets, base, at = table[s], self.element_starts[s], local[picked]
            starts[picked] = base + offsets[at]
            ends[picked] = base + offsets[at + 1]
        return starts, ends

    def window_offsets(
        self, segments: Int64Array, table: Mapping[int, Int64Array]
    ) -> tuple[Int64Array, Int64Array]:
        """Global offsets of the documents of ``segments`` (ascending), and the global number
        of each, as :func:`~asyncbatch.formats._documents.boundaries` takes them for windows
        inside these segments: runs of neighbouring segments are slices of the global
        offsets; between runs one entry stands for the elements no window touches."""
        parts: list[Int64Array] = []
        numbers: list[Int64Array] = []
        end = -1
        for s in segments.tolist():
            start = int(self.element_starts[s])
            if parts and end != start:
                parts.append(np.array([end], dtype=np.int64))
                numbers.append(np.array([self.document_starts[s]], dtype=np.int64))
            offsets = table[s]
            parts.append(start + offsets[:-1])
            first = int(self.document_starts[s])
            numbers.append(np.arange(first, first + offsets.size - 1, dtype=np.int64))
            end = int(self.element_ends[s])
        last = int(self.document_ends[segments[-1]]) if segments.size else 0
        parts.append(np.array([max(end, 0)], dtype=np.int64))
        numbers.append(np.array([last], dtype=np.int64))
        return np.concatenate(parts), np.concatenate(numbers)


class Turns:
    """Batches take turns at their index reads, in the order they ask: each waits until the
    batch before it has issued its token reads. A store serves requests in the order they
    come, so a later batch's index reads never queue ahead of an earlier batch's tokens, and
    the first batch waits for its own reads only, not for those of the batches read ahead."""

    def __init__(self) -> None:
        self._last: Future[None] | None = None
        self._pid = os.getpid()

    def take(self) -> tuple[Wait | None, Future[None]]:
        """This batch's turn: what to wait for first (None: nothing), and the future to set
        once its token reads are issued (or it failed, or was stopped), which lets the next
        batch go."""
        if self._pid != os.getpid():  # a forked child: the parent's batches are not here
            self._last, self._pid = None, os.getpid()
        previous, mine = self._last, Future[None]()
        self._last = mine
        if previous is None or previous.done():
            return None, mine
        return Wait((previous,)), mine
