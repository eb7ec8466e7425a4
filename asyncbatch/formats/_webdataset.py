"""WebDataset tar shards, read in place: a sample is one contiguous byte range of its shard,
its fields sub-ranges of it, found in the member index (:mod:`._webdataset_index`).

Opening finds the shards (a ``.tar`` URL, a folder or prefix, a glob, a list, or a brace
pattern such as ``s3://b/laion/{000000..000123}.tar``) and reads the summary at the end of
each one's sidecar index (``000000.tar.abidx``): its samples, fields and shard size, one
small range each, all at once; it scans the shards that have none, each in large
sequential ranges. A dataset is a ``Manifest("webdataset")`` with one shard per tar (its
elements: its samples); ``Dataset.arrays`` holds, per shard, its sidecar's summary or the
index a scan made. A source fetches the rest of a sidecar (the members' offsets) when a
batch first reads its shard (:mod:`._webdataset_tables`).

Reading a group of batches plans one byte range per sample (its first header to its last
member's end; neighbours merged as the store's request cost says), or with
``options={"columns": [...]}`` naming fewer fields than the dataset holds, one per selected
member (its header and data). The engine copies each member's data into its field's place
in the group's buffer and each member's header beside them; decoding checks those headers
(checksum, size) against the index, so a shard that changed after it was indexed is a
FormatError, never a wrong sample. Each field is a binary :class:`~asyncbatch._batch.Strings`
over the group's buffer; ``__key__`` and ``__url__`` are UTF-8 ones, from the index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema, Strings
from .._checksums import digest, format_digest
from .._dataset import Dataset
from .._errors import ConfigError, FormatError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import Manifest, ShardInfo
from ..stores._base import ObjectInfo, Store
from ._base import Fetch, OffLoop, Opener, Read
from ._webdataset_index import (
    BLOCK,
    FORMAT,
    ShardIndex,
    SidecarSummary,
    read_sidecar,
    read_whole,
    scanned_index,
    sidecar_url,
)
from ._webdataset_shards import claims, find_shards, limited, probe_webdataset
from ._webdataset_tables import (
    DEFAULT_INDEX_CACHE_BYTES,
    LazyShard,
    ShardTable,
    ShardTables,
    columns,
    shard_table,
)

Int64Array = npt.NDArray[np.int64]

#: open_dataset's options for WebDataset shards.
OPTIONS = ("columns",)
KEY, URL = "__key__", "__url__"
#: The Dataset.arrays key: per shard, its sidecar's summary or its whole index (an object
#: array, one entry per shard whichever it holds).
INDEXES = "wds_indexes"
#: Summaries of sidecars read at once at open (each one small range).
CONCURRENT_SUMMARIES = 64
_STRING = FieldSchema(dtype="str", shape=(-1,), nested=True, tensor=False)
_BYTES = FieldSchema(dtype="bytes", shape=(-1,), nested=True, tensor=False)

#: What opening knows of a shard's index: its sidecar's summary, or the whole index.
Entry = SidecarSummary | ShardIndex


async def sidecar_entry(
    store: Store, url: str, info: ObjectInfo | None, sidecar: ObjectInfo | None, has: bool | None
) -> Entry | None:
    """The summary of the sidecar of the shard ``url`` (the whole index, of a version 1
    sidecar); None where it has none (``has`` False, or not found)."""
    if has is False:
        return None
    side = sidecar_url(url)
    try:
        entry = await read_sidecar(store, side, sidecar)
    except NotFoundError:
        if has:
            raise
        return None
    if info is not None and info.size != entry.size:
        raise FormatError(
            f"{url}: {info.size} bytes, but its index {side} was made from a shard of"
            f" {entry.size} bytes: the shard changed after it was indexed; write the"
            f" index again with `asyncbatch index {url}`"
        )
    return entry


async def scan_entry(store: Store, url: str, info: ObjectInfo | None) -> ShardIndex:
    """The index of the shard ``url`` without a sidecar, from the node cache or a scan."""
    if info is None:
        info = await store.stat(url)
    return await scanned_index(store, url, info)


# ---------------------------------------------------------------------------------------------
# Opening


async def open_webdataset(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """WebDataset shards at ``url`` (a ``.tar``, folder, prefix, glob or brace pattern): their
    sidecars' summaries, or a scan of the shards without one."""
    columns = _columns_option(options)
    root, shards, known, has = await find_shards(url, store)
    return await _open_shards(root, shards, known, has, store, storage_options, columns)


