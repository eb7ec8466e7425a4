"""Arrow IPC datasets: Hugging Face ``save_to_disk`` folders written by the real
``datasets`` library, and ``.arrow`` files of both IPC layouts written by pyarrow, read
through every store; every row exactly once per epoch under every shuffle; headers only at
open, counted at the server; single rows' bytes under an exact shuffle; bad input refused.

Every expectation comes from the values the test wrote: row ``i`` of a pyarrow-written
dataset holds ``id == i`` and columns computed from ``i`` by :func:`make_table`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BUCKET, s3_options
from faults import fault_server
from test_parquet import check_packed, windows_of

import asyncbatch as ab
from asyncbatch._batch import Jagged, Strings
from asyncbatch._errors import ConfigError, FormatError
from asyncbatch.formats import _arrow as arrow
from asyncbatch.formats import _arrow_rows as arrow_rows
from asyncbatch.formats._arrow import HEAD_PROBE, HEADER_READ, TAIL_PROBE

pa = pytest.importorskip("pyarrow")

_names = itertools.count()
#: A list of int64 with 64-bit offsets.
LARGE = pa.large_list(pa.int64())

#: ``(rows, rows per record batch, layout, codec)`` of the files :func:`write_files` writes.
FILES = [
    (37, 10, "stream", None),
    (0, 10, "file", None),
    (55, 16, "file", None),
    (20, 8, "stream", "zstd"),
    (9, 4, "file", "lz4"),
]


def make_table(first: int, count: int) -> Any:
    """Rows ``first .. first + count - 1``: every column a function of the row's id."""
    ids = np.arange(first, first + count, dtype=np.int64)
    return pa.table(
        {
            "id": pa.array(ids),
            "tokens": pa.array(
                [list(range(i, i + i % 7)) for i in ids.tolist()], type=pa.list_(pa.int32())
            ),
            "text": pa.array([f"row {i} " + "é" * (i % 3) for i in ids.tolist()], pa.string()),
            "vec": pa.array(
                [[float(i), -float(i)] for i in ids.tolist()], type=pa.list_(pa.float32(), 2)
            ),
            "flag": pa.array([i % 3 == 0 for i in ids.tolist()], pa.bool_()),
            "blob": pa.array([bytes([i % 256]) * (i % 5) for i in ids.tolist()], pa.large_binary()),
        }
    )


def ipc_bytes(table: Any, rows_per_batch: int, layout: str, codec: str | None = None) -> bytes:
    """``table`` as an Arrow IPC file (``layout`` "file") or stream."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=codec)
    new = pa.ipc.new_file if layout == "file" else pa.ipc.new_stream
    with new(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=rows_per_batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def check_batch(batch: ab.Batch) -> None:
    """Every field equals what :func:`make_table` wrote for the batch's ids."""
    ids = batch["id"].numpy()
    np.testing.assert_array_equal(ids, batch.global_indexes)
    tokens = batch["tokens"]
    assert isinstance(tokens, Jagged)
    assert tokens.values.dtype == torch.int32
    for k, i in enumerate(ids.tolist()):
        assert tokens[k].tolist() == list(range(i, i + i % 7))
    text = batch["text"]
    assert isinstance(text, Strings)
    assert text.to_pylist() == [f"row {i} " + "é" * (i % 3) for i in ids.tolist()]
    np.testing.assert_array_equal(batch["vec"][:, 1].numpy(), -ids.astype(np.float32))
    if "flag" in batch:
        np.testing.assert_array_equal(batch["flag"].numpy(), ids % 3 == 0)
    assert batch["blob"].to_pylist() == [bytes([i % 256]) * (i % 5) for i in ids.tolist()]


Put = Callable[[str, bytes], None]


