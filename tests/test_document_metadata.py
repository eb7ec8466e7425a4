"""Per-document metadata: ``prepare(..., metadata_fields=("id", "url"))`` read back through the
loaders, as a ``metadata`` column of documents and as the metadata stream's runs of packed
windows, exactly equal to the input records' fields, through local files and S3; fetched by
range; corrupt metadata files refused, naming them.

Expectations come from the records the test wrote, never from the library: document ``d`` is
the ``d``-th record in input order (files by name, records in order).
"""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BUCKET, s3_options
from faults import fault_server

import asyncbatch as ab
from asyncbatch._cli import main as cli_main
from asyncbatch._errors import ConfigError, ManifestError
from asyncbatch._verify import verify_dataset

FIELDS = ("id", "url")
SEQ_LEN = 16
_names = itertools.count()


def word_lengths(texts: list[str]) -> list[list[int]]:
    """The test tokenizer: one id per word, its length."""
    return [[len(word) for word in text.split()] for text in texts]


class Corpus:
    """The input records, in the order prepare reads them: each document's tokens and the
    metadata it must come back with (as compact JSON, so types and key order count)."""

    def __init__(self, texts: list[str], meta: list[dict[str, Any]]) -> None:
        self.tokens = word_lengths(texts)
        self.meta = [json.dumps(m, ensure_ascii=False) for m in meta]
        lengths = [len(t) for t in self.tokens]
        self.stream = np.array([t for d in self.tokens for t in d], dtype=np.int64)
        self.owner = np.repeat(np.arange(len(lengths)), lengths)


def write_corpus(folder: Path) -> Corpus:
    """JSON Lines (plain and gzipped, with missing and odd fields), Parquet, and a text file."""
    rng = np.random.default_rng(7)
    folder.mkdir(parents=True)
    texts: list[str] = []
    meta: list[dict[str, Any]] = []

    def text() -> str:
        count = int(rng.geometric(1 / 9)) - 1 if rng.random() > 0.06 else 0  # some empty
        return " ".join("w" * int(rng.integers(1, 12)) for _ in range(count))

    records: list[dict[str, Any]] = []
    for i in range(140):
        record: dict[str, Any] = {"text": text(), "id": f"doc-{i}", "url": f"https://e.org/{i}"}
        if i % 11 == 3:
            del record["url"]  # a missing field is null
        if i % 13 == 5:
            record["id"] = i  # any JSON value, as it is
        if i % 17 == 2:
            record["url"] = 'naïve "quoted"\nline — 東京'
        records.append(record)
    lines = "".join(json.dumps(r) + "\n" for r in records[:100])
    (folder / "a.jsonl").write_text(lines, encoding="utf-8")
    (folder / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in records[100:]).encode(), mtime=0)
    )
    for r in records:
        texts.append(r["text"])
        meta.append({name: r.get(name) for name in FIELDS})
    rows = [text() for _ in range(60)]
    ids = [f"row-{i}" for i in range(60)]
    urls = [None if i % 7 == 0 else f"s3://b/{i}" for i in range(60)]
    pq.write_table(
        pa.table({"text": rows, "id": ids, "url": urls, "other": list(range(60))}),
        folder / "c.parquet",
        row_group_size=9,
    )
    texts += rows
    meta += [{"id": i, "url": u} for i, u in zip(ids, urls, strict=True)]
    (folder / "d.txt").write_text("a text file has no fields", encoding="utf-8")
    texts.append("a text file has no fields")
    meta.append({"id": None, "url": None})
    return Corpus(texts, meta)


def prepare(inputs: Path, output: str, options: dict[str, Any] | None = None) -> None:
    ab.prepare(
        str(inputs),
        output,
        tokenizer=word_lengths,
        vocab_size=1000,
        metadata_fields=FIELDS,
        shard_size=120,  # many shards of a few documents
        unit_size=1500,  # a.jsonl cut into byte ranges
        workers=1,
        storage_options=options,
        progress=False,
    )


