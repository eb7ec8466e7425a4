"""Megatron-LM indexed datasets (``name.bin`` + ``name.idx``), read in place.

The ``.idx`` (Megatron's ``MMapIndexedDataset`` index, version 1) is::

    b"MMIDIDX\\x00\\x00"  version <Q = 1  dtype code <B  sequence count S <Q  entries D <Q
    sequence lengths  int32[S]      tokens in each sequence
    sequence pointers int64[S]      byte offset of each sequence in the .bin
    document indices  int64[D]      0, then the sequence index one past each document's end
    (sequence modes   int8[S])      multimodal datasets only; ignored

(D counts document-index entries: one more than the documents), and the ``.bin`` is the
tokens of every sequence, one after another; as in Megatron, bytes after the last sequence
are allowed and never read.

The ``.idx`` is never read whole: at 10 bytes a document it is 10 GB at 10^9 documents.
Opening reads its header, then a *summary*: the first pointer of every page of
``index_page`` entries (sequences, or documents with ``unit="document"``) and the end of the
last sequence, as strided 8-byte range reads, and the ``.bin``'s size; never tokens. With a
node cache (``cache=``) the summary is kept there under the ``.idx``'s version, so the other
processes of a node read it in one piece. Batches fetch whole pages (lengths and pointers,
12 bytes a sequence) by range as they need them, check them against the summary, and keep
them in a bounded cache (:mod:`asyncbatch.formats._megatron_index`).

A sample is a Megatron *sequence* (what Megatron's GPT dataset samples from); with
``options={"unit": "document"}`` it is a document (its sequences together). Either way the
dataset has one shard (the ``.bin``) and reads as the ``documents`` format reads (documents
as samples, or packed windows with ``cu_seqlens``; :mod:`asyncbatch.formats._megatron_source`).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dataset import Dataset, join_url
from .._errors import ConfigError, FormatError, NotFoundError
from .._manifest import Manifest, ShardInfo
from ..stores._base import ObjectInfo, Store
from ..stores._cache import CachedStore
from ..stores._disk_cache import DiskCache
from ._base import Opener
from ._npy import object_infos, parent_and_name

FORMAT = "megatron"
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
#: Magic, version, dtype code, sequence count, document count.
HEADER = struct.Struct("<9sQBQQ")
#: Megatron-LM's ``DType`` codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    code: np.dtype(name)
    for code, name in {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }.items()
}
UNITS = ("sequence", "document")
#: Entries (sequences, or documents) of one page of the index: a sequence page is 12 bytes
#: of the ``.idx`` an entry (48 KiB), a document page 8 (32 KiB) plus the sequence pages of
#: its documents. The summary holds one int64 a page (2 MiB at 10^9 entries).
DEFAULT_PAGE = 4096
#: ``Dataset.arrays``: element offset of each sequence page's first sequence, then the end.
SEQUENCE_PAGES = "megatron_sequence_pages"
#: ``Dataset.arrays`` (``unit="document"``): the same of each document page.
DOCUMENT_PAGES = "megatron_document_pages"
#: What the node cache keeps a summary under: the ``.idx``'s URL with this suffix (plus the
#: unit and page size), at the ``.idx``'s version.
CACHED_SUMMARY = "#asyncbatch-megatron-summary"


def megatron_prefix(url: str) -> str:
    """``.../name`` for ``.../name``, ``.../name.bin`` or ``.../name.idx``."""
    url = url.rstrip("/")
    return url[:-4] if url.endswith((".bin", ".idx")) else url


@dataclass(frozen=True)
class IndexLayout:
    """Where the arrays of one ``.idx`` lie, from its header."""

    url: str
    dtype: np.dtype[Any]
    sequences: int
    #: Document-index entries: documents + 1.
    entries: int
    #: Entries of a page.
    page: int

    @property
    def lengths_at(self) -> int:
        return HEADER.size

    @property
    def pointers_at(self) -> int:
        return HEADER.size + 4 * self.sequences

    @property
    def documents_at(self) -> int:
        return HEADER.size + 12 * self.sequences

    @property
    def size(self) -> int:
        """Bytes of the index without sequence modes."""
        return HEADER.size + 12 * self.sequences + 8 * self.entries

    def pages(self, count: int) -> int:
        """Pages of ``count`` entries."""
        return -(-count // self.page)

    @classmethod
    def of(cls, dataset: Dataset) -> IndexLayout:
        """The layout of a dataset this module opened (from its manifest)."""
        meta = dataset.manifest.metadata
        return cls(
            join_url(dataset.url, str(meta["index"])),
            dataset.manifest.dtype,
            int(meta["sequences"]),
            int(meta["documents"]) + 1,
            int(meta["index_page"]),
        )


async def open_megatron(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """The Megatron dataset at prefix ``url``: its header and page summary read, no page."""
    extra = sorted(set(options) - {"unit", "index_page"})
    if extra:
        raise ConfigError(
            f'Megatron datasets take only options={{"unit": ..., "index_page": ...}}, got {extra}'
        )
    unit = options.get("unit", "sequence")
    if unit not in UNITS:
        raise ConfigError(f"options unit={unit!r}: expected one of {UNITS}")
    page = options.get("index_page", DEFAULT_PAGE)
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ConfigError(f"options index_page must be a positive integer, got {page!r}")
    prefix = megatron_prefix(url)
    idx_url, bin_url = f"{prefix}.idx", f"{prefix}.bin"
    idx, bin_ = await object_infos(store, [idx_url, bin_url])
    layout, reader = await read_header(store, idx_url, idx.size, page)
    arrays = await summary(reader, layout, idx, unit)
    total = int(arrays[SEQUENCE_PAGES][-1])
    dtype = layout.dtype
    # Megatron reads only what its index points at: bytes past the last sequence are no
    # error, just never read.
    nbytes = total * dtype.itemsize
    if nbytes > bin_.size:
        raise FormatError(
            f"{idx_url}: its sequences end at byte {nbytes}, but {bin_url} has {bin_.size} bytes"
            " (truncated .bin, or an index of another file)"
        )
    root, name = parent_and_name(prefix)
    shard = ShardInfo(f"{name}.bin", nbytes, total, trailing=bin_.size - nbytes)
    metadata = {
        "read_in_place": "megatron",
        "unit": unit,
        "sequences": layout.sequences,
        "documents": layout.entries - 1,
        "index": f"{name}.idx",
        "index_bytes": idx.size,
        "index_page": page,
    }
    manifest = Manifest(FORMAT, dtype, (shard,), metadata)
    return Dataset(root, manifest, storage_options, arrays, (idx.version, bin_.version))


async def read_header(
    store: Store, idx_url: str, idx_size: int, page: int
) -> tuple[IndexLayout, IndexBytes]:
    """The layout the header describes, checked against the ``.idx``'s size, and a reader of
    the ``.idx``'s values holding its first bytes."""
    if idx_size < HEADER.size:
        raise FormatError(
            f"{idx_url}: truncated Megatron index: {idx_size} bytes, shorter than the"
            f" {HEADER.size}-byte header"
        )
    # Read around the node cache, which would fetch whole blocks; the summary is kept there.
    inner = store.inner if isinstance(store, CachedStore) else store
    first = bytearray(min(idx_size, FIRST_READ))
    await inner.read_ranges(idx_url, starts=[0], ends=[len(first)], buffers=[memoryview(first)])
    magic, version, code, sequences, entries = HEADER.unpack_from(first)
    if magic != IDX_MAGIC:
        raise FormatError(
            f"{idx_url}: not a Megatron index: magic {magic!r}, expected {IDX_MAGIC!r}"
        )
    if version != IDX_VERSION:
        raise FormatError(f"{idx_url}: Megatron index version {version}, expected {IDX_VERSION}")
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        raise FormatError(
            f"{idx_url}: unknown Megatron dtype code {code} (known: {sorted(DTYPE_CODES)})"
        )
    layout = IndexLayout(idx_url, dtype, sequences, entries, page)
    expected = layout.size
    if idx_size not in (expected, expected + sequences):
        raise FormatError(
            f"{idx_url}: Megatron index has {idx_size} bytes, but its header implies"
            f" {expected} ({'truncated' if idx_size < expected else 'trailing bytes'})"
        )
    if entries < 1:
        raise FormatError(f"{idx_url}: {entries} document-index entries: expected at least 1")
    return layout, IndexBytes(inner, idx_url, bytes(first), cache=store)