async def open_webdataset_list(
    urls: Sequence[str],
    store: Store,
    storage_options: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Dataset:
    """The shards ``urls``, in the order given."""
    columns = _columns_option(options)
    root, shards, known, has = await find_shards(list(urls), store)
    return await _open_shards(root, shards, known, has, store, storage_options, columns)


def _columns_option(options: Mapping[str, Any]) -> list[str] | None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown options {unknown} for WebDataset shards (known: {', '.join(OPTIONS)})"
        )
    columns = options.get("columns")
    if columns is None:
        return None
    if (
        isinstance(columns, str)
        or not all(isinstance(c, str) for c in columns)
        or not list(columns)
    ):
        raise ConfigError(f"options columns={columns!r}: expected a list of field names")
    return list(columns)


async def _open_shards(
    root: str,
    shards: list[str],
    known: Mapping[str, ObjectInfo],
    has: Mapping[str, bool | None],
    store: Store,
    storage_options: Mapping[str, Any],
    columns: list[str] | None,
) -> Dataset:
    found: list[Entry | None] = await limited(
        [
            sidecar_entry(store, u, known.get(u), known.get(sidecar_url(u)), has.get(u))
            for u in shards
        ],
        CONCURRENT_SUMMARIES,
    )
    sidecars = sum(1 for entry in found if entry is not None)
    scans = [i for i, entry in enumerate(found) if entry is None]
    scanned = await limited([scan_entry(store, shards[i], known.get(shards[i])) for i in scans])
    by_shard: dict[int, Entry] = dict(zip(scans, scanned, strict=True))
    entries = [entry if entry is not None else by_shard[i] for i, entry in enumerate(found)]
    try:
        dataset = await asyncio.to_thread(
            webdataset_dataset, root, shards, entries, storage_options, columns, sidecars
        )
    except _LacksField as lacking:  # its whole sidecar, to name the sample
        side = sidecar_url(shards[lacking.shard])
        entries[lacking.shard] = ShardIndex.parse(await read_whole(store, side), side)
        await asyncio.to_thread(
            webdataset_dataset, root, shards, entries, storage_options, columns, sidecars
        )
        raise FormatError(
            f"{side}: its summary says a sample lacks a field, its index does not (corrupt);"
            " write it again with `asyncbatch index`"
        ) from None
    # Where a listing told every shard's version (an S3 ETag), it identifies the bytes for
    # resume states beside the indexes' digest, at no request of its own.
    versions = tuple(known[u].version if u in known else None for u in shards)
    if None in versions:
        return dataset
    return replace(dataset, versions=versions)


class _LacksField(Exception):
    """A shard known by its summary only has a sample without a selected field."""

    def __init__(self, shard: int) -> None:
        super().__init__(shard)
        self.shard = shard