@pytest.fixture(scope="module")
def corpus_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Corpus]:
    folder = tmp_path_factory.mktemp("raw") / "in"
    return folder, write_corpus(folder)


@pytest.fixture(scope="module")
def local_prepared(
    tmp_path_factory: pytest.TempPathFactory, corpus_inputs: tuple[Path, Corpus]
) -> str:
    out = str(tmp_path_factory.mktemp("prepared") / "out")
    prepare(corpus_inputs[0], out)
    return out


@pytest.fixture(scope="module")
def s3_prepared(s3_endpoint: str, corpus_inputs: tuple[Path, Corpus]) -> tuple[str, dict[str, Any]]:
    options = s3_options(s3_endpoint)
    url = f"s3://{BUCKET}/docmeta-{next(_names)}"
    prepare(corpus_inputs[0], url, options)  # written to S3 by prepare itself
    return url, options


@pytest.fixture(params=["local", "s3"])
def prepared(request: pytest.FixtureRequest, local_prepared: str) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return local_prepared, {}
    s3: tuple[str, dict[str, Any]] = request.getfixturevalue("s3_prepared")
    return s3


def metadata_of(values: Any) -> list[str]:
    assert isinstance(values, np.ndarray) and values.dtype == object
    return [json.dumps(v, ensure_ascii=False) for v in values]


def check_documents(batch: ab.Batch, corpus: Corpus) -> None:
    ids = batch.global_indexes.tolist()
    assert metadata_of(batch["metadata"]) == [corpus.meta[i] for i in ids]
    column = batch["tokens"]
    assert [column[i].tolist() for i in range(len(ids))] == [corpus.tokens[i] for i in ids]


def expected_runs(corpus: Corpus, start: int, width: int) -> tuple[list[int], list[int], list[str]]:
    """One run per document with tokens in the window, from the token owners."""
    owner = corpus.owner[start : start + width]
    heads = [0, *(np.flatnonzero(np.diff(owner)) + 1).tolist()]
    ends = [*heads[1:], width]
    return heads, ends, [corpus.meta[int(owner[h])] for h in heads]


def check_windows(batch: ab.Batch, corpus: Corpus, width: int) -> None:
    for row, window in enumerate(batch.global_indexes.tolist()):
        start = window * SEQ_LEN
        tokens = batch["tokens"][row].numpy().astype(np.int64)
        np.testing.assert_array_equal(tokens, corpus.stream[start : start + width])
        heads, ends, values = expected_runs(corpus, start, width)
        assert batch["meta_start"][row].tolist() == heads
        assert batch["meta_end"][row].tolist() == ends
        assert metadata_of(batch["meta"][row]) == values


@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_documents_carry_their_records_fields(
    prepared: tuple[str, dict[str, Any]], corpus_inputs: tuple[Path, Corpus], shuffle: Any
) -> None:
    url, options = prepared
    corpus = corpus_inputs[1]
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.metadata["document_metadata"]["fields"] == list(FIELDS)
    assert len(dataset.manifest.shards) > 8
    block = {"block_size": 8, "window": 3} if shuffle == "block" else {}
    seen: list[int] = []
    with ab.Loader(
        dataset, batch_size=8, shuffle=shuffle, seed=4, drop_last=False, **block
    ) as loader:
        for batch in loader:
            assert batch.schema["metadata"] == ab.FieldSchema("object", (), tensor=False)
            check_documents(batch, corpus)
            seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(len(corpus.meta)))