#: Bytes of the ``.idx`` the first read at open takes: a small index is read in this one
#: read (its summary then comes from these bytes), a large one's header.
FIRST_READ = 16 * 2**10
#: Values of the summary fewer than this many bytes apart are read in one range.
MERGE_GAP = 4 * 2**10
#: Ranges of the summary one store call reads.
RANGES_PER_READ = 4096


class IndexBytes:
    """Reads of a few values of one ``.idx`` at open: those in the first bytes (read once)
    come from them; the rest in ranges, neighbours less than :data:`MERGE_GAP` apart merged."""

    def __init__(self, store: Store, url: str, first: bytes, *, cache: Store) -> None:
        self.store, self.url, self.first = store, url, np.frombuffer(first, dtype=np.uint8)
        #: The store the dataset is opened through (a :class:`CachedStore` with ``cache=``).
        self.cached = cache

    async def values(self, at: npt.NDArray[np.int64], dtype: str) -> npt.NDArray[np.int64]:
        """The values of ``dtype`` at byte offsets ``at``."""
        size = np.dtype(dtype).itemsize
        at = np.asarray(at, dtype=np.int64)
        out = np.empty(at.size * size, dtype=np.uint8).reshape(-1, size)
        inside = at + size <= self.first.size
        if inside.any():
            out[inside] = self.first[at[inside, None] + np.arange(size)]
        unique, back = np.unique(at[~inside], return_inverse=True)
        if unique.size:
            cut = np.flatnonzero(unique[1:] - (unique[:-1] + size) >= MERGE_GAP) + 1
            firsts = unique[np.concatenate([[0], cut])]
            lasts = unique[np.concatenate([cut - 1, [unique.size - 1]])] + size
            sizes = lasts - firsts
            base = np.cumsum(sizes) - sizes
            joined = np.empty(int(sizes.sum()), dtype=np.uint8)
            view = memoryview(joined)  # type: ignore[arg-type]
            # A bounded number of ranges a call: the per-range objects of a store's read
            # (here and below) cost ~400 bytes each, 100 MB for the 244 k pages of 10^9.
            for at_range in range(0, firsts.size, RANGES_PER_READ):
                chunk = slice(at_range, at_range + RANGES_PER_READ)
                await self.store.read_ranges(
                    self.url,
                    starts=firsts[chunk].tolist(),
                    ends=lasts[chunk].tolist(),
                    buffers=[
                        view[b : b + n]
                        for b, n in zip(base[chunk].tolist(), sizes[chunk].tolist(), strict=True)
                    ],
                )
            group = np.searchsorted(firsts, unique, side="right") - 1
            where = base[group] + unique - firsts[group]
            out[~inside] = joined[where[:, None] + np.arange(size)][back.reshape(-1)]
        values: npt.NDArray[np.int64] = out.reshape(-1).view(dtype).astype(np.int64)
        return values


