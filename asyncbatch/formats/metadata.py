"""Token streams with per-span metadata (format ``metadata_stream``).

Each token shard holds a structured stream: a token and a metadata id per element (field
names in the manifest, e.g. ``[("token", "<u4"), ("meta", "<u4")]``). Ids are local to their
shard and index that shard's metadata: ``shard-K.meta.idx`` (int64 byte offsets, ``M + 1``
of them) and ``shard-K.meta.bin`` (the ``M`` encoded values back to back). The largest value
of the id dtype means "no metadata". A codec, named in the manifest, encodes the values.

Samples are the windows of the tokens format (field ``tokens``), plus, per sample, the runs
of equal metadata id in the window as three :class:`~asyncbatch.batch.Jagged` columns:
``meta_start`` and ``meta_end`` (token positions in the window, end exclusive) and ``meta``
(the decoded values). A run ends at a shard end even when the next shard goes on with the
same value. For a group of windows the source reads the tokens, then, per window and shard,
one range of the metadata index (the window's min to max id) and one of the data, and these
ranges merge like token reads (overlapping, or closer than the store's gap): at most two
extra requests per window, and two per file for a run of neighbouring windows, whatever the
number of spans (``combine=False`` reads per span, for comparison).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from ..batch import FieldSchema, Jagged
from ..dataset import Dataset, join_url
from ..errors import ConfigError, FormatError, ManifestError
from ..layout import ReadPlan, ShardMap
from ..manifest import MANIFEST_NAME
from .base import Offload, ReadFn
from .tokens import TOKENS_FIELD, TokenWindows, output_dtype

if TYPE_CHECKING:
    from ..stores.base import Store

FORMAT = "metadata_stream"
#: Byte offsets in a metadata index file: little-endian int64.
INDEX_DTYPE = np.dtype("<i8")
START_FIELD, END_FIELD, VALUE_FIELD = "meta_start", "meta_end", "meta"
#: A merge gap below any distance: every range is read on its own.
NEVER_MERGE = -(2**62)
Int64Array = npt.NDArray[np.int64]

# --- codecs ---------------------------------------------------------------------------------


class Codec(Protocol):
    """Turns metadata values into bytes and back.

    ``decode(data, offsets)`` gets ``n`` encoded values back to back (value ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``) and returns ``n`` values as anything sliceable and
    indexable along its first axis (a tensor, a numpy array, an object array). A codec may
    instead define ``decode_item(data: bytes)`` for one value at a time. ``schema`` (optional)
    describes one value; without it values are Python objects.
    """

    def encode(self, value: Any) -> bytes: ...


class BytesCodec:
    """Values are ``bytes`` kept as they are."""

    schema = FieldSchema("object", (-1,), nested=True, tensor=False)

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ConfigError(f"the bytes codec takes bytes, got {type(value).__name__}")
        return bytes(value)

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> npt.NDArray[Any]:
        raw = data.tobytes()
        bounds = offsets.tolist()
        return _objects([raw[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


class JsonCodec:
    """JSON values, one per line: a data file is JSON Lines, decoded in one ``json.loads``."""

    schema = FieldSchema("object", (-1,), nested=True, tensor=False)

    def encode(self, value: Any) -> bytes:
        # json.dumps escapes newlines inside strings: a newline only ever ends a value.
        return json.dumps(value, separators=(",", ":")).encode() + b"\n"

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> npt.NDArray[Any]:
        if offsets.size <= 1:
            return _objects([])
        text = data[int(offsets[0]) : int(offsets[-1]) - 1].tobytes().replace(b"\n", b",")
        return _objects(json.loads(b"[" + text + b"]"))


class NumpyCodec:
    """Numpy values of one dtype: of one ``shape`` (a tensor of all values) or, with
    ``shape=None``, 1-D of any length (an object array of arrays)."""

    def __init__(self, dtype: str = "<i8", shape: Sequence[int] | None = ()) -> None:
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigError(f"numpy codec: dtype={dtype!r} is not a numpy dtype") from exc
        if self.dtype.hasobject or self.dtype.names:
            raise ConfigError(f"numpy codec: dtype {self.dtype} is not a plain numeric dtype")
        self.shape = None if shape is None else tuple(int(n) for n in shape)
        width = (-1,) if self.shape is None else self.shape
        self.schema = FieldSchema(
            str(self.dtype), (-1, *width), nested=True, tensor=self.shape is not None
        )

    def encode(self, value: Any) -> bytes:
        array = np.asarray(value)
        if self.shape is not None and array.shape != self.shape:
            raise ConfigError(f"numpy codec: value of shape {array.shape}, expected {self.shape}")
        if self.shape is None and array.ndim != 1:
            raise ConfigError(f"numpy codec: value of shape {array.shape}, expected 1-D")
        if array.dtype != self.dtype and not np.can_cast(array.dtype, self.dtype, "same_kind"):
            raise ConfigError(f"numpy codec: {array.dtype} values do not convert to {self.dtype}")
        return np.ascontiguousarray(array, dtype=self.dtype).tobytes()

    def decode(self, data: npt.NDArray[np.uint8], offsets: Int64Array) -> Any:
        size = self.dtype.itemsize
        if self.shape is None:
            if np.any(offsets % size):
                raise FormatError(f"numpy codec: a value is not a whole number of {self.dtype}")
            flat = data[int(offsets[0]) : int(offsets[-1])].copy().view(self.dtype)
            return _objects(np.split(flat, (offsets[1:-1] - offsets[0]) // size))
        each = size * int(np.prod(self.shape, dtype=np.int64))
        if np.any(np.diff(offsets) != each):
            raise FormatError(
                f"numpy codec: a value is not {each} bytes ({self.shape} {self.dtype})"
            )
        flat = data[int(offsets[0]) : int(offsets[-1])].copy().view(self.dtype)
        return torch.from_numpy(flat.reshape(offsets.size - 1, *self.shape))


def _objects(items: Sequence[Any]) -> npt.NDArray[Any]:
    """A 1-D object array of ``items`` (never broadcast into more dimensions)."""
    return np.fromiter(items, dtype=object, count=len(items))


_CODECS: dict[str, Callable[..., Any]] = {
    "bytes": BytesCodec,
    "json": JsonCodec,
    "numpy": NumpyCodec,
}


def register_codec(name: str, factory: Callable[..., Any], *, clobber: bool = False) -> None:
    """Make ``factory(**codec_options)`` (a class, usually) the metadata codec named ``name``.

    Metadata streams name their codec in the manifest; a reader registers the same name before
    opening one. Replacing a registered name needs ``clobber=True``.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a codec name must be a non-empty string, got {name!r}")
    if name in _CODECS and not clobber:
        raise ConfigError(f"codec {name!r} is already registered (pass clobber=True to replace)")
    _CODECS[name] = factory