def webdataset_dataset(
    root: str,
    shards: Sequence[str],
    entries: Sequence[Entry],
    storage_options: Mapping[str, Any],
    columns: list[str] | None,
    sidecars: int = 0,
) -> Dataset:
    """The dataset of ``shards`` with these summaries or indexes: every sample must hold
    every field of ``columns`` (default: every field any sample holds)."""
    names: dict[str, int] = {}
    for entry in entries:
        for name in entry.fields:
            names.setdefault(name, len(names))
    fields = list(names)
    chosen = list(columns) if columns is not None else fields
    missing = [c for c in chosen if c not in names]
    if missing:
        raise ConfigError(f"options columns={chosen!r}: the shards' samples hold fields {fields}")
    reserved = [c for c in chosen if c in (KEY, URL)]
    if reserved:
        raise FormatError(f"{shards[0]}: a field named {reserved[0]!r}, which the batch's own uses")
    summaries = [e.summary() if isinstance(e, ShardIndex) else e for e in entries]
    for s, (entry, summary) in enumerate(zip(entries, summaries, strict=True)):
        held = dict(zip(summary.fields, summary.field_samples.tolist(), strict=True))
        if all(held.get(c, 0) == summary.samples for c in chosen):
            continue
        if isinstance(entry, SidecarSummary):
            raise _LacksField(s)
        _check_fields(shards[s], entry, fields, chosen, summaries)
    prefix = root.rstrip("/") + "/"
    infos = tuple(
        ShardInfo(u[len(prefix) :] if u.startswith(prefix) else u, s.size, s.samples)
        for u, s in zip(shards, summaries, strict=True)
    )
    selected = 0
    for summary in summaries:
        bytes_of = dict(zip(summary.fields, summary.field_bytes.tolist(), strict=True))
        selected += sum(bytes_of[c] for c in chosen) + summary.key_bytes
    metadata = {
        "read_in_place": FORMAT,
        "fields": fields,
        "columns": chosen,
        "sidecars": sidecars,
        # Bytes of the selected fields' data and the keys, all samples together.
        "selected_bytes": selected,
        # The indexes say where every sample lies: two datasets of one shape still differ
        # here, so a resume state of one is refused on the other. Their summaries hold
        # their digests, so a sidecar's summary and a scan of its shard agree.
        "fingerprint": format_digest(digest(b"".join(s.packed for s in summaries))),
    }
    manifest = Manifest(FORMAT, np.dtype(np.uint8), infos, metadata)
    kept = np.empty(len(entries), dtype=object)
    kept[:] = list(entries)
    return Dataset(root, manifest, dict(storage_options), {INDEXES: kept})


def _check_fields(
    shard: str,
    index: ShardIndex,
    fields: list[str],
    chosen: list[str],
    summaries: Sequence[SidecarSummary],
) -> None:
    """A ConfigError naming the first sample of ``index`` that lacks a field of ``chosen``."""
    samples = index.num_samples
    owner = np.repeat(np.arange(samples), index.members)
    present = np.zeros((samples, len(index.fields)), dtype=bool)
    present[owner, index.field] = True
    wanted = [index.fields.index(c) if c in index.fields else -1 for c in chosen]
    lacking = np.stack(
        [present[:, w] if w >= 0 else np.zeros(samples, bool) for w in wanted], axis=1
    )
    lacking = ~lacking
    s = int(np.flatnonzero(lacking.any(axis=1))[0])
    absent = [chosen[j] for j in np.flatnonzero(lacking[s]).tolist()]
    held = [index.fields[j] for j in np.flatnonzero(present[s]).tolist()]
    common = [
        name
        for name in fields
        if all(
            dict(zip(m.fields, m.field_samples.tolist(), strict=True)).get(name, 0) == m.samples
            for m in summaries
        )
    ]
    raise ConfigError(
        f"{shard}: sample {index.key(s)!r} has no {', '.join(map(repr, absent))} field (it holds"
        f" {held}); a batch has one column per field with a value for every sample, and the"
        f" fields every sample holds are {common}: choose among them with"
        " ab.open_dataset(..., options={'columns': [...]})"
    )


# ---------------------------------------------------------------------------------------------
# Reading


def _string_table(items: Sequence[str]) -> tuple[npt.NDArray[np.uint8], Int64Array]:
    raw = [item.encode("utf-8", "surrogateescape") for item in items]
    data = np.frombuffer(b"".join(raw), dtype=np.uint8)
    return data, np.cumsum([0, *(len(r) for r in raw)]).astype(np.int64)


def _gather(data: npt.NDArray[np.uint8], offsets: Int64Array, rows: Int64Array) -> Strings:
    """Rows ``rows`` of the strings ``data`` / ``offsets`` as a UTF-8 :class:`Strings`."""
    import torch

    lengths = offsets[rows + 1] - offsets[rows]
    out = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    picks = np.repeat(offsets[rows] - out[:-1], lengths) + np.arange(int(out[-1]))
    return Strings(torch.from_numpy(data[picks]), torch.from_numpy(out))