@pytest.mark.parametrize("next_token", [False, True])
@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_packed_windows_say_where_each_token_came_from(
    prepared: tuple[str, dict[str, Any]],
    corpus_inputs: tuple[Path, Corpus],
    shuffle: Any,
    next_token: bool,
) -> None:
    url, options = prepared
    corpus = corpus_inputs[1]
    width = SEQ_LEN + next_token
    block = {"block_size": 4, "window": 2} if shuffle == "block" else {}
    seen: list[int] = []
    with ab.Loader(
        url,
        batch_size=4,
        seq_len=SEQ_LEN,
        next_token=next_token,
        shuffle=shuffle,
        seed=1,
        storage_options=options,
        **block,
    ) as loader:
        for batch in loader:
            check_windows(batch, corpus, width)
            seen += batch.global_indexes.tolist()
    windows = (corpus.stream.size - next_token) // SEQ_LEN
    assert len(set(seen)) == len(seen) and max(seen) < windows
    assert len(seen) > windows - 4  # all but the uneven tail


def test_padded_and_nested_outputs_keep_the_metadata(
    local_prepared: str, corpus_inputs: tuple[Path, Corpus]
) -> None:
    corpus = corpus_inputs[1]
    for output in ("padded", "nested"):
        options = {"output": output, "max_len": 5}
        with ab.Loader(
            local_prepared, batch_size=5, shuffle=True, format_options=options
        ) as loader:
            batch = next(iter(loader))
        ids = batch.global_indexes.tolist()
        assert metadata_of(batch["metadata"]) == [corpus.meta[i] for i in ids]


def test_metadata_is_fetched_by_range_and_open_reads_the_manifest_only(
    tmp_path: Path, corpus_inputs: tuple[Path, Corpus], local_prepared: str
) -> None:
    """Counted at the server: opening reads the manifest alone; a batch reads the metadata
    files' entries and values it needs, by range, not the files."""
    corpus = corpus_inputs[1]
    root = tmp_path / "one"
    ab.prepare(  # a.jsonl, its first 100 documents, in one shard: ranges, not whole files
        str(corpus_inputs[0] / "a.jsonl"),
        str(root),
        tokenizer=word_lengths,
        vocab_size=1000,
        metadata_fields=FIELDS,
        workers=1,
        unit_size=10**9,
        progress=False,
    )
    [index] = root.glob("data/*.meta.idx")
    data = index.with_name(index.name.replace(".idx", ".bin"))
    with fault_server(tmp_path) as server:
        opened = ab.open_dataset(f"{server.url}/one")
        assert (server.count("GET"), server.count("HEAD")) == (1, 1)
        assert server.sent("GET") == server.sent("GET", "manifest.json")
        for args in ({}, {"seq_len": SEQ_LEN}):
            server.reset()
            with ab.Loader(
                opened, batch_size=2, shuffle=True, prefetch=2, coalesce_gap=0, **args
            ) as loader:
                batches = list(itertools.islice(loader, 2))
            for batch in batches:
                if args:
                    check_windows(batch, corpus, SEQ_LEN)
                else:
                    check_documents(batch, corpus)
            # Read-ahead makes how many batches were fetched (up to prefetch + 2 more than
            # taken) depend on timing: bounded, never the whole file.
            assert 0 < server.sent("GET", index.name) < index.stat().st_size // 2
            assert 0 < server.sent("GET", data.name) < data.stat().st_size // 2
            ranged = [r for m, p, r in server.log if m == "GET" and ".meta." in p]
            assert ranged and all(r.startswith("bytes=") for r in ranged)


def test_mixtures_keep_metadata_all_or_none(
    tmp_path: Path, local_prepared: str, corpus_inputs: tuple[Path, Corpus]
) -> None:
    corpus = corpus_inputs[1]
    plain = ab.write_documents(str(tmp_path / "plain"), [[1, 2, 3], [4], [5, 6]], dtype=np.uint16)
    with pytest.raises(ConfigError, match="keeps document metadata and .*plain does not"):
        ab.Loader(ab.mix([local_prepared, plain]), batch_size=2)
    # metadata=False reads none, mixed or not.
    for data in (ab.mix([local_prepared, plain]), local_prepared):
        with ab.Loader(data, batch_size=2, format_options={"metadata": False}) as loader:
            batch = next(iter(loader))
        assert "metadata" not in batch.fields
    with ab.Loader(
        local_prepared, batch_size=2, seq_len=8, format_options={"metadata": False}
    ) as loader:
        assert "meta" not in next(iter(loader)).fields
    with pytest.raises(ConfigError, match="metadata=True, and .*plain keeps no document"):
        ab.Loader(plain, batch_size=2, format_options={"metadata": True})
    with pytest.raises(ConfigError, match="metadata must be True or False"):
        ab.Loader(plain, batch_size=2, format_options={"metadata": "yes"})
    # Two datasets with metadata: documents numbered through both, each with its own.
    mixture = ab.mix([local_prepared, local_prepared], weights=[1, 1], seed=3)
    count = len(corpus.meta)
    with ab.Loader(mixture, batch_size=8, shuffle=True) as loader:
        for batch in itertools.islice(loader, 10):
            ids = batch.global_indexes % count
            assert metadata_of(batch["metadata"]) == [corpus.meta[i] for i in ids.tolist()]


