"""Megatron ``.idx`` files read by range: a header and a page summary at open, pages of
lengths and pointers fetched where a batch needs them; batches equal the whole-index reader's."""

from __future__ import annotations

import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, s3_options
from faults import fault_server
from make_megatron import random_documents, write_megatron
from test_inplace import READS

import asyncbatch as ab
from asyncbatch._dataset import Dataset
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch.formats._megatron import DOCUMENT_PAGES, HEADER, SEQUENCE_PAGES

CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}


def whole_index(prefix: Path) -> tuple[np.dtype[Any], npt.NDArray[np.int64], npt.NDArray[Any]]:
    """The dtype, the sequences' element offsets (plus the end) and the document indices,
    read from the files with numpy alone."""
    raw = prefix.with_suffix(".idx").read_bytes()
    _, _, code, sequences, entries = HEADER.unpack_from(raw)
    dtype = np.dtype(CODES[code])
    at = HEADER.size
    lengths = np.frombuffer(raw, "<i4", sequences, at).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", sequences, at + 4 * sequences)
    documents = np.frombuffer(raw, "<i8", entries, at + 12 * sequences)
    end = (pointers[-1] + lengths[-1] * dtype.itemsize) if sequences else 0
    offsets = np.append(pointers, end) // dtype.itemsize
    return dtype, offsets.astype(np.int64), documents


