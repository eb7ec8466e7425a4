"""The per-shard document index: its manifest entries, the helpers a writer needs, and the
cache a source fetches index pieces into as batches need them.

Layout (``metadata["document_index"] == "per_shard"``): documents never cross shard ends.
Shard ``s`` holds ``metadata["shard_documents"][s]`` documents and has an index file beside it
(``metadata["shard_indexes"][s]``: ``path``, ``bytes``, and ``checksum`` when the manifest
records checksums) holding the ``n_s + 1`` little-endian int64 offsets of its documents
*local to the shard*: 0 first, the shard's element count last, never decreasing. Global
document ``d`` lives in shard ``searchsorted(cumsum(shard_documents), d, "right")``.

Two kinds of index file:

* *paged* (what the writers write; the entry has ``page_documents`` ``P`` and
  ``top_checksum``): a 24-byte header (``ABDXPG01``, ``P``, ``n`` as int64), the ``n + 1``
  offsets, then the *top level*: the first offset of each of the ``ceil(n / P)`` pages, then
  each page's xxh3-64 (uint64). Page ``k`` is offsets ``kP .. min(n, (k+1)P)`` (both ends
  included: ``P + 1`` offsets, a page's last being the next page's first). A source fetches a
  shard's top level (checked against ``top_checksum``) the first time a batch touches the
  shard, then only the pages the batch needs, by range (neighbouring pages in one read), each
  checked against its checksum and its neighbours in the top level. Index bytes then grow
  with what a rank reads, not with the documents of the shards it touches. A paged file
  may end with a *slot table* (the entry has ``slots``; :mod:`._documents_slots`): where
  documents start in each block of the shard's tokens, which packed windows read instead
  of the top level and pages (:meth:`DocumentIndex.window_offsets`).
* *whole* (earlier writers; no ``page_documents``): the offsets alone, fetched whole (one read)
  the first time a batch touches the shard. Documents as samples, when the whole indexes of all
  shards do not fit the cache, read instead just the two offsets of each document asked for,
  by range (neighbouring documents' merged as the token reads are).

Opening reads the manifest only: O(shards) bytes, whatever the number of documents. Top
levels, pages, slots and whole indexes share one cache of at most ``index_cache_bytes`` (least
recently used dropped first, never what the batch fetching them needs); concurrent batches
that need one piece share one fetch, so no piece is fetched twice while the cache holds it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from .._checksums import digest, format_digest, parse_digest
from .._dataset import join_url
from .._errors import ChecksumError, ConfigError, FormatError, ManifestError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import MANIFEST_NAME
from ._base import Read, Step, Wait
from ._documents_slots import (
    OVERFLOW_POINTER,
    SLOT_HEADER_BYTES,
    Slot,
    SlotTable,
    slot_checksum,
    slot_table_bytes,
    slot_table_of,
)
from ._fetch_cache import FetchCache, Fetcher

if TYPE_CHECKING:
    from .._dataset import Dataset

Int64Array = npt.NDArray[np.int64]

#: ``metadata["document_index"]`` of the per-shard layout.
PER_SHARD = "per_shard"
#: The key of the per-shard document counts in ``Dataset.arrays``.
SHARD_DOCUMENTS = "shard_documents"
INDEX_DTYPE = np.dtype("<i8")
#: Bytes of index pieces one source keeps (``format_options={"index_cache_bytes": ...}``).
DEFAULT_INDEX_CACHE_BYTES = 64 * 2**20
#: The first bytes of a paged index file, and its header's size (magic, P, n).
PAGED_MAGIC = b"ABDXPG01"
HEADER_BYTES = 24
#: Documents per page of the paged index the writers write (a page: 4 KiB of offsets).
PAGE_DOCUMENTS = 512
#: A page's bytes in the top level: its first offset and its checksum.
TOP_ENTRY_BYTES = 16
#: Cache keys' second part: a whole index, a top level (pages are numbered from 0).
WHOLE, TOP = -1, -2
Key = tuple[int, int]
#: A slot's key: ``(segment, SLOT, block)``.
SLOT = -3
SlotKey = tuple[int, int, int]


def page_count(documents: int, page_documents: int) -> int:
    return -(-documents // page_documents)


def index_file_bytes(documents: int, page_documents: int | None) -> int:
    """The size of the index file of a shard of ``documents`` (whole when
    ``page_documents`` is None)."""
    entries = INDEX_DTYPE.itemsize * (documents + 1)
    if page_documents is None:
        return entries
    return HEADER_BYTES + entries + TOP_ENTRY_BYTES * page_count(documents, page_documents)


# ---------------------------------------------------------------------------------------------
# For writers


def index_path(shard_path: str) -> str:
    """The index file of a shard: ``shard-00000.bin`` → ``shard-00000.idx``."""
    stem = shard_path[: -len(".bin")] if shard_path.endswith(".bin") else shard_path
    return f"{stem}.idx"


def shard_index_bytes(
    local_offsets: npt.ArrayLike,
    *,
    page_documents: int | None = PAGE_DOCUMENTS,
    slots: bool = True,
    block_tokens: int | None = None,
    slot_starts: int | None = None,
) -> bytes:
    """One shard's index file: the ``n + 1`` offsets of its ``n`` documents, local to the
    shard (0 first, never decreasing, the shard's element count last), as little-endian
    int64; paged (header, offsets, top level: see the module) unless ``page_documents`` is
    None (the earlier whole layout, offsets alone). A paged file ends with the slot table
    packed windows read (:mod:`._documents_slots`) when ``slots`` and it is smaller than
    the offsets; ``block_tokens`` and ``slot_starts`` force its ``B`` and ``k`` (and the
    table)."""
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
    raw = offsets.tobytes()
    if page_documents is None:
        return raw
    if (
        isinstance(page_documents, bool)
        or not isinstance(page_documents, int)
        or page_documents < 1
    ):
        raise ConfigError(f"page_documents must be a positive integer, got {page_documents!r}")
    n, size = offsets.size - 1, INDEX_DTYPE.itemsize
    pages = page_count(n, page_documents)
    view = memoryview(raw)
    firsts = offsets[: pages * page_documents : page_documents]
    sums = np.array(
        [
            digest(view[k * page_documents * size : (min(n, (k + 1) * page_documents) + 1) * size])
            for k in range(pages)
        ],
        dtype="<u8",
    )
    header = PAGED_MAGIC + struct.pack("<qq", page_documents, n)
    table = b""
    if slots:
        for name, value in (("block_tokens", block_tokens), ("slot_starts", slot_starts)):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        table = slot_table_bytes(offsets, block=block_tokens, starts=slot_starts)
    return header + raw + firsts.tobytes() + sums.tobytes() + table


def shard_index_info(path: str, data: bytes, *, checksum: bool = True) -> dict[str, Any]:
    """The manifest entry of one shard's index file ``data`` written at ``path`` (relative to
    the dataset root); ``checksum``: record its xxh3-64 (as the shards' checksums are). Of a
    paged file, also its ``page_documents`` and its top level's checksum (always: it is what
    the pages are checked against)."""
    info: dict[str, Any] = {"path": path, "bytes": len(data)}
    if checksum:
        info["checksum"] = format_digest(digest(data))
    if bytes(data[: len(PAGED_MAGIC)]) == PAGED_MAGIC:
        page_documents, n = struct.unpack_from("<qq", data, len(PAGED_MAGIC))
        paged = index_file_bytes(n, page_documents) if page_documents >= 1 and n >= 0 else -1
        if paged < 0 or len(data) < paged:
            raise ConfigError(
                f"index file {path!r} of {len(data)} bytes is not a paged index of {n}"
                f" documents in pages of {page_documents}"
            )
        top = memoryview(data)[HEADER_BYTES + INDEX_DTYPE.itemsize * (n + 1) : paged]
        info["page_documents"] = page_documents
        info["top_checksum"] = format_digest(digest(top))
        if len(data) > paged:
            info["slots"] = slot_table_of(data, paged, path).entry()
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
        page = info.get("page_documents")
        size = index_file_bytes(n, None if page is None else int(page))
        if info.get("slots") is not None:
            size += SlotTable(**_slot_fields(info["slots"])).file_bytes
        if n < 0 or int(info["bytes"]) != size:
            raise ConfigError(
                f"index file {info.get('path')!r} of {info['bytes']} bytes cannot hold the"
                f" {n + 1} offsets of {n} documents"
                + ("" if page is None else f" in pages of {page}")
            )
    return {
        "documents": sum(numbers),
        "document_index": PER_SHARD,
        SHARD_DOCUMENTS: numbers,
        "shard_indexes": [dict(info) for info in index_infos],
    }


def _slot_fields(entry: Mapping[str, Any]) -> dict[str, int]:
    """A manifest ``slots`` entry as :class:`SlotTable`'s fields (unchecked)."""
    return {
        "block": int(entry["block_tokens"]),
        "starts": int(entry["starts"]),
        "before_bytes": int(entry["before_bytes"]),
        "count_bytes": int(entry["count_bytes"]),
        "blocks": int(entry["blocks"]),
        "overflow": int(entry["overflow"]),
    }


