"""Arrow IPC datasets read in place: Hugging Face ``save_to_disk`` folders and ``.arrow`` /
``.feather`` files, in either IPC layout (:mod:`~asyncbatch.formats._arrow_ipc`).

Opening reads message headers only, never a record batch's body on purpose. Every file
costs one tail request (:data:`TAIL_PROBE` bytes, which also tells its size); a file layout
(``ARROW1`` at its end) then has its footer, which locates every record batch's header: those
are read in one call (ranges of one file closer than the store's ``coalesce_gap`` merged).
A stream layout (what ``save_to_disk`` writes) is walked from byte 0: a first read of
:data:`HEAD_PROBE` bytes holds the schema and often several headers; a header past what is
at hand is read with :data:`HEADER_READ` bytes of read-ahead, from the end of the previous
body (the stream says where a header is only once the one before is parsed). A small file is
all in its tail: one request. Each file's walk is sans I/O (it yields the ranges it wants);
:func:`walk_files` runs the files' walks in rounds, each round's reads of all files in one
store call where the store takes a group (locally: one copy), else all at once. A
``save_to_disk`` folder is recognised by its ``state.json``,
which names the data files in order (so it opens over HTTP too, which cannot list).

A dataset is a ``Manifest("arrow")`` with one shard per file (its elements: its rows) and,
in ``Dataset.arrays``, per record batch (numbered through the files): its rows, file,
number in the file, where its body starts, its codec, and its headers' field nodes and
buffers; and the schema, serialized. A sample is a row, found by ``np.searchsorted`` over the
cumulative row counts.

Reading a group of batches fetches, of each record batch it touches, the byte range of each
field in the body (a column's buffers are contiguous, depth first; a struct column's fields
are its leaves, :mod:`~asyncbatch.formats._arrow_fields`, each read as its own buffers and
the validity of the structs above it). Under an exact
shuffle (``scattered``), and in any group that uses under 1 in :data:`SPARSE` of the rows of
the record batches it touches, rows of uncompressed record batches without nulls in the
selected columns are read one by one instead (:mod:`~asyncbatch.formats._arrow_rows`): the
bytes of the row in each buffer, offsets first. pyarrow builds the arrays from the fetched bytes
(``pyarrow.Array.from_buffers``, codecs by ``pyarrow.decompress``) and validates them fully,
so a corrupt body is a FormatError, never wrong rows; numbers, lists of numbers and strings
then reach the batch as tensors over those bytes (rows of whole record batches copied out in
one GIL-free call per column). Other fields, nulls and packing (``seq_len=``) are the Parquet
reader's (:mod:`~asyncbatch.formats._parquet`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._buffers import BufferPool
from .._checksums import digest, format_digest
from .._dataset import Dataset, join_url
from .._errors import ConfigError, FormatError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import Manifest, ShardInfo
from ..stores._base import ObjectInfo, Store, fetch_tail, tail_by_stat
from . import _arrow_ipc as ipc
from ._arrow_fields import Field, StoredByPath, field_array, fields_of, with_media
from ._arrow_rows import Column, RowPicker, gathered
from ._base import Fetch, OffLoop, Opener, Read
from ._npy import gather_limited, may_list, read_range
from ._parquet import (
    NULLS,
    PackedParquet,
    RowGroups,
    _field_schema,
    common_root,
    parquet_files,
    path_error,
    pyarrow_modules,
    to_fields,
)

Int64Array = npt.NDArray[np.int64]

FORMAT = "arrow"
SUFFIXES = (".arrow", ".feather")
#: What ``Dataset.save_to_disk`` writes beside its data files; it names them in order.
STATE = "state.json"
#: What ``DatasetDict.save_to_disk`` writes beside one folder per split.
DATASET_DICT = "dataset_dict.json"
#: Bytes read from the end of every file at open: a footer, or all of a small file.
TAIL_PROBE = 64 << 10
#: Bytes read from the start of a stream: its schema and the first headers.
HEAD_PROBE = 64 << 10
#: Bytes read at a stream's later headers (more when the last header was larger).
HEADER_READ = 4 << 10
#: A group that uses fewer than 1 in ``SPARSE`` of the rows of the record batches it touches
#: reads its rows one by one (where they can be) rather than those record batches whole.
SPARSE = 8
#: Bytes of free memory kept for the rows copied out of whole record batches.
GATHERED_KEPT = 64 << 20
#: open_dataset's options for Arrow.
OPTIONS = ("columns", "nulls")
# Dataset.arrays keys.
ROWS, FILE, LOCAL, BODY, CODEC = "rb_rows", "rb_file", "rb_local", "rb_body", "rb_codec"
NODES, BUFFERS, SCHEMA = "rb_nodes", "rb_buffers", "schema"


# ---------------------------------------------------------------------------------------------
# Finding the files


def claims(url: str) -> bool:
    """An ``.arrow`` / ``.feather`` URL, a glob of them, or a ``state.json``."""
    url = url.rstrip("/")
    return url.endswith(SUFFIXES) or url.endswith("/" + STATE)


async def _state_files(store: Store, root: str) -> list[str] | None:
    """The data files ``root/state.json`` names, in order; None when there is none."""
    url = join_url(root, STATE)
    try:
        text, info = await fetch_tail(store, url, 1 << 20)
    except (NotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if info.size > len(text):
        text = await read_range(store, url, 0, info.size)
    try:
        files = [entry["filename"] for entry in json.loads(bytes(text))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{url}: not a Hugging Face state.json ({exc!r})") from exc
    if not files or not all(isinstance(f, str) and f for f in files):
        raise FormatError(f"{url}: its _data_files name no files")
    return [join_url(root, name) for name in files]


async def probe_arrow(url: str, store: Store) -> bool:
    """Whether ``url`` is a ``save_to_disk`` folder or a folder holding ``.arrow`` /
    ``.feather`` files."""
    if await _state_files(store, url.rstrip("/")) is not None:
        return True
    if not may_list(url):
        return False
    try:
        await parquet_files(url, store, None, SUFFIXES, FORMAT)
    except (NotFoundError, ConfigError):
        return False
    return True


async def arrow_files(
    url: str, store: Store, known: dict[str, ObjectInfo]
) -> tuple[str, list[str]]:
    """The dataset root and its files: those ``state.json`` names, else as for Parquet."""
    url = url.rstrip("/")
    if url.endswith("/" + STATE):
        url = url[: -len(STATE) - 1]
    elif url.endswith(SUFFIXES) or any(c in url for c in "*?["):
        return await parquet_files(url, store, known, SUFFIXES, FORMAT)
    named = await _state_files(store, url)
    if named is not None:
        return url, named
    try:  # a DatasetDict's folder: its splits' files are not one dataset
        await store.size(join_url(url, DATASET_DICT))
    except (NotFoundError, NotADirectoryError, IsADirectoryError):
        pass
    else:
        raise ConfigError(
            f"{url} holds a DatasetDict ({DATASET_DICT}): open one split's folder, such as"
            f" {join_url(url, 'train')}"
        )
    return await parquet_files(url, store, known, SUFFIXES, FORMAT)


# ---------------------------------------------------------------------------------------------
# Headers


@dataclass(frozen=True)
class FileHeaders:
    """What opening read of one file: its size and version, its schema (a serialized schema
    message), where that came from (the schema message, or the file layout's footer), and
    its record batches' headers."""

    size: int
    version: str | None
    schema: bytes
    schema_at: int
    batches: list[ipc.Message]


#: What a file's walk yields: ranges ``(start, end)`` of its bytes, all wanted at once; it
#: gets their bytes back, in order.
Walk = Generator[list[tuple[int, int]], list[bytes], FileHeaders]


async def walk_files(store: Store, urls: Sequence[str], walks: list[Walk]) -> list[FileHeaders]:
    """Runs the walks of files ``urls`` together, in rounds: each round's ranges of every file
    in one store call where the store reads a group into one buffer (``supports_read_into``:
    the local store, one thread job or a copy in place), elsewhere one request per range,
    all at once; returns what each walk returned."""
    out: list[FileHeaders | None] = [None] * len(walks)
    wants: dict[int, list[tuple[int, int]]] = {}
    for k, walk in enumerate(walks):
        _advance(walk, k, None, wants, out)
    while wants:
        got = await _read_round(store, urls, wants)
        for k, data in got.items():
            _advance(walks[k], k, data, wants, out)
    assert all(headers is not None for headers in out)
    return [headers for headers in out if headers is not None]


def _advance(
    walk: Walk,
    k: int,
    value: Any,
    wants: dict[int, list[tuple[int, int]]],
    out: list[FileHeaders | None],
) -> None:
    """Walk ``k`` one step on (``value``: the bytes it asked for): what it wants next, or
    what it returned."""
    try:
        wants[k] = walk.send(value)
    except StopIteration as stop:
        wants.pop(k, None)
        out[k] = stop.value


async def _read_round(
    store: Store, urls: Sequence[str], wants: dict[int, list[tuple[int, int]]]
) -> dict[int, list[bytes]]:
    """The bytes of every file's wanted ranges."""
    order = list(wants)
    if not store.supports_read_into:
        reads = [read_range(store, urls[k], a, b) for k in order for a, b in wants[k]]
        flat = iter(await gather_limited(reads))
        return {k: [next(flat) for _ in wants[k]] for k in order}
    which = np.array([k for k in order for _ in wants[k]], dtype=np.int64)
    starts = np.array([a for k in order for a, _ in wants[k]], dtype=np.int64)
    ends = np.array([b for k in order for _, b in wants[k]], dtype=np.int64)
    offsets = np.cumsum(ends - starts) - (ends - starts)
    dest = np.empty(int((ends - starts).sum()), dtype=np.uint8)
    await store.read_into(urls, which, starts, ends, dest, offsets)
    data = dest.tobytes()
    pieces = iter(zip(offsets.tolist(), (ends - starts).tolist(), strict=True))
    return {k: [data[a : a + n] for a, n in itertools.islice(pieces, len(wants[k]))] for k in order}


class _Bytes:
    """The bytes of one file fetched so far (its tail, the last read-ahead window); a
    range not at hand is asked for (a step of the walk) with ``ahead`` bytes more."""

    def __init__(self, url: str, size: int, tail: bytes, gap: int) -> None:
        self.url, self.size, self.gap = url, size, gap
        self.held = [(size - len(tail), tail)]

    def at_hand(self, start: int, end: int) -> bytes | None:
        """The bytes ``[start, end)`` if fetched already (no step of the walk), else None."""
        for at, data in self.held:
            if at <= start and end <= at + len(data):
                return data[start - at : end - at]
        return None

    def get(self, start: int, end: int, ahead: int = 0) -> Generator[Any, Any, bytes]:
        held = self.at_hand(start, end)
        if held is not None:
            return held
        stop = min(self.size, max(end, start + ahead))
        (data,) = yield [(start, stop)]
        self.held[1:] = [(start, data)]
        return bytes(data[: end - start])


async def open_walks(
    store: Store, urls: Sequence[str], known: Mapping[str, ObjectInfo]
) -> list[Walk]:
    """The walk of each file's headers, from its tail (fetched here, all at once)."""

    async def tail(url: str) -> tuple[Any, ObjectInfo]:
        info = known.get(url)
        if info is None:
            return await fetch_tail(store, url, TAIL_PROBE)
        return await tail_by_stat(store, url, TAIL_PROBE, info)

    tails = await gather_limited(tail(url) for url in urls)
    return [
        walk_headers(url, info.size, info.version, bytes(data), store.coalesce_gap)
        for url, (data, info) in zip(urls, tails, strict=True)
    ]


def walk_headers(url: str, size: int, version: str | None, tail: bytes, gap: int) -> Walk:
    """The walk of one file's headers (sans I/O), given its last bytes ``tail``."""
    data = _Bytes(url, size, tail, gap)
    if size >= 2 * 8 + 4 and tail[-6:] == ipc.FILE_MAGIC:
        schema, footer, batches = yield from _file_layout(data, url, size)
        return FileHeaders(size, version, schema, footer, batches)
    return (yield from _stream_layout(data, url, size, version))


def _file_layout(
    data: _Bytes, url: str, size: int
) -> Generator[Any, Any, tuple[bytes, int, list[ipc.Message]]]:
    """The file layout's schema, the byte its footer starts at, its record batches' headers:
    the footer, then every header in one step."""
    pa, _ = pyarrow_modules()
    length = int.from_bytes((yield from data.get(size - 10, size - 6)), "little", signed=True)
    start = size - 10 - length
    if length <= 0 or start < 8:
        raise FormatError(f"{url}: its footer length {length} does not fit its {size} bytes")
    footer = yield from data.get(start, size - 10)
    blocks = ipc.parse_footer(footer, url, start)
    # pyarrow reads the schema (dictionaries' types too) from the footer alone.
    try:
        framed = footer + length.to_bytes(4, "little") + ipc.FILE_MAGIC
        schema = pa.ipc.open_file(pa.BufferReader(b"ARROW1\0\0" + framed)).schema
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise FormatError(f"{url}: corrupt footer at byte {start}: {exc}") from exc
    bad = [b for b in blocks if b[0] < 8 or b[1] < 8 or b[2] < 0 or b[0] + b[1] + b[2] > start]
    if bad:
        raise FormatError(
            f"{url}: a record batch at byte {bad[0][0]} ({bad[0][1]} + {bad[0][2]} bytes)"
            f" lies outside the data before its footer at byte {start} (truncated or corrupt)"
        )
    headers = yield from _read_blocks(data, [(b[0], b[0] + b[1]) for b in blocks])
    batches = []
    for (offset, _meta, body), header in zip(blocks, headers, strict=True):
        message = ipc.parse_message(header, offset, url)
        if message.kind != ipc.RECORD_BATCH or message.body_length != body:
            raise FormatError(
                f"{url}: the footer's record batch at byte {offset} is not one (type"
                f" {message.kind}, body {message.body_length} bytes, footer says {body})"
            )
        batches.append(message)
    return schema.serialize().to_pybytes(), start, batches


def _read_blocks(data: _Bytes, ranges: list[tuple[int, int]]) -> Generator[Any, Any, list[bytes]]:
    """Bytes of ``ranges`` of a file: those not at hand in one step, ranges closer than
    the store's ``coalesce_gap`` read as one."""
    out: list[bytes | None] = [None] * len(ranges)
    missing = []
    for k, (start, end) in enumerate(ranges):
        at, tail = data.held[0]
        if at <= start:
            out[k] = tail[start - at : end - at]
        else:
            missing.append(k)
    merged: list[list[int]] = []  # [start, end, first range, last range]
    for k in sorted(missing, key=lambda k: ranges[k]):
        start, end = ranges[k]
        if merged and start - merged[-1][1] <= data.gap:
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][3] = k
        else:
            merged.append([start, end, k, k])
    if merged:
        buffers = yield [(m[0], m[1]) for m in merged]
        which = 0
        for k in sorted(missing, key=lambda k: ranges[k]):
            while not merged[which][0] <= ranges[k][0] < merged[which][1]:
                which += 1
            base = merged[which][0]
            out[k] = bytes(buffers[which][ranges[k][0] - base : ranges[k][1] - base])
    return [b or b"" for b in out]