def whole_index_dataset(prefix: Path, unit: str) -> Dataset:
    """The dataset the reader of the whole index built (before pages): the documents format
    over offsets in memory."""
    dtype, offsets, documents = whole_index(prefix)
    if unit == "document":
        offsets = offsets[documents]
    total = int(offsets[-1])
    size = prefix.with_suffix(".bin").stat().st_size
    shard = ShardInfo(f"{prefix.name}.bin", total * dtype.itemsize, total)
    shard = ShardInfo(shard.path, shard.nbytes, total, trailing=size - shard.nbytes)
    manifest = Manifest("documents", dtype, (shard,), {})
    return Dataset(str(prefix.parent), manifest, {}, {"document_offsets": offsets})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, ab.Jagged):
        return isinstance(b, ab.Jagged) and same(a.values, b.values) and same(a.offsets, b.offsets)
    if isinstance(a, torch.Tensor) and a.is_nested:
        return len(a.unbind()) == len(b.unbind()) and all(
            same(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True)
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(np.array_equal(a, b))


def batches(data: Any, **kwargs: Any) -> list[ab.Batch]:
    with ab.Loader(data, **kwargs) as loader:
        return list(loader)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    documents = random_documents(21, 90, max_sequences=3, max_length=40)
    documents[5] = [np.zeros(0, np.uint16)]  # an empty sequence, a document of nothing
    documents[6] = [np.zeros(0, np.uint16), np.arange(3, dtype=np.uint16)]
    prefix = tmp_path_factory.mktemp("megatron-range") / "corpus"
    write_megatron(prefix, documents)
    return prefix


CASES: list[dict[str, Any]] = [
    dict(batch_size=5, shuffle=True, seed=3, drop_last=False),
    dict(batch_size=4, shuffle=False, rank=1, world_size=3, format_options={"max_len": 9}),
    dict(
        batch_size=3,
        shuffle=True,
        seed=1,
        format_options={"output": "padded", "max_len": 16, "pad_id": 7},
        dtype=torch.int64,
    ),
    dict(
        batch_size=6, shuffle="block", block_size=8, window=2, format_options={"output": "nested"}
    ),
    dict(batch_size=4, seq_len=32, next_token=True, shuffle=True, rank=2, world_size=3, seed=5),
    dict(batch_size=2, seq_len=50, shuffle="block", block_size=4, dtype=torch.int32),
    dict(batch_size=8, seq_len=7, shuffle=True, seed=9, format_options={"token_ids": False}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unit", ["sequence", "document"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_batches_equal_the_whole_index_readers(corpus: Path, unit: str, case: int) -> None:
    kwargs = CASES[case]
    # Pages of 7 entries, and a cache of a few pages: pages are dropped and fetched again.
    dataset = ab.open_dataset(str(corpus), options={"unit": unit, "index_page": 7})
    options = {**kwargs.get("format_options", {}), "index_cache_bytes": 300}
    got = batches(dataset, **{**kwargs, "format_options": options})
    expected = batches(whole_index_dataset(corpus, unit), **kwargs)
    assert len(got) == len(expected) > 0
    for new, old in zip(got, expected, strict=True):
        assert np.array_equal(new.global_indexes, old.global_indexes)
        assert sorted(new.fields) == sorted(old.fields)
        for name in old.fields:
            assert same(new[name], old[name]), name
    # The tokens themselves, from the files with numpy.
    dtype, offsets, documents = whole_index(corpus)
    stream = np.fromfile(corpus.with_suffix(".bin"), dtype=dtype)
    if unit == "document":
        offsets = offsets[documents]
    seq_len = kwargs.get("seq_len")
    for batch in got:
        for i, sample in enumerate(batch.global_indexes.tolist()):
            if seq_len is not None:
                width = seq_len + int(kwargs.get("next_token", False))
                want = stream[sample * seq_len : sample * seq_len + width]
                assert np.array_equal(batch["tokens"][i].numpy(), want)
            elif "output" not in kwargs.get("format_options", {}):
                want = stream[offsets[sample] : offsets[sample + 1]]
                cut = kwargs.get("format_options", {}).get("max_len", want.size)
                assert np.array_equal(np.asarray(batch["tokens"][i]), want[:cut])


def test_a_mixture_of_two_reads_as_before(corpus: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    write_megatron(other, random_documents(4, 30, max_length=20))
    new = ab.mix([ab.open_dataset(str(p), options={"index_page": 5}) for p in (corpus, other)])
    old = ab.mix([whole_index_dataset(p, "sequence") for p in (corpus, other)])
    for kwargs in [dict(batch_size=4), dict(batch_size=4, seq_len=16)]:
        got, expected = batches(new, **kwargs), batches(old, **kwargs)
        assert len(got) == len(expected) > 0
        for a, b in zip(got, expected, strict=True):
            assert np.array_equal(a.global_indexes, b.global_indexes)
            assert all(same(a[name], b[name]) for name in b.fields)


def test_the_summary_is_each_pages_first_offset(corpus: Path) -> None:
    _, offsets, documents = whole_index(corpus)
    dataset = ab.open_dataset(str(corpus), options={"unit": "document", "index_page": 7})
    pages = dataset.arrays[SEQUENCE_PAGES]
    assert np.array_equal(pages, np.append(offsets[:-1:7], offsets[-1]))
    document_offsets = offsets[documents]
    assert np.array_equal(
        dataset.arrays[DOCUMENT_PAGES], np.append(document_offsets[:-1:7], document_offsets[-1])
    )
    assert dataset.manifest.format == "megatron"
    assert dataset.manifest.metadata["documents"] == documents.size - 1


# --- bytes at the server ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def quiet(proxy: Any) -> None:
    """Wait until the proxy has logged nothing new for 0.3 s (10 s at most)."""
    deadline = time.monotonic() + 10
    seen = -1
    while seen != len(proxy.log) and time.monotonic() < deadline:
        seen = len(proxy.log)
        time.sleep(0.3)


def test_open_reads_the_summary_and_batches_read_pages(s3_endpoint: str, tmp_path: Path) -> None:
    """Counted at moto's S3 server (a proxy in front): opening reads the header and one value
    a page, not the .idx; the first shuffled batch reads whole pages only, each once; an epoch
    reads every page at most once while they fit the cache."""
    import s3fs

    sequences, page = 20_000, 1024  # pages 8 KiB of pointers apart: no merging at open
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 9, int(rng.integers(1, 12)), dtype=np.uint16)] for _ in range(sequences)
    ]
    write_megatron(tmp_path / "corpus", documents)
    idx_size = (tmp_path / "corpus.idx").stat().st_size
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    fs.put(str(tmp_path / "corpus.idx"), f"{BUCKET}/range/corpus.idx")
    fs.put(str(tmp_path / "corpus.bin"), f"{BUCKET}/range/corpus.bin")
    pages = -(-sequences // page)
    with fault_server(upstream=s3_endpoint) as proxy:
        url = f"s3://{BUCKET}/range/corpus.bin"
        dataset = ab.open_dataset(url, s3_options(proxy.url), options={"index_page": page})
        # The first 16 KiB (the header), then an 8-byte pointer a page, the last one and the
        # last length, the first and last document indices.
        opened = proxy.sent("GET", ".idx")
        assert opened == 16 * 2**10 + 8 * (pages + 1) + 4 + 16 < idx_size // 20
        assert proxy.sent("GET", ".bin") == 0
        proxy.reset()
        with ab.Loader(
            dataset, batch_size=4, seq_len=1024, shuffle=True, seed=2, prefetch=1
        ) as loader:
            next(iter(loader))
        ranges = [r for m, p, r in proxy.log if m == "GET" and p.endswith(".idx")]
        lengths_at, pointers_at = HEADER.size, HEADER.size + 4 * sequences
        ends = [min(sequences, page * (p + 1)) for p in range(pages)]
        page_ranges = {
            f"bytes={at + size * page * p}-{at + size * ends[p] - 1}"
            for p in range(pages)
            for at, size in [(lengths_at, 4), (pointers_at, 8)]
        }
        assert ranges and set(ranges) <= page_ranges  # whole pages, nothing else
        assert len(ranges) == len(set(ranges))
        assert proxy.sent("GET", ".idx") < 12 * page * 2 * 8  # a page or two a window
        # The closed loader's next group may have had page GETs on the wire: let them end at
        # the proxy before counting the epoch's (they were counted in it, as refetches).
        quiet(proxy)
        proxy.reset()
        with ab.Loader(
            dataset, batch_size=8, seq_len=1024, shuffle=True, seed=2, rank=1, world_size=2
        ) as loader:
            for _ in loader:
                pass
        ranges = [r for m, p, r in proxy.log if m == "GET" and p.endswith(".idx")]
        assert set(ranges) <= page_ranges
        assert max(Counter(ranges).values()) == 1  # no page twice in the epoch
        assert proxy.sent("GET", ".idx") <= 12 * sequences


# --- bad input -------------------------------------------------------------------------------


def _damaged(tmp_path: Path, at: int, fmt: str, value: int) -> Path:
    write_megatron(tmp_path / "c", random_documents(9, 60, max_sequences=1))
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    struct.pack_into(fmt, raw, at, value)
    (tmp_path / "c.idx").write_bytes(raw)
    return tmp_path / "c"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("where", "fmt", "value", "match"),
    [
        # A length inside page 2 (sequences 20..29 of 60): its pointers no longer follow.
        (HEADER.size + 4 * 23, "<i", 5, r"page 2 of sequences 20\.\.29, bytes \[114, 154\).*"),
        (HEADER.size + 4 * 24, "<i", -1, r"page 2 .*sequence 24 has length -1"),
        # A pointer inside page 4 (not a page's first).
        (HEADER.size + 4 * 60 + 8 * 45, "<q", 4, r"page 4 .*sequence 45 points at byte 4"),
        # The last length of a page: the page ends where the next does not start.
        (
            HEADER.size + 4 * 9,
            "<i",
            10**4,
            r"page 0 of sequences 0\.\.9, .*: its sequences end at byte \d+ of the .bin,"
            " but the next page starts",
        ),
    ],
)
def test_a_page_that_disagrees_is_a_format_error(
    tmp_path: Path, where: int, fmt: str, value: int, match: str
) -> None:
    prefix = _damaged(tmp_path, where, fmt, value)
    dataset = ab.open_dataset(str(prefix), options={"index_page": 10})  # the summary is intact
    with pytest.raises(ab.FormatError, match=match) as info:
        batches(dataset, batch_size=4, shuffle=False)
    assert f"{prefix}.idx" in str(info.value)


@pytest.mark.parametrize(
    ("where", "value", "match"),
    [
        (HEADER.size + 4 * 60 + 8 * 20, 3, r"bytes \[434, 442\): sequence 20 points at byte 3"),
        (HEADER.size + 4 * 60 + 8 * 30, 1, r"sequence 30 points at byte 1 "),
        (HEADER.size + 4 * 60, 2, r"sequence 0 points at byte 2"),
    ],
)
def test_a_summary_pointer_out_of_order_is_refused_at_open(
    tmp_path: Path, where: int, value: int, match: str
) -> None:
    prefix = _damaged(tmp_path, where, "<q", value)
    with pytest.raises(ab.FormatError, match=match) as info:
        ab.open_dataset(str(prefix), options={"index_page": 10})
    assert f"{prefix}.idx" in str(info.value)


def test_a_document_page_that_disagrees_is_a_format_error(tmp_path: Path) -> None:
    # Document 13's index entry (inside document page 1 of 10) moved: out of order.
    prefix = _damaged(tmp_path, HEADER.size + 12 * 60 + 8 * 13, "<q", 50)
    dataset = ab.open_dataset(str(prefix), options={"unit": "document", "index_page": 10})
    with pytest.raises(ab.FormatError, match=r"page 1 of document indices, bytes \[") as info:
        batches(dataset, batch_size=4, shuffle=False)
    assert f"{prefix}.idx" in str(info.value)


def test_a_bin_shorter_than_the_summary_says_is_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "t", random_documents(10, 50))
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-2])
    with pytest.raises(ab.FormatError, match=r"t\.idx: its sequences end at byte .*/t\.bin has"):
        ab.open_dataset(str(tmp_path / "t"), options={"index_page": 4})


