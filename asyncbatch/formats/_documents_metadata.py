"""Per-document metadata of a documents dataset (``metadata["document_metadata"]``).

Beside each token shard of the per-shard layout, a value file pair as the metadata stream
keeps its values (:mod:`asyncbatch.formats._metadata_values`): ``.meta.idx``, ``n + 1``
little-endian int64 byte offsets into ``.meta.bin``, which holds the ``n`` documents' values
in the shard's document order, encoded by the codec the manifest names (``prepare`` writes
JSON Lines: one compact JSON object per document). The manifest says::

    "document_metadata": {"fields": [...], "codec": {"name": "json", "options": {}},
        "shards": [{"index": ..., "data": ..., "count": n, "bytes": ...,
                    "index_checksum": ..., "checksum": ...}, ...]}

one entry per token shard, ``count`` equal to that shard's documents. Opening reads the
manifest only. A batch reads, per shard it touches, the index entries around the documents it
holds (by range, merged as token reads are), then those values' bytes (likewise): two rounds
of small reads, never a whole file unless that is what the ranges merge to.

Documents as samples get one more column, ``metadata`` (each document's value); packed
windows get the metadata stream's ``meta_start``, ``meta_end`` and ``meta``: one run per
document with tokens in the window, cut at the window's edges.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._checksums import parse_digest
from .._dataset import join_url
from .._errors import ConfigError, FormatError, ManifestError, NotFoundError
from .._manifest import MANIFEST_NAME
from ._base import Step
from ._documents_index import SHARD_DOCUMENTS, is_per_shard
from ._metadata_codecs import make_codec
from ._metadata_values import INDEX_DTYPE, Fetched, ValueFiles

if TYPE_CHECKING:
    from .._dataset import Dataset
    from ._documents_index import DocumentIndex

Int64Array = npt.NDArray[np.int64]

#: The manifest's ``metadata`` key of the section.
DOCUMENT_METADATA = "document_metadata"
#: The column of documents as samples.
METADATA_FIELD = "metadata"
#: Bytes a decoded value costs in a batch beyond its encoded bytes (a Python object).
OBJECT_BYTES = 64


def has_document_metadata(dataset: Dataset) -> bool:
    return DOCUMENT_METADATA in dataset.manifest.metadata


@dataclass(frozen=True)
class DocumentMetaLayout:
    """One dataset's ``document_metadata`` section, checked against its shards."""

    fields: tuple[str, ...]
    codec: str
    codec_options: dict[str, Any]
    index_urls: tuple[str, ...]
    data_urls: tuple[str, ...]
    counts: Int64Array
    data_bytes: Int64Array
    index_checksums: tuple[int | None, ...]
    checksums: tuple[int | None, ...]

    @classmethod
    def of(cls, dataset: Dataset) -> DocumentMetaLayout:
        """Parse and check (O(shards)); a problem is a ManifestError naming the manifest."""
        where = join_url(dataset.url, MANIFEST_NAME)
        metadata = dataset.manifest.metadata

        def digest(entry: dict[str, Any], key: str) -> int | None:
            value = entry.get(key)
            return None if value is None else parse_digest(value)

        try:
            raw = metadata[DOCUMENT_METADATA]
            entries = list(raw["shards"])
            layout = cls(
                tuple(str(name) for name in raw.get("fields", ())),
                str(raw["codec"]["name"]),
                dict(raw["codec"].get("options", {})),
                tuple(join_url(dataset.url, str(e["index"])) for e in entries),
                tuple(join_url(dataset.url, str(e["data"])) for e in entries),
                np.array([int(e["count"]) for e in entries], dtype=np.int64),
                np.array([int(e["bytes"]) for e in entries], dtype=np.int64),
                tuple(digest(e, "index_checksum") for e in entries),
                tuple(digest(e, "checksum") for e in entries),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{where}: no valid document_metadata section: {exc!r}") from exc
        if not is_per_shard(dataset):
            raise ManifestError(
                f"{where}: document_metadata needs the per-shard document index"
                " (document_index: per_shard)"
            )
        shards = dataset.manifest.shards
        if len(entries) != len(shards):
            raise ManifestError(
                f"{where}: {len(entries)} document_metadata entries for {len(shards)} shards"
            )
        documents = [int(n) for n in metadata[SHARD_DOCUMENTS]]
        for k, (count, size) in enumerate(zip(layout.counts, layout.data_bytes, strict=True)):
            if count != documents[k] or size < 0:
                raise ManifestError(
                    f"{where}: document_metadata entry {k} ({layout.index_urls[k]}) says"
                    f" {int(count)} values of {int(size)} bytes, and shard {shards[k].path}"
                    f" holds {documents[k]} documents"
                )
        return layout

    def files(self) -> list[tuple[str, int, int | None]]:
        """``(url, bytes, checksum)`` of every index and data file."""
        sizes = (INDEX_DTYPE.itemsize * (self.counts + 1)).tolist()
        return [
            *zip(self.index_urls, sizes, self.index_checksums, strict=True),
            *zip(self.data_urls, self.data_bytes.tolist(), self.checksums, strict=True),
        ]


def metadata_files(dataset: Dataset) -> list[tuple[str, int, int | None]]:
    """``(url, bytes, checksum)`` of the document metadata files of a documents dataset (none
    for another, or one without metadata), for the checks that cover the shards."""
    if dataset.manifest.format != "documents" or not has_document_metadata(dataset):
        return []
    return DocumentMetaLayout.of(dataset).files()


def wanted(datasets: Sequence[Dataset], metadata: bool | None) -> bool:
    """Whether a documents source over ``datasets`` reads their metadata: ``metadata=None``
    when they have it, True requires it, False never. Datasets with and without metadata
    together are a ConfigError unless ``metadata=False``."""
    if metadata is not None and not isinstance(metadata, bool):
        raise ConfigError(f"format_options metadata must be True or False, got {metadata!r}")
    if metadata is False:
        return False
    having = [has_document_metadata(d) for d in datasets]
    if all(having):
        return True
    if metadata is None and not any(having):
        return False
    without = datasets[having.index(False)].url
    if metadata is None:
        with_url = datasets[having.index(True)].url
        raise ConfigError(
            f"{with_url} keeps document metadata and {without} does not: read them apart, or"
            " pass format_options={'metadata': False} to read no metadata"
        )
    raise ConfigError(f"format_options metadata=True, and {without} keeps no document metadata")


@dataclass(frozen=True)
class Runs:
    """Per window, one run per document with tokens in it: its window, first and end position
    (end exclusive) and global document number, in order (window, then position)."""

    sample: Int64Array
    start: Int64Array
    end: Int64Array
    document: Int64Array


def document_runs(offsets: Int64Array, numbers: Int64Array, starts: Int64Array, width: int) -> Runs:
    """The runs of the windows of ``width`` elements at ``starts`` over documents at
    ``offsets`` (global element offsets, numbered ``numbers``, as
    :meth:`DocumentIndex.window_offsets` gives them), vectorised over the windows."""
    ends = starts + width
    first = np.searchsorted(offsets, starts, side="right") - 1
    last = np.minimum(np.searchsorted(offsets, ends, side="left") - 1, offsets.size - 2)
    count = np.maximum(last - first + 1, 0)
    sample = np.repeat(np.arange(starts.size), count)
    step = np.arange(sample.size) - np.repeat(np.cumsum(count) - count, count)
    k = first[sample] + step
    run_start = np.maximum(offsets[k], starts[sample]) - starts[sample]
    run_end = np.minimum(offsets[k + 1], ends[sample]) - starts[sample]
    keep = run_end > run_start  # empty documents hold no token
    return Runs(sample[keep], run_start[keep], run_end[keep], numbers[k[keep]])


class DocumentMetadata:
    """The document metadata of joined per-shard datasets (shard ``k`` of the join is the
    index's segment ``k``); its files join the source's after ``first_file`` files."""

    def __init__(
        self, datasets: Sequence[Dataset], layouts: Sequence[DocumentMetaLayout], first_file: int
    ) -> None:
        first = layouts[0]
        for dataset, layout in zip(datasets[1:], layouts[1:], strict=True):
            if (layout.codec, layout.codec_options) != (first.codec, first.codec_options):
                raise ConfigError(
                    f"{dataset.url}: document metadata codec {layout.codec!r}"
                    f" {layout.codec_options}, not {first.codec!r} {first.codec_options}"
                    f" as {datasets[0].url}"
                )
        codec = make_codec(first.codec, first.codec_options)
        index_urls = [u for layout in layouts for u in layout.index_urls]
        data_urls = [u for layout in layouts for u in layout.data_urls]
        shards = len(index_urls)
        self.values = ValueFiles(
            codec,
            np.concatenate([layout.counts for layout in layouts]),
            np.concatenate([layout.data_bytes for layout in layouts]),
            index_urls,
            data_urls,
            first_file,
            first_file + shards,
        )
        #: The files, index files then data files, and the dataset of each.
        self.urls = [*index_urls, *data_urls]
        per_dataset = np.repeat(np.arange(len(layouts)), [len(x.index_urls) for x in layouts])
        self.url_dataset = np.tile(per_dataset, 2)
        #: What the manifests record of each file, for the engine's checks.
        self.described_files = {
            url: (size, checksum) for layout in layouts for url, size, checksum in layout.files()
        }
        #: A value's schema as a column of runs (the codec's), and as one value per sample.
        self.run_schema: FieldSchema = getattr(codec, "schema", None) or FieldSchema(
            "object", (-1,), nested=True, tensor=False
        )
        self.sample_schema = FieldSchema(
            self.run_schema.dtype, self.run_schema.shape[1:], tensor=self.run_schema.tensor
        )
        documents = int(self.values.counts.sum())
        #: Bytes one document's value costs in a batch, on average.
        self.value_bytes = int(self.values.data_bytes.sum()) // max(1, documents) + OBJECT_BYTES

    def _fetch(
        self, file: Int64Array, lo: Int64Array, count: Int64Array, gap: int
    ) -> Generator[Step, Any, Fetched]:
        try:
            return (yield from self.values.fetch(self.values.groups(file, lo, count, gap)))
        except NotFoundError as exc:
            raise FormatError(
                f"{exc.url}: a document metadata file the manifest names is missing"
            ) from exc

    def of_documents(
        self, ids: Int64Array, index: DocumentIndex, gap: int
    ) -> Generator[Step, Any, Fetched]:
        """The values of documents ``ids`` (global numbers), one group each, in order: each
        document's two index entries and its bytes, neighbours' merged."""
        segments = index.segments_of_documents(ids)
        local = ids - index.document_starts[segments]
        return (yield from self._fetch(segments, local, np.ones_like(local), gap))

    def of_runs(
        self, runs: Runs, index: DocumentIndex, gap: int
    ) -> Generator[Step, Any, tuple[Fetched, Int64Array]]:
        """The values of ``runs``' documents, one group per window and shard (documents
        ``lo .. hi``, neighbours in the shard); and the value of each run among them."""
        segments = index.segments_of_documents(runs.document)
        local = runs.document - index.document_starts[segments]
        key = runs.sample * len(index.documents) + segments  # nondecreasing
        new = np.ones(key.size, dtype=bool)
        new[1:] = key[1:] != key[:-1]
        heads = np.flatnonzero(new)
        group_of_run = np.cumsum(new) - 1
        lo = local[heads]
        hi = np.maximum.reduceat(local, heads) if heads.size else heads
        fetched = yield from self._fetch(segments[heads], lo, hi - lo + 1, gap)
        item_of_run = (fetched.groups.first_item - lo)[group_of_run] + local
        return fetched, item_of_run