def _stream_layout(data: _Bytes, url: str, size: int, version: str | None) -> Walk:
    """The stream layout, walked header by header from byte 0."""
    if size < 8:
        raise FormatError(f"{url}: {size} bytes is too short for an Arrow IPC stream")
    head = yield from data.get(0, 8, HEAD_PROBE)
    if head[:6] == ipc.FILE_MAGIC:
        raise FormatError(
            f"{url}: starts as an Arrow file (ARROW1) but does not end with ARROW1 at byte"
            f" {size}: truncated or corrupt"
        )
    schema: bytes | None = None
    schema_at, batches, pos, ahead = 0, [], 0, HEADER_READ
    while pos < size:
        if pos + 8 > size:
            raise FormatError(f"{url}: a message at byte {pos} is cut off by the end at {size}")
        # Most headers are at hand (read ahead): taken without a generator's step.
        prefix = data.at_hand(pos, pos + 8) or (yield from data.get(pos, pos + 8, ahead))
        length = int.from_bytes(prefix[4:8], "little", signed=True)
        if prefix[:4] == ipc.CONTINUATION and length == 0:
            break  # the end-of-stream marker
        if prefix[:4] == ipc.CONTINUATION and pos + 8 + length > size:
            raise FormatError(
                f"{url}: the message at byte {pos} has {length} bytes of metadata, past the"
                f" file's end at {size} (truncated)"
            )
        end = pos + 8 + max(length, 0)
        header = data.at_hand(pos, end) or (yield from data.get(pos, end, ahead))
        message = ipc.parse_message(header, pos, url)
        if message.end > size:
            raise FormatError(
                f"{url}: the message at byte {pos} has a body to byte {message.end}, past the"
                f" file's end at {size} (truncated)"
            )
        if message.kind == ipc.SCHEMA and schema is None:
            schema, schema_at = header, pos
        elif schema is None or message.kind == ipc.SCHEMA:
            raise FormatError(f"{url}: the message at byte {pos} is out of place: one schema first")
        elif message.kind == ipc.RECORD_BATCH:
            batches.append(message)
        elif message.kind != ipc.DICTIONARY_BATCH:
            raise FormatError(f"{url}: the message at byte {pos} is of type {message.kind}")
        pos, ahead = message.end, max(HEADER_READ, 2 * message.metadata_length)
    else:
        # pyarrow would read such a stream to its last whole message: the rows past the cut
        # would be lost without a word.
        raise FormatError(
            f"{url}: the stream ends at byte {size} without its end-of-stream marker"
            " (ffffffff 00000000): cut at a message boundary, or written by a writer never"
            " closed; write it again"
        )
    if schema is None:
        raise FormatError(f"{url}: an Arrow IPC stream without a schema")
    return FileHeaders(size, version, schema, schema_at, batches)