def test_the_node_cache_keeps_the_summary(tmp_path: Path) -> None:
    # The first process of a node reads the summary, range by range, and keeps it; the next
    # opens read the first 16 KiB (the header) and find the rest in the cache.
    (tmp_path / "data").mkdir()
    documents = [[np.arange(i % 5, dtype=np.uint16)] for i in range(3_000)]
    write_megatron(tmp_path / "data" / "m", documents)
    url, cache = f"counting://{tmp_path}/data/m", str(tmp_path / "cache")
    READS.clear()
    first = ab.open_dataset(url, cache=cache, options={"unit": "document", "index_page": 1024})
    assert len(READS) > 1 and all(u == f"{url}.idx" for u, _, _ in READS)
    READS.clear()
    again = ab.open_dataset(url, cache=cache, options={"unit": "document", "index_page": 1024})
    assert [(s, e) for _, s, e in READS] == [(0, 16 * 2**10)]
    for name in (SEQUENCE_PAGES, DOCUMENT_PAGES):
        assert np.array_equal(first.arrays[name], again.arrays[name])
    # Pages read through the cache (the counting store reads no batches): right all the same.
    plain = ab.open_dataset(str(tmp_path / "data" / "m"), options={"unit": "document"})
    with ab.Loader(plain, batch_size=3_000, shuffle=False, cache=cache) as loader:
        (batch,) = list(loader)
    assert batch["tokens"].lengths.tolist() == [i % 5 for i in range(3_000)]


