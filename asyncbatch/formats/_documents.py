"""Documents: variable-length samples over a token stream, and packing them into windows.

A *documents* dataset (``manifest.format == "documents"``) is a token stream stored as the
tokens format stores it, plus ``dataset.arrays["document_offsets"]``: int64, ``D + 1``
entries, document ``d`` being elements ``[offsets[d], offsets[d + 1])`` of the concatenated
stream. ``offsets[0] == 0``, offsets never decrease (empty documents are allowed) and the last
equals the stream's length; documents cross shard ends freely. The sources below need nothing
else, so an opener of another layout (Megatron ``.bin``/``.idx``) builds such a dataset in
memory. asyncbatch's single-index layout keeps the offsets in one index file beside the
shards (raw little-endian int64, named by the manifest's ``metadata["document_index"]``), read
whole at open by :func:`load_document_index`. The per-shard layout
(:mod:`asyncbatch.formats._documents_index`) keeps one index per shard instead (paged: a small
top level, then pages of offsets), fetched by the source as batches need them: opening reads
the manifest alone.

Two ways to read one:

* ``seq_len=None`` (:class:`DocumentSamples`): sample ``i`` is document ``i``, whole (or cut
  to ``max_len``); one jagged column per field, never padded unless asked.
* ``seq_len=L`` (:class:`PackedDocuments`): sample ``i`` is the token window
  ``[i·L, i·L + L)`` (``+ 1`` with ``next_token``), exactly as the tokens format reads it,
  plus where documents start inside it (``cu_seqlens``, ``document_ids``, ``position_ids``),
  found by index math over the offsets.

A per-shard dataset may keep a value per document (``metadata["document_metadata"]``,
:mod:`asyncbatch.formats._documents_metadata`): documents as samples then get a ``metadata``
column, packed windows the metadata stream's ``meta_start``, ``meta_end`` and ``meta``
(``format_options={"metadata": False}`` reads none).

A mixture of document datasets numbers their documents one dataset after another, as it
numbers their samples. Its datasets keep metadata all or none (else a ConfigError, unless
``metadata=False``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema, Jagged
from .._dataset import Dataset, join_url, read_object
from .._errors import ConfigError, ManifestError, NotFoundError
from .._layout import ReadPlan, ShardMap
from .._manifest import MANIFEST_NAME
from ._base import Fetch, OffLoop, PlannedSource, Read, Source, Step
from ._documents_index import (
    DEFAULT_INDEX_CACHE_BYTES,
    SHARD_DOCUMENTS,
    DocumentIndex,
    ShardIndexes,
    is_per_shard,
)
from ._documents_metadata import (
    METADATA_FIELD,
    DocumentMetadata,
    DocumentMetaLayout,
    document_runs,
    has_document_metadata,
    wanted,
)
from ._metadata import END_FIELD, START_FIELD, VALUE_FIELD
from ._metadata_values import take_values
from ._tokens import TOKENS_FIELD, TokenWindows, output_dtype

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

    from ..stores._base import Store

Int64Array = npt.NDArray[np.int64]

FORMAT = "documents"
#: The key of the offsets in ``Dataset.arrays``.
OFFSETS = "document_offsets"
#: The index file asyncbatch writes beside the shards.
INDEX_NAME = "documents.idx"
INDEX_DTYPE = np.dtype("<i8")
OUTPUTS = ("jagged", "nested", "padded")
#: format_options of documents as samples, of packing, and of both.
OPTIONS = ("output", "pad_id", "max_len")
PACKING_OPTIONS = ("token_ids",)
INDEX_OPTIONS = ("index_cache_bytes", "metadata")


# ---------------------------------------------------------------------------------------------
# The offsets: checked once per dataset, whoever built them


def check_offsets(offsets: npt.NDArray[Any], total: int, where: str) -> Int64Array:
    """``offsets`` as int64 if they describe documents of a stream of ``total`` elements;
    a :class:`ManifestError` naming ``where`` otherwise."""
    if offsets.ndim != 1 or offsets.size == 0 or offsets.dtype.kind not in "iu":
        raise ManifestError(
            f"{where}: document offsets must be a non-empty 1-D integer array,"
            f" got {offsets.dtype} of shape {offsets.shape}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0:
        raise ManifestError(f"{where}: the first document offset is {offsets[0]}, not 0")
    falling = np.flatnonzero(offsets[1:] < offsets[:-1])
    if falling.size:
        d = int(falling[0])
        raise ManifestError(
            f"{where}: document offsets decrease: document {d + 1} starts at"
            f" {offsets[d + 1]}, before document {d} ({offsets[d]})"
        )
    if offsets[-1] != total:
        raise ManifestError(
            f"{where}: the document offsets end at element {offsets[-1]},"
            f" but the shards hold {total} elements"
        )
    return offsets


def document_offsets(dataset: Dataset) -> Int64Array:
    """The checked document offsets of ``dataset`` (a ManifestError names its URL)."""
    offsets = dataset.arrays.get(OFFSETS)
    if offsets is None:
        raise ManifestError(
            f"{dataset.url}: a documents dataset needs arrays[{OFFSETS!r}], and none was loaded"
        )
    return check_offsets(np.asarray(offsets), dataset.shard_map.total, dataset.url)


def document_count(dataset: Dataset) -> int:
    """Documents in ``dataset``, of either layout."""
    if is_per_shard(dataset):
        return int(dataset.manifest.metadata["documents"])
    return int(document_offsets(dataset).size - 1)


async def load_document_index(dataset: Dataset, store: Store) -> Dataset:
    """``INDEX_LOADERS["documents"]``: read the index file named by the manifest (one whole
    object, never the data) into ``dataset.arrays["document_offsets"]``; of the per-shard
    layout, read nothing (the manifest's per-shard counts go to
    ``dataset.arrays["shard_documents"]``; its ``document_metadata`` entries are checked)."""
    if is_per_shard(dataset):
        counts = ShardIndexes.of(dataset).counts
        if has_document_metadata(dataset):
            DocumentMetaLayout.of(dataset)  # its manifest entries checked at open, too
        return dataclasses.replace(dataset, arrays={**dataset.arrays, SHARD_DOCUMENTS: counts})
    if has_document_metadata(dataset):
        DocumentMetaLayout.of(dataset)  # refused: metadata needs the per-shard index
    manifest_url = join_url(dataset.url, MANIFEST_NAME)
    name = dataset.manifest.metadata.get("document_index")
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{manifest_url}: a documents manifest must name its document_index")
    url = join_url(dataset.url, name)
    try:
        raw = await read_object(store, url)
    except NotFoundError as exc:
        raise ManifestError(
            f"{url}: the document index named by {manifest_url} is missing"
        ) from exc
    if len(raw) % INDEX_DTYPE.itemsize:
        raise ManifestError(f"{url}: {len(raw)} bytes is not a whole number of int64 offsets")
    offsets = np.frombuffer(raw, dtype=INDEX_DTYPE).astype(np.int64)
    count = dataset.manifest.metadata.get("documents")
    if count is not None and offsets.size != int(count) + 1:
        raise ManifestError(
            f"{url}: {offsets.size} offsets, but the manifest says {count} documents"
            f" ({int(count) + 1} offsets)"
        )
    offsets = check_offsets(offsets, dataset.manifest.total_elements, url)
    return dataclasses.replace(dataset, arrays={**dataset.arrays, OFFSETS: offsets})


def _joined(
    datasets: Sequence[Dataset],
) -> tuple[ShardMap, list[str], Int64Array, np.dtype[Any]]:
    """Shards of several datasets numbered one after another:
    ``(shard_map, shard_urls, shard_dataset, stored dtype)``."""
    stored = datasets[0].manifest.dtype
    for one in datasets[1:]:
        if one.manifest.dtype != stored:
            raise ConfigError(f"{one.url} holds {one.manifest.dtype}, not {stored} as the rest")
    if len(datasets) == 1:
        shard_map = datasets[0].shard_map
    else:
        counts = np.concatenate([d.shard_map.counts for d in datasets])
        headers = np.concatenate([d.shard_map.offsets for d in datasets])
        shard_map = ShardMap(counts, stored.itemsize, headers)
    urls = [url for d in datasets for url in d.shard_urls]
    shard_dataset = np.repeat(np.arange(len(datasets)), [len(d.manifest.shards) for d in datasets])
    return shard_map, urls, shard_dataset, stored


class _Offsets:
    """The documents of joined datasets: all offsets in memory (``offsets``, numbered through
    the datasets), or, when a dataset has per-shard indexes, an ``index`` that fetches them.
    The index files join the source's files after the shards."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        shard_urls: list[str],
        shard_dataset: Int64Array,
        budget: int,
        metadata: bool | None = None,
    ) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConfigError(
                f"format_options index_cache_bytes must be a number of bytes, got {budget!r}"
            )
        parts = [None if is_per_shard(d) else document_offsets(d) for d in datasets]
        self.index: DocumentIndex | None = None
        self.offsets = np.zeros(1, dtype=np.int64)
        self.shard_urls, self.shard_dataset = shard_urls, shard_dataset
        self.described_files: Mapping[str, tuple[int, int | None]] = {}
        #: The documents' metadata, when the datasets keep it and it is asked for.
        self.metadata: DocumentMetadata | None = None
        # Parsed first: a dataset that keeps metadata without per-shard indexes is refused.
        layouts = [DocumentMetaLayout.of(d) for d in datasets] if wanted(datasets, metadata) else []
        if all(p is not None for p in parts):
            present = [p for p in parts if p is not None]
            totals = [int(p[-1]) for p in present]
            bases = np.cumsum(totals) - totals
            self.offsets = (
                present[0]
                if len(present) == 1
                else np.concatenate(
                    [p[:-1] + b for p, b in zip(present, bases.tolist(), strict=True)]
                    + [np.array([sum(totals)], dtype=np.int64)]
                )
            )
            return
        index = DocumentIndex(datasets, parts, len(shard_urls), budget)
        self.index = index
        self.shard_urls = [*shard_urls, *index.index_urls]
        self.shard_dataset = np.concatenate(
            [shard_dataset, np.array(index.index_dataset, dtype=np.int64)]
        )
        self.described_files = index.described_files
        if layouts:
            meta = DocumentMetadata(datasets, layouts, len(self.shard_urls))
            self.metadata = meta
            self.shard_urls = [*self.shard_urls, *meta.urls]
            self.shard_dataset = np.concatenate([self.shard_dataset, meta.url_dataset])
            self.described_files = {**index.described_files, **meta.described_files}


