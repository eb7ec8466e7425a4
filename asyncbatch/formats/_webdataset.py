"""WebDataset tar shards, read in place: a sample is one contiguous byte range of its shard,
its fields sub-ranges of it, found in the member index (:mod:`._webdataset_index`).

Opening finds the shards (a ``.tar`` URL, a folder or prefix, a glob, a list, or a brace
pattern such as ``s3://b/laion/{000000..000123}.tar``) and reads each one's sidecar index
(``000000.tar.abidx``), or scans the shards that have none: all at once, each in large
sequential ranges. A dataset is a ``Manifest("webdataset")`` with one shard per tar (its
elements: its samples) and the samples' and members' arrays in ``Dataset.arrays``.

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
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .._batch import FieldSchema, Strings
from .._checksums import digest, format_digest
from .._dataset import Dataset
from .._errors import ConfigError, FormatError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import Manifest, ShardInfo
from ..stores._base import ObjectInfo, Store
from ._base import Opener, PlannedSource
from ._webdataset_index import BLOCK, FORMAT, ShardIndex, read_whole, scanned_index, sidecar_url
from ._webdataset_shards import claims, find_shards, limited, probe_webdataset

Int64Array = npt.NDArray[np.int64]

#: open_dataset's options for WebDataset shards.
OPTIONS = ("columns",)
KEY, URL = "__key__", "__url__"
# Dataset.arrays keys.
STARTS, ENDS, MEMBERS = "wds_starts", "wds_ends", "wds_members"
FIELDS, OFFSETS, LENGTHS = "wds_field", "wds_offsets", "wds_lengths"
KEYS, KEY_OFFSETS = "wds_keys", "wds_key_offsets"
_STRING = FieldSchema(dtype="str", shape=(-1,), nested=True, tensor=False)
_BYTES = FieldSchema(dtype="bytes", shape=(-1,), nested=True, tensor=False)


async def shard_index(
    store: Store, url: str, info: ObjectInfo | None, sidecar: ObjectInfo | None, has: bool | None
) -> tuple[ShardIndex, bool]:
    """The index of the shard ``url`` from its sidecar (unless ``has`` says there is none),
    else from a scan of the shard; and whether it came from the sidecar."""
    side = sidecar_url(url)
    if has is not False:
        try:
            data = await read_whole(store, side, sidecar)
        except NotFoundError:
            if has:
                raise
        else:
            index = ShardIndex.parse(data, side)
            if info is not None and info.size != index.size:
                raise FormatError(
                    f"{url}: {info.size} bytes, but its index {side} was made from a shard of"
                    f" {index.size} bytes: the shard changed after it was indexed; write the"
                    f" index again with `asyncbatch index {url}`"
                )
            return index, True
    if info is None:
        info = await store.stat(url)
    return await scanned_index(store, url, info), False


# ---------------------------------------------------------------------------------------------
# Opening


async def open_webdataset(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """WebDataset shards at ``url`` (a ``.tar``, folder, prefix, glob or brace pattern): their
    sidecar indexes, or a scan of the shards without one."""
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
    found = await limited(
        [shard_index(store, u, known.get(u), known.get(sidecar_url(u)), has.get(u)) for u in shards]
    )
    indexes: list[ShardIndex] = [index for index, _ in found]
    dataset = await asyncio.to_thread(
        webdataset_dataset,
        root,
        shards,
        indexes,
        storage_options,
        columns,
        sum(1 for _, sidecar in found if sidecar),
    )
    # Where a listing told every shard's version (an S3 ETag), it identifies the bytes for
    # resume states beside the indexes' digest, at no request of its own.
    versions = tuple(known[u].version if u in known else None for u in shards)
    if None in versions:
        return dataset
    return replace(dataset, versions=versions)


def webdataset_dataset(
    root: str,
    shards: Sequence[str],
    indexes: Sequence[ShardIndex],
    storage_options: Mapping[str, Any],
    columns: list[str] | None,
    sidecars: int = 0,
) -> Dataset:
    """The dataset of ``shards`` with these indexes: every sample must hold every field of
    ``columns`` (default: every field any sample holds)."""
    names: dict[str, int] = {}
    for index in indexes:
        for name in index.fields:
            names.setdefault(name, len(names))
    fields = list(names)
    field_ids = [
        np.array([names[n] for n in index.fields], dtype=np.int64)[index.field]
        if index.fields
        else index.field
        for index in indexes
    ]
    counts = np.array([index.num_samples for index in indexes], dtype=np.int64)
    members = _concat([index.members for index in indexes])
    key_lengths = _concat([np.diff(index.key_offsets) for index in indexes])
    arrays: dict[str, npt.NDArray[Any]] = {
        STARTS: _concat([index.starts for index in indexes]),
        ENDS: _concat([index.ends for index in indexes]),
        MEMBERS: members,
        FIELDS: _concat(field_ids).astype(np.int32),
        OFFSETS: _concat([index.offsets for index in indexes]),
        LENGTHS: _concat([index.lengths for index in indexes]),
        KEYS: np.concatenate([index.keys for index in indexes])
        if indexes
        else np.empty(0, np.uint8),
        KEY_OFFSETS: np.cumsum(np.append(0, key_lengths)).astype(np.int64),
    }
    chosen = list(columns) if columns is not None else fields
    missing = [c for c in chosen if c not in names]
    if missing:
        raise ConfigError(f"options columns={chosen!r}: the shards' samples hold fields {fields}")
    reserved = [c for c in chosen if c in (KEY, URL)]
    if reserved:
        raise FormatError(f"{shards[0]}: a field named {reserved[0]!r}, which the batch's own uses")
    _check_fields(shards, counts, arrays, fields, chosen)
    prefix = root.rstrip("/") + "/"
    infos = tuple(
        ShardInfo(u[len(prefix) :] if u.startswith(prefix) else u, index.size, index.num_samples)
        for u, index in zip(shards, indexes, strict=True)
    )
    metadata = {
        "read_in_place": FORMAT,
        "fields": fields,
        "columns": chosen,
        "sidecars": sidecars,
        # The indexes say where every sample lies: two datasets of one shape still differ
        # here, so a resume state of one is refused on the other.
        "fingerprint": format_digest(digest(b"".join(index.pack() for index in indexes))),
    }
    manifest = Manifest(FORMAT, np.dtype(np.uint8), infos, metadata)
    return Dataset(root, manifest, dict(storage_options), arrays)


def _concat(parts: Sequence[Int64Array]) -> Int64Array:
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def _check_fields(
    shards: Sequence[str],
    counts: Int64Array,
    arrays: Mapping[str, npt.NDArray[Any]],
    fields: list[str],
    chosen: list[str],
) -> None:
    """A ConfigError naming the first sample that lacks a field of ``chosen``."""
    members = arrays[MEMBERS]
    samples = int(members.size)
    if not samples:
        return
    owner = np.repeat(np.arange(samples), members)
    present = np.zeros((samples, len(fields)), dtype=bool)
    present[owner, arrays[FIELDS]] = True
    wanted = np.array([fields.index(c) for c in chosen], dtype=np.int64)
    lacking = ~present[:, wanted]
    bad = np.flatnonzero(lacking.any(axis=1))
    if not bad.size:
        return
    s = int(bad[0])
    shard = int(np.searchsorted(np.cumsum(counts), s, side="right"))
    offsets = arrays[KEY_OFFSETS]
    key = arrays[KEYS][offsets[s] : offsets[s + 1]].tobytes().decode("utf-8", "surrogateescape")
    absent = [chosen[j] for j in np.flatnonzero(lacking[s]).tolist()]
    held = [fields[j] for j in np.flatnonzero(present[s]).tolist()]
    common = [fields[j] for j in np.flatnonzero(present.all(axis=0)).tolist()]
    raise ConfigError(
        f"{shards[shard]}: sample {key!r} has no {', '.join(map(repr, absent))} field (it holds"
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


class WebDatasetSamples(PlannedSource):
    """Sample ``i`` is sample ``i`` of the shards one after another (of the datasets of a
    mixture one after another); fields: ``__key__``, ``__url__`` and the selected ones."""

    #: Decoding checks every member's header (numpy over the headers, off the loop).
    converts = True

    def __init__(self, datasets: Sequence[Dataset]) -> None:
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
        self.shard_urls: Sequence[str] = [u for d in self.datasets for u in d.shard_urls]
        shards = [len(d.manifest.shards) for d in self.datasets]
        self.shard_dataset = np.repeat(np.arange(len(shards), dtype=np.int64), shards)
        per_shard = np.array(
            [s.elements for d in self.datasets for s in d.manifest.shards], dtype=np.int64
        )
        #: Samples before the end of each shard: a sample's shard by ``np.searchsorted``.
        self.shard_ends = np.cumsum(per_shard)
        self.sizes = np.array([d.manifest.total_elements for d in self.datasets], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self.file_sizes = np.array(
            [s.nbytes for d in self.datasets for s in d.manifest.shards], dtype=np.int64
        )
        self.file_map = ShardMap(self.file_sizes, 1)
        arrays = [d.arrays for d in self.datasets]
        self.starts = _concat([a[STARTS] for a in arrays])
        self.ends = _concat([a[ENDS] for a in arrays])
        self.offsets = _concat([a[OFFSETS] for a in arrays])
        self.lengths = _concat([a[LENGTHS] for a in arrays])
        # Which member holds each selected field of each sample: [samples, fields].
        width = len(self.columns)
        self.table = np.full((self.num_samples, width), -1, dtype=np.int64)
        sample_base = member_base = 0
        whole = True
        for dataset, a in zip(self.datasets, arrays, strict=True):
            fields: list[str] = dataset.manifest.metadata["fields"]
            whole = whole and set(fields) <= set(self.columns)
            column_of = np.full(len(fields), -1, dtype=np.int64)
            for j, name in enumerate(self.columns):
                column_of[fields.index(name)] = j
            counts = a[MEMBERS]
            owner = np.repeat(np.arange(counts.size, dtype=np.int64), counts) + sample_base
            column = column_of[a[FIELDS]]
            chosen = np.flatnonzero(column >= 0)
            self.table[owner[chosen], column[chosen]] = chosen + member_base
            sample_base += int(counts.size)
            member_base += int(counts.sum())
        if (self.table < 0).any():
            raise ConfigError("a sample lacks a selected field (the datasets were opened apart)")
        #: Every member of every sample is selected: a sample is read as one range.
        self.whole = whole
        key_lengths = _concat([np.diff(a[KEY_OFFSETS]) for a in arrays])
        self.keys = np.concatenate([a[KEYS] for a in arrays])
        self.key_offsets = np.cumsum(np.append(0, key_lengths)).astype(np.int64)
        self.urls, self.url_offsets = _string_table(self.shard_urls)
        data = int(self.lengths[self.table].sum())
        self.sample_bytes = max(
            1, (data + int(self.keys.size)) // max(1, self.num_samples) + BLOCK * width
        )
        self.schema = {KEY: _STRING, URL: _STRING}
        self.schema.update({name: _BYTES for name in self.columns})

    def shard_of(self, ids: Int64Array) -> Int64Array:
        """The shard (numbered through the datasets) of each sample of ``ids``."""
        return np.searchsorted(self.shard_ends, ids, side="right").astype(np.int64)

    def plan(self, ids: Int64Array, gap: int) -> ReadPlan:
        """One range per sample (or per selected member), merged across gaps the store says
        cost less than a request; each member's data copied to its field's place, field
        after field, then every member's header."""
        members = self.table[ids].T.ravel()  # field-major
        base = self.file_map.starts[self.shard_of(ids)]
        member_base = np.tile(base, len(self.columns))
        data_at = member_base + self.offsets[members]
        lengths = self.lengths[members]
        if self.whole:
            starts = base + self.starts[ids]
            spans = self.ends[ids] - self.starts[ids]
        else:
            starts = data_at - BLOCK
            spans = lengths + BLOCK
        planned = self.file_map.plan(starts, spans, gap)
        read_at = self.file_map.starts[planned.read_shard] + planned.read_start
        data = int(lengths.sum())
        sources = np.concatenate([data_at, data_at - BLOCK])
        sizes = np.concatenate([lengths, np.full(members.size, BLOCK, dtype=np.int64)])
        dest = np.concatenate(
            [np.cumsum(lengths) - lengths, data + BLOCK * np.arange(members.size, dtype=np.int64)]
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
            nbytes=data + BLOCK * int(members.size),
        )

    def decode(self, buffer: npt.NDArray[np.uint8], ids: Int64Array) -> dict[str, Any]:
        """The fields of samples ``ids`` as views of ``buffer``, after their headers are
        checked against the index."""
        count = ids.size
        members = self.table[ids].T.ravel()
        lengths = self.lengths[members]
        data = int(lengths.sum())
        headers = buffer[data : data + BLOCK * members.size].reshape(members.size, BLOCK)
        self._check_headers(headers, members, lengths, ids)
        fields: dict[str, Any] = {
            KEY: _gather(self.keys, self.key_offsets, ids),
            URL: _gather(self.urls, self.url_offsets, self.shard_of(ids)),
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
        self,
        headers: npt.NDArray[np.uint8],
        members: Int64Array,
        lengths: Int64Array,
        ids: Int64Array,
    ) -> None:
        """Each member's header (the 512 bytes before its data) must be a tar header (its
        checksum right) of a regular file of the indexed length; else a FormatError naming the
        shard, the sample's key and the header's byte range."""
        if not members.size:
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
        sample = int(ids[m % ids.size])
        field = self.columns[m // ids.size]
        shard = int(self.shard_of(np.array([sample]))[0])
        start = int(self.offsets[members[m]]) - BLOCK
        key = self.keys[self.key_offsets[sample] : self.key_offsets[sample + 1]].tobytes()
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
            f"{self.shard_urls[shard]}: sample {key.decode('utf-8', 'surrogateescape')!r},"
            f" field {field!r}: bytes [{start}, {start + BLOCK}) are not the member's tar header"
            f" the index says ({why}); the shard changed after it was indexed, or is corrupt:"
            " write its index again with `asyncbatch index`"
        )


def webdataset_samples(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> WebDatasetSamples:
    """Source factory of the ``webdataset`` format: samples of tar shards."""
    if options:
        raise ConfigError(
            f"WebDataset shards take no format_options, got {sorted(options)}; choose fields"
            " with ab.open_dataset(..., options={'columns': [...]})"
        )
    if seq_len is not None or next_token:
        raise ConfigError("seq_len= and next_token= do not apply to WebDataset samples")
    if dtype is not None:
        raise ConfigError("dtype= does not apply to WebDataset samples: fields are bytes")
    return WebDatasetSamples(datasets)


WEBDATASET_OPENER = Opener(
    FORMAT,
    open_webdataset,
    claims=claims,
    probe=probe_webdataset,
    probes_for="no .tar shards listed under it",
    open_many=open_webdataset_list,
)