@pytest.mark.timeout(60)
def test_index_memory_stays_within_its_bound(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pages of 7 sequences (64 bytes of offsets each): 200 bytes hold three. An exact shuffle
    # fetches pages again once dropped, and holds no more than the bound (but for one batch's
    # own pages); with room for all, each page once.
    from asyncbatch.formats._megatron_index import MegatronIndex

    dataset = ab.open_dataset(str(corpus), options={"index_page": 7})
    pages = dataset.arrays[SEQUENCE_PAGES].size - 1
    fetched: list[int] = []
    original = MegatronIndex._sequence_pages

    def counted(self: MegatronIndex, chosen: list[int]) -> Any:
        fetched.extend(chosen)
        return (yield from original(self, chosen))

    monkeypatch.setattr(MegatronIndex, "_sequence_pages", counted)
    for budget, expected in [(200, None), (2**20, pages)]:
        fetched.clear()
        options = {"index_cache_bytes": budget}
        with ab.Loader(
            dataset, batch_size=2, shuffle=True, prefetch=1, format_options=options
        ) as loader:
            peak = 0
            for _ in loader:
                engine = loader._engine
                assert engine is not None
                peak = max(peak, engine.source.index.cached_bytes)  # type: ignore[attr-defined]
        if expected is None:
            assert peak <= budget + 2 * 8 * 8 and len(fetched) > pages
        else:
            assert sorted(fetched) == list(range(pages))  # each page once


def test_format_options_are_checked(corpus: Path) -> None:
    dataset = ab.open_dataset(str(corpus))
    with pytest.raises(ab.ConfigError, match=r"unknown format_options \['shuffle_pages'\]"):
        ab.Loader(dataset, batch_size=2, format_options={"shuffle_pages": True})
    with pytest.raises(ab.ConfigError, match="keeps no per-document metadata"):
        ab.Loader(dataset, batch_size=2, format_options={"metadata": True})
    with pytest.raises(ab.ConfigError, match="apply to sequences as samples"):
        ab.Loader(dataset, batch_size=2, seq_len=8, format_options={"max_len": 3})
    with pytest.raises(ab.ConfigError, match="index_cache_bytes must be a number of bytes"):
        ab.Loader(dataset, batch_size=2, format_options={"index_cache_bytes": -1})
    with ab.Loader(dataset, batch_size=2, format_options={"metadata": False}) as loader:
        assert next(iter(loader))["tokens"] is not None
