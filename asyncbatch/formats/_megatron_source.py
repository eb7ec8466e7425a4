"""Sources of Megatron datasets: what the ``documents`` format gives, from pages of the
``.idx`` fetched as batches need them (:mod:`asyncbatch.formats._megatron_index`).

* ``seq_len=None`` (:class:`MegatronSamples`): sample ``i`` is sequence (or document) ``i``,
  as :class:`~asyncbatch.formats._documents.DocumentSamples` gives it (``output``,
  ``pad_id``, ``max_len``); the page holding its offsets is fetched beside nothing else,
  then its tokens, one ranged read per sample (neighbours merged as for any format).
* ``seq_len=L`` (:class:`MegatronWindows`): the token windows of the tokens format plus
  ``cu_seqlens``, ``document_ids`` and ``position_ids``, as
  :class:`~asyncbatch.formats._documents.PackedDocuments` gives them; the pages around the
  windows are fetched while their tokens are read.

Batches are byte for byte those of the documents format over the same offsets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._dataset import Dataset
from .._errors import ConfigError
from ._base import Fetch, OffLoop, Read, Source
from ._documents import OFFSETS, DocumentSamples, boundaries
from ._megatron_index import DEFAULT_INDEX_CACHE_BYTES, MegatronIndex
from ._tokens import TokenWindows

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

Int64Array = npt.NDArray[np.int64]

#: format_options of samples, of windows, and of both.
SAMPLE_OPTIONS = ("output", "pad_id", "max_len")
WINDOW_OPTIONS = ("token_ids",)
INDEX_OPTIONS = ("index_cache_bytes",)


def _joined_files(
    shard_urls: Sequence[str], shard_dataset: Int64Array, index: MegatronIndex
) -> tuple[list[str], Int64Array]:
    """The shards, then the ``.idx`` files; the dataset of each."""
    urls = [*shard_urls, *index.index_urls]
    dataset = np.concatenate([shard_dataset, np.array(index.index_dataset, dtype=np.int64)])
    return urls, dataset


class MegatronSamples:
    """Sample ``i`` = entry ``i`` (a sequence, or a document), cut to ``max_len``; the
    fields of :class:`~asyncbatch.formats._documents.DocumentSamples`, which decodes them."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        *,
        dtype: npt.DTypeLike | torch.dtype | None = None,
        output: str = "jagged",
        pad_id: int = 0,
        max_len: int | None = None,
        index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES,
    ) -> None:
        self.datasets: Sequence[Dataset] = list(datasets)
        # The documents format's samples over one document a dataset give the fields, their
        # schema and their decoding; the offsets come from the pages.
        stand_ins = [
            dataclasses.replace(
                d,
                manifest=dataclasses.replace(d.manifest, format="documents", metadata={}),
                arrays={OFFSETS: np.array([0, d.manifest.total_elements], dtype=np.int64)},
            )
            for d in self.datasets
        ]
        self.shape = DocumentSamples(
            stand_ins, dtype=dtype, output=output, pad_id=pad_id, max_len=max_len
        )
        self.index = MegatronIndex(self.datasets, len(self.shape.shard_urls), index_cache_bytes)
        urls, self.shard_dataset = _joined_files(
            self.shape.shard_urls, self.shape.shard_dataset, self.index
        )
        self.shard_urls: Sequence[str] = urls
        #: The ``.idx`` files, which the engine checks as it checks shards (their size).
        self.described_files: Mapping[str, tuple[int, int | None]] = self.index.described_files
        self.sizes = self.index.entries
        self.num_samples = int(self.sizes.sum())
        self.schema: dict[str, FieldSchema] = self.shape.schema
        self.converts: bool = self.shape.converts
        stored = self.shape.stored_dtype
        mean = self.shape.shard_map.total / max(1, self.num_samples)
        if max_len is not None:
            mean = min(mean, max_len)
        final = self.shape.out_dtype if self.converts and self.shape.out_dtype else stored
        per_element = stored.itemsize + (final.itemsize if self.converts else 0)
        self.sample_bytes = max(1, int(mean * per_element))

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The pages holding the offsets of ``ids`` (those not cached), then their tokens."""
        starts, ends = yield from self.index.spans(ids)
        starts, lengths = self.shape._cut(starts, ends - starts)
        buffer = yield Read(self.shape._plan(starts, lengths, gap))
        shape = self.shape

        def decode() -> dict[str, Any]:
            return shape._decode(buffer, ids.size, lengths)

        if self.converts:
            fields: dict[str, Any] = yield OffLoop(decode)
            return fields
        return decode()


class MegatronWindows(TokenWindows):
    """Token windows with the boundaries of the entries (sequences, or documents) inside
    each: the fields of :class:`~asyncbatch.formats._documents.PackedDocuments`."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        seq_len: int,
        *,
        next_token: bool = False,
        dtype: npt.DTypeLike | torch.dtype | None = None,
        token_ids: bool = True,
        index_cache_bytes: int = DEFAULT_INDEX_CACHE_BYTES,
    ) -> None:
        super().__init__(datasets, seq_len, next_token=next_token, dtype=dtype)
        if not isinstance(token_ids, bool):
            raise ConfigError(f"format_options token_ids must be True or False, got {token_ids!r}")
        self.index = MegatronIndex(self.datasets, len(self.shard_urls), index_cache_bytes)
        self.shard_urls, self.shard_dataset = _joined_files(
            self.shard_urls, self.shard_dataset, self.index
        )
        #: The ``.idx`` files, which the engine checks as it checks shards (their size).
        self.described_files: Mapping[str, tuple[int, int | None]] = self.index.described_files
        self.token_ids = token_ids
        self.sample_bytes += 8 + (self.window * 16 if token_ids else 0)
        self.schema["cu_seqlens"] = FieldSchema(dtype="int32", shape=(-1,), nested=True)
        if token_ids:
            self.schema["document_ids"] = FieldSchema(dtype="int64", shape=(self.window,))
            self.schema["position_ids"] = FieldSchema(dtype="int64", shape=(self.window,))

    def window_starts(self, ids: Int64Array) -> Int64Array:
        """Element (of the joined stream) where each window starts."""
        if len(self.datasets) == 1:
            return ids * self.seq_len
        which = np.searchsorted(self._id_ends, ids, side="right")
        local = ids - (self._id_ends - self.sizes)[which]
        starts: Int64Array = self._element_base[which] + local * self.seq_len
        return starts

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The windows ``ids``; the pages around them not cached yet are fetched while the
        tokens are read."""
        index = self.index
        starts = self.window_starts(ids)
        pages = index.pages_of_windows(starts, self.window)
        table, buffer = yield (
            index.load(index.pages, pages),
            Read(self.windows(ids, gap), self.convert),
        )
        offsets, numbers = index.window_offsets(pages, table)

        def decode() -> dict[str, Any]:
            fields = TokenWindows.decode(self, buffer, ids)
            fields.update(
                boundaries(offsets, starts, self.seq_len, self.window, self.token_ids, numbers)
            )
            return fields

        if self.converts:
            fields: dict[str, Any] = yield OffLoop(decode)
            return fields
        return decode()


def megatron_documents(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> Source:
    """Source factory of the ``megatron`` format: entries as samples without ``seq_len``
    (``format_options``: ``output``, ``pad_id``, ``max_len``), packed windows with it
    (``token_ids``); both take ``index_cache_bytes`` (pages of the ``.idx`` kept) and, as the
    documents format does, ``metadata`` (None or False: there is none)."""
    metadata = options.pop("metadata", None)
    if metadata:  # as the documents format takes it: a Megatron dataset keeps none
        raise ConfigError(
            f"format_options metadata={metadata!r}: a Megatron dataset keeps no per-document"
            " metadata"
        )
    known = SAMPLE_OPTIONS + WINDOW_OPTIONS + INDEX_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown format_options {unknown} for Megatron datasets (known: {', '.join(known)})"
        )
    if seq_len is not None:
        wrong = sorted(set(options) - set(WINDOW_OPTIONS + INDEX_OPTIONS))
        if wrong:
            raise ConfigError(
                f"format_options {wrong} apply to sequences as samples (seq_len=None);"
                f" with seq_len={seq_len} sequences are packed into windows"
            )
        return MegatronWindows(datasets, seq_len, next_token=next_token, dtype=dtype, **options)
    if "token_ids" in options:
        raise ConfigError("format_options token_ids applies to packing (seq_len=L)")
    if next_token:
        raise ConfigError("next_token=True needs seq_len= (packing); a sequence sample is whole")
    if "pad_id" in options and options.get("output") != "padded":
        raise ConfigError("format_options pad_id applies to output='padded'")
    return MegatronSamples(datasets, dtype=dtype, **options)