async def summary(
    reader: IndexBytes, layout: IndexLayout, info: ObjectInfo, unit: str
) -> dict[str, npt.NDArray[np.int64]]:
    """The page summary of ``layout``'s index (see the module docstring): from the node
    cache where a process of this node kept it, else read and checked, then kept there."""
    store = reader.cached
    cache = store.cache if isinstance(store, CachedStore) else None
    if cache is None or info.version is None:
        return await read_summary(reader, layout, unit)
    key = f"{layout.url}{CACHED_SUMMARY}-{unit}-{layout.page}"
    directory = cache.object_dir(key, info.version)
    arrays = await asyncio.to_thread(_cached_summary, cache, directory, unit)
    if arrays is not None:
        return arrays
    arrays = await read_summary(reader, layout, unit)
    packed = np.concatenate(
        [[arrays[SEQUENCE_PAGES].size], arrays[SEQUENCE_PAGES], arrays.get(DOCUMENT_PAGES, [])]
    ).astype("<i8")
    entry = {0: memoryview(packed.nbytes.to_bytes(8, "little")), 1: memoryview(packed.tobytes())}
    await asyncio.to_thread(cache.store, directory, entry)
    return arrays


def _cached_summary(
    cache: DiskCache, directory: str, unit: str
) -> dict[str, npt.NDArray[np.int64]] | None:
    """The summary kept in ``directory`` (block 0: its length; block 1: the sequence pages'
    count, then the arrays), or None."""
    length = bytearray(8)
    if not cache.read(directory, [(0, 8, [(0, 8, memoryview(length), 0)])]):
        return None
    size = int.from_bytes(length, "little")
    data = bytearray(size)
    if size < 8 or not cache.read(directory, [(1, size, [(0, size, memoryview(data), 0)])]):
        return None
    values = np.frombuffer(data, dtype="<i8").astype(np.int64)
    count = int(values[0])
    if not 0 < count < values.size:
        return None
    arrays = {SEQUENCE_PAGES: values[1 : 1 + count]}
    if unit == "document":
        arrays[DOCUMENT_PAGES] = values[1 + count :]
    return arrays