def _schema(headers: FileHeaders, url: str) -> Any:
    pa, _ = pyarrow_modules()
    try:
        return pa.ipc.read_schema(pa.py_buffer(headers.schema))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise FormatError(f"{url}: corrupt schema at byte {headers.schema_at}: {exc}") from exc


def column_layout(schema: Any, url: str) -> list[tuple[int, int, int, int]]:
    """``(first node, end node, first buffer, end buffer)`` of every top-level column."""
    pa, _ = pyarrow_modules()
    out, nodes, buffers = [], 0, 0
    for field in schema:
        try:
            n, b = ipc.type_layout(field.type, pa, field.name)
        except FormatError as exc:
            raise FormatError(f"{url}: {exc}") from exc
        out.append((nodes, nodes + n, buffers, buffers + b))
        nodes, buffers = nodes + n, buffers + b
    return out


# ---------------------------------------------------------------------------------------------
# Opening


async def open_arrow(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """A ``save_to_disk`` folder, an ``.arrow`` / ``.feather`` file, a folder or prefix of
    them, or a glob (reads only headers)."""
    known: dict[str, ObjectInfo] = {}
    root, urls = await arrow_files(url, store, known)
    return await _open_files(root, urls, store, storage_options, options, known)


async def open_arrow_list(
    urls: Sequence[str],
    store: Store,
    storage_options: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Dataset:
    """The Arrow IPC files ``urls``, in the order given (reads only headers)."""
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
        raise ConfigError(f"unknown options {unknown} for Arrow (known: {', '.join(OPTIONS)})")
    nulls = options.get("nulls", "error")
    if nulls not in NULLS:
        raise ConfigError(f"options nulls={nulls!r}: expected one of {NULLS}")
    pa, _ = pyarrow_modules()
    known = known or {}
    files = await walk_files(store, urls, await open_walks(store, urls, known))
    # Schemas are small (and most are alike): parsed here, not worth a thread's hop.
    schemas = [_schema(f, u) for f, u in zip(files, urls, strict=True)]
    schema = schemas[0]
    for file_url, headers, other in zip(urls, files, schemas, strict=True):
        if not other.equals(schema, check_metadata=False):
            raise FormatError(
                f"{file_url}: its schema (at byte {headers.schema_at}) differs from that of"
                f" {urls[0]}: {other} against {schema}"
            )
    columns = list(options.get("columns") or schema.names)
    if not columns or len(set(columns)) != len(columns):
        raise ConfigError(f"options columns={columns!r}: the files hold {schema.names}")
    for name in dict.fromkeys(f.column for f in fields_of(schema, columns, pa)):
        if pa.types.is_dictionary(schema.field(name).type):
            raise FormatError(
                f"{urls[0]}: column {name!r} is dictionary-encoded (schema at byte"
                f" {files[0].schema_at}), which asyncbatch does not read; leave it out with"
                " options={'columns': [...]}"
            )
    layout = column_layout(schema, urls[0])
    num_nodes = layout[-1][1] if layout else 0
    num_buffers = layout[-1][3] if layout else 0
    tops = np.array([c[0] for c in layout], dtype=np.int64)
    for file_url, headers in zip(urls, files, strict=True):
        for message in headers.batches:
            if len(message.nodes) != 2 * num_nodes or len(message.buffers) != 2 * num_buffers:
                raise FormatError(
                    f"{file_url}: the record batch at byte {message.start} has"
                    f" {len(message.nodes) // 2} field nodes and {len(message.buffers) // 2}"
                    f" buffers; its schema has {num_nodes} and {num_buffers}"
                )
    batches = [m for f in files for m in f.batches]
    counts = [len(f.batches) for f in files]
    rows = np.array([m.rows for m in batches], dtype=np.int64)
    nodes = np.array([m.nodes for m in batches], dtype=np.int64).reshape(-1, num_nodes, 2)
    other = np.flatnonzero((nodes[:, tops, 0] != rows[:, None]).any(axis=1))
    if other.size:  # checked for all at once; the first named
        message = batches[int(other[0])]
        file_url = urls[int(np.searchsorted(np.cumsum(counts), other[0], side="right"))]
        raise FormatError(
            f"{file_url}: the record batch at byte {message.start} has columns of"
            f" other lengths than its {message.rows} rows"
        )
    arrays = {
        ROWS: rows,
        FILE: np.repeat(np.arange(len(urls), dtype=np.int64), counts),
        LOCAL: np.concatenate([np.arange(n, dtype=np.int64) for n in counts]),
        BODY: np.array([m.body_start for m in batches], dtype=np.int64),
        CODEC: np.array([m.codec for m in batches], dtype=np.int64),
        NODES: nodes,
        BUFFERS: np.array([m.buffers for m in batches], dtype=np.int64).reshape(-1, num_buffers, 2),
        SCHEMA: np.frombuffer(files[0].schema, dtype=np.uint8),
    }
    prefix = root.rstrip("/") + "/"
    shards = tuple(
        ShardInfo(
            u[len(prefix) :] if u.startswith(prefix) else u,
            f.size,
            sum(m.rows for m in f.batches),
        )
        for u, f in zip(urls, files, strict=True)
    )
    described = b"".join(
        np.array(
            [(m.start, m.rows, m.body_length, m.codec) for m in f.batches], dtype=np.int64
        ).tobytes()
        + f.size.to_bytes(8, "little")
        for f in files
    )
    metadata = {
        "read_in_place": FORMAT,
        "columns": columns,
        "types": {name: str(schema.field(name).type) for name in schema.names},
        "nulls": nulls,
        "record_batches": len(batches),
        # Headers tell no values: the files' versions (in Dataset.versions) tell them apart.
        "fingerprint": format_digest(digest(files[0].schema + described)),
    }
    return Dataset(
        root,
        Manifest(FORMAT, np.dtype(np.uint8), shards, metadata),
        storage_options,
        arrays,
        versions=tuple(f.version for f in files),
    )


# ---------------------------------------------------------------------------------------------
# Reading


class ArrowRows:
    """Sample ``i`` is row ``i`` of the files one after another (of the datasets of a mixture
    one after another); fields are the selected columns."""

    #: Decoding runs in the engine's decode thread (pyarrow drops the GIL).
    converts = True

    def __init__(
        self,
        datasets: Sequence[Dataset],
        columns: Sequence[str] | None = None,
        nulls: str | None = None,
    ) -> None:
        pa, _ = pyarrow_modules()
        self.datasets: Sequence[Dataset] = list(datasets)
        first = self.datasets[0].manifest.metadata
        self.types: dict[str, str] = dict(first["types"])
        for one in self.datasets[1:]:
            if one.manifest.metadata["types"] != self.types:
                raise ConfigError(f"{one.url} has other columns than {self.datasets[0].url}")
        self.nulls = nulls or first["nulls"]
        arrow_schema = pa.ipc.read_schema(pa.py_buffer(self.datasets[0].arrays[SCHEMA]))
        layout = dict(zip(arrow_schema.names, column_layout(arrow_schema, ""), strict=True))
        fields = fields_of(arrow_schema, list(columns or first["columns"]), pa)
        #: The batch fields' names, in the order selected.
        self.columns: list[str] = [f.name for f in fields]
        self.selected: Sequence[Column] = [
            leaf_column(f, arrow_schema.field(f.column).type, layout[f.column], pa) for f in fields
        ]
        self.fields = fields
        #: The source of a media field's paths, made when a row without bytes needs them.
        self.path_sources: dict[str, ArrowRows] = {}
        self.schema: dict[str, FieldSchema] = with_media(
            {c.name: _field_schema(c.name, c.kind, pa) for c in self.selected},
            fields,
            arrow_schema,
        )
        self.shard_urls: Sequence[str] = [u for d in self.datasets for u in d.shard_urls]
        files = [len(d.manifest.shards) for d in self.datasets]
        self.shard_dataset = np.repeat(np.arange(len(files), dtype=np.int64), files)
        file_base = np.cumsum([0, *files])[:-1]

        def joined(key: str) -> Any:
            return np.concatenate([d.arrays[key] for d in self.datasets])

        # Each dataset's field nodes and buffers in the first one's column order (a mixture's
        # datasets may hold the same columns in another order).
        nodes, buffers = [], []
        for one in self.datasets:
            own = pa.ipc.read_schema(pa.py_buffer(one.arrays[SCHEMA]))
            spans = dict(zip(own.names, column_layout(own, one.url), strict=True))
            ordered = [spans[name] for name in arrow_schema.names]
            nodes.append(one.arrays[NODES][:, [n for a, b, _, _ in ordered for n in range(a, b)]])
            buffers.append(one.arrays[BUFFERS][:, [k for *_, a, b in ordered for k in range(a, b)]])
        self.rows = joined(ROWS)
        self.rg_file = np.concatenate(
            [d.arrays[FILE] + b for d, b in zip(self.datasets, file_base.tolist(), strict=True)]
        )
        self.rg_local = joined(LOCAL)
        self.codec = joined(CODEC)
        self.nodes = np.concatenate(nodes)
        self.buffers = np.concatenate(buffers)
        self.ends = np.cumsum(self.rows)
        self.sizes = np.array([d.manifest.total_elements for d in self.datasets], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        sizes = [s.nbytes for d in self.datasets for s in d.manifest.shards]
        self.file_sizes = np.array(sizes, dtype=np.int64)
        self.file_map = ShardMap(self.file_sizes, 1)
        #: Where each record batch's body starts, in file-concatenated positions.
        self.body = joined(BODY) + self.file_map.starts[self.rg_file]
        #: ``[record batch, column, (start, end)]``: each selected column's bytes in the body.
        regions = np.zeros((self.rows.size, len(self.selected), 2), dtype=np.int64)
        for c, column in enumerate(self.selected):
            own = self.buffers[:, column.buffer_ids]
            if own.shape[1]:
                used = own[..., 1] > 0
                starts = np.where(used, own[..., 0], np.iinfo(np.int64).max).min(axis=1)
                ends = (own[..., 0] + own[..., 1]).max(axis=1)
                regions[:, c, 0] = np.minimum(starts, ends)
                regions[:, c, 1] = ends
        self.regions = regions
        self.leaves = np.arange(len(self.selected), dtype=np.int64)
        span = int((regions[..., 1] - regions[..., 0]).sum())
        self.sample_bytes = max(1, span // max(1, self.num_samples))
        nonempty = self.rows[self.rows > 0]
        #: A block shuffle's blocks: a whole record batch (the largest).
        self.default_block_size = int(nonempty.max()) if nonempty.size else 1
        #: Blocks start at row 0 every epoch, so equal record batches are whole blocks.
        self.aligned_blocks = True
        #: Set by the loader under an exact shuffle: rows then read one by one where they can.
        self.scattered = False
        self.picker = RowPicker(self)
        #: Memory of the rows copied out of whole record batches, reused once their batches
        #: are gone (fresh memory costs a page fault per 4 KiB at its first touch).
        self.gathered = BufferPool(GATHERED_KEPT)
        #: A group of few rows reads them alone (a block shuffle's first batch, say).
        self.reads_rows_alone = SPARSE if self.picker.readable.any() else 0

    def where(self, batch: int) -> str:
        """Record batch ``batch`` for an error: its file and the byte its body starts at."""
        file = int(self.rg_file[batch])
        body = int(self.body[batch] - self.file_map.starts[file])
        return (
            f"{self.shard_urls[file]}: record batch {int(self.rg_local[batch])} (body at"
            f" byte {body})"
        )

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        batches = np.searchsorted(self.ends, ids, side="right")
        in_batch = ids - (self.ends - self.rows)[batches]
        # Rows are read one by one under an exact shuffle, and in any group that uses few of
        # the rows of the record batches it touches (a block shuffle's first batch).
        touched = None if self.scattered else np.unique(batches)
        if touched is None or ids.size * SPARSE < int(self.rows[touched].sum()):
            single = self.picker.readable[batches]
            needed = np.unique(batches[~single])
        else:
            single, needed = np.zeros(ids.size, dtype=bool), touched
        spans, starts, lengths = self.region_ranges(needed)
        whole_bytes = int(lengths.sum())
        picks = None
        if single.any():
            picks = self.picker.first(batches[single], in_batch[single])
            starts = np.concatenate([starts, picks.starts])
            lengths = np.concatenate([lengths, picks.lengths])
        empty = np.empty(0, dtype=np.uint8)
        # Nothing to read first once every record batch's offsets are kept.
        buffer = (yield Read(self.file_map.plan(starts, lengths, gap))) if starts.size else empty
        second = None
        if picks is not None:
            picked = buffer[whole_bytes:]
            at, sizes = self.picker.second(picks, picked)
            second = (yield Read(self.file_map.plan(at, sizes, gap))) if at.size else empty

        def decode() -> dict[str, Any] | StoredByPath:
            pa, _ = pyarrow_modules()
            fill = self.nulls == "fill"
            if picks is not None and not needed.size:  # every row read by row
                assert second is not None
                return self.picker.fields(picks, buffer, second)
            parts: list[dict[str, Any]] = []
            if picks is None:  # whole record batches only: rows copied out where they can be
                rows_of = np.searchsorted(needed, batches)
                fields = self.gather_rows(buffer, needed, spans, rows_of, in_batch)
                rest = [f for f in self.fields if f.name not in fields]
                if rest:
                    arrays = self.decode_arrays(buffer, needed, spans, [f.name for f in rest])
                    base = np.cumsum(self.rows[needed]) - self.rows[needed]
                    rows = pa.array(base[rows_of] + in_batch)
                    taken = {name: array.take(rows) for name, array in arrays.items()}
                    more = to_fields(taken, rest, ids, fill, pa)
                    if isinstance(more, StoredByPath):
                        return more
                    fields.update(more)
                return {name: fields[name] for name in self.columns}
            if needed.size:
                arrays = self.decode_arrays(buffer[:whole_bytes], needed, spans)
                base = np.cumsum(self.rows[needed]) - self.rows[needed]
                rows = pa.array(base[np.searchsorted(needed, batches[~single])] + in_batch[~single])
                parts.append({name: arrays[name].take(rows) for name in self.columns})
            if picks is not None:
                assert second is not None
                picked = self.picker.decode(picks, buffer[whole_bytes:], second)
                for f in self.fields:  # a media field's bytes (no nulls) as its struct
                    if f.media:
                        picked[f.name] = pa.StructArray.from_arrays([picked[f.name]], ["bytes"])
                parts.append(picked)
            if len(parts) == 1:
                columns = parts[0]
            else:  # rows of both kinds: back in the order asked for
                order = pa.array(np.argsort(np.argsort(single, kind="stable"), kind="stable"))
                columns = {
                    name: pa.concat_arrays([parts[0][name], parts[1][name]]).take(order)
                    for name in self.columns
                }
            return to_fields(columns, self.fields, ids, fill, pa)

        fields: dict[str, Any] | StoredByPath = yield OffLoop(decode)
        if isinstance(fields, StoredByPath):
            raise (yield from path_error(self, fields, gap))
        return fields

    def region_ranges(self, needed: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The selected columns of record batches ``needed``: ``[batch, column, (start,
        end)]`` in the body, then starts in file-concatenated positions and lengths, flat."""
        spans = self.regions[needed]
        starts = (spans[..., 0] + self.body[needed][:, None]).ravel()
        return spans, starts, (spans[..., 1] - spans[..., 0]).ravel()

    def plan_groups(self, needed: Int64Array, gap: int) -> tuple[ReadPlan, Int64Array]:
        """The selected columns of record batches ``needed`` (ascending), one read plan;
        and their ``[batch, column, (start, end)]`` byte ranges."""
        spans, starts, lengths = self.region_ranges(needed)
        return self.file_map.plan(starts, lengths, gap), spans

    def decode_groups(
        self, buffer: npt.NDArray[np.uint8], needed: Int64Array, spans: Int64Array
    ) -> Any:
        """The rows of record batches ``needed`` as one Arrow table (what packing reads)."""
        pa, _ = pyarrow_modules()
        arrays = self.decode_arrays(buffer, needed, spans)
        return pa.table({name: arrays[name] for name in self.columns})

    def decode_arrays(
        self,
        buffer: npt.NDArray[np.uint8],
        needed: Int64Array,
        spans: Int64Array,
        names: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Every selected column (those ``names``) of record batches ``needed``, one array
        each, built by pyarrow from the bytes :meth:`region_ranges` located, validated,
        nulls checked."""
        pa, _ = pyarrow_modules()
        out: dict[str, Any] = {}
        for c, column in enumerate(self.selected):
            if names is None or column.name in names:
                pieces = self._pieces(buffer, needed, spans, c)
                array = pa.concat_arrays(pieces) if len(pieces) != 1 else pieces[0]
                if column.field is None or not column.field.optional:
                    self.check_nulls(array, column.name, needed, pa)
                out[column.name] = array
        return out

    def _pieces(
        self, buffer: npt.NDArray[np.uint8], needed: Int64Array, spans: Int64Array, c: int
    ) -> list[Any]:
        """Column ``c`` of each of record batches ``needed``, an array each, validated."""
        lengths = (spans[..., 1] - spans[..., 0]).reshape(needed.size, -1)
        at = np.cumsum(lengths).reshape(needed.size, -1) - lengths
        view = memoryview(buffer)  # type: ignore[arg-type]
        column = self.selected[c]
        return [
            self._array(
                b, column, view[int(at[j, c]) : int(at[j, c] + lengths[j, c])], int(spans[j, c, 0])
            )
            for j, b in enumerate(needed.tolist())
        ]

    def gather_rows(
        self,
        buffer: npt.NDArray[np.uint8],
        needed: Int64Array,
        spans: Int64Array,
        rows_of: Int64Array,
        in_batch: Int64Array,
    ) -> dict[str, Any]:
        """The fields of rows ``in_batch`` of record batches ``needed[rows_of]``, copied
        straight out of the bytes read (one GIL-free call per column) for the columns whose
        rows are byte ranges there: numbers, lists of numbers, strings and binaries, of
        uncompressed record batches without nulls in them. pyarrow builds and validates each
        record batch's array first (its offsets within its values, ...), as for every read;
        the other columns are left out (taken by pyarrow)."""
        out: dict[str, Any] = {}
        if (self.codec[needed] != ipc.NO_CODEC).any():
            return out
        lengths = (spans[..., 1] - spans[..., 0]).reshape(needed.size, -1)
        at = np.cumsum(lengths).reshape(needed.size, -1) - lengths
        batch_buffers = self.buffers[needed[rows_of], :, 0]
        needed_nodes = self.nodes[needed]
        for c, column in enumerate(self.selected):
            layout = self.picker.layouts[c]
            nodes = needed_nodes[:, column.node_ids, 1]
            if layout is None or layout.kind == "bits" or (nodes > 0).any():
                continue
            self._pieces(buffer, needed, spans, c)  # validated, never used
            # Where each row's record batch keeps each of its buffers, in ``buffer``.
            placed = (at[rows_of, c] - spans[rows_of, c, 0])[:, None] + batch_buffers
            out[column.name] = gathered(
                buffer, layout, column.kind, placed, in_batch, self.gathered.empty
            )
        return out

    def _array(self, batch: int, column: Column, region: memoryview, base: int) -> Any:
        """Column ``column`` of record batch ``batch`` from its bytes ``region`` (which start
        at byte ``base`` of the body)."""
        pa, _ = pyarrow_modules()
        codec = ipc.CODECS.get(int(self.codec[batch]))
        buffers = self.buffers[batch]

        def buffer(k: int) -> Any:
            offset, length = int(buffers[k, 0]) - base, int(buffers[k, 1])
            if length == 0:
                return pa.py_buffer(b"")
            raw = region[offset : offset + length]
            if codec is None:
                return pa.py_buffer(raw)
            size = int.from_bytes(raw[:8], "little", signed=True)
            if size == -1:
                return pa.py_buffer(raw[8:])
            return pa.decompress(raw[8:], decompressed_size=size, codec=codec)

        nodes = self.nodes[batch]
        try:
            array, _, _ = _build(column.kind, column.nodes[0], column.buffers[0], nodes, buffer, pa)
            if column.field is not None and column.parents:
                # The structs above the leaf, one child each, so their nulls are the field's.
                for (node, at), child in zip(
                    column.parents[::-1], column.field.path[::-1], strict=True
                ):
                    length, nulls = int(nodes[node, 0]), int(nodes[node, 1])
                    array = pa.Array.from_buffers(
                        pa.struct([pa.field(child, array.type)]),
                        length,
                        [buffer(at) if nulls else None],
                        nulls,
                        children=[array],
                    )
            array.validate(full=True)
        except (pa.ArrowException, ValueError, IndexError) as exc:
            raise FormatError(
                f"{self.where(batch)}, column {column.name!r} does not decode: {exc}"
            ) from exc
        return field_array(array, column.field) if column.field is not None else array

    def check_nulls(self, array: Any, name: str, needed: Int64Array, pa: Any) -> None:
        """A null in ``array`` (a list's items too) is a FormatError, unless filled."""
        if self.nulls == "fill":
            return
        inner = array
        while (
            pa.types.is_list(inner.type)
            or pa.types.is_large_list(inner.type)
            or (pa.types.is_fixed_size_list(inner.type))
        ):
            if inner.null_count:
                break
            inner = inner.flatten()
        if inner.null_count:
            batches = ", ".join(self.where(int(b)) for b in needed[:3])
            raise FormatError(
                f"{batches}: column {name!r} holds nulls; open with options={{'nulls': 'fill'}}"
                " to read them as 0 / NaN / empty"
            )


def _build(
    kind: Any, node: int, at: int, nodes: Int64Array, buffer: Any, pa: Any
) -> tuple[Any, int, int]:
    """The array of type ``kind`` whose field node is ``nodes[node]`` and whose buffers
    start at ``at`` (``buffer(k)`` gives one); returns it and the next node and buffer."""
    length, nulls = int(nodes[node, 0]), int(nodes[node, 1])
    validity = buffer(at) if nulls else None
    t = pa.types
    if t.is_list(kind) or t.is_large_list(kind):
        child, next_node, next_at = _build(kind.value_type, node + 1, at + 2, nodes, buffer, pa)
        array = pa.Array.from_buffers(
            kind, length, [validity, buffer(at + 1)], nulls, children=[child]
        )
        return array, next_node, next_at
    if t.is_fixed_size_list(kind):
        child, next_node, next_at = _build(kind.value_type, node + 1, at + 1, nodes, buffer, pa)
        return (
            pa.Array.from_buffers(kind, length, [validity], nulls, children=[child]),
            (next_node),
            next_at,
        )
    if t.is_string(kind) or t.is_binary(kind) or t.is_large_string(kind) or t.is_large_binary(kind):
        array = pa.Array.from_buffers(
            kind, length, [validity, buffer(at + 1), buffer(at + 2)], nulls
        )
        return array, node + 1, at + 3
    array = pa.Array.from_buffers(kind, length, [validity, buffer(at + 1)], nulls)
    return array, node + 1, at + 2


def leaf_column(field: Field, kind: Any, layout: tuple[int, int, int, int], pa: Any) -> Column:
    """The :class:`Column` of field ``field`` of a column of Arrow type ``kind`` whose
    first node and buffer are ``layout[0]`` and ``layout[2]``: a struct's node and validity
    buffer come first, then its children's, depth first."""
    node, buffer = layout[0], layout[2]
    parents = []
    for child in field.path:
        parents.append((node, buffer))
        node, buffer = node + 1, buffer + 1
        for sibling in kind:
            if sibling.name == child:
                break
            n, b = ipc.type_layout(sibling.type, pa, field.name)
            node, buffer = node + n, buffer + b
        kind = kind.field(child).type
    n, b = ipc.type_layout(kind, pa, field.name)
    return Column(field.name, kind, (node, node + n), (buffer, buffer + b), tuple(parents), field)


class PackedArrow(PackedParquet):
    """Token windows over a list column of Arrow record batches, as
    :class:`~asyncbatch.formats._parquet.PackedParquet` packs Parquet row groups; each record
    batch's tokens are its list column's child length, from its header."""

    def row_groups(self, datasets: Sequence[Dataset], column: str) -> RowGroups:
        rows: RowGroups = ArrowRows(datasets, [column])
        return rows

    def _token_counts(self, leaf: int) -> tuple[Int64Array, npt.NDArray[np.bool_]]:
        rows = self.rows
        assert isinstance(rows, ArrowRows)
        (column,) = rows.selected
        tokens = rows.nodes[:, column.nodes[0] + 1, 0].astype(np.int64)
        return tokens, np.ones(tokens.shape, dtype=np.bool_)


def arrow_rows(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> ArrowRows | PackedArrow:
    """Source factory of the ``arrow`` format: rows as samples; with ``seq_len`` a token list
    column packed into windows (``format_options``: ``column``, ``token_ids``)."""
    if dtype is not None:
        raise ConfigError("dtype= does not apply to Arrow: fields keep their Arrow types")
    if seq_len is not None:
        unknown = sorted(set(options) - {"column", "token_ids"})
        if unknown:
            raise ConfigError(
                f"unknown format_options {unknown} for packed Arrow (known: column, token_ids)"
            )
        return PackedArrow(datasets, seq_len, next_token=next_token, **options)
    if options:
        raise ConfigError(
            f"Arrow rows take no format_options, got {sorted(options)}; choose columns and"
            " nulls with ab.open_dataset(..., options={'columns': [...], 'nulls': 'fill'})"
        )
    if next_token:
        raise ConfigError("next_token=True needs seq_len= (packing); a row is whole")
    return ArrowRows(datasets)


ARROW_OPENER = Opener(
    FORMAT,
    open_arrow,
    claims=claims,
    probe=probe_arrow,
    probes_for="no state.json, no .arrow or .feather files listed under it",
    open_many=open_arrow_list,
)
