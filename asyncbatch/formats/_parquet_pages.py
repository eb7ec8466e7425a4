"""Single rows of Parquet column chunks, read through their offset index: the page holding
a row (and the chunk's dictionary page), not the whole chunk.

Under an exact shuffle the rows of a batch lie in as many row groups as it has rows, and
reading each one's whole column chunks costs many MiB per row. A file written with a page
index (``pyarrow.parquet.write_table(..., write_page_index=True)``; Spark, DuckDB and
parquet-rs by default) has an *offset index* per column chunk, stored just before its
footer: every page's file offset, compressed size and first row, and pages start at row
boundaries. :class:`PageReader` reads a chunk's offset index the first time a read needs it
(through the engine, like every read) and keeps it in a bounded cache, then fetches only the
pages holding the rows asked for.

pyarrow decodes pages only inside a file, so each page is handed to it as a small file of its
own (:func:`page_file`): ``PAR1``, the dictionary page, the data page, then the file's footer
rewritten by field id (:mod:`~asyncbatch.formats._thrift`) to one row group of the page's rows
whose column chunk covers exactly those bytes (statistics and index fields dropped). pyarrow
makes no I/O of its own; data pages v1 and v2, any codec, dictionaries and nested lists decode
as in the whole file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .._errors import FormatError
from .._layout import ShardMap
from . import _thrift as thrift
from ._arrow_fields import Field, field_array
from ._base import OffLoop, Read, Step

Int64Array = npt.NDArray[np.int64]

#: Column chunks whose offset index is kept (a few hundred bytes each).
OFFSET_INDEX_CACHE = 16384
#: Files whose parsed footer is kept (the template of every page's footer).
FOOTER_CACHE = 256

# Thrift field ids of parquet.thrift.
_FILE_ROWS, _FILE_GROUPS, _FILE_CRYPTO = 3, 4, (8, 9)
_GROUP_COLUMNS, _GROUP_ROWS = 1, 3
_CHUNK_META, _CHUNK_OFFSET_INDEX, _CHUNK_OFFSET_INDEX_LENGTH = 3, 4, 5
_CHUNK_INDEXES = (4, 5, 6, 7, 8, 9)  # page indexes and encryption
_META_VALUES, _META_RAW, _META_SIZE, _META_DATA, _META_DICTIONARY = 5, 6, 7, 9, 11
_META_SLOTS = (_META_VALUES, _META_RAW, _META_SIZE, _META_DATA)
# Index page, statistics, bloom filter, size and geospatial statistics.
_META_DROPPED = (10, 12, 14, 15, 16, 17)
# What a chunk not read keeps: its type, encodings, path, codec and the slots' fields.
_META_KEPT = (1, 2, 3, 4, *_META_SLOTS)
#: The header of a list of one struct.
_ONE_STRUCT = bytes([(1 << 4) | thrift.STRUCT])
_HEADER_RAW, _HEADER_SIZE, _HEADER_V1, _HEADER_V2 = 2, 3, 5, 8
_DATA_PAGES = (0, 3)  # DATA_PAGE, DATA_PAGE_V2


@dataclass(frozen=True)
class ChunkPages:
    """The pages of one column chunk, from its offset index."""

    #: File offset and size of each page (its header included); pages that start no row
    #: are counted in the page before them.
    offsets: Int64Array
    sizes: Int64Array
    #: First row of each page in the row group, then the row group's rows.
    first_rows: Int64Array
    #: Byte range of the dictionary page; ``(0, 0)`` when the chunk has none.
    dictionary: tuple[int, int]
    #: The row group of a page's file (:func:`chunk_template`).
    template: thrift.Template


@dataclass(frozen=True)
class Footer:
    """A file's footer, parsed, and the footer of its pages' files (:func:`file_template`)."""

    parsed: thrift.Struct
    template: thrift.Template


@dataclass(frozen=True)
class PageSelection:
    """The pages a group of rows needs, per selected column: what to fetch and to decode."""

    #: Per column: the pages fetched, as (row group, page number, its pages, footer).
    pages: list[list[tuple[int, int, ChunkPages, Footer]]]
    #: Per column and requested row: the page holding it (index into ``pages``), its row there.
    which: list[Int64Array]
    local: list[Int64Array]
    #: Byte ranges fetched, in file-concatenated positions, in the order decoded.
    starts: Int64Array
    lengths: Int64Array


class RowGroups(Protocol):
    """What :class:`PageReader` reads of :class:`~asyncbatch.formats._parquet.ParquetRows`:
    per row group (numbered through the files) its rows, file, number in the file and the
    ``(start, end)`` byte ranges of its selected leaves' chunks."""

    #: The fields read, one leaf each, in the order of ``leaves``.
    fields: list[Field]
    #: The selected leaves' numbers in a row group's column chunks (one per field).
    leaves: Int64Array
    rows: Int64Array
    ends: Int64Array
    rg_file: Int64Array
    rg_local: Int64Array
    ranges: Int64Array
    shard_urls: Sequence[str]
    file_sizes: Int64Array
    file_map: ShardMap

    def footer(self, file: int) -> bytes: ...

    def check_nulls(
        self,
        table: Any,
        file: int,
        groups: Int64Array,
        pa: Any,
        fields: Sequence[Field] | None = None,
    ) -> None: ...