# ---------------------------------------------------------------------------------------------
# Corrupt metadata files are refused, naming them


@pytest.fixture
def copy(tmp_path: Path, local_prepared: str) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(local_prepared, root)
    return root


def first_batches(root: Path, **kwargs: Any) -> None:
    for seq_len in (None, SEQ_LEN):
        with ab.Loader(
            str(root), batch_size=64, shuffle=False, seq_len=seq_len, **kwargs
        ) as loader:
            for _ in loader:
                pass


def offsets_of(path: Path) -> npt.NDArray[np.int64]:
    return np.frombuffer(path.read_bytes(), dtype="<i8").copy()


def test_a_corrupt_metadata_index_is_refused_naming_it(copy: Path) -> None:
    [index] = (copy / "data").glob("u000000-*-0001.meta.idx")
    data = index.with_name(index.name.replace(".idx", ".bin"))
    good = offsets_of(index)
    assert good.size > 3 and good[0] == 0 and good[-1] == data.stat().st_size
    for change, message in [
        (lambda o: o.__setitem__(2, o[1] - 1), r"bytes \[\d+, \d+\): .* offsets that decrease"),
        (
            lambda o: o.__setitem__(-1, o[-1] + 5),
            rf"bytes \[\d+, \d+\): .* outside the \d+ bytes of {data}",
        ),
        (lambda o: o.__setitem__(0, 3), r"bytes \[0, \d+\): .* a first offset of 3, not 0"),
    ]:
        offsets = good.copy()
        change(offsets)
        index.write_bytes(offsets.tobytes())
        with pytest.raises(ab.FormatError, match=f"{index}: {message}"):
            first_batches(copy)
    # A value that no longer parses: the codec's error names the data file.
    index.write_bytes(good.tobytes())
    raw = data.read_bytes()
    at = raw.index(b'"doc-')
    data.write_bytes(raw[:at] + b"'" + raw[at + 1 :])  # the same size
    line = raw.rindex(b"\n", 0, at) + 1 if b"\n" in raw[:at] else 0
    end = raw.index(b"\n", at) + 1
    with pytest.raises(
        ab.FormatError, match=rf"{data}: bytes \[{line}, {end}\): metadata does not decode"
    ):
        first_batches(copy)
    # The manifest's checksum catches it before any value is read; the size check a file of
    # another size.
    with pytest.raises(ab.ChecksumError, match=str(data)):
        first_batches(copy, verify="full")
    report = verify_dataset(str(copy))
    assert [bad.url for bad in report.bad] == [str(data)]
    assert report.metadata_files > 0  # checked with the shards
    index.write_bytes(good.tobytes() + b"\0" * 8)
    with pytest.raises(ManifestError, match=f"size mismatch: {index}"):
        first_batches(copy)
    index.write_bytes(good.tobytes())
    data.unlink()
    with pytest.raises(ab.FormatError, match=f"{data}: a document metadata file .* is missing"):
        first_batches(copy, verify="off")


