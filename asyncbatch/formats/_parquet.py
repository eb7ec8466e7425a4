"""Parquet datasets, read the Reimu way: footers only at open, row groups as the unit read,
only the columns asked for, decoded by pyarrow from bytes the engine fetched.

Opening reads each file's footer and nothing else: one request for its last
:data:`FOOTER_PROBE` bytes that also tells its size (a second read when the footer is
larger), every file at once. Where the listing told the sizes (S3), that request is a
plain range.
A dataset is a ``Manifest("parquet")`` with one shard per file (its elements: its rows) and, in
``Dataset.arrays``, per row group (numbered through the files): its rows, its file, its
number in the file, and the byte range of every leaf column chunk; the footers themselves are
kept so that decoding never reads them again. A sample is a row: sample ``i`` is found by
``np.searchsorted`` over the cumulative row counts, never by a per-row table.

Reading a group of batches plans one byte range per selected column chunk of each row group
it touches (coalesced, retried, pinned, cached and counted like every read), then pyarrow
decodes those row groups from the fetched bytes (:class:`KnownRanges` stands in for the
file, as fsspec's ``parquet`` module does) in the decode thread; pyarrow drops the GIL. Under
an exact shuffle (``scattered``), rows of row groups whose chunks have an offset index are
read page by page instead (:mod:`~asyncbatch.formats._parquet_pages`).

Fields follow the Arrow type: a number is a tensor ``[B]``, a fixed-size list of numbers
``[B, L]``, a list of numbers a :class:`~asyncbatch._batch.Jagged` column, a string or binary
column a :class:`~asyncbatch._batch.Strings` column; a struct column is its leaves, one field
and one column chunk each (a Hugging Face ``Image`` / ``Audio`` struct: its bytes), as
:mod:`~asyncbatch.formats._arrow_fields` names them. A null is a FormatError naming the file,
row group and column, unless the dataset was opened with ``options={"nulls": "fill"}``
(numbers read 0, or NaN when floating; lists and strings read empty). With ``seq_len``,
:class:`PackedParquet` packs a token list column into windows as the documents format does
(empty and null documents hold no tokens).
"""

from __future__ import annotations

import asyncio
import bisect
import fnmatch
import io
import re
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema, Jagged, Strings
from .._checksums import digest, format_digest
from .._dataset import Dataset
from .._errors import ConfigError, FormatError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import Manifest, ShardInfo
from ..stores._base import ListsInfo, ObjectInfo, Store, fetch_tail, tail_by_stat
from ._arrow_fields import (
    Field,
    StoredByPath,
    field_array,
    fields_of,
    media_bytes,
    path_name,
    stored_by_path,
    with_media,
)
from ._base import Fetch, OffLoop, Opener, Read, Step, natural_key
from ._documents import boundaries
from ._npy import gather_limited, may_list, parent_and_name, read_range
from ._parquet_pages import PageReader
from ._tokens import TOKENS_FIELD

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

Int64Array = npt.NDArray[np.int64]

FORMAT = "parquet"
SUFFIX = ".parquet"
MAGIC = b"PAR1"
#: Bytes read from the end of every file at open; a footer this size or less needs no more.
FOOTER_PROBE = 64 << 10
#: open_dataset's options for Parquet.
OPTIONS = ("columns", "nulls")
NULLS = ("error", "fill")
_GLOB = re.compile(r"[*?\[]")
# Dataset.arrays keys.
ROWS, FILE, LOCAL, RANGES, RAW = "rg_rows", "rg_file", "rg_local", "rg_ranges", "rg_raw_bytes"
#: Values of each column chunk (a list column's items, when no list is empty or null).
VALUES = "rg_values"
FOOTERS, FOOTER_OFFSETS = "footers", "footer_offsets"


def pyarrow_modules() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or a ConfigError saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError(
            "Parquet and Arrow datasets need pyarrow: pip install 'asyncbatch[parquet]'"
        ) from exc
    return pyarrow, pyarrow.parquet


# ---------------------------------------------------------------------------------------------
# Finding the files


def claims(url: str) -> bool:
    """A ``.parquet`` URL, or a glob of them."""
    return url.rstrip("/").endswith(SUFFIX)


async def probe_parquet(url: str, store: Store) -> bool:
    """Whether ``url`` is a folder or prefix holding ``.parquet`` files (at any depth)."""
    return may_list(url) and bool(await _walk(store, url))


async def _walk(
    store: Store,
    url: str,
    known: dict[str, ObjectInfo] | None = None,
    suffixes: tuple[str, ...] = (SUFFIX,),
) -> list[str]:
    """``.parquet`` files (names ending in one of ``suffixes``) under ``url``, recursively
    (into names without a dot: folders;
    names starting with ``.`` or ``_``, such as ``_SUCCESS``, are skipped). A store whose
    listing tells sizes and versions (:class:`~asyncbatch.stores._base.ListsInfo`) puts
    them in ``known``: those files' footers are then read without a stat or a suffix."""
    try:
        if known is not None and isinstance(store, ListsInfo):
            entries = await store.list_info(url.rstrip("/"))
        else:
            entries = [(child, None) for child in await store.list(url.rstrip("/"))]
    except (NotFoundError, NotADirectoryError):
        return []
    files, folders = [], []
    for child, info in entries:
        name = child.rstrip("/").rpartition("/")[2]
        if child.rstrip("/") == url.rstrip("/") or name.startswith((".", "_")):
            continue
        if name.endswith(suffixes):
            files.append(child)
            if known is not None and info is not None:
                known[child] = info
        elif "." not in name and may_list(child + "/"):
            folders.append(child)
    for nested in await gather_limited(_walk(store, folder, known, suffixes) for folder in folders):
        files.extend(nested)
    return files