class PageReader:
    """Reads rows of :class:`RowGroups` page by page where its files have offset indexes;
    bounded caches of footers and offset indexes."""

    def __init__(self, rows: RowGroups) -> None:
        self.rows = rows
        self._footers: OrderedDict[int, Footer] = OrderedDict()
        #: ``(row group, selected leaf)`` → its pages, or None when it has no offset index.
        self._chunks: OrderedDict[tuple[int, int], ChunkPages | None] = OrderedDict()

    def chunk_pages(
        self, groups: Int64Array
    ) -> Generator[Step, Any, tuple[dict[tuple[int, int], ChunkPages | None], dict[int, Footer]]]:
        """The pages of every selected column chunk of row groups ``groups`` (unique), and
        the parsed footers of their files; reads the offset indexes not in the cache."""
        rows = self.rows
        leaves = range(rows.leaves.size)
        wanted = [(g, j) for g in groups.tolist() for j in leaves]
        found = {key: self._chunks[key] for key in wanted if key in self._chunks}
        for key in found:
            self._chunks.move_to_end(key)
        files = sorted({int(rows.rg_file[g]) for g in groups.tolist()})
        footers = {f: self._footers[f] for f in files if f in self._footers}
        unparsed = [f for f in files if f not in footers]
        if unparsed:
            parsed = yield OffLoop(lambda: [self._parse_footer(f) for f in unparsed])
            footers.update(zip(unparsed, parsed, strict=True))
            _keep(self._footers, dict(zip(unparsed, parsed, strict=True)), FOOTER_CACHE)
        for f in files:
            self._footers.move_to_end(f)
        missing = [key for key in wanted if key not in found]
        if not missing:
            return found, footers
        located: list[tuple[tuple[int, int], int, int]] = []
        for g, j in missing:
            chunk = self._chunk(footers[int(rows.rg_file[g])].parsed, g, j)
            at, length = chunk.get(_CHUNK_OFFSET_INDEX), chunk.get(_CHUNK_OFFSET_INDEX_LENGTH)
            if at is None or not length:
                found[g, j] = None
            else:
                located.append(((g, j), self._check_index_range(g, j, at, length), length))
        if located:
            starts = np.array([at for _, at, _ in located], dtype=np.int64)
            lengths = np.array([n for _, _, n in located], dtype=np.int64)
            buffer: npt.NDArray[np.uint8] = yield Read(rows.file_map.plan(starts, lengths, 0))
            cuts = np.cumsum(lengths) - lengths

            def parse_all() -> list[ChunkPages]:
                data = memoryview(buffer)  # type: ignore[arg-type]
                return [
                    self._parse_index(key, footers, data[c : c + n], at)
                    for (key, at, n), c in zip(located, cuts.tolist(), strict=True)
                ]

            parsed_pages = yield OffLoop(parse_all)
            found.update(zip((key for key, _, _ in located), parsed_pages, strict=True))
        _keep(self._chunks, {key: found[key] for key in missing}, OFFSET_INDEX_CACHE)
        return found, footers

    def select(
        self,
        groups: Int64Array,
        rows_in_group: Int64Array,
        chunks: dict[tuple[int, int], ChunkPages | None],
        footers: dict[int, Footer],
    ) -> PageSelection:
        """The pages holding rows ``rows_in_group`` of row groups ``groups`` (every one of
        whose column chunks has pages), per selected column."""
        rows = self.rows
        unique = np.unique(groups)
        ids = (rows.ends - rows.rows)[groups] + rows_in_group  # rows numbered through all
        pages, which, local, starts, lengths = [], [], [], [], []
        for j in range(rows.leaves.size):
            mine = [_pages(chunks[g, j]) for g in unique.tolist()]
            counts = [p.offsets.size for p in mine]
            firsts = np.concatenate(
                [
                    p.first_rows[:-1] + (rows.ends - rows.rows)[g]
                    for g, p in zip(unique.tolist(), mine, strict=True)
                ]
            )
            page = np.searchsorted(firsts, ids, side="right") - 1
            used, inverse = np.unique(page, return_inverse=True)
            group_of = np.repeat(unique, counts)[used]
            number = used - np.repeat(np.cumsum(counts) - counts, counts)[used]
            chosen = []
            for g, k in zip(group_of.tolist(), number.tolist(), strict=True):
                chunk = _pages(chunks[g, j])
                file = int(rows.rg_file[g])
                base = int(rows.file_map.starts[file])
                first, last = chunk.dictionary
                starts += [base + first, base + int(chunk.offsets[k])]
                lengths += [last - first, int(chunk.sizes[k])]
                chosen.append((g, k, chunk, footers[file]))
            pages.append(chosen)
            which.append(inverse.reshape(-1))
            local.append(ids - firsts[page])
        return PageSelection(
            pages,
            which,
            local,
            np.array(starts, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
        )

    def decode(self, buffer: npt.NDArray[np.uint8], selection: PageSelection) -> dict[str, Any]:
        """Each field's values of the rows selected, in their order (Arrow arrays, of
        :func:`~asyncbatch.formats._arrow_fields.field_array`), decoded by pyarrow page by
        page; nulls checked."""
        # Installed: the Parquet source checked it when it was made.
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self.rows
        data = memoryview(buffer)  # type: ignore[arg-type]
        cuts = (np.cumsum(selection.lengths) - selection.lengths).tolist()
        lengths = selection.lengths.tolist()
        columns: dict[str, Any] = {}
        piece = 0
        for j, field in enumerate(rows.fields):
            name = field.name
            arrays, bases = [], [0]
            for g, k, chunk, footer in selection.pages[j]:
                file = int(rows.rg_file[g])
                url = rows.shard_urls[file]
                where = (
                    f"{url}: row group {int(rows.rg_local[g])}, column {name!r}, page at bytes"
                    f" [{int(chunk.offsets[k])}, {int(chunk.offsets[k] + chunk.sizes[k])})"
                )
                dictionary = data[cuts[piece] : cuts[piece] + lengths[piece]]
                page = data[cuts[piece + 1] : cuts[piece + 1] + lengths[piece + 1]]
                piece += 2
                count = int(chunk.first_rows[k + 1] - chunk.first_rows[k])
                try:
                    framed = page_file(footer.template, chunk.template, dictionary, page, count)
                    table = pq.ParquetFile(pa.BufferReader(framed)).read_row_group(
                        0, columns=[field.dotted], use_threads=False
                    )
                except (pa.ArrowException, OSError, thrift.ThriftError) as exc:
                    raise FormatError(f"{where} does not decode: {exc}") from exc
                if table.num_rows != count:
                    raise FormatError(
                        f"{where}: {table.num_rows} rows decoded, {count} in its offset index"
                    )
                rows.check_nulls(table, file, np.array([g], dtype=np.int64), pa, [field])
                arrays.append(field_array(table.column(0).combine_chunks(), field))
                bases.append(bases[-1] + count)
            joined = pa.concat_arrays(arrays) if len(arrays) > 1 else arrays[0]
            at = np.asarray(bases[:-1], dtype=np.int64)[selection.which[j]] + selection.local[j]
            columns[name] = joined.take(pa.array(at))
        return columns

    def _parse_footer(self, file: int) -> Footer:
        url = self.rows.shard_urls[file]
        try:
            parsed = thrift.parse_all(self.rows.footer(file)[:-8], "footer")
            return Footer(parsed, file_template(parsed))
        except thrift.ThriftError as exc:
            raise FormatError(f"{url}: corrupt Parquet footer: {exc}") from exc

    def _chunk(self, footer: thrift.Struct, g: int, j: int) -> thrift.Struct:
        group = footer[_FILE_GROUPS].items[int(self.rows.rg_local[g])]
        chunk: thrift.Struct = group[_GROUP_COLUMNS].items[int(self.rows.leaves[j])]
        return chunk

    def _where(self, g: int, j: int) -> str:
        rows = self.rows
        return (
            f"{rows.shard_urls[int(rows.rg_file[g])]}: row group {int(rows.rg_local[g])},"
            f" column {rows.fields[j].name!r}"
        )

    def _check_index_range(self, g: int, j: int, at: int, length: int) -> int:
        """The offset index's position in the file-concatenated positions; it must lie in
        the file before its footer."""
        rows = self.rows
        file = int(rows.rg_file[g])
        end = int(rows.file_sizes[file]) - 8 - (len(rows.footer(file)) - 8)
        if at < 4 or length < 0 or at + length > end:
            raise FormatError(
                f"{self._where(g, j)}: its offset index at bytes [{at}, {at + length}) lies"
                f" outside bytes [4, {end}) of the file (corrupt footer)"
            )
        return int(rows.file_map.starts[file]) + at

    def _parse_index(
        self,
        key: tuple[int, int],
        footers: dict[int, Footer],
        data: memoryview,
        at: int,
    ) -> ChunkPages:
        """A column chunk's pages from its offset index, checked against its footer."""
        g, j = key
        rows = self.rows
        file = int(rows.rg_file[g])
        at -= int(rows.file_map.starts[file])
        where = f"{self._where(g, j)}: offset index at bytes [{at}, {at + len(data)})"
        try:
            locations = thrift.parse_all(data, "offset index")[1].items
            table = np.array([(p[1], p[2], p[3]) for p in locations], dtype=np.int64)
        except (thrift.ThriftError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"{where} is corrupt: {exc}") from exc
        footer = footers[file].parsed
        meta = self._chunk(footer, g, j)[_CHUNK_META]
        start, end = (int(x) for x in rows.ranges[g, j])
        group_rows = int(rows.rows[g])
        data_start = int(meta[_META_DATA])
        offsets, sizes, firsts = table.T if table.size else np.zeros((3, 0), np.int64)
        # Pages that start no row (an empty page a writer flushed) join the page before.
        new = np.flatnonzero(np.diff(firsts, prepend=-1) > 0)
        ends = offsets + sizes
        if (
            not table.size
            or firsts[0] != 0
            or (np.diff(firsts) < 0).any()
            or firsts[-1] >= group_rows
            or offsets[0] < data_start
            or (sizes <= 0).any()
            or (offsets[1:] < ends[:-1]).any()
            or ends[-1] > end
            # The pages of one run lie end to end.
            or (offsets[1:] != ends[:-1])[firsts[1:] == firsts[:-1]].any()
        ):
            raise FormatError(
                f"{where} is corrupt: its pages (offset, size, first row) {table[:4].tolist()}..."
                f" do not tile the chunk's bytes [{data_start}, {end}) and its {group_rows} rows"
            )
        dictionary = int(meta.get(_META_DICTIONARY) or 0)
        has_dictionary = start <= dictionary < data_start and dictionary > 0
        last = np.append(new[1:], firsts.size) - 1
        local, leaf = int(rows.rg_local[g]), int(rows.leaves[j])
        return ChunkPages(
            offsets[new],
            ends[last] - offsets[new],
            np.append(firsts[new], group_rows),
            (dictionary, data_start) if has_dictionary else (0, 0),
            chunk_template(footer, local, leaf, has_dictionary),
        )


def _pages(chunk: ChunkPages | None) -> ChunkPages:
    if chunk is None:
        raise AssertionError("a row group whose chunks have no offset index was paged")
    return chunk


def _keep(cache: OrderedDict[Any, Any], new: dict[Any, Any], bound: int) -> None:
    """Add ``new`` to an LRU ``cache`` holding at most ``bound`` entries."""
    cache.update(new)
    while len(cache) > bound:
        cache.popitem(last=False)


def _header(page: memoryview, what: str) -> tuple[thrift.Struct, int]:
    """A page's header and its length."""
    try:
        return thrift.parse(page)
    except thrift.ThriftError as exc:
        raise thrift.ThriftError(f"its {what} page header: {exc}") from exc


def file_template(footer: thrift.Struct) -> thrift.Template:
    """A file's footer with its row count and row groups left to fill (encryption dropped:
    pyarrow cannot read an encrypted file from bytes anyway)."""
    metadata = footer.copy(drop=_FILE_CRYPTO)
    metadata.set(_FILE_ROWS, thrift.I64, thrift.Slot(thrift.I64))
    metadata.set(_FILE_GROUPS, thrift.LIST, thrift.Slot(thrift.LIST))
    return thrift.Template(metadata)


def chunk_template(
    footer: thrift.Struct, group: int, leaf: int, dictionary: bool
) -> thrift.Template:
    """Row group ``group`` of ``footer`` as one page of leaf ``leaf`` makes it: that column
    chunk's values, sizes and first data page left to fill (its dictionary page, when it has
    one, at byte 4), then the row group's bytes and rows. Statistics and index fields are
    dropped, and every field of the other chunks that pyarrow does not read to open a file."""
    columns = []
    for column, chunk in enumerate(footer[_FILE_GROUPS].items[group][_GROUP_COLUMNS].items):
        meta = thrift.Struct()
        for field_id, (kind, value) in chunk[_CHUNK_META].fields.items():
            if column == leaf and field_id in _META_SLOTS:
                meta.set(field_id, kind, thrift.Slot(thrift.I64))
            elif field_id == _META_DICTIONARY:
                if column == leaf and dictionary:
                    meta.set(field_id, kind, 4)
            elif field_id not in _META_DROPPED and (column == leaf or field_id in _META_KEPT):
                meta.set(field_id, kind, value)
        stripped = chunk.copy(drop=_CHUNK_INDEXES)
        stripped.set(_CHUNK_META, thrift.STRUCT, meta)
        columns.append(stripped)
    row_group = thrift.Struct()
    row_group.set(_GROUP_COLUMNS, thrift.LIST, thrift.List(thrift.STRUCT, columns))
    row_group.set(2, thrift.I64, thrift.Slot(thrift.I64))
    row_group.set(_GROUP_ROWS, thrift.I64, thrift.Slot(thrift.I64))
    return thrift.Template(row_group)


def page_file(
    footer: thrift.Template,
    chunk: thrift.Template,
    dictionary: memoryview,
    page: memoryview,
    rows: int,
) -> bytes:
    """A Parquet file of one data page (and the dictionary page before it): ``PAR1``, the
    pages, the footer of :func:`file_template` filled with one row group of ``rows`` rows,
    :func:`chunk_template` filled to cover exactly those pages."""
    values = raw = at = 0
    kept = []
    while at < len(page):  # one page, and any that start no row after it
        header, header_length = _header(page[at:], "data")
        kind = header.get(1)
        body = header.get(_HEADER_V1) or header.get(_HEADER_V2)
        if kind not in _DATA_PAGES or body is None:
            raise thrift.ThriftError(f"the page at byte {at} is of type {kind}, not a data page")
        size = header_length + int(header[_HEADER_SIZE])
        if body[1]:  # pyarrow stops at a page of no values (a writer's flush): drop it
            values += int(body[1])
            raw += header_length + int(header[_HEADER_RAW])
            kept.append(page[at : at + size])
        at += size
    if at != len(page):
        raise thrift.ThriftError(f"its pages end at byte {at} of {len(page)}")
    pages = b"".join(kept)
    if len(dictionary):
        dictionary_header, dictionary_length = _header(dictionary, "dictionary")
        raw += dictionary_length + int(dictionary_header[_HEADER_RAW])
    # The chunk's slots in field order: values, raw size, size, first data page.
    group = chunk.fill(values, raw, len(dictionary) + len(pages), 4 + len(dictionary), raw, rows)
    encoded = footer.fill(rows, _ONE_STRUCT + group)
    return b"".join(
        (b"PAR1", dictionary, pages, encoded, len(encoded).to_bytes(4, "little"), b"PAR1")
    )