# ---------------------------------------------------------------------------------------------
# Documents as samples


class _PerBatch:
    """A group's jagged column that becomes another form (nested, padded, mask) when the
    engine slices one batch off it, since that form cannot be sliced or padded per group."""

    __slots__ = ("column", "convert")

    def __init__(self, column: Jagged, convert: Callable[[Jagged], Any]) -> None:
        self.column = column
        self.convert = convert

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, index: slice) -> Any:
        return self.convert(self.column[index])


def _pad(column: Jagged, pad: Any, width: int | None) -> torch.Tensor:
    """``[samples, width]`` padded with ``pad`` (numpy does it: torch cannot index-put
    uint16); ``width`` None means the longest sample's length."""
    import torch

    lengths = column.lengths.numpy()
    if width is None:
        width = int(lengths.max()) if lengths.size else 0
    values = column.values.numpy()
    out = np.full((lengths.size, width, *values.shape[1:]), pad, dtype=values.dtype)
    # Samples never exceed ``width``, so the real positions in row-major order are exactly
    # the concatenated values.
    out[np.arange(width)[None, :] < lengths[:, None]] = values
    return torch.from_numpy(out)


class DocumentSamples(PlannedSource):
    """Sample ``i`` = document ``i`` (cut to ``max_len``), as a jagged column per field.

    ``output="nested"`` gives ``torch.nested`` jagged tensors instead; ``output="padded"``
    gives dense ``[batch, width]`` tensors padded with ``pad_id`` (width ``max_len`` when
    given, so every batch has one shape; else the batch's longest document) plus
    ``lengths`` and ``attention_mask``.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        *,
        dtype: npt.DTypeLike | torch.dtype | None = None,
        output: str = "jagged",
        pad_id: int = 0,
        max_len: int | None = None,
        index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES,
        metadata: bool | None = None,
    ) -> None:
        self.datasets: Sequence[Dataset] = list(datasets)
        if output not in OUTPUTS:
            raise ConfigError(f"format_options output={output!r}: expected one of {OUTPUTS}")
        if max_len is not None and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            raise ConfigError(f"format_options max_len must be a positive integer, got {max_len!r}")
        self.output, self.max_len = output, max_len
        self.shard_map, urls, shard_dataset, stored = _joined(self.datasets)
        joined = _Offsets(self.datasets, urls, shard_dataset, index_cache_bytes, metadata)
        self.offsets, self.index = joined.offsets, joined.index
        self.metadata = joined.metadata
        self.shard_urls: Sequence[str] = joined.shard_urls
        self.shard_dataset = joined.shard_dataset
        #: Index files the engine checks as it checks shards (per-shard indexes).
        self.described_files = joined.described_files
        self.stored_dtype = stored
        self.sizes = np.array([document_count(d) for d in self.datasets], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self.out_dtype = output_dtype(dtype, stored, self.datasets[0].url)
        if self.out_dtype is not None and stored.names:
            raise ConfigError(f"dtype={dtype!r} cannot convert the structured dtype {stored}")
        self.converts = self.out_dtype is not None and self.out_dtype != stored
        final = self.out_dtype if self.converts and self.out_dtype is not None else stored
        self.pad_id = pad_id
        if output == "padded":
            if isinstance(pad_id, bool) or not isinstance(pad_id, int | float):
                raise ConfigError(f"format_options pad_id must be a number, got {pad_id!r}")
            for name in stored.names or (None,):
                kind = final[name] if name is not None else final
                if np.array(pad_id).astype(kind) != pad_id:
                    raise ConfigError(f"format_options pad_id={pad_id!r} does not fit {kind}")
        mean = self.shard_map.total / max(1, self.num_samples)
        if max_len is not None:
            mean = min(mean, max_len)
        per_element = stored.itemsize + (final.itemsize if self.converts else 0)
        self.sample_bytes = max(1, int(mean * per_element))
        self.names = stored.names or (TOKENS_FIELD,)
        width = max_len if output == "padded" and max_len is not None else -1
        self.schema = {
            name: FieldSchema(
                dtype=str(final[name] if stored.names else final),
                shape=(width,),
                nested=output != "padded",
            )
            for name in self.names
        }
        if output == "padded":
            self.schema["lengths"] = FieldSchema(dtype="int64", shape=())
            self.schema["attention_mask"] = FieldSchema(dtype="bool", shape=(width,))
        if self.metadata is not None:
            if METADATA_FIELD in self.schema:
                raise ConfigError(
                    f"{self.datasets[0].url}: a field named {METADATA_FIELD!r} clashes with the"
                    " documents' metadata column (pass format_options={'metadata': False})"
                )
            self.schema[METADATA_FIELD] = self.metadata.sample_schema
            self.sample_bytes += self.metadata.value_bytes

    def _spans(self, ids: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Element start and length of documents ``ids``, all offsets being in memory."""
        starts = self.offsets[ids]
        return self._cut(starts, self.offsets[ids + 1] - starts)

    def _cut(self, starts: Int64Array, lengths: Int64Array) -> tuple[Int64Array, Int64Array]:
        if self.max_len is not None:
            np.minimum(lengths, self.max_len, out=lengths)
        return starts, lengths

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The documents ``ids``; with per-shard indexes, after fetching those of the shards
        they lie in that are not cached yet (or, when not all fit the cache, the documents'
        own offsets, by range)."""
        if self.index is None:
            return (yield from super().fetch(ids, gap))
        index = self.index
        wait, turn = index.turns.take()
        try:
            if wait is not None:
                yield wait
            tokens = self._read_documents(ids, gap, turn)
            if self.metadata is None:
                buffer, lengths = yield from tokens
            else:  # the metadata's reads go with the index reads, in this batch's turn
                meta = self.metadata.of_documents(ids, index, gap)
                (buffer, lengths), fetched = yield (tokens, meta)
        finally:  # set by then, unless the reads were stopped before they began
            if not turn.done():
                turn.set_result(None)
        metadata = self.metadata

        def decode() -> dict[str, Any]:
            fields = self._decode(buffer, ids.size, lengths)
            if metadata is not None:
                fields[METADATA_FIELD] = metadata.values.decode(fetched)
            return fields

        if self.converts or metadata is not None:
            fields: dict[str, Any] = yield OffLoop(decode)
            return fields
        return decode()

    def _read_documents(
        self, ids: Int64Array, gap: int, turn: Future[None]
    ) -> Generator[Step, Any, tuple[npt.NDArray[np.uint8], Int64Array]]:
        """The bytes of documents ``ids`` and their lengths: their offsets first (lets the
        next batch take its ``turn`` as the token reads are issued)."""
        index = self.index
        assert index is not None
        try:
            starts, ends = yield from index.document_spans(ids, gap)
            starts, lengths = self._cut(starts, ends - starts)
            plan = self._plan(starts, lengths, gap)
        finally:
            if not turn.done():
                turn.set_result(None)
        buffer = yield Read(plan)
        return buffer, lengths

    def plan(self, ids: Int64Array, gap: int) -> ReadPlan:
        return self._plan(*self._spans(ids), gap)

    def _plan(self, starts: Int64Array, lengths: Int64Array, gap: int) -> ReadPlan:
        if not lengths.all():  # empty documents read nothing (one may sit past the last shard)
            keep = lengths > 0
            starts, lengths = starts[keep], lengths[keep]
        return self.shard_map.plan(starts, lengths, gap)

    def decode(self, buffer: npt.NDArray[np.uint8], ids: Int64Array) -> dict[str, Any]:
        return self._decode(buffer, ids.size, self._spans(ids)[1])

    def _decode(
        self, buffer: npt.NDArray[np.uint8], count: int, lengths: Int64Array
    ) -> dict[str, Any]:
        import torch

        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = buffer.view(self.stored_dtype)
        if self.converts and self.out_dtype is not None:
            values = values.astype(self.out_dtype)
        torch_offsets = torch.from_numpy(offsets)
        columns = {
            name: Jagged(
                torch.from_numpy(
                    np.ascontiguousarray(values[name]) if self.stored_dtype.names else values
                ),
                torch_offsets,
            )
            for name in self.names
        }
        if self.output == "jagged":
            return dict(columns)
        if self.output == "nested":
            return {name: _PerBatch(c, Jagged.to_nested) for name, c in columns.items()}
        width, pad = self.max_len, self.pad_id
        fields: dict[str, Any] = {
            name: _PerBatch(c, lambda c: _pad(c, pad, width)) for name, c in columns.items()
        }
        first = columns[self.names[0]]
        fields["lengths"] = torch.from_numpy(lengths)
        fields["attention_mask"] = _PerBatch(first, lambda c: c.mask(width))
        return fields


# ---------------------------------------------------------------------------------------------
# Packing: token windows plus the document boundaries inside each


class PackedDocuments(TokenWindows):
    """Token windows of a documents dataset, with the documents' boundaries inside each.

    Fields besides the tokens (a window of ``W = L (+ 1)`` elements):

    * ``cu_seqlens``: a :class:`Jagged` of int32, per window ``0``, the start of every
      document that begins strictly inside the first ``L`` positions, then ``L``
      (flash-attention's ``cu_seqlens`` for that window's inputs);
    * ``document_ids``: int64 ``[batch, W]``, the document of every token (numbered through
      the mixture's documents);
    * ``position_ids``: int64 ``[batch, W]``, each token's position counted from the start
      of its document *inside the window* (0 at the window's start and at every boundary),
      consistent with ``cu_seqlens``.

    Boundaries come from ``np.searchsorted`` over the offsets for the whole batch: no scan
    of the data, no Python per window.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        seq_len: int,
        *,
        next_token: bool = False,
        dtype: npt.DTypeLike | torch.dtype | None = None,
        token_ids: bool = True,
        index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES,
        metadata: bool | None = None,
    ) -> None:
        super().__init__(datasets, seq_len, next_token=next_token, dtype=dtype)
        if not isinstance(token_ids, bool):
            raise ConfigError(f"format_options token_ids must be True or False, got {token_ids!r}")
        urls = list(self.shard_urls)
        joined = _Offsets(self.datasets, urls, self.shard_dataset, index_cache_bytes, metadata)
        self.offsets, self.index = joined.offsets, joined.index
        self.metadata = joined.metadata
        self.shard_urls, self.shard_dataset = joined.shard_urls, joined.shard_dataset
        #: Index files the engine checks as it checks shards (per-shard indexes).
        self.described_files = joined.described_files
        self.token_ids = token_ids
        self.sample_bytes += 8 + (self.window * 16 if token_ids else 0)
        self.schema["cu_seqlens"] = FieldSchema(dtype="int32", shape=(-1,), nested=True)
        if token_ids:
            self.schema["document_ids"] = FieldSchema(dtype="int64", shape=(self.window,))
            self.schema["position_ids"] = FieldSchema(dtype="int64", shape=(self.window,))
        if self.metadata is not None:
            clash = {START_FIELD, END_FIELD, VALUE_FIELD} & set(self.schema)
            if clash:
                raise ConfigError(
                    f"{self.dataset.url}: fields {sorted(clash)} clash with the documents'"
                    " metadata columns (pass format_options={'metadata': False})"
                )
            runs = FieldSchema("int64", (-1,), nested=True)
            self.schema.update(
                {START_FIELD: runs, END_FIELD: runs, VALUE_FIELD: self.metadata.run_schema}
            )
            documents = max(1, int(self.index.documents.sum()) if self.index is not None else 1)
            per_window = self.window * documents / max(1, self.shard_map.total) + 1
            self.sample_bytes += int(per_window * (16 + self.metadata.value_bytes))

    def window_starts(self, ids: Int64Array) -> Int64Array:
        """Element (of the joined stream) where each window starts."""
        if len(self.datasets) == 1:
            return ids * self.seq_len
        which = np.searchsorted(self._id_ends, ids, side="right")
        local = ids - (self._id_ends - self.sizes)[which]
        starts: Int64Array = self._element_base[which] + local * self.seq_len
        return starts

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The windows ``ids``; with per-shard indexes, the indexes of the shards they touch
        that are not cached yet are fetched while the tokens are read."""
        if self.index is None:
            return (yield from super().fetch(ids, gap))
        starts = self.window_starts(ids)
        loading = self._offsets(ids, starts, gap)
        (offsets, numbers, meta), buffer = yield (loading, Read(self.windows(ids, gap)))

        def decode() -> dict[str, Any]:
            fields = TokenWindows.decode(self, buffer, ids)
            fields.update(
                boundaries(offsets, starts, self.seq_len, self.window, self.token_ids, numbers)
            )
            if meta is not None:
                fields.update(meta())
            return fields

        if self.converts or meta is not None:
            fields: dict[str, Any] = yield OffLoop(decode)
            return fields
        return decode()

    def _offsets(
        self, ids: Int64Array, starts: Int64Array, gap: int
    ) -> Generator[Step, Any, tuple[Int64Array, Int64Array, Callable[[], dict[str, Any]] | None]]:
        """The offsets around the windows (see :meth:`DocumentIndex.window_offsets`), and with
        metadata, once its values are fetched, what makes its columns."""
        index = self.index
        assert index is not None
        offsets, numbers = yield from index.window_offsets(starts, self.window)
        metadata = self.metadata
        if metadata is None:
            return offsets, numbers, None
        runs = document_runs(offsets, numbers, starts, self.window)
        fetched, item_of_run = yield from metadata.of_runs(runs, index, gap)

        def columns() -> dict[str, Any]:
            import torch

            values = take_values(metadata.values.decode(fetched), item_of_run)
            bounds = np.searchsorted(runs.sample, np.arange(ids.size + 1)).astype(np.int64)
            offsets = torch.from_numpy(bounds)
            return {
                START_FIELD: Jagged(torch.from_numpy(runs.start), offsets),
                END_FIELD: Jagged(torch.from_numpy(runs.end), offsets),
                VALUE_FIELD: Jagged(values, offsets),
            }

        return offsets, numbers, columns

    def decode(self, buffer: npt.NDArray[np.uint8], ids: Int64Array) -> dict[str, Any]:
        fields = super().decode(buffer, ids)
        starts = self.window_starts(ids)
        fields.update(boundaries(self.offsets, starts, self.seq_len, self.window, self.token_ids))
        return fields


def boundaries(
    offsets: Int64Array,
    starts: Int64Array,
    seq_len: int,
    window: int,
    token_ids: bool = True,
    numbers: Int64Array | None = None,
) -> dict[str, Any]:
    """``cu_seqlens``, and with ``token_ids`` ``document_ids`` and ``position_ids``, of the
    windows of ``window`` elements at ``starts`` (see :class:`PackedDocuments`), vectorised
    over the windows. ``numbers``: the document number of each offset (default: its
    index), when ``offsets`` are a part of the offsets around the windows."""
    import torch

    n = starts.size
    first_doc = np.searchsorted(offsets, starts, side="right") - 1
    # Offsets strictly inside each window: indexes lo[b] .. hi[b] - 1 of ``offsets``.
    lo = first_doc + 1
    hi = np.searchsorted(offsets, starts + window, side="left")
    counts = hi - lo
    # Flattened over the windows: boundary j is in window which[j], the rank[j]-th there.
    heads = np.cumsum(counts + 1) - (counts + 1)  # where each window's segments begin
    which = np.repeat(np.arange(n), counts)
    flat = np.arange(which.size)
    rank = flat - (heads[which] - which)
    index = lo[which] + rank  # the document starting there
    at = offsets[index] - starts[which]  # window-relative; equal for empty documents
    fields: dict[str, Any] = {"cu_seqlens": _cu_seqlens(at, which, n, seq_len)}
    if not token_ids:
        return fields
    # Segments: each window's head, then one per document starting inside it (an empty
    # document's is zero tokens long); per token, two repeats and no cumulative sum.
    segment = np.empty(n + which.size, dtype=np.int64)
    segment_doc = np.empty_like(segment)
    inner_at = flat + which + 1
    segment[heads] = np.arange(n) * window
    segment[inner_at] = which * window + at
    segment_doc[heads] = first_doc
    segment_doc[inner_at] = index
    if numbers is not None:
        segment_doc = numbers[segment_doc]
    length = np.diff(segment, append=n * window)
    document_ids = np.repeat(segment_doc, length).reshape(n, window)
    positions = np.repeat(segment, length)
    np.subtract(_ramp(n * window), positions, out=positions)
    position_ids = positions.reshape(n, window)
    fields["document_ids"] = torch.from_numpy(document_ids)
    fields["position_ids"] = torch.from_numpy(position_ids)
    return fields


_RAMPS: list[Int64Array] = [np.arange(0, dtype=np.int64)]


def _ramp(size: int) -> Int64Array:
    """``arange(size)``, a read-only view of one shared array (grown when too short)."""
    ramp = _RAMPS[-1]
    if ramp.size < size:
        ramp = np.arange(max(size, 2 * ramp.size), dtype=np.int64)
        ramp.flags.writeable = False
        _RAMPS[-1] = ramp  # threads may race here: each gets a correct ramp
    return ramp[:size]


def _cu_seqlens(at: Int64Array, which: Int64Array, n: int, seq_len: int) -> Jagged:
    """Per window: 0, the distinct boundaries ``at`` (window-relative, grouped by window
    ``which``, ascending) inside ``(0, seq_len)``, then ``seq_len``; int32."""
    import torch

    keep = at < seq_len
    keep[1:] &= (at[1:] != at[:-1]) | (which[1:] != which[:-1])
    inner_of = which[keep]
    inner = np.bincount(inner_of, minlength=n)
    sizes = inner + 2
    cu_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu_offsets[1:])
    values = np.empty(int(cu_offsets[-1]), dtype=np.int32)
    values[cu_offsets[:-1]] = 0
    values[cu_offsets[1:] - 1] = seq_len
    inner_rank = np.arange(inner_of.size) - np.repeat(np.cumsum(inner) - inner, inner)
    values[cu_offsets[:-1][inner_of] + 1 + inner_rank] = at[keep]
    return Jagged(torch.from_numpy(values), torch.from_numpy(cu_offsets))


def documents(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> Source:
    """Source factory of the ``documents`` format: documents as samples without ``seq_len``
    (``format_options``: ``output``, ``pad_id``, ``max_len``), packed windows with it
    (``token_ids``); both take ``index_cache_bytes`` (per-shard indexes kept) and
    ``metadata`` (None: read the documents' metadata when the datasets keep it; True: they
    must; False: read none)."""
    known = OPTIONS + PACKING_OPTIONS + INDEX_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown format_options {unknown} for documents (known: {', '.join(known)})"
        )
    if seq_len is not None:
        wrong = sorted(set(options) - set(PACKING_OPTIONS + INDEX_OPTIONS))
        if wrong:
            raise ConfigError(
                f"format_options {wrong} apply to documents as samples (seq_len=None);"
                f" with seq_len={seq_len} documents are packed into windows"
            )
        return PackedDocuments(datasets, seq_len, next_token=next_token, dtype=dtype, **options)
    if "token_ids" in options:
        raise ConfigError("format_options token_ids applies to packing (seq_len=L)")
    if next_token:
        raise ConfigError("next_token=True needs seq_len= (packing); a document sample is whole")
    if "pad_id" in options and options.get("output") != "padded":
        raise ConfigError("format_options pad_id applies to output='padded'")
    return DocumentSamples(datasets, dtype=dtype, **options)