async def parquet_files(
    url: str,
    store: Store,
    known: dict[str, ObjectInfo] | None = None,
    suffixes: tuple[str, ...] = (SUFFIX,),
    format: str = FORMAT,
) -> tuple[str, list[str]]:
    """The dataset root and its files, in natural order: ``url`` itself, the files matching a
    glob, or every ``.parquet`` (name ending in one of ``suffixes``, of format ``format``)
    under a folder or prefix (sizes and versions the listing tells go in ``known``, see
    :func:`_walk`)."""
    url = url.rstrip("/")
    match = _GLOB.search(url)
    if match is None and url.endswith(suffixes):
        return parent_and_name(url)[0], [url]
    root = url[: match.start()].rpartition("/")[0] if match else url
    if not may_list(root + "/") or not may_list(url + "/"):
        raise ConfigError(
            f"{url}: this store cannot list a folder; name the files instead:"
            f" ab.open_dataset([url, ...], format={format!r})"
        )
    found = await _walk(store, root, known, suffixes)
    if match is not None:
        found = [u for u in found if fnmatch.fnmatchcase(u, url)]
    if not found:
        raise NotFoundError(f"no {' or '.join(suffixes)} files at {url}", url)
    return root, sorted(found, key=lambda u: natural_key(u[len(root) :]))


def common_root(urls: Sequence[str]) -> str:
    """The deepest folder holding every URL of a list."""
    parents = [parent_and_name(u)[0].split("/") for u in urls]
    shared = parents[0]
    for parts in parents[1:]:
        same = 0
        while same < min(len(shared), len(parts)) and shared[same] == parts[same]:
            same += 1
        shared = shared[:same]
    root = "/".join(shared)
    if not root or root.endswith(":/") or root.endswith(":"):
        raise ConfigError(f"the files {list(urls)[:3]}... share no folder or bucket")
    return root


# ---------------------------------------------------------------------------------------------
# Footers


async def read_footer(store: Store, url: str, info: ObjectInfo | None = None) -> bytes:
    """The Thrift footer of the Parquet file ``url`` followed by the file's size (8 bytes,
    little-endian), the form ``Dataset.arrays`` keeps: one tail read that also tells the size
    (:func:`~asyncbatch.stores._base.fetch_tail`; a plain range when ``info``, from a
    listing, tells it already), a second for a footer larger than it."""
    if info is None:
        tail, info = await fetch_tail(store, url, FOOTER_PROBE)
    else:
        tail, info = await tail_by_stat(store, url, FOOTER_PROBE, info)
    size = info.size
    if size < 12:
        raise FormatError(f"{url}: {size} bytes is too short for a Parquet file (12 at least)")
    if tail[-4:] != MAGIC:
        raise FormatError(
            f"{url}: not a Parquet file: its last 4 bytes are {bytes(tail[-4:])!r}, not"
            f" {MAGIC!r} (truncated, corrupt or encrypted)"
        )
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 12 > size:
        raise FormatError(
            f"{url}: its footer says {length} bytes, more than the file's {size} (truncated?)"
        )
    if length + 8 > len(tail):
        tail = await read_range(store, url, size - 8 - length, size - len(tail)) + tail
    return bytes(tail[-8 - length : -8]) + size.to_bytes(8, "little")


def parse_footer(footer: bytes, url: str) -> Any:
    """pyarrow's ``FileMetaData`` of a footer :func:`read_footer` returned."""
    pa, pq = pyarrow_modules()
    body = footer[:-8]
    framed = body + len(body).to_bytes(4, "little") + MAGIC
    try:
        return pq.read_metadata(pa.BufferReader(framed))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise FormatError(f"{url}: corrupt Parquet footer: {exc}") from exc


def footer_arrays(
    metadata: Any, leaves: Sequence[str], size: int, body: int, url: str
) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
    """Rows per row group, ``[row group, leaf, (start, end)]`` byte ranges of the column
    chunks, their decoded sizes and their value counts; every range must lie inside the
    file before its footer."""
    groups = metadata.num_row_groups
    rows = np.empty(groups, dtype=np.int64)
    ranges = np.zeros((groups, len(leaves), 2), dtype=np.int64)
    raw = np.zeros((groups, len(leaves)), dtype=np.int64)
    values = np.zeros((groups, len(leaves)), dtype=np.int64)
    for g in range(groups):
        group = metadata.row_group(g)
        rows[g] = group.num_rows
        for c in range(group.num_columns):
            chunk = group.column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            ranges[g, c] = start, start + chunk.total_compressed_size
            raw[g, c] = chunk.total_uncompressed_size
            values[g, c] = chunk.num_values
    end = size - 8 - body
    # An empty row group is never read (pyarrow writes an empty table as one at offset 0).
    outside = ((ranges[..., 0] < 4) | (ranges[..., 1] > end)).any(axis=1)
    bad = np.flatnonzero(outside & (rows > 0))
    if bad.size:
        g = int(bad[0])
        raise FormatError(
            f"{url}: row group {g} has column chunks outside bytes [4, {end}) of the file"
            " (truncated or corrupt)"
        )
    return rows, ranges, raw, values