def store_for(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, Put, dict[str, Any]]:
    """``(root URL, put(relative path, bytes), storage options)`` of a new folder."""
    name = f"arrow-{next(_names)}"
    if store == "s3":
        import s3fs

        options = s3_options(request.getfixturevalue("s3_endpoint"))
        fs = s3fs.S3FileSystem(**options)
        root = f"s3://{BUCKET}/{name}"
        return root, lambda path, data: fs.pipe(f"{root}/{path}", data), options
    if store == "http":
        base, server = request.getfixturevalue("http_root")
        folder, root = base / name, f"{server.url}/{name}"
    else:
        folder = tmp_path / name
        root = str(folder)

    def put(path: str, data: bytes) -> None:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)

    return root, put, {}


def write_files(put: Put, names: list[str]) -> int:
    """The files of :data:`FILES` under ``names``; returns the rows written."""
    first = 0
    for name, (rows, per_batch, layout, codec) in zip(names, FILES, strict=True):
        put(name, ipc_bytes(make_table(first, rows), per_batch, layout, codec))
        first += rows
    return first


@pytest.mark.parametrize("shuffle", [False, "block", True])
@pytest.mark.parametrize("store", ["local", "s3", "http"])
def test_every_row_once_per_epoch_every_store(
    store: str, shuffle: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    root, put, options = store_for(store, request, tmp_path)
    names = ["p-2.arrow", "p-10.arrow", "p-11.feather", "p-12.arrow", "p-100.arrow"]
    total = write_files(put, names)
    if store == "http":  # no listing over plain HTTP: a list of files
        dataset = ab.open_dataset([f"{root}/{n}" for n in names], options)
    else:
        dataset = ab.open_dataset(root, options)
    assert dataset.manifest.format == "arrow"
    assert [s.path for s in dataset.manifest.shards] == names  # natural order
    assert dataset.manifest.total_elements == total
    extra: dict[str, Any] = {"window": 2} if shuffle == "block" else {}
    with ab.Loader(dataset, batch_size=6, shuffle=shuffle, drop_last=False, **extra) as loader:
        seen = []
        for epoch in range(2 if store == "local" else 1):
            loader.set_epoch(epoch)
            ids = []
            for batch in loader:
                check_batch(batch)
                ids.extend(batch.global_indexes.tolist())
            assert sorted(ids) == list(range(total))
            seen.append(ids)
    if shuffle is False:
        assert seen[0] == list(range(total))
    elif len(seen) > 1:
        assert seen[0] != seen[1]


# ---------------------------------------------------------------------------------------------
# Hugging Face save_to_disk, by the real library


def tokenize(text: str) -> list[int]:
    """A trivial tokenizer (no downloads): the characters' code points."""
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def hf_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """A ``save_to_disk`` folder of 3 shards, tokenized by ``.map``; and its rows, as the
    ``datasets`` library reads them back."""
    home = tmp_path_factory.mktemp("hf-home")
    settings = {
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        datasets = pytest.importorskip("datasets")
        datasets.disable_progress_bars()
        texts = [f"document {i}: " + "word " * (i % 9) for i in range(300)]
        raw = datasets.Dataset.from_dict({"id": list(range(300)), "text": texts})
        tokenized = raw.map(
            lambda batch: {"input_ids": [tokenize(t) for t in batch["text"]]},
            batched=True,
            batch_size=50,
        )
        folder = tmp_path_factory.mktemp("hf") / "saved"
        tokenized.save_to_disk(str(folder), num_shards=3)
        rows = list(datasets.load_from_disk(str(folder)))
        yield folder, rows
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def hf_root(
    store: str, folder: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any]]:
    """The ``save_to_disk`` folder copied to ``store``: its URL and storage options."""
    root, put, options = store_for(store, request, tmp_path)
    for path in sorted(folder.iterdir()):
        put(path.name, path.read_bytes())
    return root, options


@pytest.mark.parametrize("store", ["local", "s3", "http"])
def test_huggingface_save_to_disk_folder(
    store: str,
    hf_folder: tuple[Path, list[dict[str, Any]]],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    folder, rows = hf_folder
    root, options = hf_root(store, folder, request, tmp_path)
    dataset = ab.open_dataset(root, options)  # recognised by its state.json
    assert [s.path for s in dataset.manifest.shards] == [
        f"data-0000{k}-of-00003.arrow" for k in range(3)
    ]
    assert dataset.manifest.total_elements == len(rows)
    shuffles: list[Any] = [False, "block", True] if store == "local" else [True]
    for shuffle in shuffles:
        with ab.Loader(dataset, batch_size=16, shuffle=shuffle, drop_last=False) as loader:
            ids = []
            for batch in loader:
                for k, i in enumerate(batch.global_indexes.tolist()):
                    assert batch["id"][k].item() == rows[i]["id"]
                    assert batch["input_ids"][k].tolist() == rows[i]["input_ids"]
                    assert batch["text"][k] == rows[i]["text"]
                ids.extend(batch.global_indexes.tolist())
        assert sorted(ids) == list(range(len(rows)))
    # Packed windows of the token column, as the documents format packs.
    documents = [row["input_ids"] for row in rows]
    packed = ab.open_dataset(root, options, format="arrow")
    args: dict[str, Any] = dict(seq_len=64, format_options={"column": "input_ids"})
    with ab.Loader(packed, batch_size=8, shuffle="block", drop_last=False, **args) as loader:
        seen = check_packed(windows_of(loader), documents, 64, next_token=False)
    assert sorted(seen) == list(range(sum(map(len, documents)) // 64))


# ---------------------------------------------------------------------------------------------
# Opening costs, counted at the server


def big_table(first: int, count: int) -> Any:
    """Rows with ~4 KiB of tokens each: record batch bodies far larger than a read-ahead."""
    ids = np.arange(first, first + count, dtype=np.int64)
    tokens = np.arange(count * 1024, dtype=np.int32).reshape(count, 1024)
    return pa.table(
        {"id": pa.array(ids), "tokens": pa.array(list(tokens), type=pa.list_(pa.int32()))}
    )


@pytest.mark.parametrize("store", ["http", "s3"])
def test_open_reads_headers_only(
    store: str,
    hf_folder: tuple[Path, list[dict[str, Any]]],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A stream: its tail, its head and one read per later header; a file: its tail and one
    read per header (HTTP and S3 ranges are one range each); a small file: its tail only.
    Bytes served stay far below the files' bodies."""
    root, put, options = store_for(store, request, tmp_path)
    batches = 4  # of 64 rows: ~256 KiB bodies, more than the store's coalesce gap
    stream = ipc_bytes(big_table(0, 256), 64, "stream")
    put("a.arrow", stream)
    put("b.arrow", ipc_bytes(big_table(256, 256), 64, "file"))
    folder, rows = hf_folder
    for path in sorted(folder.iterdir()):  # small shards: all in their tails
        put(f"hf/{path.name}", path.read_bytes())
    with contextlib.ExitStack() as stack:
        if store == "s3":
            proxy = stack.enter_context(
                fault_server(upstream=request.getfixturevalue("s3_endpoint"))
            )
            options = s3_options(proxy.url)
            folder_path = f"/{root.rpartition('/')[2]}/"

            def served() -> tuple[int, int]:
                got = [p for m, p, _ in proxy.log if folder_path in p and m in ("GET", "HEAD")]
                return len(got), 0

        else:
            server = request.getfixturevalue("http_root")[1]

            def served() -> tuple[int, int]:
                return server.requests + server.heads, server.bytes_served

        before = served()
        a = ab.open_dataset([f"{root}/a.arrow"], options)
        after_a = served()
        b = ab.open_dataset([f"{root}/b.arrow"], options)
        after_b = served()
        hf = ab.open_dataset(f"{root}/hf", options, format="arrow")
        after_hf = served()
        ab.open_dataset(f"{root}/hf", options)  # recognised: its state.json read twice
        detected = served()
        with ab.Loader(a, batch_size=32, shuffle=True) as loader:
            ids = sorted(i for x in loader for i in x.global_indexes.tolist())
        assert ids == list(range(256))
    assert a.manifest.total_elements == b.manifest.total_elements == 256
    assert hf.manifest.total_elements == len(rows)
    # Stream: the tail (the end), the head (the schema and first header), each later header.
    assert after_a[0] - before[0] == 1 + 1 + (batches - 1)
    # File: the tail (footer), then each header but none in the tail.
    assert after_b[0] - after_a[0] == 1 + batches
    # save_to_disk: state.json, then one tail per (small) shard.
    assert after_hf[0] - after_b[0] == 1 + 3
    if store == "http":  # (S3 also looks for a manifest and lists for other layouts)
        assert detected[0] - after_hf[0] == 2 + 3
    if store == "http":
        assert after_a[1] - before[1] <= TAIL_PROBE + HEAD_PROBE + (batches - 1) * HEADER_READ
        assert after_a[1] - before[1] < len(stream) // 2
        assert after_b[1] - after_a[1] <= TAIL_PROBE + batches * 1024


# ---------------------------------------------------------------------------------------------
# Reading: single rows, whole record batches, ranks, resume, transform


def exact_epoch(dataset: ab.Dataset) -> tuple[int, list[int]]:
    """One exact-shuffle epoch, one batch per read, every batch checked: bytes fetched, rows."""
    ids: list[int] = []
    with ab.Loader(dataset, batch_size=8, shuffle=True, prefetch=2, coalesce_gap=0) as loader:
        for batch in loader:
            check_batch(batch)
            ids.extend(batch.global_indexes.tolist())
        return loader.statistics().bytes_fetched, sorted(ids)


@pytest.fixture(params=["offsets kept", "offsets per row"])
def offsets(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way an exact shuffle finds a string's or list's offsets: record batches' whole
    offsets buffers read once and kept (a dataset's fit), or two offsets read per row."""
    if request.param == "offsets per row":
        monkeypatch.setattr(arrow_rows, "OFFSETS_CACHE", 0)
    name: str = request.param
    return name


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_exact_shuffle_reads_single_rows(codec: str | None, offsets: str, tmp_path: Path) -> None:
    """Uncompressed: a row's bytes in each buffer, far below the record batches' columns it
    lies in. Compressed: whole record batches (a compressed buffer has no row offsets)."""
    n = 400
    table = make_table(0, n).append_column("pad", pa.array([b"x" * 2000] * n, pa.binary()))
    (tmp_path / "a.arrow").write_bytes(ipc_bytes(table, 200, "stream", codec))
    columns = ["id", "tokens", "text", "vec", "flag", "blob"]
    dataset = ab.open_dataset(str(tmp_path), options={"columns": columns})
    fetched, ids = exact_epoch(dataset)
    assert ids == list(range(n))
    regions = dataset.arrays["rb_buffers"][..., 1].sum()
    if codec is None:
        # Per row: 8 + 8 + 2 * 4 + ~4 * 2 + 8 + 2 * 4 + 1 + ~12 bytes: offsets and values.
        assert fetched < 100 * n < regions
    else:
        assert fetched > 200 * n  # each batch's 8 rows lie in both record batches


def test_rows_read_by_row_in_any_column_order(offsets: str, tmp_path: Path) -> None:
    """A list of numbers after a string column: its values start at an odd byte of the
    group's read (each column's values follow the last's), and come out as written."""
    (tmp_path / "a.arrow").write_bytes(ipc_bytes(make_table(0, 90), 20, "stream"))
    columns = ["text", "tokens", "vec", "id", "blob"]
    dataset = ab.open_dataset(str(tmp_path), options={"columns": columns})
    ids: list[int] = []
    with ab.Loader(dataset, batch_size=9, shuffle=True, seed=3) as loader:
        for batch in loader:
            assert list(batch) == columns
            check_batch(batch)
            ids.extend(batch.global_indexes.tolist())
    assert sorted(ids) == list(range(90))


def test_block_shuffle_reads_each_record_batch_once_only_its_columns(tmp_path: Path) -> None:
    for k in range(3):
        table = make_table(100 * k, 100).append_column(
            "pad", pa.array([b"x" * 1000] * 100, pa.binary())
        )
        (tmp_path / f"f{k}.arrow").write_bytes(ipc_bytes(table, 25, "file"))
    dataset = ab.open_dataset(str(tmp_path), options={"columns": ["id", "tokens"]})
    args: dict[str, Any] = dict(batch_size=10, shuffle="block", window=2, seed=5, coalesce_gap=0)
    ids: list[int] = []
    fetched = 0
    for rank in range(2):
        with ab.Loader(dataset, rank=rank, world_size=2, **args) as loader:
            ids += [i for b in loader for i in b["id"].tolist()]
            fetched += loader.statistics().bytes_fetched
    assert sorted(ids) == list(range(300))
    # The id and tokens columns of every record batch, each read once by one rank.
    buffers = dataset.arrays["rb_buffers"]  # id: 2 buffers, tokens: 4
    assert fetched == int(buffers[:, :6, 1].sum())


def test_a_block_shuffle_first_batch_reads_only_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows of many batches: the run's first group is its first batch alone, its rows
    read by their byte ranges; then the rest of the window, its record batches whole."""
    table = make_table(0, 800).append_column("pad", pa.array([b"x" * 500] * 800, pa.binary()))
    (tmp_path / "a.arrow").write_bytes(ipc_bytes(table, 200, "stream"))
    dataset = ab.open_dataset(str(tmp_path), options={"columns": ["id", "tokens", "pad"]})
    groups: list[tuple[int, int]] = []
    fetch = arrow.ArrowRows.fetch

    def counting(self: arrow.ArrowRows, ids: Any, gap: int) -> Any:
        steps = fetch(self, ids, gap)
        step = next(steps)
        groups.append((int(ids.size), step.plan.nbytes))
        result = yield step
        while True:
            try:
                step = steps.send(result)
            except StopIteration as stop:
                return stop.value
            result = yield step

    monkeypatch.setattr(arrow.ArrowRows, "fetch", counting)
    args: dict[str, Any] = dict(batch_size=10, shuffle="block", window=4, seed=1)
    with ab.Loader(dataset, **args) as loader:
        ids = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(ids) == list(range(800))
    body = int(dataset.arrays["rb_buffers"][:, :, 1].sum())
    assert [size for size, _ in groups] == [10, 790]
    assert groups[0][1] < 10 * (8 + 8 + 600) < body / 10  # offsets and the rows' bytes
    assert groups[1][1] > body / 2


@pytest.mark.parametrize("shuffle", ["block", True])
def test_resume_and_transform(shuffle: Any, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    total = 0
    for k, (rows, per_batch, layout, codec) in enumerate(FILES):
        data = ipc_bytes(make_table(total, rows), per_batch, layout, codec)
        (tmp_path / "d" / f"p{k}.arrow").write_bytes(data)
        total += rows
    dataset = ab.open_dataset(str(tmp_path / "d"))
    args: dict[str, Any] = dict(batch_size=5, shuffle=shuffle, seed=3, prefetch=3)
    with ab.Loader(dataset, **args) as loader:
        full = [b.global_indexes.tolist() for b in loader]
    with ab.Loader(dataset, **args) as loader:
        it = iter(loader)
        head = [next(it).global_indexes.tolist() for _ in range(3)]
        state = loader.state_dict()
    with ab.Loader(dataset, **args) as loader:
        loader.load_state_dict(state)
        assert head + [b.global_indexes.tolist() for b in loader] == full

    def double(batch: ab.Batch) -> dict[str, Any]:
        return {"twice": batch["id"] * 2}

    with ab.Loader(dataset, transform=double, **args) as loader:
        assert [b["twice"].tolist() for b in loader] == [[2 * i for i in ids] for ids in full]


def test_packing_a_token_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    documents = [rng.integers(0, 50000, rng.integers(0, 40)).tolist() for _ in range(300)]
    table = pa.table({"input_ids": pa.array(documents, pa.list_(pa.int64()))})
    (tmp_path / "a.arrow").write_bytes(ipc_bytes(table.slice(0, 150), 32, "stream"))
    (tmp_path / "b.arrow").write_bytes(ipc_bytes(table.slice(150), 50, "file"))
    dataset = ab.open_dataset(str(tmp_path))
    args: dict[str, Any] = dict(seq_len=16, next_token=True, drop_last=False)
    with ab.Loader(dataset, batch_size=4, shuffle=True, **args) as loader:
        seen = check_packed(windows_of(loader), documents, 16, next_token=True)
    assert sorted(seen) == list(range((sum(map(len, documents)) - 1) // 16))


# ---------------------------------------------------------------------------------------------
# Bad input


def good_files(folder: Path, layout: str = "stream") -> tuple[bytes, bytes]:
    folder.mkdir(exist_ok=True)
    a, b = (ipc_bytes(make_table(k * 40, 40), 10, layout) for k in range(2))
    (folder / "a.arrow").write_bytes(a)
    (folder / "b.arrow").write_bytes(b)
    return a, b


def read_all(url: str, **options: Any) -> list[int]:
    dataset = ab.open_dataset(url, **options)
    out = []
    for shuffle in [False, True]:
        with ab.Loader(dataset, batch_size=7, shuffle=shuffle, drop_last=False) as loader:
            out = [i for batch in loader for i in batch["id"].tolist()]
    return out


@pytest.mark.parametrize("layout", ["stream", "file"])
def test_a_truncated_file_names_the_file_and_byte(layout: str, tmp_path: Path) -> None:
    _, b = good_files(tmp_path, layout)
    (tmp_path / "b.arrow").write_bytes(b[: len(b) // 2])
    match = r"b\.arrow: .*(byte \d+.*truncated|does not end with ARROW1)"
    with pytest.raises(FormatError, match=match):
        ab.open_dataset(str(tmp_path))


def test_a_stream_cut_at_a_message_boundary_is_refused(tmp_path: Path) -> None:
    # Without its end-of-stream marker the stream would read as its first record batches.
    a, _ = good_files(tmp_path)
    assert a.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    (tmp_path / "a.arrow").write_bytes(a[:-8])
    match = rf"a\.arrow: the stream ends at byte {len(a) - 8} without its end-of-stream marker"
    with pytest.raises(FormatError, match=match):
        ab.open_dataset(str(tmp_path))


def test_a_bad_continuation_marker(tmp_path: Path) -> None:
    a, _ = good_files(tmp_path)
    schema_end = 8 + int.from_bytes(a[4:8], "little")
    damaged = a[:schema_end] + b"\x00\x01\x02\x03" + a[schema_end + 4 :]
    (tmp_path / "a.arrow").write_bytes(damaged)
    with pytest.raises(FormatError, match=rf"a\.arrow: message at byte {schema_end}: bad cont"):
        ab.open_dataset(str(tmp_path))


def test_a_column_of_other_length_than_its_record_batch(tmp_path: Path) -> None:
    """A field node that says 36 values in a record batch of 37 rows (its header edited):
    a FormatError naming the file and the record batch's byte, found at open."""
    data = ipc_bytes(pa.table({"id": pa.array(np.arange(37, dtype=np.int64))}), 37, "stream")
    # The nodes vector: its count (one), then the node (length 37, no nulls).
    node = (1).to_bytes(4, "little") + (37).to_bytes(8, "little") + bytes(8)
    assert data.count(node) == 1
    (tmp_path / "b.arrow").write_bytes(
        data.replace(node, node[:4] + (36).to_bytes(8, "little") + bytes(8))
    )
    with pytest.raises(
        FormatError,
        match=r"b\.arrow: the record batch at byte \d+ has columns of other lengths than its 37",
    ):
        ab.open_dataset(str(tmp_path / "b.arrow"))


def test_schemas_that_differ_between_files(tmp_path: Path) -> None:
    good_files(tmp_path)
    other = make_table(80, 5).drop_columns(["vec"])
    (tmp_path / "c.arrow").write_bytes(ipc_bytes(other, 5, "file"))
    with pytest.raises(FormatError, match=r"c\.arrow: its schema \(at byte \d+\) differs"):
        ab.open_dataset(str(tmp_path))


def test_dictionary_columns_refused_unless_left_out(tmp_path: Path) -> None:
    table = make_table(0, 30)
    table = table.append_column("kind", pa.array(["a", "b", "c"] * 10).dictionary_encode())
    for layout in ["stream", "file"]:
        (tmp_path / "a.arrow").write_bytes(ipc_bytes(table, 8, layout))
        with pytest.raises(FormatError, match=r"a\.arrow: column 'kind' is dictionary-encoded"):
            ab.open_dataset(str(tmp_path))
        columns = {"columns": ["id", "tokens", "text", "vec", "flag", "blob"]}
        assert sorted(read_all(str(tmp_path), options=columns)) == list(range(30))


def test_corrupt_offsets_are_an_error_never_wrong_rows(offsets: str, tmp_path: Path) -> None:
    table = pa.table({"id": pa.array(np.arange(20)), "text": pa.array(["ab"] * 20)})
    data = bytearray(ipc_bytes(table, 20, "stream"))
    text_offsets = np.arange(0, 42, 2, dtype="<i4").tobytes()
    at = bytes(data).index(text_offsets)
    data[at + 4 * 5 : at + 4 * 6] = (10**6).to_bytes(4, "little")  # row 5's end, far out
    (tmp_path / "a.arrow").write_bytes(bytes(data))
    dataset = ab.open_dataset(str(tmp_path))
    for shuffle in [False, True]:
        with (
            pytest.raises(FormatError, match=r"a\.arrow: record batch 0 \(body at byte \d+\)"),
            ab.Loader(dataset, batch_size=20, shuffle=shuffle) as loader,
        ):
            list(loader)


def test_offsets_past_int64_are_an_error_never_a_crash(offsets: str, tmp_path: Path) -> None:
    """A large list's last offset so large that it overflows as a byte count (times the
    values' 8 bytes) is refused by the bounds check, not passed on to pyarrow."""
    table = pa.table({"id": pa.array(np.arange(20)), "l": pa.array([[1, 2]] * 20, LARGE)})
    data = bytearray(ipc_bytes(table, 20, "stream"))
    at = bytes(data).index(np.arange(0, 42, 2, dtype="<i8").tobytes())
    data[at + 8 * 20 : at + 8 * 21] = (2**61 + 40).to_bytes(8, "little")  # 8 * it wraps to 320
    (tmp_path / "a.arrow").write_bytes(bytes(data))
    dataset = ab.open_dataset(str(tmp_path))
    for shuffle in [False, True]:
        with (
            pytest.raises(FormatError, match=r"a\.arrow: record batch 0 \(body at byte \d+\)"),
            ab.Loader(dataset, batch_size=20, shuffle=shuffle) as loader,
        ):
            list(loader)


def test_a_buffer_past_int64_is_an_error_at_open(tmp_path: Path) -> None:
    """A buffer whose offset plus length overflows int64 lies outside its body too."""
    table = pa.table({"id": pa.array(np.arange(20)), "l": pa.array([[1, 2]] * 20, LARGE)})
    data = bytearray(ipc_bytes(table, 20, "stream"))
    batch_at = 8 + int.from_bytes(data[4:8], "little")  # the schema message's end
    at = bytes(data).index(np.array([328, 320], dtype="<i8").tobytes(), batch_at)
    data[at : at + 16] = np.array([2**62, 2**62], dtype="<i8").tobytes()
    (tmp_path / "a.arrow").write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"a\.arrow: message at byte \d+: a buffer lies outside"):
        ab.open_dataset(str(tmp_path))


def test_nulls_are_an_error_unless_filled(tmp_path: Path) -> None:
    table = pa.table(
        {
            "id": pa.array(np.arange(12)),
            "tokens": pa.array([[1, 2], None, [3]] * 4, pa.list_(pa.int32())),
            "score": pa.array([1.5, None, 2.5] * 4, pa.float64()),
        }
    )
    (tmp_path / "a.arrow").write_bytes(ipc_bytes(table, 6, "file"))
    with (
        pytest.raises(FormatError, match=r"a\.arrow: record batch 0 .*holds nulls"),
        ab.Loader(ab.open_dataset(str(tmp_path)), batch_size=4, shuffle=True) as loader,
    ):
        list(loader)
    dataset = ab.open_dataset(str(tmp_path), options={"nulls": "fill"})
    with ab.Loader(dataset, batch_size=12, shuffle=False) as loader:
        (batch,) = list(loader)
    assert [batch["tokens"][k].tolist() for k in range(3)] == [[1, 2], [], [3]]
    assert np.isnan(batch["score"][1].item())


def test_options_and_explicit_format(tmp_path: Path) -> None:
    good_files(tmp_path)
    with pytest.raises(ConfigError, match="unknown options"):
        ab.open_dataset(str(tmp_path), options={"column": "id"})
    with pytest.raises(ConfigError, match="columns="):
        ab.open_dataset(str(tmp_path), options={"columns": ["nope"]})
    dataset = ab.open_dataset(str(tmp_path / "a.arrow"), format="arrow")
    assert dataset.manifest.total_elements == 40
    assert ab.open_dataset(str(tmp_path / "*.arrow")).manifest.total_elements == 80
    (tmp_path / "splits").mkdir()  # a DatasetDict: one folder per split
    good_files(tmp_path / "splits" / "train")
    good_files(tmp_path / "splits" / "test")
    (tmp_path / "splits" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ConfigError, match=r"DatasetDict .*open one split's folder"):
        ab.open_dataset(str(tmp_path / "splits"))
    assert ab.open_dataset(str(tmp_path / "splits" / "train")).manifest.total_elements == 80


@pytest.mark.parametrize("shuffle", ["block", True])
def test_a_mixture_of_two_arrow_datasets(shuffle: Any, tmp_path: Path) -> None:
    for name, first in (("a", 0), ("b", 100)):
        (tmp_path / name).mkdir()
        data = ipc_bytes(make_table(first, 30), 7, "stream" if name == "a" else "file")
        (tmp_path / name / "p.arrow").write_bytes(data)
    blend = ab.mix([str(tmp_path / "a"), str(tmp_path / "b")], [0.5, 0.5], samples=40)
    with ab.Loader(blend, batch_size=8, shuffle=shuffle) as loader:
        ids = []
        for batch in loader:
            assert batch["text"].to_pylist() == [
                f"row {i} " + "é" * (i % 3) for i in batch["id"].tolist()
            ]
            ids += batch["id"].tolist()
    assert len(ids) == 40
    assert {i // 100 for i in ids} == {0, 1}  # rows of both
    assert all(i % 100 < 30 for i in ids)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_mixture_of_datasets_with_columns_in_other_orders(shuffle: Any, tmp_path: Path) -> None:
    """Each dataset's columns are found by name: the same columns in another order are not
    read from another column's buffers."""
    for name, first, order in (("a", 0, ["id", "text"]), ("b", 100, ["text", "id"])):
        (tmp_path / name).mkdir()
        table = make_table(first, 30).select(order)
        (tmp_path / name / "p.arrow").write_bytes(ipc_bytes(table, 7, "stream"))
    blend = ab.mix([str(tmp_path / "a"), str(tmp_path / "b")], [0.5, 0.5], samples=40)
    with ab.Loader(blend, batch_size=8, shuffle=shuffle) as loader:
        for batch in loader:
            assert batch["text"].to_pylist() == [
                f"row {i} " + "é" * (i % 3) for i in batch["id"].tolist()
            ]


def test_inspect_lists_record_batches_and_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "p.arrow").write_bytes(ipc_bytes(make_table(0, 30), 7, "stream"))
    from asyncbatch._cli import main

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "format    arrow" in out
    assert "record batches: 5" in out
    assert "tokens: list<item: int32>\n" in out
