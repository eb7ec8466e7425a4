"""Token streams with per-span metadata: windows, spans and values match what was written."""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, s3_options
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncbatch as ab
from asyncbatch._engine import Reader, run_fetch
from asyncbatch._errors import ConfigError, FormatError, ManifestError
from asyncbatch._layout import ReadPlan, WindowPlan
from asyncbatch.formats import _metadata
from asyncbatch.formats._metadata import MetadataWindows
from asyncbatch.formats._registry import make_source
from asyncbatch.stores import open_store

Span = tuple[npt.NDArray[Any], Any]
RECORD = 8  # bytes per element of the default stream dtype (u4 token + u4 id)
_names = itertools.count()


def make_spans(seed: int, count: int, none_every: int = 5) -> list[Span]:
    """Spans of random lengths (1..40) with JSON values naming them; some without metadata."""
    rng = np.random.default_rng(seed)
    spans: list[Span] = []
    for k in range(count):
        n = int(rng.integers(1, 41))
        tokens = rng.integers(0, 2**32, n, dtype=np.uint32)
        spans.append((tokens, None if k % none_every == 3 else {"span": k, "tag": "é\n" * (k % 3)}))
    return spans


def expected(
    spans: Sequence[Span], shard_elements: int, window: int, seq_len: int, ids: Sequence[int]
) -> list[tuple[npt.NDArray[Any], list[tuple[int, int, Any]]]]:
    """Per window: its tokens and (start, end, value) of its spans, from the source spans:
    runs of one span, split at shard ends, spans without a value left out."""
    tokens = np.concatenate([t for t, _ in spans])
    span_of = np.repeat(np.arange(len(spans)), [t.size for t, _ in spans])
    out = []
    for i in ids:
        lo = i * seq_len
        key = [(int(span_of[p]), p // shard_elements) for p in range(lo, lo + window)]
        runs = []
        start = 0
        for pos in range(1, window + 1):
            if pos == window or key[pos] != key[start]:
                value = spans[key[start][0]][1]
                if value is not None:
                    runs.append((start, pos, value))
                start = pos
        out.append((tokens[lo : lo + window], runs))
    return out


def check_batch(batch: ab.Batch, spans: Sequence[Span], shard_elements: int, seq_len: int) -> None:
    window = batch["tokens"].shape[1]
    want = expected(spans, shard_elements, window, seq_len, batch.global_indexes.tolist())
    for i, (tokens, runs) in enumerate(want):
        np.testing.assert_array_equal(batch["tokens"][i].numpy(), tokens)
        got = list(
            zip(
                batch["meta_start"][i].tolist(),
                batch["meta_end"][i].tolist(),
                list(batch["meta"][i]),
                strict=True,
            )
        )
        assert got == runs


WriteMeta = Callable[..., tuple[str, dict[str, Any]]]


@pytest.fixture
def write_meta(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> WriteMeta:
    """``write_meta(spans, **kwargs)`` writes a metadata stream to the current store."""

    def write(spans: Any = None, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        name = f"meta-{next(_names)}"
        if store == "local":
            url = str(tmp_path / name)
            ab.write_metadata_stream(url, spans, **kwargs)
            return url, {}
        if store == "s3":
            options = s3_options(request.getfixturevalue("s3_endpoint"))
            url = f"s3://{BUCKET}/{name}"
            ab.write_metadata_stream(url, spans, storage_options=options, **kwargs)
            return url, options
        root, server = request.getfixturevalue("http_root")
        ab.write_metadata_stream(str(root / name), spans, **kwargs)
        return f"{server.url}/{name}", {}

    return write


def replace_object(
    store: str, url: str, data: bytes, options: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Overwrite the object at ``url`` behind the manifest's back."""
    if store == "s3":
        import s3fs

        s3fs.S3FileSystem(**options).pipe(url, data)
        return
    if store == "http":
        root, server = request.getfixturevalue("http_root")
        path = root / url.removeprefix(server.url + "/")
    else:
        path = Path(url)
    path.write_bytes(data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_windows_and_spans_match_the_source(write_meta: WriteMeta, shuffle: bool | str) -> None:
    spans = make_spans(0, 120)
    shard_elements = 700  # windows of 41 cross shard ends often
    url, options = write_meta(spans, shard_size=shard_elements * RECORD)
    block = {"block_size": 4, "window": 3} if shuffle == "block" else {}
    seen = []
    with ab.Loader(
        url,
        batch_size=5,
        seq_len=40,
        next_token=True,
        shuffle=shuffle,
        storage_options=options,
        **block,
    ) as loader:
        for batch in loader:
            check_batch(batch, spans, shard_elements, 40)
            seen.append(batch.global_indexes)
    ids = np.concatenate(seen)
    total = sum(t.size for t, _ in spans)
    assert ids.size == (total - 1) // 40 // 5 * 5 and np.unique(ids).size == ids.size
    if not shuffle:
        np.testing.assert_array_equal(ids, np.arange(ids.size))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80),
    none_every=st.integers(2, 6),
    shard_elements=st.integers(5, 400),
    seq_len=st.integers(1, 90),
    combine=st.booleans(),
)
def test_spans_match_random_span_lengths(
    lengths: list[int], none_every: int, shard_elements: int, seq_len: int, combine: bool
) -> None:
    rng = np.random.default_rng(len(lengths))
    spans: list[Span] = [
        (
            rng.integers(0, 1000, n, dtype=np.uint32),
            None if k % none_every == 1 else [k, "x" * (k % 4)],
        )
        for k, n in enumerate(lengths)
    ]
    if sum(lengths) < seq_len:
        return
    with tempfile.TemporaryDirectory() as root:
        ab.write_metadata_stream(root, spans, shard_size=shard_elements * RECORD)
        with ab.Loader(
            root,
            batch_size=3,
            seq_len=seq_len,
            drop_last=False,
            format_options={"combine": combine},
        ) as loader:
            count = 0
            for batch in loader:
                check_batch(batch, spans, shard_elements, seq_len)
                count += batch.batch_size
    assert count == sum(lengths) // seq_len


async def _fetch_plans(
    dataset: ab.Dataset, ids: npt.NDArray[np.int64], gap: int, **options: Any
) -> tuple[list[ReadPlan], dict[str, Any]]:
    source = make_source([dataset], seq_len=50, options=options)
    store = open_store(dataset.url, {})
    reader = Reader([store], source.shard_urls, np.zeros(len(source.shard_urls), dtype=np.int64))
    plans: list[ReadPlan] = []

    async def read(plan: ReadPlan | WindowPlan, convert: Any = None) -> npt.NDArray[np.uint8]:
        assert isinstance(plan, ReadPlan)
        plans.append(plan)
        return await reader.read_plan(plan, convert)

    async def offload(work: Callable[[], Any]) -> Any:
        return work()

    try:
        fields = await run_fetch(source.fetch(ids, gap), read, offload)
    finally:
        await store.close()
    return plans, fields


def test_metadata_reads_are_one_index_and_one_data_read_per_file(tmp_path: Path) -> None:
    spans = make_spans(1, 400, none_every=1000)
    dataset = ab.write_metadata_stream(str(tmp_path / "d"), spans, shard_size=3000 * RECORD)
    ids = np.array([3, 4, 5, 58, 59, 60, 125, 126], dtype=np.int64)  # in 3 shards
    plans, fields = asyncio.run(_fetch_plans(dataset, ids, 16384))
    tokens_plan, index_plan, data_plan = plans
    shards = {int(i) * 50 // 3000 for i in ids} | {(int(i) * 50 + 49) // 3000 for i in ids}
    assert index_plan.num_reads == data_plan.num_reads == len(shards) == 3
    # Without merging gaps, windows far apart in one shard read apart: 3-5 and 58-59 (shard
    # 0), 60 (shard 1), 125-126 (shard 2); neighbouring windows still share reads.
    plans_near, fields_near = asyncio.run(_fetch_plans(dataset, ids, 0))
    assert plans_near[1].num_reads == plans_near[2].num_reads == 4
    spans_read = sum(len(s) for s in fields["meta_start"])
    assert spans_read > 8 * 2  # many spans, still one index read and one data read per file
    plans_apart, fields_apart = asyncio.run(_fetch_plans(dataset, ids, 16384, combine=False))
    assert [p.num_reads for p in plans_apart[1:]] == [spans_read, spans_read]
    for name in ("meta_start", "meta_end"):
        assert torch.equal(fields[name].values, fields_apart[name].values)
        assert torch.equal(fields[name].offsets, fields_apart[name].offsets)
    assert list(fields["meta"].values) == list(fields_apart["meta"].values)
    assert list(fields["meta"].values) == list(fields_near["meta"].values)
    assert tokens_plan.num_reads == plans_apart[0].num_reads


def test_http_requests_with_and_without_combining(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root, server = request.getfixturevalue("http_root")
    spans = make_spans(2, 300)
    ab.write_metadata_stream(str(root / "requests"), spans, shard_size=2000 * RECORD)
    counts = {}
    for combine in (True, False):
        before = server.requests
        with ab.Loader(
            f"{server.url}/requests",
            batch_size=8,
            seq_len=64,
            shuffle=False,
            prefetch=4,
            format_options={"combine": combine},
        ) as loader:
            windows = sum(batch.batch_size for batch in loader)
        counts[combine] = (server.requests - before) / windows
    # Windows of 64 tokens hold ~3 spans: per span, 2 requests; combined, ~2 per group.
    assert counts[True] < 1.0 < 4.0 < counts[False]


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_resume_and_workers_deliver_the_same_batches(tmp_path: Path, shuffle: bool | str) -> None:
    spans = make_spans(3, 200)
    dataset = ab.write_metadata_stream(str(tmp_path / "d"), spans, shard_size=900 * RECORD)
    args: dict[str, Any] = dict(batch_size=4, seq_len=30, shuffle=shuffle, seed=5)
    if shuffle == "block":
        args.update(block_size=3, window=4)

    def key(batch: ab.Batch) -> tuple[list[int], list[Any]]:
        return batch.global_indexes.tolist(), [
            list(batch["meta"][i]) for i in range(len(batch["meta"]))
        ]

    with ab.Loader(dataset, **args) as loader:
        full = [key(b) for b in loader]
    with ab.Loader(dataset, prefetch=2, **args) as loader:
        head = [key(b) for b in itertools.islice(loader, 5)]
        state = loader.state_dict()
    with ab.Loader(dataset, **args) as loader:
        loader.load_state_dict(state)
        tail = [key(b) for b in loader]
    assert head + tail == full
    source = ab.LoaderDataset(dataset, **args)
    batches = list(source.dataloader(num_workers=2))
    assert [key(b) for b in batches] == full
    check_batch(batches[-1], spans, 900, 30)

    async def collect() -> list[tuple[list[int], list[Any]]]:
        async with ab.AsyncLoader(dataset, **args) as loader:
            return [key(b) async for b in loader]

    assert asyncio.run(collect()) == full


def test_codecs_numpy_bytes_and_registered(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 30, 100)
    chunks = [np.full(n, k, dtype=np.uint32) for k, n in enumerate(lengths)]
    scalar = ab.write_metadata_stream(
        str(tmp_path / "scalar"),
        [(c, np.float32(k) / 2) for k, c in enumerate(chunks)],
        codec="numpy",
        codec_options={"dtype": "<f4"},
        shard_size=500 * RECORD,
    )
    fixed = ab.write_metadata_stream(
        str(tmp_path / "fixed"),
        [(c, [k, -k, 7]) for k, c in enumerate(chunks)],
        codec="numpy",
        codec_options={"dtype": "<i2", "shape": [3]},
    )
    ragged = ab.write_metadata_stream(
        str(tmp_path / "ragged"),
        [(c, np.arange(k % 5, dtype=np.int64)) for k, c in enumerate(chunks)],
        codec="numpy",
        codec_options={"dtype": "<i8", "shape": None},
    )
    raw = ab.write_metadata_stream(
        str(tmp_path / "raw"), [(c, b"\x00%d" % k) for k, c in enumerate(chunks)], codec="bytes"
    )

    class Upper:
        def __init__(self, suffix: str) -> None:
            self.suffix = suffix

        def encode(self, value: str) -> bytes:
            return value.encode()

        def decode_item(self, data: bytes) -> str:
            return data.decode().upper() + self.suffix

    ab.register_codec("test-upper", Upper, clobber=True)
    with pytest.raises(ConfigError, match="already registered"):
        ab.register_codec("test-upper", Upper)
    user = ab.write_metadata_stream(
        str(tmp_path / "user"),
        [(c, f"v{k}") for k, c in enumerate(chunks)],
        codec="test-upper",
        codec_options={"suffix": "!"},
    )

    def first(dataset: ab.Dataset) -> ab.Batch:
        with ab.Loader(dataset.url, batch_size=16, seq_len=20, shuffle=False) as loader:
            return next(iter(loader))

    batch = first(scalar)
    meta = batch["meta"]
    assert isinstance(meta.values, torch.Tensor) and meta.values.dtype == torch.float32
    # Each token holds its span's number k, so a span's value is its first token / 2.
    starts = batch["tokens"].numpy()[
        np.repeat(np.arange(16), meta.lengths.numpy()), meta_starts(batch)
    ]
    np.testing.assert_array_equal(meta.values.numpy(), starts.astype(np.float32) / 2)
    assert batch.schema["meta"].dtype == "float32" and batch.schema["meta"].tensor
    values = first(fixed)["meta"].values
    assert values.shape[1:] == (3,) and values.dtype == torch.int16
    assert torch.equal(values[:, 0], -values[:, 1]) and bool((values[:, 2] == 7).all())
    batch = first(ragged)
    ks = batch["tokens"].numpy()[
        np.repeat(np.arange(16), batch["meta"].lengths.numpy()), meta_starts(batch)
    ]
    for k, value in zip(ks.tolist(), batch["meta"].values, strict=True):
        np.testing.assert_array_equal(value, np.arange(k % 5))
    batch = first(raw)
    ks = batch["tokens"].numpy()[
        np.repeat(np.arange(16), batch["meta"].lengths.numpy()), meta_starts(batch)
    ]
    assert list(batch["meta"].values) == [b"\x00%d" % k for k in ks.tolist()]
    batch = first(user)
    ks = batch["tokens"].numpy()[
        np.repeat(np.arange(16), batch["meta"].lengths.numpy()), meta_starts(batch)
    ]
    assert list(batch["meta"].values) == [f"V{k}!" for k in ks.tolist()]


def meta_starts(batch: ab.Batch) -> npt.NDArray[np.int64]:
    return batch["meta_start"].values.numpy()


def test_unknown_codec_and_bad_options_are_config_errors(tmp_path: Path) -> None:
    spans = make_spans(5, 20)
    with pytest.raises(ConfigError, match="no metadata codec 'nope'"):
        ab.write_metadata_stream(str(tmp_path / "a"), spans, codec="nope")
    with pytest.raises(ConfigError, match="bad codec_options"):
        ab.write_metadata_stream(str(tmp_path / "a"), spans, codec="json", codec_options={"x": 1})
    with pytest.raises(ConfigError, match="shape"):
        ab.write_metadata_stream(
            str(tmp_path / "a"),
            [(np.ones(3, dtype=np.uint32), [1, 2])],
            codec="numpy",
            codec_options={"shape": [3]},
        )
    ab.register_codec("test-gone", lambda: _metadata.JsonCodec(), clobber=True)
    ab.write_metadata_stream(str(tmp_path / "b"), spans, codec="test-gone")
    ab.write_metadata_stream(str(tmp_path / "c"), spans)
    _metadata._CODECS.pop("test-gone")
    with pytest.raises(ConfigError, match="'test-gone'.*register_codec"):
        ab.Loader(str(tmp_path / "b"), batch_size=2, seq_len=8)
    with pytest.raises(ConfigError, match="format_options"):
        ab.Loader(str(tmp_path / "c"), batch_size=2, seq_len=8, format_options={"combin": False})


def test_writer_from_tokens_and_metadata_ids(tmp_path: Path) -> None:
    tokens = np.arange(100, dtype=np.int64)
    meta_ids = np.repeat([0, 1, -1, 0, 2], 20)  # value 0 twice, a stretch without metadata
    values = ["a", {"b": 1}, [3]]
    ab.write_metadata_stream(
        str(tmp_path / "d"), tokens=tokens, meta_ids=meta_ids, values=values, shard_size=30 * 8
    )
    with ab.Loader(
        str(tmp_path / "d"), batch_size=1, seq_len=50, shuffle=False, dtype=torch.int64
    ) as loader:
        first, second = list(loader)
    assert first["tokens"].dtype == torch.int64 and first["tokens"][0].tolist() == list(range(50))
    # Shards of 30 tokens: runs end at 20 (new id), 30 (shard end), 40 (none), 60, 80.
    assert first["meta_start"][0].tolist() == [0, 20, 30] and first["meta_end"][0].tolist() == [
        20,
        30,
        40,
    ]
    assert list(first["meta"][0]) == ["a", {"b": 1}, {"b": 1}]
    assert second["meta_start"][0].tolist() == [10, 30, 40]  # a shard ends at 90
    assert list(second["meta"][0]) == ["a", [3], [3]]
    with pytest.raises(ConfigError, match="meta_ids"):
        ab.write_metadata_stream(
            str(tmp_path / "e"), tokens=tokens, meta_ids=meta_ids, values=["a"]
        )
    with pytest.raises(ConfigError, match="not both"):
        ab.write_metadata_stream(str(tmp_path / "e"), [], tokens=tokens)
    with pytest.raises(ConfigError, match="do not fit"):
        ab.write_metadata_stream(str(tmp_path / "e"), [(np.array([70000]), 1)], token_dtype="<u2")


@pytest.mark.parametrize("corruption", ["decreasing", "past_end", "bad_id", "bad_value"])
def test_corrupt_metadata_is_a_format_error(
    write_meta: WriteMeta, store: str, corruption: str, request: pytest.FixtureRequest
) -> None:
    spans = make_spans(6, 40, none_every=1000)
    url, options = write_meta(spans, shard_size=400 * RECORD)
    dataset = ab.open_dataset(url, options)
    source = make_source([dataset], seq_len=20)
    assert isinstance(source, MetadataWindows)
    index_url, data_url = source.index_urls[0], source.data_urls[0]
    count = int(source.meta_counts[0])
    offsets = np.frombuffer(Path_or_read(index_url, options), dtype="<i8").copy()
    assert offsets.size == count + 1 and offsets[0] == 0 and (np.diff(offsets) > 0).all()
    if corruption == "decreasing":
        offsets[2], offsets[3] = offsets[3], offsets[2]
        replace_object(store, index_url, offsets.tobytes(), options, request)
        match = f"{index_url}.*decrease"
    elif corruption == "past_end":
        offsets[-1] += 10
        replace_object(store, index_url, offsets.tobytes(), options, request)
        match = f"{index_url}.*outside the .* bytes of {data_url}"
    elif corruption == "bad_value":
        data = bytearray(Path_or_read(data_url, options))
        data[offsets[1]] = ord("}")  # the second value no longer parses as JSON
        replace_object(store, data_url, bytes(data), options, request)
        match = rf"{data_url}: bytes \[{offsets[1]}, {offsets[2]}\): metadata does not decode"
    else:
        stream = np.frombuffer(
            Path_or_read(source.shard_urls[0], options), dtype=source.stored_dtype
        )
        stream = stream.copy()
        stream["meta"][5] = count + 3
        replace_object(store, source.shard_urls[0], stream.tobytes(), options, request)
        match = f"{source.shard_urls[0]}: element 5 has metadata id {count + 3}"
    # Opened again: a remote object replaced since open is a ShardChangedError, not its bytes.
    dataset = ab.open_dataset(url, options)
    with (
        ab.Loader(dataset, batch_size=4, seq_len=20, shuffle=False) as loader,
        pytest.raises(FormatError, match=match),
    ):
        for _ in loader:
            pass


def Path_or_read(url: str, options: dict[str, Any]) -> bytes:  # noqa: N802
    """The whole object at ``url`` through asyncbatch's own store."""
    from asyncbatch._dataset import read_object

    async def main() -> bytes:
        store = open_store(url, options)
        try:
            return await read_object(store, url)
        finally:
            await store.close()

    return asyncio.run(main())


def test_manifest_without_metadata_section_is_a_manifest_error(tmp_path: Path) -> None:
    ab.write_metadata_stream(str(tmp_path / "d"), make_spans(7, 10))
    path = tmp_path / "d" / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["metadata"]["metadata_stream"]["shards"][0]["count"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="manifest.json.*metadata_stream"):
        ab.open_dataset(str(tmp_path / "d"))


def test_mixture_of_metadata_streams(tmp_path: Path) -> None:
    a, b = make_spans(8, 60), make_spans(9, 50)
    first = ab.write_metadata_stream(str(tmp_path / "a"), a, shard_size=300 * RECORD)
    second = ab.write_metadata_stream(str(tmp_path / "b"), b, shard_size=200 * RECORD)
    sizes = [sum(t.size for t, _ in s) // 25 for s in (a, b)]
    mixture = ab.mix([first, second], weights=[1, 1], seed=3)
    with ab.Loader(mixture, batch_size=1, seq_len=25, shuffle=False) as loader:
        for batch in loader:
            i = int(batch.global_indexes[0])
            spans, shard, local = (a, 300, i) if i < sizes[0] else (b, 200, i - sizes[0])
            again = ab.Batch(np.array([local]), dict(batch.fields), batch.schema)
            check_batch(again, spans, shard, 25)