def test_metadata_entries_that_disagree_with_the_manifest_are_refused(copy: Path) -> None:
    path = copy / "manifest.json"
    saved = path.read_text()
    for change, message in [
        (lambda m: m["document_metadata"]["shards"][1].update(count=1), "entry 1 .* says 1 values"),
        (lambda m: m["document_metadata"]["shards"].pop(), "entries for"),
        (lambda m: m["document_metadata"].pop("codec"), "no valid document_metadata"),
    ]:
        raw = json.loads(saved)
        change(raw["metadata"])
        path.write_text(json.dumps(raw))
        with pytest.raises(ManifestError, match=message):
            ab.open_dataset(str(copy))
    raw = json.loads(saved)
    raw["metadata"]["document_metadata"]["codec"]["name"] = "nobody"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no metadata codec 'nobody'"):
        ab.Loader(str(copy), batch_size=2)
    with ab.Loader(str(copy), batch_size=2, format_options={"metadata": False}) as loader:
        next(iter(loader))  # read without it


def test_the_command_keeps_metadata_fields(
    tmp_path: Path, corpus_inputs: tuple[Path, Corpus], capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = corpus_inputs[1]
    out = tmp_path / "out"
    argv = ["prepare", str(corpus_inputs[0]), "--output", str(out), "--workers", "1"]
    argv += ["--tokenizer", "test_document_metadata:word_lengths", "--vocab-size", "1000"]
    argv += ["--metadata-field", "id", "--metadata-field", "url", "--no-progress"]
    assert cli_main(argv) == 0
    with ab.Loader(str(out), batch_size=50, shuffle=False, drop_last=False) as loader:
        got = [v for batch in loader for v in metadata_of(batch["metadata"])]
    assert got == corpus.meta
    with pytest.raises(SystemExit):
        cli_main(["prepare", "--help"])
    assert "--metadata-field" in capsys.readouterr().out


@pytest.mark.parametrize("seq_len", [None, SEQ_LEN])
def test_dataloader_workers_and_checksum_levels_keep_the_metadata(
    local_prepared: str, corpus_inputs: tuple[Path, Corpus], seq_len: int | None
) -> None:
    corpus = corpus_inputs[1]
    args: dict[str, Any] = dict(batch_size=6, shuffle=True, seed=2, seq_len=seq_len)
    source = ab.LoaderDataset(local_prepared, **args)
    batches = 0
    for batch in source.dataloader(num_workers=2):  # batches pickled across processes
        if seq_len is None:
            check_documents(batch, corpus)
        else:
            check_windows(batch, corpus, SEQ_LEN)
        batches += 1
    assert batches > 5
    for verify in ("block", "full"):
        with ab.Loader(local_prepared, verify=verify, **args) as loader:
            for batch in loader:
                if seq_len is None:
                    check_documents(batch, corpus)
                else:
                    check_windows(batch, corpus, SEQ_LEN)


def test_parquet_metadata_columns_that_json_cannot_hold_are_named(tmp_path: Path) -> None:
    import datetime

    folder = tmp_path / "in"
    folder.mkdir()
    when = [datetime.datetime(2020, 1, 1), None]
    table = pa.table({"text": ["a b", "c"], "id": ["x", "y"], "when": when})
    pq.write_table(table, folder / "a.parquet")
    args: dict[str, Any] = dict(tokenizer=word_lengths, vocab_size=100, workers=1, progress=False)
    with pytest.raises(ab.RecordError, match=r"a.parquet, file .*metadata column 'when' is"):
        ab.prepare(str(folder), str(tmp_path / "out"), metadata_fields=("id", "when"), **args)
    nested = pa.table({"text": ["a b"], "tags": [[{"k": "v", "n": 1.5}]]})
    pq.write_table(nested, folder / "a.parquet")
    ab.prepare(str(folder), str(tmp_path / "ok"), metadata_fields=("tags",), **args)
    with ab.Loader(str(tmp_path / "ok"), batch_size=1) as loader:
        assert list(next(iter(loader))["metadata"]) == [{"tags": [{"k": "v", "n": 1.5}]}]