def _octal(fields: npt.NDArray[np.uint8]) -> Int64Array:
    """Octal numeric header fields, one per row, as tarfile reads them: the digits (spaces
    before them skipped) up to the first byte that is not one."""
    digit = (fields >= 0x30) & (fields <= 0x37)
    seen = np.logical_or.accumulate(digit, axis=1)
    stopped = np.logical_or.accumulate(seen & ~digit, axis=1)
    use = digit & ~stopped
    value = np.zeros(fields.shape[0], dtype=np.int64)
    values = fields.astype(np.int64) - 0x30
    for column in range(fields.shape[1]):
        take = use[:, column]
        value = np.where(take, value * 8 + values[:, column], value)
    return value


@dataclass(frozen=True, eq=False)
class _Picked:
    """What the index says of the samples of one group, in their order: their shards, their
    table rows (:func:`~._webdataset_tables.columns`: byte range, the selected members' data
    offsets and lengths, local to the shard) and their keys as UTF-8 bytes with offsets."""

    shards: Int64Array
    rows: Int64Array
    keys: npt.NDArray[np.uint8]
    key_offsets: Int64Array


class WebDatasetSamples:
    """Sample ``i`` is sample ``i`` of the shards one after another (of the datasets of a
    mixture one after another); fields: ``__key__``, ``__url__`` and the selected ones.

    The sidecars of shards opened from their summaries follow the shards in
    :attr:`shard_urls`; a group fetches those of the shards it reads that are not cached
    (:class:`~._webdataset_tables.ShardTables`), then its samples."""

    #: Decoding checks every member's header (numpy over the headers, off the loop).
    converts = True

    def __init__(
        self, datasets: Sequence[Dataset], index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES
    ) -> None:
        if (
            isinstance(index_cache_bytes, bool)
            or not isinstance(index_cache_bytes, int)
            or index_cache_bytes < 0
        ):
            raise ConfigError(
                "format_options index_cache_bytes must be a number of bytes,"
                f" got {index_cache_bytes!r}"
            )
        self.datasets: Sequence[Dataset] = list(datasets)
        first = self.datasets[0].manifest.metadata
        self.columns: list[str] = list(first["columns"])
        for one in self.datasets[1:]:
            if one.manifest.metadata["columns"] != self.columns:
                raise ConfigError(
                    f"{one.url} gives fields {one.manifest.metadata['columns']}, not"
                    f" {self.columns} as {self.datasets[0].url}: open both with the same"
                    " options={'columns': [...]}"
                )
        shard_urls = [u for d in self.datasets for u in d.shard_urls]
        shards = [len(d.manifest.shards) for d in self.datasets]
        shard_dataset = np.repeat(np.arange(len(shards), dtype=np.int64), shards)
        per_shard = np.array(
            [s.elements for d in self.datasets for s in d.manifest.shards], dtype=np.int64
        )
        #: Samples before the end of each shard: a sample's shard by ``np.searchsorted``.
        self.shard_ends = np.cumsum(per_shard)
        self.shard_starts = self.shard_ends - per_shard
        self.sizes = np.array([d.manifest.total_elements for d in self.datasets], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self.file_sizes = np.array(
            [s.nbytes for d in self.datasets for s in d.manifest.shards], dtype=np.int64
        )
        self.file_map = ShardMap(self.file_sizes, 1)
        width = len(self.columns)
        fixed: dict[int, ShardTable] = {}
        lazy: dict[int, LazyShard] = {}
        sidecars: list[str] = []
        sidecar_dataset: list[int] = []
        #: What the engine checks of each sidecar it reads: its size.
        self.described_files: dict[str, tuple[int, int | None]] = {}
        whole = True
        g = 0
        for k, dataset in enumerate(self.datasets):
            whole = whole and set(dataset.manifest.metadata["fields"]) <= set(self.columns)
            for entry in dataset.arrays[INDEXES].tolist():
                column_of = np.array(
                    [self.columns.index(f) if f in self.columns else -1 for f in entry.fields],
                    dtype=np.int64,
                )
                if isinstance(entry, ShardIndex):
                    fixed[g] = shard_table(entry, column_of, width, shard_urls[g])
                else:
                    side = sidecar_url(shard_urls[g])
                    file = len(shard_urls) + len(sidecars)
                    lazy[g] = LazyShard(file, side, entry, column_of)
                    sidecars.append(side)
                    sidecar_dataset.append(k)
                    self.described_files[side] = (entry.sidecar_bytes, None)
                g += 1
        self.tables = ShardTables(fixed, lazy, width, index_cache_bytes, g)
        self.shard_urls: Sequence[str] = [*shard_urls, *sidecars]
        self.shard_dataset = np.concatenate(
            [shard_dataset, np.array(sidecar_dataset, dtype=np.int64)]
        )
        #: Every member of every sample is selected: a sample is read as one range.
        self.whole = whole
        self.urls, self.url_offsets = _string_table(shard_urls)
        data = sum(int(d.manifest.metadata["selected_bytes"]) for d in self.datasets)
        self.sample_bytes = max(1, data // max(1, self.num_samples) + BLOCK * width)
        self.schema = {KEY: _STRING, URL: _STRING}
        self.schema.update({name: _BYTES for name in self.columns})

    def shard_of(self, ids: Int64Array) -> Int64Array:
        """The shard (numbered through the datasets) of each sample of ``ids``."""
        return np.searchsorted(self.shard_ends, ids, side="right").astype(np.int64)

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The tables of the shards ``ids`` lie in (their sidecars fetched where not cached,
        in this group's turn), then one range per sample (or per selected member), then the
        fields, their headers checked."""
        shards = self.shard_of(ids)
        if not self.tables.lazy:  # no sidecar to fetch
            picked = self._pick(ids, shards)
            plan = self._plan(picked, gap)
        else:
            wait, turn = self.tables.turns.take()
            try:
                if wait is not None:
                    yield wait
                held = yield from self.tables.load(np.unique(shards))
                try:
                    picked = self._pick(ids, shards)
                finally:
                    self.tables.release(held)
                plan = self._plan(picked, gap)
            finally:  # the next group may fetch its sidecars
                if not turn.done():
                    turn.set_result(None)
        buffer = yield Read(plan)
        fields: dict[str, Any] = yield OffLoop(lambda: self._decode(buffer, picked))
        return fields

    def _pick(self, ids: Int64Array, shards: Int64Array) -> _Picked:
        """What the tables (all in the pool) say of samples ``ids``: one gather."""
        rows, keys, key_offsets = self.tables.pool.pick(shards, ids - self.shard_starts[shards])
        return _Picked(shards, rows, keys, key_offsets)

    def _plan(self, picked: _Picked, gap: int) -> ReadPlan:
        """One range per sample (or per selected member), merged across gaps the store says
        cost less than a request; each member's data copied to its field's place, field
        after field, then every member's header."""
        base = self.file_map.starts[picked.shards]
        start, offsets, lengths_at, _ = columns(len(self.columns))
        data_at = (base[:, None] + picked.rows[:, offsets]).T.ravel()  # field-major
        lengths = picked.rows[:, lengths_at].T.ravel()
        if self.whole:
            starts = base + picked.rows[:, start]
            spans = picked.rows[:, start + 1] - picked.rows[:, start]
        else:
            starts = data_at - BLOCK
            spans = lengths + BLOCK
        planned = self.file_map.plan(starts, spans, gap)
        read_at = self.file_map.starts[planned.read_shard] + planned.read_start
        data = int(lengths.sum())
        members = lengths.size
        sources = np.concatenate([data_at, data_at - BLOCK])
        sizes = np.concatenate([lengths, np.full(members, BLOCK, dtype=np.int64)])
        dest = np.concatenate(
            [np.cumsum(lengths) - lengths, data + BLOCK * np.arange(members, dtype=np.int64)]
        )
        read = np.searchsorted(read_at, sources, side="right") - 1
        keep = sizes > 0
        return ReadPlan(
            read_shard=planned.read_shard,
            read_start=planned.read_start,
            read_end=planned.read_end,
            read_dest=np.full(planned.read_shard.size, -1, dtype=np.int64),
            piece_read=read[keep],
            piece_src=(sources - read_at[read])[keep],
            piece_dest=dest[keep],
            piece_length=sizes[keep],
            nbytes=data + BLOCK * members,
        )

    def _decode(self, buffer: npt.NDArray[np.uint8], picked: _Picked) -> dict[str, Any]:
        """The fields of the picked samples as views of ``buffer``, after their headers are
        checked against the index."""
        import torch

        count = picked.shards.size
        lengths = picked.rows[:, columns(len(self.columns))[2]].T.ravel()
        data = int(lengths.sum())
        headers = buffer[data : data + BLOCK * lengths.size].reshape(lengths.size, BLOCK)
        self._check_headers(headers, lengths, picked)
        fields: dict[str, Any] = {
            KEY: Strings(torch.from_numpy(picked.keys), torch.from_numpy(picked.key_offsets)),
            URL: _gather(self.urls, self.url_offsets, picked.shards),
        }
        at = 0
        for j, name in enumerate(self.columns):
            mine = lengths[j * count : (j + 1) * count]
            offsets = np.zeros(count + 1, dtype=np.int64)
            np.cumsum(mine, out=offsets[1:])
            end = at + int(offsets[-1])
            fields[name] = Strings(
                torch.from_numpy(buffer[at:end]), torch.from_numpy(offsets), binary=True
            )
            at = end
        return fields

    def _check_headers(
        self, headers: npt.NDArray[np.uint8], lengths: Int64Array, picked: _Picked
    ) -> None:
        """Each member's header (the 512 bytes before its data) must be a tar header (its
        checksum right) of a regular file of the indexed length; else a FormatError naming the
        shard, the sample's key and the header's byte range."""
        if not lengths.size:
            return
        unsigned = headers.sum(axis=1, dtype=np.int64)
        stored_field = headers[:, 148:156]
        spaces = 256 - stored_field.sum(axis=1, dtype=np.int64)
        signed = headers.view(np.int8).sum(axis=1, dtype=np.int64)
        signed_spaces = 256 - stored_field.view(np.int8).sum(axis=1, dtype=np.int64)
        stored = _octal(stored_field)
        checksum = (stored == unsigned + spaces) | (stored == signed + signed_spaces)
        size_field = headers[:, 124:136]
        base256 = size_field[:, 0] >= 0x80
        size = (_octal(size_field) == lengths) | base256 | (lengths > 0o77777777777)
        kind = headers[:, 156]
        regular = (kind == ord("0")) | (kind == 0) | (kind == ord("7"))
        bad = np.flatnonzero(~(checksum & size & regular))
        if not bad.size:
            return
        m = int(bad[0])
        count = picked.shards.size
        row, column = m % count, m // count
        field = self.columns[column]
        start = int(picked.rows[row, columns(len(self.columns))[1]][column]) - BLOCK
        at = picked.key_offsets
        key = picked.keys[at[row] : at[row + 1]].tobytes()
        why = (
            "bad checksum"
            if not checksum[m]
            else (
                f"its size field is not the {int(lengths[m])} bytes indexed"
                if not size[m]
                else f"type {bytes([int(kind[m])])!r} is not a file"
            )
        )
        raise FormatError(
            f"{self.shard_urls[int(picked.shards[row])]}: sample"
            f" {key.decode('utf-8', 'surrogateescape')!r}, field {field!r}: bytes [{start},"
            f" {start + BLOCK}) are not the member's tar header the index says ({why}); the"
            " shard changed after it was indexed, or is corrupt: write its index again with"
            " `asyncbatch index`"
        )


def webdataset_samples(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES,
    **options: Any,
) -> WebDatasetSamples:
    """Source factory of the ``webdataset`` format: samples of tar shards. Its one
    ``format_options`` entry, ``index_cache_bytes``, bounds the sidecar tables kept."""
    if options:
        raise ConfigError(
            f"WebDataset shards take no format_options but index_cache_bytes, got"
            f" {sorted(options)}; choose fields with ab.open_dataset(..., options={{'columns':"
            " [...]})"
        )
    if seq_len is not None or next_token:
        raise ConfigError("seq_len= and next_token= do not apply to WebDataset samples")
    if dtype is not None:
        raise ConfigError("dtype= does not apply to WebDataset samples: fields are bytes")
    return WebDatasetSamples(datasets, index_cache_bytes)


WEBDATASET_OPENER = Opener(
    FORMAT,
    open_webdataset,
    claims=claims,
    probe=probe_webdataset,
    probes_for="no .tar shards listed under it",
    open_many=open_webdataset_list,
)