def make_codec(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The codec registered as ``name``, built with ``options``."""
    factory = _CODECS.get(name)
    if factory is None:
        raise ConfigError(
            f"no metadata codec {name!r} (known: {', '.join(sorted(_CODECS))});"
            " register it with asyncbatch.register_codec"
        )
    try:
        codec = factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: bad codec_options {dict(options or {})!r}") from exc
    if not callable(getattr(codec, "encode", None)) or not (
        callable(getattr(codec, "decode", None)) or callable(getattr(codec, "decode_item", None))
    ):
        raise ConfigError(f"codec {name!r} needs encode() and decode() or decode_item()")
    return codec


def decode_values(codec: Any, data: npt.NDArray[np.uint8], offsets: Int64Array) -> Any:
    """``offsets.size - 1`` values decoded by ``codec``; numbers come back as a tensor."""
    decode = getattr(codec, "decode", None)
    if decode is not None:
        values = decode(data, offsets)
    else:
        raw = data.tobytes()
        bounds = offsets.tolist()
        values = _objects(
            [codec.decode_item(raw[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        )
    if isinstance(values, np.ndarray) and values.dtype != object:
        values = torch.from_numpy(np.ascontiguousarray(values))
    if len(values) != offsets.size - 1:
        raise FormatError(f"codec {codec!r} decoded {len(values)} values of {offsets.size - 1}")
    return values


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


@dataclass(frozen=True)
class Groups:
    """Groups of spans read together: per group its shard, first id ``lo`` and number of ids
    ``count`` read, where its index entries start in the index buffer; the group of each
    span, and the merge gap used."""

    shard: Int64Array
    lo: Int64Array
    count: Int64Array
    entry_at: Int64Array
    group_of_span: Int64Array
    gap: int


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
        #: Index files as one stream of int64 entries, data files as one of bytes.
        self.index_map = ShardMap(self.meta_counts + 1, INDEX_DTYPE.itemsize)
        self.data_map = ShardMap(self.data_bytes, 1)
        self.no_meta = int(np.iinfo(self.stored_dtype[self.meta_field]).max)
        token_urls = list(self.shard_urls)
        self.num_shards = len(token_urls)
        pairs = list(zip(self.datasets, layouts, strict=True))
        self.index_urls = [join_url(d.url, p) for d, lay in pairs for p in lay.index_paths]
        self.data_urls = [join_url(d.url, p) for d, lay in pairs for p in lay.data_paths]
        # Plans name token shards 0..S-1, index files S..2S-1, data files 2S..3S-1.
        self.shard_urls = [*token_urls, *self.index_urls, *self.data_urls]
        self.shard_dataset = np.tile(self.shard_dataset, 3)
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

    async def fetch(
        self, ids: Int64Array, read: ReadFn, gap: int, offload: Offload
    ) -> dict[str, Any]:
        """Tokens, then one index read and one data read per metadata file touched."""
        buffer = await read(self.plan(ids, gap))
        stream = buffer.view(self.stored_dtype).reshape(ids.size, self.window)
        spans: Spans = await offload(lambda: self.spans(stream, ids))
        index_plan, groups = self.index_plan(spans, gap)
        index = await read(index_plan) if index_plan.nbytes else buffer[:0]
        data_plan, offsets = self.data_plan(index.view(INDEX_DTYPE), groups)
        data = await read(data_plan) if data_plan.num_reads else buffer[:0]
        first_item = np.cumsum(groups.count) - groups.count - groups.lo
        item_of_span = first_item[groups.group_of_span] + spans.meta_id
        fields: dict[str, Any] = await offload(
            lambda: self.fields(stream, spans, data, offsets, item_of_span, groups.shard)
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

    def index_plan(self, spans: Spans, gap: int) -> tuple[ReadPlan, Groups]:
        """Index entries ``lo .. hi + 1`` of each group, back to back in the buffer.

        Combined, a group is the spans of one window in one shard (``lo``, ``hi``: their min
        and max id), and the groups' ranges of one index file merge as the token reads do
        (overlapping, or closer than ``gap``): a group of neighbouring windows costs one index
        read per file. Not combined, a group is one span, read on its own.
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
        count = hi - lo + 1
        entry_at = np.cumsum(count + 1) - (count + 1)
        # Index and value reads are small beside the tokens: they may bridge one request's
        # worth of gaps beyond their own bytes, so neighbouring windows share one read per file.
        plan = self.index_map.plan(
            self.index_map.starts[shard] + lo, count + 1, gap, extra_waste_bytes=max(0, gap)
        )
        plan = replace(plan, read_shard=plan.read_shard + self.num_shards)
        return plan, Groups(shard, lo, count, entry_at, group_of_span, gap)

    def data_plan(self, index: Int64Array, groups: Groups) -> tuple[ReadPlan, Int64Array]:
        """Data reads of every group back to back, merged as the index reads; the offsets
        of all items read (ids ``lo .. hi`` of each group, in order) in the data buffer."""
        shard, lo, count, entry_at = groups.shard, groups.lo, groups.count, groups.entry_at
        index = index.astype(np.int64)
        firsts = index[entry_at]
        lasts = index[entry_at + count]
        group_of_entry = np.repeat(np.arange(count.size), count + 1)
        steps = np.diff(index)
        if entry_at.size > 1:
            steps[entry_at[1:] - 1] = 0  # from one group's entries to the next: no step
        broken = np.flatnonzero(steps < 0)
        over = np.flatnonzero((lasts > self.data_bytes[shard]) | (firsts < 0))
        if broken.size or over.size:
            g = int(group_of_entry[broken[0]]) if broken.size else int(over[0])
            s = int(shard[g])
            problem = (
                "offsets that decrease"
                if broken.size
                else f"offsets outside the {int(self.data_bytes[s])} bytes of {self.data_urls[s]}"
            )
            raise FormatError(
                f"{self.index_urls[s]}: metadata index entries"
                f" {int(lo[g])}..{int(lo[g] + count[g])} hold {problem}"
            )
        lengths = lasts - firsts
        dest = np.cumsum(lengths) - lengths
        # Item offsets in the data buffer: each group's entries shifted to its place, the
        # last entry of a group dropped (it is where the next group's first item starts).
        offsets = index - np.repeat(firsts - dest, count + 1)
        keep = np.ones(offsets.size, dtype=bool)
        keep[(entry_at + count)[:-1]] = False
        offsets = offsets[keep] if offsets.size else np.zeros(1, dtype=np.int64)
        plan = self.data_map.plan(
            self.data_map.starts[shard] + firsts,
            lengths,
            groups.gap,
            extra_waste_bytes=max(0, groups.gap),
        )
        plan = replace(plan, read_shard=plan.read_shard + 2 * self.num_shards)
        return plan, offsets

    def fields(
        self,
        stream: npt.NDArray[Any],
        spans: Spans,
        data: npt.NDArray[np.uint8],
        offsets: Int64Array,
        item_of_span: Int64Array,
        shards: Int64Array,
    ) -> dict[str, Any]:
        tokens = np.ascontiguousarray(stream[self.token_field])
        if self.out_dtype is not None and self.out_dtype != tokens.dtype:
            tokens = tokens.astype(self.out_dtype)
        try:
            values = decode_values(self.codec, data, offsets)
        except Exception as exc:  # a codec's own error, whatever its type: name the files
            urls = ", ".join(self.data_urls[s] for s in np.unique(shards).tolist())
            raise FormatError(f"{urls}: metadata does not decode: {exc}") from exc
        if isinstance(values, torch.Tensor):  # numpy's gather: torch's is ~100x slower here
            values = torch.from_numpy(values.numpy()[item_of_span])
        else:
            values = values[item_of_span]
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
