"""``prepare``: raw JSONL, Parquet and text files tokenized into a documents dataset, on a
local process pool and on a real local Ray cluster, from and to a real S3 server; exact
tokens, byte-identical output for any worker count and engine, resume after ``kill -9``, and
every bad input named."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import BUCKET, s3_options

import asyncbatch as ab
from asyncbatch._cli import main as cli_main
from asyncbatch._prepare import engines

HERE = Path(__file__).parent
EOS = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------
# A real-text corpus and a BPE tokenizer trained on it (nothing downloaded)


def corpus_texts() -> list[str]:
    """Real text: the sources of a few standard-library modules, cut into documents of
    varied length, with an empty one and non-ASCII ones."""
    import email
    import json as json_module

    texts: list[str] = []
    for package in (json_module, email):
        folder = Path(package.__file__).parent
        for path in sorted(folder.glob("*.py"))[:6]:
            source = path.read_text(encoding="utf-8")
            texts += [source[i : i + 900] for i in range(0, min(len(source), 9000), 900)]
    texts += ["", "naïve café — 東京 🚀", "x"]
    return texts


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return corpus_texts()


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOS, "[UNK]", "<s>"])
    tokenizer.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def encode(tokenizer_file: Path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return [tokenizer.encode(text).ids for text in texts]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    lines = "".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts))
    raw = lines.encode()
    if path.suffix == ".gz":
        raw = gzip.compress(raw, mtime=0)
    elif path.suffix == ".zst":
        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    return path


def mixed_inputs(folder: Path, texts: list[str]) -> tuple[Path, list[str]]:
    """A folder of every input kind, and the texts in the order prepare must read them
    (files by name, records in order)."""
    folder.mkdir(parents=True, exist_ok=True)
    a, b, c = texts[:20], texts[20:40], texts[40:60]
    write_jsonl(folder / "a-0.jsonl", a)  # cut into byte ranges by a small unit_size
    write_jsonl(folder / "a-1.jsonl.gz", b)
    write_jsonl(folder / "a-2.jsonl.zst", c)
    rows = texts[60:100]
    table = pa.table({"text": rows, "n": list(range(len(rows)))})
    pq.write_table(table, folder / "b.parquet", row_group_size=7)
    rest = texts[100:]
    for i, text in enumerate(rest):
        (folder / f"c-{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder, a + b + c + rows + rest


def read_back(url: str, options: dict[str, Any] | None = None) -> list[list[int]]:
    """Every document of the dataset at ``url``, in order, through the Loader."""
    documents: list[list[int]] = []
    with ab.Loader(
        url, batch_size=7, shuffle=False, drop_last=False, storage_options=options or {}
    ) as loader:
        for batch in loader:
            column = batch["tokens"]
            documents += [column[i].tolist() for i in range(len(column))]
    return documents


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# ---------------------------------------------------------------------------------------------
# Exact tokens


def test_every_record_read_back_equals_encode_plus_eos(
    tmp_path: Path, texts: list[str], tokenizer_file: Path
) -> None:
    folder, ordered = mixed_inputs(tmp_path / "in", texts)
    out = tmp_path / "out"
    report = ab.prepare(
        str(folder),
        str(out),
        tokenizer=str(tokenizer_file),
        eos=EOS,
        workers=1,
        unit_size=2000,  # the plain JSONL file and the Parquet file are cut into several units
        shard_size=3000,
        progress=False,
    )
    eos = json.loads(tokenizer_file.read_text())["added_tokens"][0]["id"]
    expected = [ids + [eos] for ids in encode(tokenizer_file, ordered)]
    assert read_back(str(out)) == expected
    assert report.documents == len(ordered)
    assert report.tokens == sum(map(len, expected))
    assert report.units > 8  # byte ranges of a-0.jsonl, row-group runs of b.parquet, files
    assert report.units_already_done == 0 and report.skipped_records == 0
    assert report.dtype == "uint16"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "documents" and manifest["dtype"] == "<u2"
    assert manifest["metadata"]["documents"] == len(ordered)
    assert [t for t in ordered if t == ""] == [""]  # the empty document is kept: eos alone
    assert [eos] in read_back(str(out))


def test_jsonl_units_own_the_lines_that_start_in_them(tmp_path: Path, texts: list[str]) -> None:
    # Every unit size from a byte to the whole file: no line lost or read twice.
    lines = [t[: 3 * i] for i, t in enumerate(texts[:12])]
    path = write_jsonl(tmp_path / "a.jsonl", lines)
    size = path.stat().st_size
    for unit_size in (1, 2, 7, 30, 100, size - 1, size):
        out = tmp_path / f"out-{unit_size}"
        report = ab.prepare(
            str(path),
            str(out),
            token_field=None,
            tokenizer=lambda batch: [[len(t)] for t in batch],
            workers=1,
            unit_size=unit_size,
            progress=False,
        )
        assert report.units == -(-size // unit_size)
        assert read_back(str(out)) == [[len(t)] for t in lines]


@pytest.mark.parametrize("kind", ["tokenizers", "tiktoken", "callable"])
def test_tokenizer_kinds(tmp_path: Path, texts: list[str], tokenizer_file: Path, kind: str) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", texts[:25])
    expected: list[list[int]]
    if kind == "tokenizers":
        from tokenizers import Tokenizer

        tokenizer: Any = Tokenizer.from_file(str(tokenizer_file))
        expected = [tokenizer.encode(t).ids for t in texts[:25]]
        bos: Any = "<s>"
        bos_id = tokenizer.token_to_id("<s>")
    elif kind == "tiktoken":
        import tiktoken

        ranks = {bytes([b]): b for b in range(256)}
        tokenizer = tiktoken.Encoding(
            "bytes-only", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<s>": 256}
        )
        expected = [tokenizer.encode_ordinary(t) for t in texts[:25]]
        bos, bos_id = "<s>", 256
    else:
        tokenizer = byte_tokenizer
        expected = byte_tokenizer(texts[:25])
        bos, bos_id = 3, 3
    report = ab.prepare(
        str(path),
        str(tmp_path / "out"),
        tokenizer=tokenizer,
        bos=bos,
        eos=[1, 2],
        vocab_size=None if kind != "callable" else 300,
        workers=2,
        unit_size=3000,
        progress=False,
    )
    assert report.units > 1
    assert read_back(str(tmp_path / "out")) == [[bos_id, *ids, 1, 2] for ids in expected]


def byte_tokenizer(texts: list[str]) -> list[list[int]]:
    return [list(text.encode()) for text in texts]


def test_ids_already_tokenized_from_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [[5, 6, 7], [], [70_000, 1], [9]]
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "in" / "b.parquet")
    report = ab.prepare(
        str(tmp_path / "in"), str(tmp_path / "out"), token_field="input_ids", progress=False
    )
    assert report.dtype == "uint32"  # no vocabulary known: ids up to 2**32 - 1
    assert read_back(str(tmp_path / "out")) == rows + rows
    # With a vocabulary of 65,536 the output is uint16, and an id past it is refused.
    with pytest.raises(ab.ConfigError, match=r"a.jsonl, line 3 \(unit 0\): token id 70000"):
        ab.prepare(
            str(tmp_path / "in"),
            str(tmp_path / "out16"),
            token_field="input_ids",
            vocab_size=65_536,
            progress=False,
        )


# ---------------------------------------------------------------------------------------------
# Deterministic on any worker count and engine; resumable


def test_byte_identical_for_any_worker_count(
    tmp_path: Path, texts: list[str], tokenizer_file: Path
) -> None:
    folder, _ = mixed_inputs(tmp_path / "in", texts)
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"out-{workers}"
        ab.prepare(
            str(folder),
            str(out),
            tokenizer=str(tokenizer_file),
            eos=EOS,
            workers=workers,
            unit_size=2000,
            shard_size=3000,
            progress=False,
        )
        outputs.append(tree(out))
    assert outputs[0] == outputs[1] == outputs[2]
    assert "manifest.json" in outputs[0]


def test_ray_engine_writes_the_local_engines_bytes(
    tmp_path: Path, texts: list[str], tokenizer_file: Path, ray_cluster: None
) -> None:
    folder, ordered = mixed_inputs(tmp_path / "in", texts)
    common: dict[str, Any] = {
        "tokenizer": str(tokenizer_file),
        "eos": EOS,
        "unit_size": 2000,
        "shard_size": 3000,
        "progress": False,
    }
    local = ab.prepare(str(folder), str(tmp_path / "local"), workers=2, **common)
    ray_report = ab.prepare(str(folder), str(tmp_path / "ray"), engine="ray", **common)
    assert tree(tmp_path / "local") == tree(tmp_path / "ray")
    assert ray_report.documents == local.documents == len(ordered)
    # The cluster this process started is still up: prepare leaves a cluster it joined.
    import ray

    assert ray.is_initialized()


def test_ray_engine_reports_a_bad_record_as_the_local_one(
    tmp_path: Path, tokenizer_file: Path, ray_cluster: None
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(ab.RecordError, match=r"a.jsonl, line 2 \(unit 0\): field 'text' is a int"):
        ab.prepare(
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            tokenizer=str(tokenizer_file),
            engine="ray",
            progress=False,
        )


def test_a_second_run_redoes_nothing_and_a_changed_setting_redoes_all(
    tmp_path: Path, texts: list[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", texts[:40])
    args: dict[str, Any] = {"tokenizer": byte_tokenizer, "workers": 1, "unit_size": 2000}
    first = ab.prepare(str(path), str(tmp_path / "out"), progress=False, **args)
    before = tree(tmp_path / "out")
    again = ab.prepare(str(path), str(tmp_path / "out"), progress=False, **args)
    assert again.units_already_done == again.units == first.units
    assert tree(tmp_path / "out") == before
    # A unit whose shard lost bytes is redone; the others are not.
    shard = sorted((tmp_path / "out" / "data").glob("u000001-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    fixed = ab.prepare(str(path), str(tmp_path / "out"), progress=False, **args)
    assert fixed.units_already_done == first.units - 1
    assert tree(tmp_path / "out") == before
    changed = ab.prepare(str(path), str(tmp_path / "out"), eos=0, progress=False, **args)
    assert changed.units_already_done == 0


def _wait_for_done(out: Path, count: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while len(list((out / "done").glob("u*.json"))) < count:
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no unit finished in 60 s"
        time.sleep(0.02)


def _child(inputs: Path, out: Path, workers: int, unit_size: int) -> list[str]:
    return [
        sys.executable,
        str(HERE / "prepare_child.py"),
        str(inputs),
        str(out),
        str(workers),
        str(unit_size),
    ]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> tuple[Path, int, Path]:
    """``(input, unit size, output)`` of a run never interrupted, for the runs killed to
    equal once resumed (one run for every victim)."""
    folder = tmp_path_factory.mktemp("clean-run")
    path = write_jsonl(folder / "a.jsonl", texts * 2)
    unit_size = path.stat().st_size // 24 + 1
    clean = folder / "clean"
    subprocess.run(_child(path, clean, 2, unit_size), check=True, capture_output=True, timeout=120)
    return path, unit_size, clean


@pytest.mark.parametrize("victim", ["driver", "worker"])
def test_kill_9_then_resume_equals_a_clean_run(
    tmp_path: Path, clean_run: tuple[Path, int, Path], victim: str
) -> None:
    path, unit_size, clean = clean_run
    out = tmp_path / "out"
    process = subprocess.Popen(
        _child(path, out, 2, unit_size),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_done(out, 3, process)
        if victim == "driver":
            os.killpg(process.pid, signal.SIGKILL)  # the driver and its workers, at once
        else:
            workers = subprocess.run(
                ["pgrep", "-P", str(process.pid), "-f", "spawn_main"],
                capture_output=True,
                text=True,
            ).stdout.split()
            os.kill(int(workers[0]), signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0
    assert not (out / "manifest.json").exists()
    # Resumed on another worker count.
    resumed = subprocess.run(
        _child(path, out, 1, unit_size), check=True, capture_output=True, text=True, timeout=120
    )
    line = resumed.stdout.strip().splitlines()[-1]
    done = int(line.split(" units, ")[1].split(" already done")[0])
    assert 3 <= done < 24, line
    assert tree(out) == tree(clean)


# ---------------------------------------------------------------------------------------------
# S3 in and out (moto's server)


def test_s3_inputs_and_output(
    tmp_path: Path, texts: list[str], tokenizer_file: Path, s3_endpoint: str
) -> None:
    import s3fs

    options = s3_options(s3_endpoint)
    fs = s3fs.S3FileSystem(**options)
    local = write_jsonl(tmp_path / "a.jsonl", texts[:40])
    fs.put(str(local), f"{BUCKET}/raw/a.jsonl")
    fs.put(str(write_jsonl(tmp_path / "b.jsonl.gz", texts[40:60])), f"{BUCKET}/raw/b.jsonl.gz")
    fs.put(str(tokenizer_file), f"{BUCKET}/tok/tokenizer.json")
    common: dict[str, Any] = {"eos": EOS, "workers": 2, "unit_size": 3000, "progress": False}
    report = ab.prepare(
        f"s3://{BUCKET}/raw/",
        f"s3://{BUCKET}/prepared",
        tokenizer=f"s3://{BUCKET}/tok/tokenizer.json",
        storage_options=options,
        **common,
    )
    (tmp_path / "in").mkdir()
    local.rename(tmp_path / "in" / "a.jsonl")
    (tmp_path / "b.jsonl.gz").rename(tmp_path / "in" / "b.jsonl.gz")
    ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=str(tokenizer_file), **common)
    assert report.documents == 60
    assert read_back(f"s3://{BUCKET}/prepared", options) == read_back(str(tmp_path / "out"))
    # The same shards, byte for byte (their names carry the unit's fingerprint, which holds
    # the input's URL and version).
    local_shards = sorted(d for n, d in tree(tmp_path / "out").items() if n.startswith("data/"))
    remote = fs.find(f"{BUCKET}/prepared/data")
    assert sorted(fs.cat(path) for path in remote) == local_shards


def test_a_missing_bucket_fails_before_any_tokenization(s3_endpoint: str, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    called: list[int] = []

    def tokenizer(texts: list[str]) -> list[list[int]]:
        called.append(1)
        return [[1] for _ in texts]

    with pytest.raises(ab.NotFoundError, match="cannot write the output s3://no-such-bucket"):
        ab.prepare(
            str(path),
            "s3://no-such-bucket/out",
            tokenizer=tokenizer,
            storage_options=s3_options(s3_endpoint),
            workers=1,
            progress=False,
        )
    assert not called


def test_an_unwritable_local_output_fails_before_any_tokenization(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["one"])
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ab.StoreError, match="cannot write the output"):
        ab.prepare(str(path), str(tmp_path / "file" / "out"), tokenizer=byte_tokenizer)


# ---------------------------------------------------------------------------------------------
# Bad input


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "ok", \n', r"line 2 \(unit 1\): malformed JSON"),
    (b'{"text": "ok"}\n{"body": "x"}\n', r"line 2 \(unit 1\): no field 'text'"),
    (b'{"text": "ok"}\n{"text": null}\n', r"line 2 \(unit 1\): field 'text' is a NoneType"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"line 2 \(unit 1\): invalid UTF-8 at byte 25"),
    (b'{"text": "ok"}\n[1, 2]\n', r"line 2 \(unit 1\): a JSON list, not an object"),
]


@pytest.mark.parametrize(("content", "message"), BAD_LINES)
def test_a_bad_jsonl_record_is_named_or_skipped_and_counted(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "first"}\n')
    (tmp_path / "in" / "b.jsonl").write_bytes(content)
    with pytest.raises(ab.RecordError, match=r"b.jsonl, " + message) as caught:
        ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=byte_tokenizer, workers=1)
    assert caught.value.url.endswith("b.jsonl") and caught.value.unit == 1
    assert caught.value.location == "line 2"
    # The unit before it finished and is kept for the resume; no manifest.
    assert (tmp_path / "out" / "done" / "u000000.json").exists()
    assert not (tmp_path / "out" / "manifest.json").exists()
    report = ab.prepare(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        tokenizer=byte_tokenizer,
        on_error="skip",
        workers=1,
        progress=False,
    )
    assert report.skipped_records == 1 and report.documents == 2
    assert report.units_already_done == 0  # on_error shapes the output: the units are redone
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["metadata"]["prepare"]["skipped_records"] == 1
    assert read_back(str(tmp_path / "out")) == [list(b"first"), list(b"ok")]


def test_a_record_in_a_later_byte_range_is_named_by_its_offset(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(50)]
    lines[40] = b'{"text": oops}\n'
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines))
    offset = len(b"".join(lines[:40]))
    with pytest.raises(ab.RecordError, match=rf"line at byte {offset} \(unit \d+\)"):
        ab.prepare(
            str(tmp_path / "a.jsonl"), str(tmp_path / "o"), tokenizer=byte_tokenizer, unit_size=100
        )


def test_parquet_without_the_column_or_with_a_null(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "in" / "a.parquet")
    with pytest.raises(ab.RecordError, match=r"a.parquet, file \(unit 0\): no column 'text'"):
        ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=byte_tokenizer)
    report = ab.prepare(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        tokenizer=byte_tokenizer,
        on_error="skip",
        progress=False,
    )
    assert report.skipped_records == 2 and report.documents == 0
    (tmp_path / "in" / "a.parquet").unlink()
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "in" / "b.parquet")
    with pytest.raises(ab.RecordError, match=r"b.parquet, row 1 \(unit 0\): column 'text' is null"):
        ab.prepare(str(tmp_path / "in"), str(tmp_path / "out2"), tokenizer=byte_tokenizer)


def test_an_unreadable_file_is_named_or_skipped(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", ["fine"])
    good = gzip.compress(b'{"text": "x"}\n' * 1000, mtime=0)
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(good[: len(good) // 2] + b"garbage" * 20)
    with pytest.raises(ab.RecordError, match=r"b.jsonl.gz, byte \d+ \(unit 1\): cannot read"):
        ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=byte_tokenizer)
    report = ab.prepare(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        tokenizer=byte_tokenizer,
        on_error="skip",
        progress=False,
    )
    assert report.skipped_files == 1
    assert read_back(str(tmp_path / "out"))[0] == list(b"fine")


def test_bad_arguments_are_config_errors(tmp_path: Path, tokenizer_file: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["a"])
    out = str(tmp_path / "out")
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "exactly one of tokenizer= .* and token_field="),
        ({"tokenizer": byte_tokenizer, "token_field": "ids"}, "exactly one of"),
        ({"tokenizer": byte_tokenizer, "engine": "spark"}, "engine must be one of"),
        ({"tokenizer": byte_tokenizer, "workers": 0}, "workers must be a positive"),
        ({"tokenizer": byte_tokenizer, "on_error": "ignore"}, "on_error must be"),
        ({"tokenizer": byte_tokenizer, "shard_size": 0}, "shard_size must be a positive"),
        ({"tokenizer": str(tokenizer_file), "eos": "<nope>"}, "eos='<nope>' is not a token"),
        ({"tokenizer": byte_tokenizer, "eos": "<s>"}, "a token string needs a tokenizer"),
        ({"tokenizer": str(tokenizer_file), "bos": 10**6}, r"outside the vocabulary \[0, 60"),
        ({"tokenizer": str(tmp_path / "none.json")}, "tokenizer file not found"),
        ({"tokenizer": 42}, "tokenizer must be a tokenizer.json path"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ab.ConfigError, match=message):
            ab.prepare(str(path), out, progress=False, **kwargs)
    with pytest.raises(ab.NotFoundError, match="no input files at"):
        ab.prepare(str(tmp_path / "missing*.jsonl"), out, tokenizer=byte_tokenizer)


# ---------------------------------------------------------------------------------------------
# The command


def test_cli_runs_resumes_and_documents_every_option(
    tmp_path: Path, texts: list[str], tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", texts[:30])
    argv = [
        "prepare",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--tokenizer",
        str(tokenizer_file),
        "--eos",
        EOS,
        "--unit-size",
        "4000",
        "--workers",
        "2",
    ]
    assert cli_main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("prepared 30 documents")
    assert "0 already done" in first.out
    assert "prepare: 100.0%" in first.err  # a plain progress line: stderr is no terminal
    assert cli_main(argv) == 0
    again = capsys.readouterr().out.strip().splitlines()[-1]
    units = int(again.split(" units, ")[0].rsplit(": ", 1)[1])
    assert f"{units} already done, 0 run" in again
    with pytest.raises(SystemExit):
        cli_main(["prepare", "--help"])
    usage = capsys.readouterr().out
    for option in (
        "--output", "--tokenizer", "--text-field", "--token-field", "--eos", "--bos",
        "--vocab-size", "--shard-size", "--unit-size", "--workers", "--engine",
        "--ray-address", "--on-error", "--no-progress", "--option",
    ):  # fmt: skip
        assert option in usage


def test_default_workers_are_the_cpus_this_process_may_use() -> None:
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})  # as a job scheduler's allocation of one CPU
        assert engines.default_workers() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert engines.default_workers() == len(allowed)


def test_a_worker_imports_no_torch(tmp_path: Path, texts: list[str]) -> None:
    # torch costs a spawned worker ~2 s of CPU at start, and a worker builds no batch: its
    # tokenizer refuses to run where torch was imported.
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    command = [
        sys.executable,
        "-m",
        "asyncbatch._cli",
        "prepare",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--tokenizer",
        "prepare_child:torch_free_tokenizer",
        "--eos",
        "0",
        "--vocab-size",
        "1000",
        "--workers",
        "2",
        "--unit-size",
        str(path.stat().st_size // 4 + 1),
    ]
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_ctrl_c_stops_the_command_and_the_same_command_resumes(
    tmp_path: Path, texts: list[str]
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", texts * 2)

    def command(out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "asyncbatch._cli",
            "prepare",
            str(path),
            "--output",
            str(out),
            "--tokenizer",
            "prepare_child:slow_tokenizer",  # module:function, importable by the workers
            "--eos",
            "0",
            "--vocab-size",
            "1000",
            "--unit-size",
            str(path.stat().st_size // 24 + 1),
            "--workers",
            "2",
        ]

    env = {**os.environ, "PYTHONPATH": str(HERE)}
    clean = tmp_path / "clean"
    subprocess.run(command(clean), check=True, capture_output=True, env=env, timeout=120)
    out = tmp_path / "out"
    process = subprocess.Popen(
        command(out),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        _wait_for_done(out, 3, process)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 130, err
    assert b"run the same command again to resume" in err
    assert b"Traceback" not in err
    resumed = subprocess.run(
        command(out), check=True, capture_output=True, text=True, env=env, timeout=120
    )
    assert " 0 already done" not in resumed.stdout
    assert tree(out) == tree(clean)


def test_http_url_lists_as_inputs(
    tmp_path: Path, texts: list[str], http_root: tuple[Path, Any]
) -> None:
    root, server = http_root
    write_jsonl(root / "prep-a.jsonl", texts[:30])  # cut into byte ranges: Range requests
    write_jsonl(root / "prep-b.jsonl.gz", texts[30:40])
    urls = [f"{server.url}/prep-a.jsonl", f"{server.url}/prep-b.jsonl.gz"]
    report = ab.prepare(
        urls, str(tmp_path / "out"), tokenizer=byte_tokenizer, unit_size=2000, progress=False
    )
    assert report.units > 2
    assert read_back(str(tmp_path / "out")) == byte_tokenizer(texts[:40])


# ---------------------------------------------------------------------------------------------
# Found in review


def test_empty_documents_without_eos_make_a_readable_dataset(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello")
    (tmp_path / "in" / "b.txt").write_text("")  # a unit of one empty document: a 0-byte shard
    write_jsonl(tmp_path / "in" / "c.jsonl", ["abcd", "", "", "ef"])
    ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=byte_tokenizer, shard_size=8)
    expected = [list(b"hello"), [], list(b"abcd"), [], [], list(b"ef")]
    assert read_back(str(tmp_path / "out")) == expected
    # The empty documents after the full shard "abcd" stay in it: no shard of them alone.
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    counts = manifest["metadata"]["shard_documents"]
    assert counts == [1, 1, 3, 1]


def test_a_changed_function_is_a_changed_tokenizer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["a", "bb"])
    out = str(tmp_path / "out")

    def make(shift: int) -> Any:
        def tokenize(texts: list[str]) -> list[list[int]]:
            return [[len(text) + shift] for text in texts]

        return tokenize

    ab.prepare(str(path), out, tokenizer=make(0), workers=1, progress=False)
    again = ab.prepare(str(path), out, tokenizer=make(100), workers=1, progress=False)
    assert again.units_already_done == 0  # same name, other closure: redone
    assert read_back(out) == [[101], [102]]


def test_a_run_killed_under_other_settings_never_spoils_done_units(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["aaa", "bbb"])
    out = str(tmp_path / "out")
    ab.prepare(str(path), out, tokenizer=byte_tokenizer, eos=0, progress=False)

    def crash(texts: list[str]) -> list[list[int]]:
        raise RuntimeError("killed mid-unit")

    with pytest.raises(ab.RecordError, match="raised RuntimeError: killed mid-unit"):
        ab.prepare(str(path), out, tokenizer=crash, eos=1, workers=1, progress=False)
    back = ab.prepare(str(path), out, tokenizer=byte_tokenizer, eos=0, progress=False)
    assert back.units_already_done == 1
    assert read_back(out) == [[97, 97, 97, 0], [98, 98, 98, 0]]


def test_an_edited_input_is_redone(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["aaa"])
    out = str(tmp_path / "out")
    ab.prepare(str(path), out, tokenizer=byte_tokenizer, progress=False)
    write_jsonl(path, ["bbb"])  # the same size
    os.utime(path, (time.time() + 5, time.time() + 5))
    again = ab.prepare(str(path), out, tokenizer=byte_tokenizer, progress=False)
    assert again.units_already_done == 0
    assert read_back(out) == [list(b"bbb")]


def test_more_bad_records_are_named(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"text": "\\ud800"}\n')
    with pytest.raises(ab.RecordError, match=r"line 2 \(unit 0\): field 'text' holds a lone"):
        ab.prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "o1"), tokenizer=byte_tokenizer)
    (tmp_path / "b.jsonl").write_text('{"ids": [1, 99999999999999999999]}\n')
    with pytest.raises(ab.ConfigError, match=r"line 1 \(unit 0\): a token id"):
        ab.prepare(str(tmp_path / "b.jsonl"), str(tmp_path / "o2"), token_field="ids")
    pq.write_table(pa.table({"ids": [[1, None, 3]]}), tmp_path / "c.parquet")
    with pytest.raises(ab.RecordError, match="holds a null id"):
        ab.prepare(str(tmp_path / "c.parquet"), str(tmp_path / "o3"), token_field="ids")
    (tmp_path / "d.jsonl").write_text('{"text": "x", "score": NaN}\n{"text": "y", "score": 1}\n')
    report = ab.prepare(
        str(tmp_path / "d.jsonl"),
        str(tmp_path / "o4"),
        tokenizer=byte_tokenizer,
        metadata_fields=("score",),
        on_error="skip",
        progress=False,
    )
    assert report.skipped_records == 1 and report.documents == 1
    (tmp_path / "e.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "bom"}\n')
    ab.prepare(str(tmp_path / "e.jsonl"), str(tmp_path / "o5"), tokenizer=byte_tokenizer)
    assert read_back(str(tmp_path / "o5")) == [list(b"bom")]


def test_a_tokenizers_answer_and_the_vocabulary_are_checked(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["a", "b", "c"])
    with pytest.raises(ab.ConfigError, match="returned 2 token lists for 3 texts"):
        ab.prepare(str(path), str(tmp_path / "o1"), tokenizer=lambda t: [[1], [2]], workers=1)
    with pytest.raises(ab.ConfigError, match="ids must be integers"):
        ab.prepare(str(path), str(tmp_path / "o2"), tokenizer=lambda t: [[1.5]] * 3, workers=1)
    with pytest.raises(ab.ConfigError, match=r"token id 60 is outside \[0, 50\)"):
        ab.prepare(str(path), str(tmp_path / "o3"), tokenizer=lambda t: [[60]] * 3,
                   vocab_size=50, workers=1)  # fmt: skip
    with pytest.raises(ab.ConfigError, match="cannot be sent to worker processes"):
        ab.prepare(str(path), str(tmp_path / "o4"), tokenizer=lambda t: t, workers=2)


def failing_tokenizer(texts: list[str]) -> list[list[int]]:
    if any("boom" in text for text in texts):
        raise ValueError("cannot encode this")
    return [list(text.encode()) for text in texts]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_tokenizer_that_raises_is_a_record_error_naming_file_and_unit(
    tmp_path: Path, on_error: str
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["fine", "boom"])
    with pytest.raises(ab.RecordError, match="the tokenizer raised ValueError: cannot encode") as e:
        ab.prepare(str(path), str(tmp_path / "o"), tokenizer=failing_tokenizer,
                   on_error=on_error, workers=2)  # fmt: skip
    assert (e.value.url, e.value.location, e.value.unit) == (str(path), "line 1", 0)
    assert "on the records of line 1 to line 2" in str(e.value)


def test_a_bad_parquet_footer_is_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.parquet").write_bytes(b"PAR1 not really PAR1")
    write_jsonl(tmp_path / "in" / "b.jsonl", ["fine"])
    with pytest.raises(ab.RecordError, match="cannot read the Parquet footer"):
        ab.prepare(str(tmp_path / "in"), str(tmp_path / "o"), tokenizer=byte_tokenizer)
    report = ab.prepare(
        str(tmp_path / "in"), str(tmp_path / "o"), tokenizer=byte_tokenizer, on_error="skip"
    )
    assert report.skipped_files == 1 and read_back(str(tmp_path / "o")) == [list(b"fine")]


def test_prepare_from_a_running_event_loop(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["in a notebook"])

    async def main() -> ab.PrepareReport:
        return ab.prepare(str(path), str(tmp_path / "o"), tokenizer=byte_tokenizer)

    import asyncio

    assert asyncio.run(main()).documents == 1


def test_a_hugging_face_dataset_folder_reads_its_data_files_only(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("# dataset card")
    (folder / "dataset_info.json").write_text('{"features": {}}')
    pq.write_table(pa.table({"text": ["one", "two"]}), folder / "data" / "train-0.parquet")
    ab.prepare(str(folder), str(tmp_path / "o"), tokenizer=byte_tokenizer)
    assert read_back(str(tmp_path / "o")) == [list(b"one"), list(b"two")]


# ---------------------------------------------------------------------------------------------
# As a user sees it: checks before any worker, messages, balanced units


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncbatch._cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(HERE), **(env or {})},
        timeout=120,
        check=False,
    )


def test_a_failed_check_starts_no_worker_and_leaves_nothing(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    out = tmp_path / "out"
    common = ["--output", str(out), "--workers", "2"]
    wrong_input = _cli(
        "prepare", str(tmp_path / "nope.jsonl"), "--tokenizer", str(tokenizer_file), *common
    )
    assert wrong_input.returncode == 1, wrong_input.stderr
    assert "no input files at" in wrong_input.stderr
    assert "Traceback" not in wrong_input.stderr
    wrong_tokenizer = _cli(
        "prepare", str(path), "--tokenizer", str(tmp_path / "nope.json"), *common
    )
    assert wrong_tokenizer.returncode == 1, wrong_tokenizer.stderr
    assert "nope.json" in wrong_tokenizer.stderr
    assert not out.exists()  # no done/.write-check, nothing
    # A run that passes its checks keeps no probe either.
    ab.prepare(str(path), str(out), tokenizer=byte_tokenizer, workers=1, progress=False)
    assert not (out / "done" / ".write-check").exists()


def test_a_malformed_line_reads_well_and_says_how_to_skip(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(ab.RecordError) as caught:
        ab.prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "o"), tokenizer=byte_tokenizer)
    message = str(caught.value)
    assert "malformed JSON: Unterminated string starting at column 10" in message
    assert " at at " not in message
    assert "--on-error skip" in message and "on_error='skip'" in message
    skipped = ab.prepare(
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "o"),
        tokenizer=byte_tokenizer,
        on_error="skip",
        progress=False,
    )
    assert skipped.skipped_records == 1  # the hint is for the error raised, not the examples


def length_tokenizer(texts: list[str]) -> list[list[int]]:
    return [[len(text) % 256] for text in texts]


def test_the_default_unit_size_balances_units_from_the_inputs_alone(tmp_path: Path) -> None:
    from asyncbatch._prepare.driver import MAX_UNIT_SIZE, MIN_UNIT_SIZE, default_unit_size
    from asyncbatch._prepare.inputs import InputFile

    def sized(*sizes: int) -> list[InputFile]:
        return [InputFile(f"f{i}.jsonl", size, "jsonl", None) for i, size in enumerate(sizes)]

    assert default_unit_size(sized(1000)) == MIN_UNIT_SIZE
    assert default_unit_size(sized(3 * 2**30, 2**30)) == 4 * 2**20  # 1024 units
    assert default_unit_size(sized(2**40)) == MAX_UNIT_SIZE
    # A Parquet file of 4 row groups of ~1.5 MB was one unit (256 MiB by default): now each
    # row group is a unit of its own, whatever the worker count.
    (tmp_path / "in").mkdir()
    rows = [os.urandom(1500).hex() for _ in range(4000)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "in" / "big.parquet", row_group_size=1000)
    write_jsonl(tmp_path / "in" / "small.jsonl", ["a", "b"])
    report = ab.prepare(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        tokenizer=length_tokenizer,
        workers=1,
        progress=False,
    )
    assert report.units == 5 and report.documents == 4002


def test_progress_is_reported_as_a_unit_runs_inline_and_from_workers(tmp_path: Path) -> None:
    from prepare_child import slow_tokenizer

    from asyncbatch._prepare.driver import Settings
    from asyncbatch._prepare.inputs import expand_inputs, plan_units
    from asyncbatch._prepare.tokenizer import make_spec

    path = write_jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(3000)])  # 3 batches
    (unit,) = plan_units(expand_inputs(str(path), {}), 2**20, {})
    assert unit.weight == path.stat().st_size
    spec = make_spec(slow_tokenizer, 1000, {})
    settings = Settings(
        str(tmp_path / "out"), {}, spec.fingerprint, "text", None, (), (), "<u2", 2**20,
        None, "raise", (), 1000,
    )  # fmt: skip
    seen: list[tuple[int, ...]] = []
    for _ in engines.run_inline([unit], settings, spec, lambda *report: seen.append(report)):
        pass
    assert [report[:3] for report in seen] == [(0, 1024, 2048), (0, 2048, 4096), (0, 3000, 6000)]
    assert 0 < seen[0][3] < seen[1][3] < seen[2][3] <= unit.weight
    # From a worker process: reports (every 0.25 s) arrive while the unit runs, before its end.
    events: list[str] = []
    pool = engines.start_pool(spec, 1, reports=True)
    try:
        for result in engines.run_pool(
            [unit], settings, pool, 1, lambda *report: events.append(f"report {report[1]}")
        ):
            events.append(f"done {result.record['documents']}")
    finally:
        pool.close()
    assert events[-1] == "done 3000"
    assert any(event.startswith("report ") for event in events[:-1]), events


def pid_tokenizer(texts: list[str]) -> list[list[int]]:
    return [[os.getpid() % 1000] for _ in texts]


def test_a_small_run_is_done_here_before_any_worker_has_started(tmp_path: Path) -> None:
    # Spawning and loading a worker takes a second or more: until one is up the driver runs
    # units itself, and workers that were not needed are not waited for.
    (tmp_path / "in").mkdir()
    for k in range(2):
        write_jsonl(tmp_path / "in" / f"{k}.jsonl", ["a b", "c"])
    report = ab.prepare(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        tokenizer=pid_tokenizer,
        vocab_size=1000,
        workers=2,
        progress=False,
    )
    assert report.units == 2 and report.units_already_done == 0
    assert read_back(str(tmp_path / "out")) == [[os.getpid() % 1000]] * 4