# ---------------------------------------------------------------------------------------------
# Reading the manifest


def is_per_shard(dataset: Dataset) -> bool:
    return dataset.manifest.metadata.get("document_index") == PER_SHARD


@dataclass(frozen=True)
class ShardIndexes:
    """The per-shard index entries of one dataset's manifest, checked. ``pages[s]``: the
    documents per page of a paged index, 0 for a whole one."""

    counts: Int64Array
    urls: tuple[str, ...]
    nbytes: Int64Array
    checksums: tuple[int | None, ...]
    pages: Int64Array
    top_checksums: tuple[int | None, ...]
    #: Each shard's slot table (None: none, packed windows read pages).
    slots: tuple[SlotTable | None, ...] = ()

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
            pages = [int(e.get("page_documents") or 0) for e in entries]
            tops = [
                parse_digest(e["top_checksum"]) if "page_documents" in e else None for e in entries
            ]
            if isinstance(total, bool) or not isinstance(total, int):
                raise TypeError(f"documents is {total!r}")
            paged = ["page_documents" in e for e in entries]
            if any(p < 1 for p, on in zip(pages, paged, strict=True) if on):
                raise ValueError(f"page_documents {pages[:8]} must be positive")
            slots: list[SlotTable | None] = []
            # (another number of entries than shards is refused below)
            for e, on, shard in zip(entries, paged, shards, strict=False):
                if e.get("slots") is None:
                    slots.append(None)
                elif not on:
                    raise ValueError(f"{e['path']}: slots without page_documents")
                else:
                    slots.append(SlotTable.of_entry(e["slots"], shard.elements))
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
        for n, path, size, page, table, shard in zip(
            counts, paths, nbytes, pages, slots, shards, strict=True
        ):
            url = join_url(dataset.url, path)
            if size != index_file_bytes(n, page or None) + (table.file_bytes if table else 0):
                kind = f" paged index ({page} documents a page)" if page else " int64 offsets"
                kind += f" and slot table ({table.file_bytes} bytes)" if table else ""
                raise ManifestError(
                    f"{where}: the index {url} (bytes [0, {size})) cannot hold the {n + 1}"
                    f"{kind} of the {n} documents of {shard.path}"
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
            np.array(pages, dtype=np.int64),
            tuple(tops),
            tuple(slots),
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
    per-shard dataset (its offsets fetched when needed: whole, or by page) or a whole dataset
    whose offsets are in memory (a single ``documents.idx``, Megatron). Documents never cross
    segments.

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
        pages: list[int] = []
        checksums: list[int | None] = []
        tops: list[int | None] = []
        #: Each segment's slot table (None: none; packed windows then read pages or whole).
        self.slot_tables: list[SlotTable | None] = []
        self.urls: list[str] = []  # of each segment's index ("" when in memory)
        self.shard_urls: list[str] = []  # of each segment's shard ("" when in memory)
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
                pages.append(0)
                checksums.append(None)
                tops.append(None)
                self.slot_tables.append(None)
                self.urls.append("")
                self.shard_urls.append("")
                continue
            layout = ShardIndexes.of(dataset)
            documents += layout.counts.tolist()
            elements += [s.elements for s in dataset.manifest.shards]
            files += range(
                first_file + len(self.index_urls),
                first_file + len(self.index_urls) + len(layout.urls),
            )
            nbytes += layout.nbytes.tolist()
            pages += layout.pages.tolist()
            checksums += layout.checksums
            tops += layout.top_checksums
            self.slot_tables += layout.slots
            self.urls += layout.urls
            self.shard_urls += dataset.shard_urls
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
        #: Documents per page of each segment's paged index (0: whole, or in memory).
        self.page = np.array(pages, dtype=np.int64)
        lazy = self.file >= 0
        #: The index files' entries as one stream (for reads of a few entries by range, of
        #: whole indexes only: a paged one's entries are read by checked page).
        self.entries = ShardMap(self.nbytes[lazy] // INDEX_DTYPE.itemsize, INDEX_DTYPE.itemsize)
        self.entry_base = np.zeros(len(documents), dtype=np.int64)
        self.entry_base[lazy] = self.entries.starts
        self.first_file = first_file
        self.checksums = checksums
        self.top_checksums = tops
        #: What the manifests record of each index file, for the engine's checks.
        self.described_files: dict[str, tuple[int, int | None]] = {
            url: (int(n), c)
            for url, n, c, f in zip(self.urls, nbytes, checksums, files, strict=True)
            if f >= 0
        }
        self.budget = budget
        #: Whether documents as samples read the offsets of whole indexes by range instead
        #: of whole: when the whole indexes of all shards do not fit the cache.
        self.ranged = int(self.nbytes[lazy & (self.page == 0)].sum()) > budget
        #: Where each segment's slots begin in its index file (-1: no slot table).
        self.slot_at = np.array(
            [
                -1 if t is None else index_file_bytes(n, p) + SLOT_HEADER_BYTES
                for t, n, p in zip(self.slot_tables, documents, pages, strict=True)
            ],
            dtype=np.int64,
        )
        #: Index pieces fetched (pages, top levels, whole indexes, slots), and fetches under
        #: way shared (:mod:`._fetch_cache`).
        self._pieces: FetchCache[Key | SlotKey, Int64Array | Slot] = FetchCache(budget)
        self.turns = Turns()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into a worker process: the cache and fetches under way stay behind.
        return dict(self.__dict__, turns=Turns())

    @property
    def cached_bytes(self) -> int:
        """Bytes of index pieces the cache holds now (at most ``budget``, bar those batches
        are using)."""
        return self._pieces.cached_bytes

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

    # -- pieces, fetched once and shared -------------------------------------------------------

    def _obtain(
        self,
        keys: Sequence[Key],
        fetch: Callable[[list[Key]], Generator[Step, Any, dict[Key, Int64Array]]],
    ) -> Generator[Step, Any, dict[Key, Int64Array]]:
        """The pieces ``keys`` (unique), fetching with ``fetch`` those not cached; a fetch
        another batch started is waited for, not repeated."""
        # One cache holds every kind of piece; a kind's keys only ever hold that kind.
        shared = cast("Fetcher[Key | SlotKey, Int64Array | Slot]", fetch)
        got = yield from self._pieces.obtain(keys, shared)
        return cast("dict[Key, Int64Array]", got)

    def _read(
        self, segments: Sequence[int], starts: Sequence[int], sizes: Sequence[int]
    ) -> Generator[Step, Any, tuple[npt.NDArray[np.uint8], list[int]]]:
        """Bytes ``[start, start + size)`` of the index files of ``segments``, in one read;
        the buffer and where each range lies in it."""
        chosen = np.array(segments, dtype=np.int64)
        size = np.array(sizes, dtype=np.int64)
        dest = np.cumsum(size) - size
        start = np.array(starts, dtype=np.int64)
        none = np.zeros(0, dtype=np.int64)
        plan = ReadPlan(
            self.file[chosen], start, start + size, dest, none, none, none, none, int(size.sum())
        )
        try:
            buffer = yield Read(plan)
        except NotFoundError as exc:
            named = exc.url or ", ".join(sorted({self.urls[s] for s in segments}))
            raise FormatError(f"{named}: a document index the manifest names is missing") from exc
        return buffer, dest.tolist()

    def load(self, segments: Int64Array) -> Generator[Step, Any, dict[int, Int64Array]]:
        """The local offsets of ``segments`` (unique; in memory, or of whole indexes),
        fetching those not cached."""
        table = {s: self._fixed[s] for s in segments.tolist() if s in self._fixed}
        keys = [(s, WHOLE) for s in segments.tolist() if s not in self._fixed]
        if keys:
            got = yield from self._obtain(keys, self._fetch_whole)
            table.update((s, offsets) for (s, _), offsets in got.items())
        return table

    def _fetch_whole(self, keys: list[Key]) -> Generator[Step, Any, dict[Key, Int64Array]]:
        segments = [s for s, _ in keys]
        sizes = self.nbytes[segments].tolist()
        buffer, dest = yield from self._read(segments, [0] * len(segments), sizes)
        got: dict[Key, Int64Array] = {}
        for s, at, size in zip(segments, dest, sizes, strict=True):
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
            got[(s, WHOLE)] = offsets
        return got

    def _top_range(self, s: int) -> tuple[int, int]:
        n, page = int(self.documents[s]), int(self.page[s])
        start = HEADER_BYTES + INDEX_DTYPE.itemsize * (n + 1)
        return start, start + TOP_ENTRY_BYTES * page_count(n, page)

    def tops(self, segments: Sequence[int]) -> Generator[Step, Any, dict[int, Int64Array]]:
        """The top levels of paged ``segments``: per segment ``[2, pages]`` int64, the first
        offset of each page, then its checksum (as int64 bits)."""
        got = yield from self._obtain([(s, TOP) for s in segments], self._fetch_tops)
        return {s: top for (s, _), top in got.items()}

    def _fetch_tops(self, keys: list[Key]) -> Generator[Step, Any, dict[Key, Int64Array]]:
        segments = [s for s, _ in keys]
        ranges = [self._top_range(s) for s in segments]
        buffer, dest = yield from self._read(
            segments, [a for a, _ in ranges], [b - a for a, b in ranges]
        )
        got: dict[Key, Int64Array] = {}
        for s, (a, b), at in zip(segments, ranges, dest, strict=True):
            raw = buffer[at : at + b - a]
            expected = self.top_checksums[s]
            if expected is not None and digest(raw) != expected:
                raise ChecksumError(
                    f"{self.urls[s]}: bytes [{a}, {b}): the top level of the paged index of"
                    f" shard {self.shard_urls[s]}: checksum {format_digest(digest(raw))},"
                    f" the manifest says {format_digest(expected)}",
                    self.urls[s],
                    a,
                    b,
                )
            top = raw.view(INDEX_DTYPE).astype(np.int64).reshape(2, -1)
            firsts = top[0]
            bad = np.flatnonzero(
                np.concatenate([firsts[:1] != 0, firsts[1:] < firsts[:-1]])
                | (firsts > self.elements[s])
            )
            if bad.size:
                k = int(bad[0])
                raise FormatError(
                    f"{self.urls[s]}: bytes [{a + 8 * k}, {a + 8 * k + 8}): page {k} of the"
                    f" index of shard {self.shard_urls[s]} starts at element {firsts[k]},"
                    f" out of order in the {self.elements[s]} elements of the shard"
                )
            got[(s, TOP)] = top
        return got

    def pages(
        self, keys: Sequence[Key], tops: Mapping[int, Int64Array] | None
    ) -> Generator[Step, Any, dict[Key, Int64Array]]:
        """Pages ``keys`` (``(segment, page)``, unique), each the page's local offsets
        (``P + 1``, fewer in the last page), checked against ``tops`` (None: the top levels
        are fetched, where not cached, beside the pages, in the same round of reads)."""

        def fetch(missing: list[Key]) -> Generator[Step, Any, dict[Key, Int64Array]]:
            return self._fetch_pages(missing, tops)

        return (yield from self._obtain(keys, fetch))

    def _fetch_pages(
        self, keys: list[Key], tops: Mapping[int, Int64Array] | None
    ) -> Generator[Step, Any, dict[Key, Int64Array]]:
        # Neighbouring pages of one index in one range (a page's last offset is the next
        # page's first: the ranges of neighbours overlap by one offset).
        keys = sorted(keys)
        runs: list[list[Key]] = []
        for key in keys:
            if runs and runs[-1][-1] == (key[0], key[1] - 1):
                runs[-1].append(key)
            else:
                runs.append([key])
        size = INDEX_DTYPE.itemsize
        segments, starts, sizes = [], [], []
        for run in runs:
            s, first, last = run[0][0], run[0][1], run[-1][1]
            page, n = int(self.page[s]), int(self.documents[s])
            segments.append(s)
            starts.append(HEADER_BYTES + size * first * page)
            sizes.append(size * (min(n, (last + 1) * page) + 1 - first * page))
        if tops is None:  # the top levels (to check the pages by) read beside them
            tops, (buffer, dest) = yield (
                self.tops(sorted(set(segments))),
                self._read(segments, starts, sizes),
            )
        else:
            buffer, dest = yield from self._read(segments, starts, sizes)
        got: dict[Key, Int64Array] = {}
        for run, at in zip(runs, dest, strict=True):
            s, first = run[0]
            page, n = int(self.page[s]), int(self.documents[s])
            for _, k in run:
                lo, hi = k * page, min(n, (k + 1) * page) + 1
                raw = buffer[at + size * (lo - first * page) : at + size * (hi - first * page)]
                got[(s, k)] = self._checked_page(s, k, raw, tops[s])
        return got

    def _checked_page(
        self, s: int, k: int, raw: npt.NDArray[np.uint8], top: Int64Array
    ) -> Int64Array:
        """Page ``k`` of segment ``s``'s index from its bytes: a ChecksumError or FormatError
        naming the index, the shard, the page and its bytes unless it is whole and agrees
        with the top level and the shard."""
        page, n = int(self.page[s]), int(self.documents[s])
        size = INDEX_DTYPE.itemsize
        a = HEADER_BYTES + size * k * page
        b = a + raw.size
        where = (
            f"{self.urls[s]}: bytes [{a}, {b}): page {k} of the index of shard {self.shard_urls[s]}"
        )
        expected = int(top[1, k]) & 0xFFFFFFFFFFFFFFFF
        if digest(raw) != expected:
            raise ChecksumError(
                f"{where}: checksum {format_digest(digest(raw))}, the top level says"
                f" {format_digest(expected)}",
                self.urls[s],
                a,
                b,
            )
        offsets = raw.view(INDEX_DTYPE).astype(np.int64)  # a copy: the buffer is pooled
        last = int(top[0, k + 1]) if k + 1 < top.shape[1] else int(self.elements[s])
        if offsets[0] != top[0, k] or offsets[-1] != last:
            raise FormatError(
                f"{where}: offsets {offsets[0]} .. {offsets[-1]}, but the top level puts the"
                f" page at elements {top[0, k]} .. {last} (the shard holds"
                f" {self.elements[s]} elements, {n} documents)"
            )
        falling = np.flatnonzero(offsets[1:] < offsets[:-1])
        if falling.size:
            d = int(falling[0])
            raise FormatError(
                f"{where}: document offsets decrease at document {k * page + d}"
                f" ({offsets[d]} then {offsets[d + 1]})"
            )
        return offsets

    # -- documents as samples ------------------------------------------------------------------

    def document_spans(
        self, ids: Int64Array, gap: int
    ) -> Generator[Step, Any, tuple[Int64Array, Int64Array]]:
        """Global element start and end of documents ``ids``: from pages of paged indexes
        (top levels first), whole indexes (or their entries by range when they do not all fit
        the cache), offsets in memory."""
        segments = self.segments_of_documents(ids)
        paged = self.page[segments] > 0
        if not paged.any():
            if self.ranged:
                return (yield from self.read_spans(ids, gap))
            return self.spans(ids, (yield from self.load(np.unique(segments))))
        starts = np.empty(ids.size, dtype=np.int64)
        ends = np.empty(ids.size, dtype=np.int64)
        rest = np.flatnonzero(~paged)
        if rest.size:
            starts[rest], ends[rest] = yield from self.document_spans(ids[rest], gap)
        picked = np.flatnonzero(paged)
        seg = segments[picked]
        local = ids[picked] - self.document_starts[seg]
        page = local // self.page[seg]
        pairs = np.unique(np.stack([seg, page]), axis=1)
        keys = [(int(s), int(k)) for s, k in pairs.T]
        table = yield from self.pages(keys, None)  # a document's page needs no top level
        order = np.lexsort((page, seg))
        cuts = np.flatnonzero(np.diff(seg[order]) | np.diff(page[order])) + 1
        for group in np.split(order, cuts):
            s, k = int(seg[group[0]]), int(page[group[0]])
            offsets, at = table[(s, k)], local[group] - k * int(self.page[s])
            base = self.element_starts[s]
            starts[picked[group]] = base + offsets[at]
            ends[picked[group]] = base + offsets[at + 1]
        return starts, ends

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

    # -- packed windows ------------------------------------------------------------------------

    def window_offsets(
        self, starts: Int64Array, width: int
    ) -> Generator[Step, Any, tuple[Int64Array, Int64Array]]:
        """Global offsets of the documents around the windows of ``width`` elements at
        ``starts``, and the global number of each, as
        :func:`~asyncbatch.formats._documents.boundaries` takes them; fetched as needed (of
        indexes with a slot table, the slots of the blocks the windows overlap; whole
        indexes; of paged ones, the top level, then the pages the windows overlap). Each
        entry says where a document starts, or (at the edges of what was fetched) a bound
        that no window's boundaries can tell from it (see :meth:`slot_entries`)."""
        segments = self.segments_of_windows(starts, width)
        slotted = self.slot_at[segments] >= 0
        if not slotted.any():
            return (yield from self._piece_offsets(segments, starts, width))
        keys = self.slot_keys(segments[slotted], starts, width)
        if slotted.all():
            table = yield from self.slots(keys)
            return self.slot_entries(keys, table)
        table, (offsets, numbers) = yield (
            self.slots(keys),
            self._piece_offsets(segments[~slotted], starts, width),
        )
        more, more_numbers = self.slot_entries(keys, table)
        offsets = np.concatenate([offsets, more])
        numbers = np.concatenate([numbers, more_numbers])
        order = np.lexsort((numbers, offsets))
        offsets, numbers = offsets[order], numbers[order]
        fresh = np.ones(offsets.size, dtype=bool)
        fresh[1:] = (offsets[1:] != offsets[:-1]) | (numbers[1:] != numbers[:-1])
        return offsets[fresh], numbers[fresh]

    def _piece_offsets(
        self, segments: Int64Array, starts: Int64Array, width: int
    ) -> Generator[Step, Any, tuple[Int64Array, Int64Array]]:
        """:meth:`window_offsets` of ``segments`` without slot tables: runs of neighbouring
        pieces (segments, pages) are slices of the global offsets; between runs one entry
        stands for the elements no window touches."""
        paged = self.page[segments] > 0
        pieces: list[tuple[int, int, Int64Array]] = []  # segment, first local document, offsets
        whole = segments[~paged]
        if whole.size:
            table = yield from self.load(whole)
            pieces += [(s, 0, table[s]) for s in whole.tolist()]
        if paged.any():
            chosen = segments[paged].tolist()
            tops = yield from self.tops(chosen)
            keys: list[Key] = []
            for s in chosen:
                base = self.element_starts[s]
                lo = np.maximum(starts, base) - base
                hi = np.minimum(starts + width, self.element_ends[s]) - base
                inside = lo < hi
                firsts = tops[s][0]
                first = np.searchsorted(firsts, lo[inside], side="right") - 1
                last = np.searchsorted(firsts, hi[inside] - 1, side="right") - 1
                count = last - first + 1
                step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
                keys += [(s, k) for k in np.unique(np.repeat(first, count) + step).tolist()]
            pages = yield from self.pages(keys, tops)
            pieces += [(s, k * int(self.page[s]), pages[(s, k)]) for s, k in keys]
        pieces.sort(key=lambda piece: (piece[0], piece[1]))
        parts: list[Int64Array] = []
        numbers: list[Int64Array] = []
        end, after = -1, 0
        for s, first, offsets in pieces:
            base = int(self.element_starts[s])
            if parts and end != base + int(offsets[0]):
                parts.append(np.array([end], dtype=np.int64))
                numbers.append(np.array([after], dtype=np.int64))
            parts.append(base + offsets[:-1])
            number = int(self.document_starts[s]) + first
            numbers.append(np.arange(number, number + offsets.size - 1, dtype=np.int64))
            end, after = base + int(offsets[-1]), number + offsets.size - 1
        parts.append(np.array([max(end, 0)], dtype=np.int64))
        numbers.append(np.array([after], dtype=np.int64))
        return np.concatenate(parts), np.concatenate(numbers)

    # -- packed windows: slot tables ------------------------------------------------------------

    def slot_keys(self, segments: Int64Array, starts: Int64Array, width: int) -> list[SlotKey]:
        """The slots (``(segment, SLOT, block)``, ordered) of the blocks of ``segments``
        that the windows of ``width`` elements at ``starts`` overlap."""
        keys: list[SlotKey] = []
        for s in segments.tolist():
            table = self.slot_tables[s]
            assert table is not None
            base = self.element_starts[s]
            lo = np.maximum(starts, base) - base
            hi = np.minimum(starts + width, self.element_ends[s]) - base
            inside = lo < hi
            first = lo[inside] // table.block
            count = (hi[inside] - 1) // table.block - first + 1
            step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            keys += [(s, SLOT, b) for b in np.unique(np.repeat(first, count) + step).tolist()]
        return keys

    def slots(self, keys: Sequence[SlotKey]) -> Generator[Step, Any, dict[SlotKey, Slot]]:
        """The slots ``keys`` (unique), fetching those not cached (neighbours in one range;
        an overflowing block's starts in a second round), each checked."""
        shared = cast("Fetcher[Key | SlotKey, Int64Array | Slot]", self._fetch_slots)
        got = yield from self._pieces.obtain(keys, shared)
        return cast("dict[SlotKey, Slot]", got)

    def _slot_where(self, s: int, b: int, a: int, size: int) -> str:
        table = self.slot_tables[s]
        assert table is not None
        end = min((b + 1) * table.block, int(self.elements[s]))
        return (
            f"{self.urls[s]}: bytes [{a}, {a + size}): the slot of block {b} (elements"
            f" [{b * table.block}, {end})) of shard {self.shard_urls[s]}"
        )

    def _fetch_slots(self, keys: list[SlotKey]) -> Generator[Step, Any, dict[SlotKey, Slot]]:
        keys = sorted(keys)
        runs: list[list[SlotKey]] = []
        for key in keys:
            if runs and runs[-1][-1] == (key[0], SLOT, key[2] - 1):
                runs[-1].append(key)
            else:
                runs.append([key])
        segments, starts, sizes = [], [], []
        for run in runs:
            s, first = run[0][0], run[0][2]
            table = self.slot_tables[s]
            assert table is not None
            segments.append(s)
            starts.append(int(self.slot_at[s]) + first * table.slot_bytes)
            sizes.append(len(run) * table.slot_bytes)
        buffer, dest = yield from self._read(segments, starts, sizes)
        got: dict[SlotKey, Slot] = {}
        spills: list[tuple[SlotKey, int, int, int, int]] = []  # key, before, first, count, sum
        for run, start, at in zip(runs, starts, dest, strict=True):
            table = self.slot_tables[run[0][0]]
            assert table is not None
            size = table.slot_bytes
            for i, key in enumerate(run):
                row = bytes(buffer[at + i * size : at + (i + 1) * size])
                parsed = self._checked_slot(key, row, start + i * size)
                if isinstance(parsed, Slot):
                    got[key] = parsed
                else:
                    spills.append((key, *parsed))
        if spills:
            segments, starts, sizes = [], [], []
            for (s, _, _), _, first, count, _ in spills:
                table = self.slot_tables[s]
                assert table is not None
                segments.append(s)
                starts.append(int(self.slot_at[s]) + table.blocks * table.slot_bytes + 2 * first)
                sizes.append(2 * count)
            buffer, dest = yield from self._read(segments, starts, sizes)
            for (key, before, _, count, expected), start, at in zip(
                spills, starts, dest, strict=True
            ):
                s, _, b = key
                raw = bytes(buffer[at : at + 2 * count])
                if slot_checksum(raw, b) != expected:
                    raise ChecksumError(
                        f"{self.urls[s]}: bytes [{start}, {start + 2 * count}): the overflow"
                        f" starts of block {b} of shard {self.shard_urls[s]}: checksum"
                        f" {slot_checksum(raw, b):08x}, its slot says {expected:08x}",
                        self.urls[s],
                        start,
                        start + 2 * count,
                    )
                table = self.slot_tables[s]
                assert table is not None
                slot_start = int(self.slot_at[s]) + b * table.slot_bytes
                where = self._slot_where(s, b, slot_start, table.slot_bytes)
                positions = np.frombuffer(raw, dtype="<u2").astype(np.int64)
                got[key] = self._slot(s, b, before, positions, where)
        return got

    def _checked_slot(
        self, key: SlotKey, row: bytes, start: int
    ) -> Slot | tuple[int, int, int, int]:
        """Slot ``key`` from its bytes ``row`` (read at byte ``start`` of the index), checked;
        of an overflowing block, its ``before`` and overflow pointer (first entry, count,
        checksum) instead. A ChecksumError or FormatError naming the index, the bytes, the
        block and the shard unless it is whole and agrees with its shard."""
        s, _, b = key
        table = self.slot_tables[s]
        assert table is not None
        where = self._slot_where(s, b, start, len(row))
        body = len(row) - 4
        expected = int.from_bytes(row[body:], "little")
        if slot_checksum(row[:body], b) != expected:
            raise ChecksumError(
                f"{where}: checksum {slot_checksum(row[:body], b):08x}, the slot says"
                f" {expected:08x}",
                self.urls[s],
                start,
                start + len(row),
            )
        head = table.before_bytes + table.count_bytes
        before = int.from_bytes(row[: table.before_bytes], "little")
        count = int.from_bytes(row[table.before_bytes : head], "little")
        if count == table.marker:
            pointer = np.frombuffer(row, dtype=OVERFLOW_POINTER, count=1, offset=head)[0]
            first, spilled = int(pointer["first"]), int(pointer["count"])
            if spilled <= table.starts or first + spilled > table.overflow:
                raise FormatError(
                    f"{where}: overflow entries [{first}, {first + spilled}), not more than"
                    f" the slot's {table.starts} starts within the {table.overflow} entries"
                    " of the overflow area"
                )
            return before, first, spilled, int(pointer["checksum"])
        if count > table.starts:
            raise FormatError(f"{where}: {count} starts, more than the {table.starts} a slot holds")
        positions = np.frombuffer(row, dtype="<u2", count=count, offset=head).astype(np.int64)
        return self._slot(s, b, before, positions, where)

    def _slot(self, s: int, b: int, before: int, positions: Int64Array, where: str) -> Slot:
        """Block ``b``'s slot of ``before`` and ``positions`` (from the block's start): a
        FormatError naming ``where`` unless they agree with the shard."""
        table = self.slot_tables[s]
        assert table is not None
        n, length = (
            int(self.documents[s]),
            min(table.block, int(self.elements[s]) - b * table.block),
        )
        count = positions.size
        if before + count > n or (b > 0 and before < 1):
            raise FormatError(
                f"{where}: {before} documents before the block and {count} starting in it,"
                f" but the shard holds {n} documents, its first at element 0"
            )
        if b == 0 and (before != 0 or count == 0 or positions[0] != 0):
            first = int(positions[0]) if count else None
            raise FormatError(
                f"{where}: the shard's first document must start at element 0 (the slot"
                f" says {before} before the block, the first start at {first})"
            )
        falling = np.flatnonzero(positions[1:] < positions[:-1])
        if falling.size:
            d = int(falling[0])
            raise FormatError(
                f"{where}: document starts decrease ({positions[d]} then {positions[d + 1]})"
            )
        if count and positions[-1] >= length:
            raise FormatError(
                f"{where}: a document starts at {positions[-1]} from the block's start, beyond"
                f" its {length} elements"
            )
        return Slot(before, positions + b * table.block)

    def slot_entries(
        self, keys: Sequence[SlotKey], table: Mapping[SlotKey, Slot]
    ) -> tuple[Int64Array, Int64Array]:
        """The entries of :meth:`window_offsets` from the slots ``keys`` (ordered): per run
        of neighbouring blocks, a *head* (unless the run starts the shard: the document going
        on at the run's start, numbered, placed at the element before it), every document
        starting in the run, and a *tail* (the number of the next document, at the run's
        end). The head and the tail stand where no window whose slots these are has an
        element: a window that held that element would have fetched that block, and the
        run would go on. So they only ever number the document a window starts in, or
        close its last document; no boundary comes from them. Neighbouring slots must agree
        (a FormatError naming the later)."""
        offsets: list[Int64Array] = []
        numbers: list[Int64Array] = []
        tail: tuple[int, int] | None = None
        previous: tuple[int, int, Slot] | None = None
        for key in keys:
            s, _, b = key
            slot = table[key]
            layout = self.slot_tables[s]
            assert layout is not None
            block = layout.block
            base, first = int(self.element_starts[s]), int(self.document_starts[s])
            if previous is not None and previous[:2] == (s, b - 1):
                last = previous[2]
                if slot.before != last.before + last.starts.size:
                    at = int(self.slot_at[s]) + b * layout.slot_bytes
                    raise FormatError(
                        f"{self._slot_where(s, b, at, layout.slot_bytes)}: {slot.before}"
                        f" documents before the block, but block {b - 1}'s slot has"
                        f" {last.before} before it and {last.starts.size} starting in it"
                    )
            else:
                if tail is not None:
                    offsets.append(np.array([tail[0]], dtype=np.int64))
                    numbers.append(np.array([tail[1]], dtype=np.int64))
                if b > 0:
                    offsets.append(np.array([base + b * block - 1], dtype=np.int64))
                    numbers.append(np.array([first + slot.before - 1], dtype=np.int64))
            offsets.append(base + slot.starts)
            number = first + slot.before
            numbers.append(np.arange(number, number + slot.starts.size, dtype=np.int64))
            end = base + min((b + 1) * block, int(self.elements[s]))
            tail = (end, number + slot.starts.size)
            previous = (s, b, slot)
        if tail is not None:
            offsets.append(np.array([tail[0]], dtype=np.int64))
            numbers.append(np.array([tail[1]], dtype=np.int64))
        if not offsets:
            return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        return np.concatenate(offsets), np.concatenate(numbers)


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