async def read_summary(
    reader: IndexBytes, layout: IndexLayout, unit: str
) -> dict[str, npt.NDArray[np.int64]]:
    """Read and check the summary: per page the element offset of its first entry, then the
    end of the last sequence (in elements)."""
    url, itemsize = layout.url, layout.dtype.itemsize
    sequences, entries = layout.sequences, layout.entries
    pages = layout.pages(sequences)
    firsts = np.arange(pages, dtype=np.int64) * layout.page
    last = sequences - 1
    at = np.concatenate(
        [
            layout.pointers_at + 8 * np.append(firsts, max(last, 0)),
            layout.documents_at + 8 * np.array([0, entries - 1], dtype=np.int64),
        ]
    )
    values = await reader.values(at if sequences else at[-2:], "<i8")
    values, documents = values[:-2], values[-2:]
    if documents[0] != 0 or documents[1] != sequences:
        raise FormatError(
            f"{url}: bytes [{layout.documents_at}, {layout.size}): document indices run from"
            f" {documents[0]} to {documents[1]}, not from 0 up to the {sequences} sequences"
        )
    if sequences == 0:
        sequence_pages = np.zeros(1, dtype=np.int64)
    else:
        (length,) = await reader.values(
            np.array([layout.lengths_at + 4 * last], dtype=np.int64), "<i4"
        )
        if length < 0:
            start = layout.lengths_at + 4 * last
            raise FormatError(
                f"{url}: bytes [{start}, {start + 4}): sequence {last} has length {length}"
            )
        pointers = values[:-1]
        end = int(values[-1]) + int(length) * itemsize
        sequence_pages = check_pointers(
            np.append(pointers, end), np.append(firsts, sequences), layout
        )
    arrays = {SEQUENCE_PAGES: sequence_pages}
    if unit == "document":
        arrays[DOCUMENT_PAGES] = await document_summary(reader, layout, sequence_pages)
    return arrays


def check_pointers(
    pointers: npt.NDArray[np.int64], sequence: npt.NDArray[np.int64], layout: IndexLayout
) -> npt.NDArray[np.int64]:
    """``pointers`` (bytes in the ``.bin``, of sequences ``sequence``; the last may be the
    end) as element offsets, once checked: the first 0, never decreasing, whole elements."""
    itemsize = layout.dtype.itemsize
    at = layout.pointers_at + 8 * np.minimum(sequence, max(layout.sequences - 1, 0))
    bad = np.flatnonzero(
        (pointers % itemsize != 0)
        | (np.diff(pointers, prepend=0) < 0)
        | ((sequence == 0) & (pointers != 0))
    )
    if bad.size:
        i = int(bad[0])
        raise FormatError(
            f"{layout.url}: bytes [{at[i]}, {at[i] + 8}): sequence {sequence[i]} points at byte"
            f" {pointers[i]} of the .bin (pointers start at 0, never decrease and fall on"
            f" whole {itemsize}-byte elements)"
        )
    offsets: npt.NDArray[np.int64] = pointers // itemsize
    return offsets


async def document_summary(
    reader: IndexBytes, layout: IndexLayout, sequence_pages: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Per document page the element offset of its first document, then the end."""
    documents = layout.entries - 1
    firsts = np.arange(layout.pages(documents), dtype=np.int64) * layout.page
    starts = await reader.values(layout.documents_at + 8 * firsts, "<i8")
    bad = np.flatnonzero(
        (starts < 0) | (starts > layout.sequences) | (np.diff(starts, prepend=0) < 0)
    )
    if bad.size:
        i = int(bad[0])
        at = layout.documents_at + 8 * int(firsts[i])
        raise FormatError(
            f"{layout.url}: bytes [{at}, {at + 8}): document {firsts[i]} starts at sequence"
            f" {starts[i]}, out of order in the {layout.sequences} sequences"
        )
    inner = starts < layout.sequences
    pointers = await reader.values(layout.pointers_at + 8 * starts[inner], "<i8")
    offsets = np.full(starts.size, sequence_pages[-1], dtype=np.int64)
    offsets[inner] = check_pointers(pointers, starts[inner], layout)
    return np.append(offsets, sequence_pages[-1])


async def probe_megatron(url: str, store: Store) -> bool:
    """Whether a ``.idx`` sits at ``url``'s prefix."""
    try:
        await store.size(f"{megatron_prefix(url)}.idx")
    except NotFoundError:
        return False
    return True


MEGATRON_OPENER = Opener(
    FORMAT,
    open_megatron,
    claims=lambda url: url.rstrip("/").endswith((".bin", ".idx")),
    probe=probe_megatron,
    probes_for="no Megatron .idx beside it",
)