async def open_parquet(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """A ``.parquet`` file, a folder or prefix of them, or a glob (reads only footers)."""
    known: dict[str, ObjectInfo] = {}
    root, urls = await parquet_files(url, store, known)
    return await _open_files(root, urls, store, storage_options, options, known)


async def open_parquet_list(
    urls: Sequence[str],
    store: Store,
    storage_options: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Dataset:
    """The Parquet files ``urls``, in the order given (reads only footers)."""
    return await _open_files(common_root(urls), list(urls), store, storage_options, options)


async def _open_files(
    root: str,
    urls: list[str],
    store: Store,
    storage_options: Mapping[str, Any],
    options: Mapping[str, Any],
    known: Mapping[str, ObjectInfo] | None = None,
) -> Dataset:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown options {unknown} for Parquet (known: {', '.join(OPTIONS)})")
    nulls = options.get("nulls", "error")
    if nulls not in NULLS:
        raise ConfigError(f"options nulls={nulls!r}: expected one of {NULLS}")
    pa, _ = pyarrow_modules()  # the ConfigError saying how to install it, before any read
    known = known or {}
    footers = await gather_limited(read_footer(store, u, known.get(u)) for u in urls)
    metas = await asyncio.to_thread(
        lambda: [parse_footer(f, u) for f, u in zip(footers, urls, strict=True)]
    )
    schema = metas[0].schema.to_arrow_schema()
    for file_url, meta in zip(urls, metas, strict=True):
        if not meta.schema.to_arrow_schema().equals(schema):
            raise FormatError(f"{file_url}: its columns differ from those of {urls[0]}")
    columns = list(options.get("columns") or schema.names)
    if not columns:
        raise ConfigError(f"options columns={columns!r}: the files hold {schema.names}")
    fields_of(schema, columns, pa)  # every name a column or a struct's child
    leaves = [metas[0].schema.column(c).path for c in range(len(metas[0].schema))]
    parts = [
        footer_arrays(meta, leaves, int.from_bytes(f[-8:], "little"), len(f) - 8, u)
        for meta, f, u in zip(metas, footers, urls, strict=True)
    ]
    rows = np.concatenate([p[0] for p in parts])
    counts = [p[0].size for p in parts]
    arrays = {
        ROWS: rows,
        FILE: np.repeat(np.arange(len(urls), dtype=np.int64), counts),
        LOCAL: np.concatenate([np.arange(n, dtype=np.int64) for n in counts]),
        RANGES: np.concatenate([p[1] for p in parts]).reshape(-1, len(leaves), 2),
        RAW: np.concatenate([p[2] for p in parts]).reshape(-1, len(leaves)),
        VALUES: np.concatenate([p[3] for p in parts]).reshape(-1, len(leaves)),
        FOOTERS: np.frombuffer(b"".join(footers), dtype=np.uint8),
        FOOTER_OFFSETS: np.cumsum([0, *(len(f) for f in footers)]).astype(np.int64),
    }
    prefix = root.rstrip("/") + "/"
    shards = tuple(
        ShardInfo(
            u[len(prefix) :] if u.startswith(prefix) else u,
            int.from_bytes(f[-8:], "little"),
            int(p[0].sum()),
        )
        for u, f, p in zip(urls, footers, parts, strict=True)
    )
    metadata = {
        "read_in_place": FORMAT,
        "columns": columns,
        "types": {name: str(schema.field(name).type) for name in schema.names},
        "leaves": leaves,
        "nulls": nulls,
        "row_groups": int(rows.size),
        # Footers hold every row group's size and statistics: two datasets of one shape
        # still differ here, so a resume state of one is refused on the other.
        "fingerprint": format_digest(digest(b"".join(footers))),
    }
    return Dataset(
        root, Manifest(FORMAT, np.dtype(np.uint8), shards, metadata), storage_options, arrays
    )


# ---------------------------------------------------------------------------------------------
# Reading


class KnownRanges(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges are at hand (the column
    chunks fetched); pyarrow reads nothing else of it, and anything else is a FormatError."""

    def __init__(self, url: str, size: int, starts: list[int], pieces: list[memoryview]) -> None:
        super().__init__()
        self.url, self.size = url, size
        self.starts, self.pieces = starts, pieces
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        at = self.position
        want = self.size - at if size is None or size < 0 else min(size, self.size - at)
        if want <= 0:
            return b""
        # pyarrow may read neighbouring column chunks in one call: join pieces that touch.
        i = bisect.bisect_right(self.starts, at) - 1
        parts, end = [], at
        while i >= 0 and i < len(self.starts) and end < at + want:
            offset = end - self.starts[i]
            if offset < 0 or offset >= len(self.pieces[i]):
                break
            part = self.pieces[i][offset : offset + at + want - end]
            parts.append(part)
            end += len(part)
            i += 1
        if end < at + want:
            raise FormatError(
                f"{self.url}: bytes [{at}, {at + want}) were read outside the column chunks"
                " fetched (a column chunk larger than its footer says?)"
            )
        self.position = end
        return b"".join(parts)


class ParquetRows:
    """Sample ``i`` is row ``i`` of the files one after another (of the datasets of a mixture
    one after another); fields are those of the selected columns (structs flattened,
    :mod:`~asyncbatch.formats._arrow_fields`), one column chunk (leaf) each."""

    #: Decoding runs in the engine's decode thread (pyarrow drops the GIL).
    converts = True

    def __init__(
        self,
        datasets: Sequence[Dataset],
        columns: Sequence[str] | None = None,
        nulls: str | None = None,
    ) -> None:
        self.datasets: Sequence[Dataset] = list(datasets)
        first = self.datasets[0].manifest.metadata
        selection = list(columns or first["columns"])
        self.types: dict[str, str] = dict(first["types"])
        for one in self.datasets[1:]:
            if one.manifest.metadata["types"] != self.types:
                raise ConfigError(f"{one.url} has other columns than {self.datasets[0].url}")
        self.nulls = nulls or first["nulls"]
        self.shard_urls: Sequence[str] = [u for d in self.datasets for u in d.shard_urls]
        pa, _ = pyarrow_modules()
        schema = parse_footer(self.footer(0), self.shard_urls[0]).schema.to_arrow_schema()
        fields = fields_of(schema, selection, pa)
        #: The batch fields, and their names, in the order selected.
        self.in_order = fields
        self.columns: list[str] = [f.name for f in fields]
        self.schema = with_media(
            {f.name: _field_schema(f.name, f.kind, pa) for f in fields}, fields, schema
        )
        leaves: list[str] = first["leaves"]
        at = []
        for f in fields:
            mine = [i for i, leaf in enumerate(leaves) if (leaf + ".").startswith(f.dotted + ".")]
            if len(mine) != 1:
                raise ConfigError(f"field {f.name!r} is {len(mine)} Parquet columns, not one")
            at.append(mine[0])
        order = np.argsort(at, kind="stable")
        #: The fields in the order of their leaves in the files (the chunks' order).
        self.fields: list[Field] = [fields[i] for i in order.tolist()]
        self.leaves = np.array(at, dtype=np.int64)[order]
        files = [len(d.manifest.shards) for d in self.datasets]
        self.shard_dataset = np.repeat(np.arange(len(files), dtype=np.int64), files)
        file_base = np.cumsum([0, *files])[:-1]
        self.rows = np.concatenate([d.arrays[ROWS] for d in self.datasets])
        self.rg_file = np.concatenate(
            [d.arrays[FILE] + b for d, b in zip(self.datasets, file_base.tolist(), strict=True)]
        )
        self.rg_local = np.concatenate([d.arrays[LOCAL] for d in self.datasets])
        self.ranges = np.concatenate([d.arrays[RANGES] for d in self.datasets])[:, self.leaves]
        raw = np.concatenate([d.arrays[RAW] for d in self.datasets])[:, self.leaves]
        self.ends = np.cumsum(self.rows)
        self.sizes = np.array([d.manifest.total_elements for d in self.datasets], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        sizes = [s.nbytes for d in self.datasets for s in d.manifest.shards]
        self.file_sizes = np.array(sizes, dtype=np.int64)
        self.file_map = ShardMap(self.file_sizes, 1)
        self.sample_bytes = max(1, int(raw.sum()) // max(1, self.num_samples))
        nonempty = self.rows[self.rows > 0]
        #: A block shuffle's blocks: a whole row group (the largest), as Reimu reads.
        self.default_block_size = int(nonempty.max()) if nonempty.size else 1
        #: Blocks start at row 0 every epoch, so equal row groups are whole blocks.
        self.aligned_blocks = True
        self._metadata: dict[int, Any] = {}
        #: Set by the loader under an exact shuffle: rows are then read page by page where
        #: the files have offset indexes (:mod:`~asyncbatch.formats._parquet_pages`).
        self.scattered = False
        self.pages = PageReader(self)
        #: The source of a media field's paths, made when a row without bytes needs them.
        self.path_sources: dict[str, ParquetRows] = {}
        #: What pyarrow is asked to read: each field's leaf by its dotted path.
        self.dotted = [f.dotted for f in self.fields]

    def footer(self, file: int) -> bytes:
        """File ``file``'s footer as :func:`read_footer` returned it."""
        for d in self.datasets:
            n = len(d.manifest.shards)
            if file < n:
                at = d.arrays[FOOTER_OFFSETS]
                return bytes(d.arrays[FOOTERS][at[file] : at[file + 1]])
            file -= n
        raise IndexError(file)

    def _file_metadata(self, file: int) -> Any:
        meta = self._metadata.get(file)
        if meta is None:
            meta = self._metadata[file] = parse_footer(self.footer(file), self.shard_urls[file])
        return meta

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        groups = np.searchsorted(self.ends, ids, side="right")
        in_group = ids - (self.ends - self.rows)[groups]
        paged = np.zeros(ids.size, dtype=bool)
        selection = None
        if self.scattered:
            # Rows of row groups whose every selected chunk has an offset index: by page.
            unique, at = np.unique(groups, return_inverse=True)
            chunks, footers = yield from self.pages.chunk_pages(unique)
            indexed = [
                all(chunks[g, j] is not None for j in range(self.leaves.size))
                for g in unique.tolist()
            ]
            paged = np.array(indexed, dtype=bool)[at.reshape(-1)]
            if paged.any():
                selection = self.pages.select(groups[paged], in_group[paged], chunks, footers)
        needed = np.unique(groups[~paged])
        spans, starts, lengths = self.chunk_ranges(needed)
        whole_bytes = int(lengths.sum())
        if selection is not None:
            starts = np.concatenate([starts, selection.starts])
            lengths = np.concatenate([lengths, selection.lengths])
        buffer = yield Read(self.file_map.plan(starts, lengths, gap))

        def decode() -> dict[str, Any] | StoredByPath:
            pa, _ = pyarrow_modules()
            parts: list[dict[str, Any]] = []
            if needed.size:
                table = self.decode_groups(buffer[:whole_bytes], needed, spans)
                whole = ~paged
                base = np.cumsum(self.rows[needed]) - self.rows[needed]
                rows = base[np.searchsorted(needed, groups[whole])] + in_group[whole]
                parts.append(field_arrays(table.take(pa.array(rows)), self.fields))
            if selection is not None:
                parts.append(self.pages.decode(buffer[whole_bytes:], selection))
            if len(parts) == 1:
                columns = parts[0]
            else:  # rows of both kinds: back in the order asked for
                order = pa.array(np.argsort(np.argsort(paged, kind="stable"), kind="stable"))
                columns = {
                    name: pa.concat_arrays([parts[0][name], parts[1][name]]).take(order)
                    for name in self.columns
                }
            return to_fields(columns, self.in_order, ids, self.nulls == "fill", pa)

        fields: dict[str, Any] | StoredByPath = yield OffLoop(decode)
        if isinstance(fields, StoredByPath):
            raise (yield from path_error(self, fields, gap))
        return fields

    def plan_groups(self, needed: Int64Array, gap: int) -> tuple[ReadPlan, Int64Array]:
        """The selected column chunks of row groups ``needed`` (ascending), one read plan;
        and the chunks' ``[row group, leaf, (start, end)]`` byte ranges."""
        spans, starts, lengths = self.chunk_ranges(needed)
        return self.file_map.plan(starts, lengths, gap), spans

    def chunk_ranges(self, needed: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The selected column chunks of row groups ``needed``: their ``[row group, leaf,
        (start, end)]`` byte ranges in the file, then their starts in file-concatenated
        positions and their lengths, flat."""
        spans = self.ranges[needed]
        starts = (spans[..., 0] + (self.file_map.starts[self.rg_file[needed]])[:, None]).ravel()
        return spans, starts, (spans[..., 1] - spans[..., 0]).ravel()

    def decode_groups(
        self, buffer: npt.NDArray[np.uint8], needed: Int64Array, spans: Int64Array
    ) -> Any:
        """The rows of row groups ``needed`` (ascending) as one Arrow table, decoded by pyarrow
        from the bytes :meth:`read_groups` fetched; nulls checked."""
        pa, pq = pyarrow_modules()
        view = memoryview(buffer)  # type: ignore[arg-type]
        lengths = (spans[..., 1] - spans[..., 0]).reshape(needed.size, -1)
        at = np.cumsum(lengths.ravel()) - lengths.ravel()
        tables = []
        files = self.rg_file[needed]
        for file in np.unique(files).tolist():
            mine = np.flatnonzero(files == file)
            chunk_at = at.reshape(needed.size, -1)[mine].ravel().tolist()
            chunk_start = spans[mine, :, 0].ravel().tolist()
            chunk_len = lengths[mine].ravel().tolist()
            order = np.argsort(chunk_start, kind="stable").tolist()
            known = KnownRanges(
                self.shard_urls[file],
                int(self.file_sizes[file]),
                [chunk_start[i] for i in order],
                [view[chunk_at[i] : chunk_at[i] + chunk_len[i]] for i in order],
            )
            local = self.rg_local[needed[mine]].tolist()
            try:
                reader = pq.ParquetFile(known, metadata=self._file_metadata(file), pre_buffer=False)
                table = reader.read_row_groups(local, columns=self.dotted, use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                raise FormatError(
                    f"{self.shard_urls[file]}: row groups {local} do not decode: {exc}"
                ) from exc
            self.check_nulls(table, file, needed[mine], pa)
            tables.append(table)
        return pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def check_nulls(
        self,
        table: Any,
        file: int,
        groups: Int64Array,
        pa: Any,
        fields: Sequence[Field] | None = None,
    ) -> None:
        """A null anywhere in a field of ``table`` (the rows of row groups ``groups`` of
        file ``file``, or some rows of one; a list's items too; of ``fields``, by default all)
        is a FormatError naming where, unless nulls are filled. A media field's null is a
        null struct (its rows without bytes are found later)."""
        if self.nulls == "fill":
            return
        for field in self.fields if fields is None else fields:
            if field.optional:
                continue
            name = field.name
            column = table.column(field.column)
            if field.path:  # a struct's child (the column's chunks joined: one file's rows)
                column = field_array(column.combine_chunks(), field)
            inner = column
            while (
                pa.types.is_list(inner.type)
                or pa.types.is_large_list(inner.type)
                or (pa.types.is_fixed_size_list(inner.type))
            ):
                if inner.null_count:
                    break
                if isinstance(inner, pa.ChunkedArray):
                    inner = inner.combine_chunks()
                inner = inner.flatten()
            if not inner.null_count:
                continue
            where = (
                self._null_group(column, groups, pa)
                if inner is column
                else f" row groups {self.rg_local[groups].tolist()}, items of"
            )
            raise FormatError(
                f"{self.shard_urls[file]}:{where} column {name!r} holds nulls; open with"
                " options={'nulls': 'fill'} to read them as 0 / NaN / empty"
            )

    def _null_group(self, column: Any, groups: Int64Array, pa: Any) -> str:
        nulls = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
        g = int(np.searchsorted(np.cumsum(self.rows[groups]), nulls[0], side="right"))
        return f" row group {int(self.rg_local[groups[g]])},"


def _field_schema(name: str, kind: Any, pa: Any) -> FieldSchema:
    """What a column of Arrow type ``kind`` becomes; a type asyncbatch cannot batch is a
    ConfigError naming the column."""
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return FieldSchema(dtype=str(kind.to_pandas_dtype()().dtype), shape=())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return FieldSchema(dtype="str", shape=(-1,), nested=True, tensor=False)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return FieldSchema(dtype="bytes", shape=(-1,), nested=True, tensor=False)
    item = getattr(kind, "value_type", None)
    if item is not None and (pa.types.is_integer(item) or pa.types.is_floating(item)):
        dtype = str(item.to_pandas_dtype()().dtype)
        if pa.types.is_fixed_size_list(kind):
            return FieldSchema(dtype=dtype, shape=(kind.list_size,))
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            return FieldSchema(dtype=dtype, shape=(-1,), nested=True)
    raise ConfigError(
        f"column {name!r} has Arrow type {kind}; asyncbatch batches numbers, (fixed-size)"
        " lists of numbers, strings and binary, and structs of them: leave it out with"
        " options={'columns': [...]}"
    )


def _numbers(array: Any) -> torch.Tensor:
    import torch

    return torch.from_numpy(array.to_numpy(zero_copy_only=False, writable=True))


def _filled(array: Any, pa: Any) -> Any:
    """``array`` with nulls read as 0 (NaN when floating, False), or empty."""
    kind = array.type
    if pa.types.is_floating(kind):
        return array.fill_null(float("nan"))
    if pa.types.is_boolean(kind):
        return array.fill_null(False)
    if pa.types.is_integer(kind):
        return array.fill_null(0)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return array.fill_null("")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return array.fill_null(b"")
    if pa.types.is_fixed_size_list(kind):
        return array.fill_null(pa.scalar([0] * kind.list_size, kind))
    return array.fill_null(pa.scalar([], kind))


def _to_field(array: Any, fill: bool, pa: Any) -> Any:
    """The batch field of one column of the taken rows (a contiguous Arrow array)."""
    import torch

    kind = array.type
    if fill and array.null_count:
        array = _filled(array, pa)
    if pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind):
        array = array.cast(pa.large_binary())
    if pa.types.is_large_binary(array.type):
        _, offsets_buffer, data_buffer = array.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[
            array.offset : array.offset + len(array) + 1
        ]
        data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer else np.empty(0, np.uint8)
        data = np.array(data[offsets[0] : offsets[-1]])
        binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        return Strings(torch.from_numpy(data), torch.from_numpy(offsets - offsets[0]), binary)
    if pa.types.is_fixed_size_list(kind):
        values = array.flatten()
        if fill and values.null_count:
            values = values.fill_null(0)
        return _numbers(values).reshape(len(array), kind.list_size)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        offsets = np.asarray(array.offsets, dtype=np.int64)
        values = array.flatten()
        if fill and values.null_count:
            values = values.fill_null(0)
        return Jagged(_numbers(values), torch.from_numpy(offsets - offsets[0]))
    return _numbers(array)


def field_arrays(table: Any, fields: Sequence[Field]) -> dict[str, Any]:
    """Each field's array of ``table`` (:func:`~asyncbatch.formats._arrow_fields.field_array`:
    a media field's struct)."""
    return {f.name: field_array(table.column(f.column).combine_chunks(), f) for f in fields}


def to_fields(
    arrays: Mapping[str, Any], fields: Sequence[Field], ids: Int64Array, fill: bool, pa: Any
) -> dict[str, Any] | StoredByPath:
    """The batch fields of rows ``ids`` from their arrays (of :func:`field_arrays`), or the
    rows of the first media field that hold no bytes."""
    out = {}
    for field in fields:
        array = arrays[field.name]
        if field.media:
            array, bad = media_bytes(array)
            if bad is not None:
                return StoredByPath(field, ids[bad])
        out[field.name] = _to_field(array, fill or field.optional, pa)
    return out


def path_error(source: Any, rows: StoredByPath, gap: int) -> Generator[Step, Any, Exception]:
    """The FormatError of media rows without bytes, naming the first one's path, read for
    it by a source of that one field (Parquet: its column chunk or page alone)."""
    name = path_name(rows.field)
    paths = source.path_sources.get(name)
    if paths is None:
        paths = source.path_sources[name] = type(source)(source.datasets, [name], nulls="fill")
        paths.scattered = source.scattered
    first = rows.ids[:1]
    read = yield from paths.fetch(first, gap)
    url, row = row_in_file(source, int(first[0]))
    return stored_by_path(url, row, rows.field, read[name].to_pylist()[0], rows.ids.size - 1)


def row_in_file(source: Any, sample: int) -> tuple[str, int]:
    """The file of sample ``sample`` of a source of row blocks (Parquet row groups, Arrow
    record batches) and its row there."""
    block = int(np.searchsorted(source.ends, sample, side="right"))
    file = int(source.rg_file[block])
    first = int(np.searchsorted(source.rg_file, file))
    return source.shard_urls[file], sample - int(source.ends[first] - source.rows[first])


class RowGroups(Protocol):
    """What :class:`PackedParquet` reads through: blocks of rows (Parquet row groups, Arrow
    record batches) of one list column, read and decoded whole."""

    datasets: Sequence[Dataset]
    shard_urls: Sequence[str]
    shard_dataset: Int64Array
    schema: dict[str, FieldSchema]
    #: Rows, file, number in the file and cumulative row ends of every block.
    rows: Int64Array
    rg_file: Int64Array
    rg_local: Int64Array
    ends: Int64Array
    #: The column's leaf (its index among the format's leaves).
    leaves: Int64Array

    def plan_groups(self, needed: Int64Array, gap: int) -> tuple[ReadPlan, Int64Array]: ...

    def decode_groups(
        self, buffer: npt.NDArray[np.uint8], needed: Int64Array, spans: Int64Array
    ) -> Any: ...


class PackedParquet:
    """Token windows over a list column's documents one after another, with the documents'
    boundaries inside each (``cu_seqlens``, ``document_ids``, ``position_ids``), exactly as
    :class:`~asyncbatch.formats._documents.PackedDocuments` gives them (the same
    :func:`~asyncbatch.formats._documents.boundaries`).

    The tokens of each row group come from its footer: the column chunk's value count less its
    null count (an empty or a null document is one level entry and no token), so window ``i``
    maps to its row groups by ``np.searchsorted`` with no scan. Empty and null documents (the
    latter with ``nulls="fill"``) hold no tokens and are passed over; documents are numbered by
    row. Each row group read is checked against its count: a chunk without statistics is
    taken to hold no empty or null document, and a FormatError says so when it does. Several
    datasets (a mixture) are packed each on its own: no window crosses from one to the next.
    """

    converts = True

    def __init__(
        self,
        datasets: Sequence[Dataset],
        seq_len: int,
        *,
        next_token: bool = False,
        column: str | None = None,
        token_ids: bool = True,
    ) -> None:
        if not isinstance(token_ids, bool):
            raise ConfigError(f"format_options token_ids must be True or False, got {token_ids!r}")
        dataset = datasets[0]
        metadata = dataset.manifest.metadata
        lists = [
            name
            for name in metadata["columns"]
            if metadata["types"][name].startswith(("list<", "large_list<"))
        ]
        if column is None:
            if len(lists) != 1:
                raise ConfigError(
                    f"{dataset.url}: seq_len= packs one list column of tokens; name it with"
                    f" format_options={{'column': ...}} (list columns: {lists})"
                )
            column = lists[0]
        if column not in metadata["types"]:
            raise ConfigError(
                f"format_options column={column!r}: the files hold {list(metadata['types'])}"
            )
        self.rows: RowGroups = self.row_groups(datasets, column)
        kind = self.rows.schema[column]
        if not kind.nested or kind.dtype.startswith("float"):
            raise ConfigError(
                f"column {column!r} ({metadata['types'][column]}) is not a list of integer tokens"
            )
        self.column, self.token_ids = column, token_ids
        self.datasets, self.shard_urls = self.rows.datasets, self.rows.shard_urls
        self.shard_dataset = self.rows.shard_dataset
        (leaf,) = self.rows.leaves.tolist()
        self.tokens, self.counted = self._token_counts(leaf)
        self.token_ends = np.cumsum(self.tokens)
        # Each dataset's tokens form its own stream; its windows start where it starts.
        group_dataset = self.shard_dataset[self.rows.rg_file]
        totals = np.bincount(group_dataset, self.tokens, len(self.datasets)).astype(np.int64)
        self.seq_len, self.window = seq_len, seq_len + int(next_token)
        self.sizes = np.maximum(0, totals - int(next_token)) // seq_len
        self.num_samples = int(self.sizes.sum())
        self._id_ends = np.cumsum(self.sizes)
        self._token_base = np.cumsum(totals) - totals
        itemsize = np.dtype(kind.dtype).itemsize
        self.sample_bytes = self.window * itemsize + 8 + (self.window * 16 if token_ids else 0)
        per_group = self.tokens[self.tokens > 0]
        #: A block shuffle's blocks: about one row group of windows.
        self.default_block_size = (
            max(1, int(np.median(per_group)) // seq_len) if per_group.size else 1
        )
        self.schema = {
            TOKENS_FIELD: FieldSchema(dtype=kind.dtype, shape=(self.window,)),
            "cu_seqlens": FieldSchema(dtype="int32", shape=(-1,), nested=True),
        }
        if token_ids:
            self.schema["document_ids"] = FieldSchema(dtype="int64", shape=(self.window,))
            self.schema["position_ids"] = FieldSchema(dtype="int64", shape=(self.window,))

    def row_groups(self, datasets: Sequence[Dataset], column: str) -> RowGroups:
        """The rows read, of the one column packed (another format's packer overrides it)."""
        return ParquetRows(datasets, [column])

    def _token_counts(self, leaf: int) -> tuple[Int64Array, npt.NDArray[np.bool_]]:
        """Tokens of every row group (value count less null count, from the footers), and
        whether its footer had the null count (else its value count stands, unchecked)."""
        rows = self.rows
        assert isinstance(rows, ParquetRows)
        values = np.concatenate([d.arrays[VALUES][:, leaf] for d in self.datasets])
        nulls = np.zeros_like(values)
        counted = np.ones(values.shape, dtype=np.bool_)
        files, local = rows.rg_file.tolist(), rows.rg_local.tolist()
        for at, (file, g) in enumerate(zip(files, local, strict=True)):
            stats = rows._file_metadata(file).row_group(g).column(leaf).statistics
            if stats is not None and stats.has_null_count:
                nulls[at] = stats.null_count
            else:
                counted[at] = False
        return values - nulls, counted

    def window_starts(self, ids: Int64Array) -> Int64Array:
        """Token (of the row groups one after another) where each window starts."""
        which = np.searchsorted(self._id_ends, ids, side="right")
        local = ids - (self._id_ends - self.sizes)[which]
        starts: Int64Array = self._token_base[which] + local * self.seq_len
        return starts

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        starts = self.window_starts(ids)
        first = np.searchsorted(self.token_ends, starts, side="right")
        last = np.searchsorted(self.token_ends, starts + self.window - 1, side="right")
        # Every row group from each window's first to its last.
        spans = last - first + 1
        needed = np.unique(
            np.repeat(first, spans)
            + np.arange(int(spans.sum()))
            - np.repeat(np.cumsum(spans) - spans, spans)
        )
        plan, chunk_spans = self.rows.plan_groups(needed, gap)
        buffer = yield Read(plan)
        fields: dict[str, Any] = yield OffLoop(
            lambda: self._decode(buffer, chunk_spans, needed, starts)
        )
        return fields

    def _documents(self, table: Any, needed: Int64Array) -> tuple[Int64Array, Any]:
        """Offsets (from 0) and token values of the documents of row groups ``needed``, each
        row group's tokens checked against its footer's count."""
        pa, _ = pyarrow_modules()
        array = table.column(self.column).combine_chunks()
        if array.null_count:  # null documents (nulls="fill", else refused already): empty
            array = _filled(array, pa)
        values = array.flatten()
        rows = self.rows.rows[needed]
        offsets = np.asarray(array.offsets, dtype=np.int64)
        offsets = offsets - offsets[0]
        row_ends = np.cumsum(rows)
        counted = offsets[row_ends] - offsets[row_ends - rows]
        wrong = np.flatnonzero(counted != self.tokens[needed])
        if values.null_count or wrong.size:
            g = int(needed[wrong[0]]) if wrong.size else int(needed[0])
            where = (
                f"{self.shard_urls[self.rows.rg_file[g]]}: row group {self.rows.rg_local[g]},"
                f" column {self.column!r}"
            )
            if values.null_count:
                raise FormatError(
                    f"{where}: null tokens inside documents (row groups"
                    f" {self.rows.rg_local[needed].tolist()}); packing reads whole tokens only"
                )
            why = (
                "its footer has no null count for the column, so empty or null documents"
                " cannot be counted: packing needs statistics (pyarrow writes them by default)"
                if not self.counted[g]
                else "its footer's counts are wrong"
            )
            raise FormatError(
                f"{where}: {counted[wrong[0]]} tokens in its documents but"
                f" {self.tokens[g]} counted from its footer: {why}"
            )
        return offsets, values.to_numpy(zero_copy_only=False)

    def _decode(
        self,
        buffer: npt.NDArray[np.uint8],
        spans: Int64Array,
        needed: Int64Array,
        starts: Int64Array,
    ) -> dict[str, Any]:
        import torch

        table = self.rows.decode_groups(buffer, needed, spans)
        offsets, values = self._documents(table, needed)
        tokens, rows = self.tokens[needed], self.rows.rows[needed]
        row_ends = np.cumsum(rows)
        group_start = self.token_ends[needed] - tokens  # in the whole stream
        group_base = np.cumsum(tokens) - tokens  # in ``values``
        # Each window's tokens: a gather from the row groups decoded.
        at = starts[:, None] + np.arange(self.window)[None, :]
        which = np.searchsorted(self.token_ends[needed], at, side="right")
        window_tokens = values[at - group_start[which] + group_base[which]]
        # Document starts in stream positions (a gap between row groups not read is never
        # inside a window), then the end of the last. An empty document starts where the
        # next one does: it gets no token and no boundary of its own.
        row_group = np.repeat(np.arange(needed.size), rows)
        doc_starts = offsets[:-1] - group_base[row_group] + group_start[row_group]
        stream_offsets = np.append(doc_starts, group_start[-1] + tokens[-1])
        fields: dict[str, Any] = {TOKENS_FIELD: torch.from_numpy(window_tokens)}
        fields.update(boundaries(stream_offsets, starts, self.seq_len, self.window, self.token_ids))
        if self.token_ids:
            # Rows numbered through the dataset (the mixture): the document id of a row.
            first_row = (self.rows.ends - self.rows.rows)[needed]
            row_ids = np.append(
                first_row[row_group] + np.arange(row_group.size) - np.repeat(row_ends - rows, rows),
                -1,
            )
            fields["document_ids"] = torch.from_numpy(row_ids[fields["document_ids"].numpy()])
        return fields


def parquet_rows(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> ParquetRows | PackedParquet:
    """Source factory of the ``parquet`` format: rows as samples; with ``seq_len`` a token
    list column packed into windows (``format_options``: ``column``, ``token_ids``)."""
    if dtype is not None:
        raise ConfigError("dtype= does not apply to Parquet: fields keep their Arrow types")
    if seq_len is not None:
        unknown = sorted(set(options) - {"column", "token_ids"})
        if unknown:
            raise ConfigError(
                f"unknown format_options {unknown} for packed Parquet (known: column, token_ids)"
            )
        return PackedParquet(datasets, seq_len, next_token=next_token, **options)
    if options:
        raise ConfigError(
            f"Parquet rows take no format_options, got {sorted(options)}; choose columns and"
            " nulls with ab.open_dataset(..., options={'columns': [...], 'nulls': 'fill'})"
        )
    if next_token:
        raise ConfigError("next_token=True needs seq_len= (packing); a row is whole")
    return ParquetRows(datasets)


PARQUET_OPENER = Opener(
    FORMAT,
    open_parquet,
    claims=claims,
    probe=probe_parquet,
    probes_for="no .parquet files listed under it",
    open_many=open_parquet_list,
)
