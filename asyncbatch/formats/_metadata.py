"""Token streams with per-span metadata (format ``metadata_stream``).

Each token shard holds a structured stream: a token and a metadata id per element (field
names in the manifest, e.g. ``[("token", "<u4"), ("meta", "<u4")]``). Ids are local to their
shard and index that shard's metadata: ``shard-K.meta.idx`` (int64 byte offsets, ``M + 1``
of them) and ``shard-K.meta.bin`` (the ``M`` encoded values back to back). The largest value
of the id dtype means "no metadata". A codec, named in the manifest, encodes the values.

Samples are the windows of the tokens format (field ``tokens``), plus, per sample, the runs
of equal metadata id in the window as three :class:`~asyncbatch._batch.Jagged` columns:
``meta_start`` and ``meta_end`` (token positions in the window, end exclusive) and ``meta``
(the decoded values). A run ends at a shard end even when the next shard goes on with the
same value. For a group of windows the source reads the tokens, then, per window and shard,
one range of the metadata index (the window's min to max id) and one of the data, and these
ranges merge like token reads (overlapping, or closer than the store's gap): at most two
extra requests per window, and two per file for a run of neighbouring windows, whatever the
number of spans (``combine=False`` reads per span, for comparison).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema, Jagged
from .._dataset import Dataset, join_url
from .._errors import ConfigError, FormatError, ManifestError
from .._manifest import MANIFEST_NAME
from ._base import Fetch, OffLoop, Read
from ._metadata_codecs import _CODECS as _CODECS
from ._metadata_codecs import BytesCodec as BytesCodec
from ._metadata_codecs import Codec as Codec
from ._metadata_codecs import JsonCodec as JsonCodec
from ._metadata_codecs import NumpyCodec as NumpyCodec
from ._metadata_codecs import decode_values as decode_values
from ._metadata_codecs import make_codec as make_codec
from ._metadata_codecs import register_codec as register_codec
from ._metadata_values import INDEX_DTYPE as INDEX_DTYPE
from ._metadata_values import NEVER_MERGE as NEVER_MERGE
from ._metadata_values import Fetched, Groups, ValueFiles, take_values
from ._tokens import TOKENS_FIELD, TokenWindows, output_dtype

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

    from ..stores._base import Store

FORMAT = "metadata_stream"
START_FIELD, END_FIELD, VALUE_FIELD = "meta_start", "meta_end", "meta"
Int64Array = npt.NDArray[np.int64]

# --- layout in the manifest -----------------------------------------------------------------


@dataclass(frozen=True)
class MetaLayout:
    """The ``metadata_stream`` part of a manifest: fields, codec, one index and data file per
    token shard with its metadata count and data bytes."""

    token_field: str
    meta_field: str
    codec: str
    codec_options: dict[str, Any]
    index_paths: tuple[str, ...]
    data_paths: tuple[str, ...]
    counts: Int64Array
    data_bytes: Int64Array

    def to_json(self) -> dict[str, Any]:
        return {
            "token_field": self.token_field,
            "meta_field": self.meta_field,
            "codec": {"name": self.codec, "options": self.codec_options},
            "shards": [
                {"index": i, "data": d, "count": int(c), "bytes": int(b)}
                for i, d, c, b in zip(
                    self.index_paths, self.data_paths, self.counts, self.data_bytes, strict=True
                )
            ],
        }

    @classmethod
    def of(cls, dataset: Dataset) -> MetaLayout:
        """Parse and check; a problem is a :class:`ManifestError` naming the manifest."""
        manifest = dataset.manifest
        url = join_url(dataset.url, MANIFEST_NAME)
        try:
            raw = manifest.metadata[FORMAT]
            shards = raw["shards"]
            layout = cls(
                str(raw["token_field"]),
                str(raw["meta_field"]),
                str(raw["codec"]["name"]),
                dict(raw["codec"].get("options", {})),
                tuple(str(s["index"]) for s in shards),
                tuple(str(s["data"]) for s in shards),
                np.array([int(s["count"]) for s in shards], dtype=np.int64),
                np.array([int(s["bytes"]) for s in shards], dtype=np.int64),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"{url}: no valid metadata_stream section: {exc!r}") from exc
        dtype = manifest.dtype
        names = dtype.names or ()
        if layout.token_field not in names or layout.meta_field not in names:
            raise ManifestError(
                f"{url}: dtype {dtype} lacks the token field {layout.token_field!r}"
                f" or the metadata id field {layout.meta_field!r}"
            )
        meta = dtype[layout.meta_field]
        if meta.kind != "u" or meta.shape:
            raise ManifestError(f"{url}: metadata ids must be unsigned integers, not {meta}")
        if len(shards) != len(manifest.shards):
            raise ManifestError(
                f"{url}: {len(shards)} metadata entries for {len(manifest.shards)} token shards"
            )
        if np.any(layout.counts < 0) or np.any(layout.data_bytes < 0):
            raise ManifestError(f"{url}: negative metadata count or size")
        return layout


async def load_metadata_layout(dataset: Dataset, store: Store) -> Dataset:
    """Index loader: checks the manifest's metadata section and keeps the per-shard metadata
    counts and data sizes in ``Dataset.arrays``; reads nothing more (the index files are read
    range by range, as windows need them)."""
    layout = MetaLayout.of(dataset)
    arrays = {**dataset.arrays, "meta_counts": layout.counts, "meta_bytes": layout.data_bytes}
    return replace(dataset, arrays=arrays)


# --- the source -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spans:
    """Runs of one metadata id in a group of windows, in order (sample, then position)."""

    sample: Int64Array
    start: Int64Array
    end: Int64Array
    shard: Int64Array
    meta_id: Int64Array


class MetadataWindows(TokenWindows):
    """Windows of a metadata stream with their metadata spans (see the module docstring)."""

    converts = True

    def __init__(
        self,
        datasets: Sequence[Dataset],
        seq_len: int | None,
        *,
        next_token: bool = False,
        dtype: npt.DTypeLike | torch.dtype | None = None,
        combine: bool = True,
    ) -> None:
        super().__init__(datasets, seq_len, next_token=next_token)
        layouts = [MetaLayout.of(d) for d in self.datasets]
        first = layouts[0]
        for dataset, layout in zip(self.datasets[1:], layouts[1:], strict=True):
            if (layout.token_field, layout.meta_field, layout.codec, layout.codec_options) != (
                first.token_field,
                first.meta_field,
                first.codec,
                first.codec_options,
            ):
                raise ConfigError(f"{dataset.url}: other fields or codec than {self.dataset.url}")
        self.combine = bool(combine)
        self.token_field, self.meta_field = first.token_field, first.meta_field
        self.codec = make_codec(first.codec, first.codec_options)
        self.meta_counts = np.concatenate([layout.counts for layout in layouts])
        self.data_bytes = np.concatenate([layout.data_bytes for layout in layouts])
        self.no_meta = int(np.iinfo(self.stored_dtype[self.meta_field]).max)
        token_urls = list(self.shard_urls)
        self.num_shards = len(token_urls)
        pairs = list(zip(self.datasets, layouts, strict=True))
        self.index_urls = [join_url(d.url, p) for d, lay in pairs for p in lay.index_paths]
        self.data_urls = [join_url(d.url, p) for d, lay in pairs for p in lay.data_paths]
        # Plans name token shards 0..S-1, index files S..2S-1, data files 2S..3S-1.
        self.shard_urls = [*token_urls, *self.index_urls, *self.data_urls]
        self.shard_dataset = np.tile(self.shard_dataset, 3)
        self.values = ValueFiles(
            self.codec,
            self.meta_counts,
            self.data_bytes,
            self.index_urls,
            self.data_urls,
            self.num_shards,
            2 * self.num_shards,
        )
        self.token_dtype = self.stored_dtype[self.token_field]
        self.out_dtype = output_dtype(dtype, self.token_dtype, self.dataset.url)
        self.extra_fields = [
            n for n in self.stored_dtype.names or () if n not in (self.token_field, self.meta_field)
        ]
        clash = {TOKENS_FIELD, START_FIELD, END_FIELD, VALUE_FIELD} & set(self.extra_fields)
        if clash:
            raise ConfigError(
                f"{self.dataset.url}: stream fields {sorted(clash)} clash with outputs"
            )
        span_schema = FieldSchema("int64", (-1,), nested=True)
        value_schema = getattr(self.codec, "schema", None) or FieldSchema(
            "object", (-1,), nested=True, tensor=False
        )
        self.schema = {
            TOKENS_FIELD: FieldSchema(str(self.out_dtype or self.token_dtype), (self.window,)),
            **{
                n: FieldSchema(str(self.stored_dtype[n]), (self.window,)) for n in self.extra_fields
            },
            START_FIELD: span_schema,
            END_FIELD: span_schema,
            VALUE_FIELD: value_schema,
        }
        total = max(1, int(sum(d.manifest.total_elements for d in self.datasets)))
        meta_per_token = (int(self.data_bytes.sum()) + 24 * int(self.meta_counts.sum())) / total
        self.sample_bytes = self.window * self.stored_dtype.itemsize + int(
            self.window * meta_per_token
        )

    def element_starts(self, ids: Int64Array) -> Int64Array:
        """First element of each window in the concatenated stream of all shards."""
        if len(self.datasets) == 1:
            return ids * self.seq_len
        which = np.searchsorted(self._id_ends, ids, side="right")
        local = ids - (self._id_ends - self.sizes)[which]
        starts: Int64Array = self._element_base[which] + local * self.seq_len
        return starts

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """Tokens, then one index read and one data read per metadata file touched."""
        buffer = yield Read(self.plan(ids, gap))
        stream = buffer.view(self.stored_dtype).reshape(ids.size, self.window)
        spans: Spans = yield OffLoop(lambda: self.spans(stream, ids))
        groups, group_of_span = self.groups(spans, gap)
        fetched = yield from self.values.fetch(groups)
        item_of_span = (groups.first_item - groups.lo)[group_of_span] + spans.meta_id
        fields: dict[str, Any] = yield OffLoop(
            lambda: self.fields(stream, spans, fetched, item_of_span)
        )
        return fields

    def spans(self, stream: npt.NDArray[Any], ids: Int64Array) -> Spans:
        """Runs of equal metadata id in each window, split at shard ends; checks the ids."""
        n, width = stream.shape
        meta = stream[self.meta_field].reshape(-1)
        head = np.empty(n * width, dtype=bool)
        if head.size:
            head[0] = True
            np.not_equal(meta[1:], meta[:-1], out=head[1:])
            head[::width] = True
        starts = self.element_starts(ids)
        shards = self.shard_map
        first = shards.shard_of(starts)
        crossing = np.flatnonzero(shards.shard_of(starts + width - 1) > first)
        if crossing.size:  # a shard end inside a window ends a run
            last = shards.shard_of(starts[crossing] + width - 1)
            count = last - first[crossing]
            window = np.repeat(crossing, count)
            step = np.arange(window.size) - np.repeat(np.cumsum(count) - count, count) + 1
            at = shards.starts[first[window] + step] - starts[window]
            head[window * width + at] = True
        heads = np.flatnonzero(head)
        ends = np.append(heads[1:], n * width)
        sample = heads // width
        meta_id = meta[heads].astype(np.int64)
        keep = meta_id != self.no_meta
        sample, heads, ends, meta_id = sample[keep], heads[keep], ends[keep], meta_id[keep]
        start = heads - sample * width
        shard = shards.shard_of(starts[sample] + start)
        bad = np.flatnonzero(meta_id >= self.meta_counts[shard])
        if bad.size:
            i = int(bad[0])
            s = int(shard[i])
            element = int(starts[sample[i]] + start[i] - shards.starts[s])
            raise FormatError(
                f"{self.shard_urls[s]}: element {element} has metadata id {int(meta_id[i])},"
                f" but {self.index_urls[s]} indexes {int(self.meta_counts[s])} values"
            )
        return Spans(sample, start, start + (ends - heads), shard, meta_id)

    def groups(self, spans: Spans, gap: int) -> tuple[Groups, Int64Array]:
        """The groups of metadata values to read, and the group of each span.

        Combined, a group is the spans of one window in one shard (ids from their min to
        their max), and the groups' ranges of one file merge as the token reads do
        (overlapping, or closer than ``gap``): a group of neighbouring windows costs one index
        read and one data read per file. Not combined, a group is one span, read on its own.
        """
        if self.combine:
            key = spans.sample * self.num_shards + spans.shard  # nondecreasing
            new = np.ones(key.size, dtype=bool)
            new[1:] = key[1:] != key[:-1]
            heads = np.flatnonzero(new)
            group_of_span = np.cumsum(new) - 1
            ids = spans.meta_id
            lo = np.minimum.reduceat(ids, heads) if heads.size else heads
            hi = np.maximum.reduceat(ids, heads) if heads.size else heads
            shard = spans.shard[heads]
        else:
            group_of_span = np.arange(spans.shard.size)
            shard, lo, hi = spans.shard, spans.meta_id, spans.meta_id
            gap = NEVER_MERGE
        return self.values.groups(shard, lo, hi - lo + 1, gap), group_of_span

    def fields(
        self, stream: npt.NDArray[Any], spans: Spans, fetched: Fetched, item_of_span: Int64Array
    ) -> dict[str, Any]:
        import torch

        tokens = np.ascontiguousarray(stream[self.token_field])
        if self.out_dtype is not None and self.out_dtype != tokens.dtype:
            tokens = tokens.astype(self.out_dtype)
        values = take_values(self.values.decode(fetched), item_of_span)
        n = stream.shape[0]
        bounds = torch.from_numpy(np.searchsorted(spans.sample, np.arange(n + 1)).astype(np.int64))
        return {
            TOKENS_FIELD: torch.from_numpy(tokens),
            **{
                name: torch.from_numpy(np.ascontiguousarray(stream[name]))
                for name in self.extra_fields
            },
            START_FIELD: Jagged(torch.from_numpy(spans.start), bounds),
            END_FIELD: Jagged(torch.from_numpy(spans.end), bounds),
            VALUE_FIELD: Jagged(values, bounds),
        }


def metadata_windows(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    combine: bool = True,
    **options: Any,
) -> MetadataWindows:
    """Source factory of the ``metadata_stream`` format; ``format_options``: ``combine``."""
    if options:
        raise ConfigError(f"metadata streams take format_options combine=, got {sorted(options)}")
    return MetadataWindows(datasets, seq_len, next_token=next_token, dtype=dtype, combine=combine)
