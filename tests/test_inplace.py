"""Data users already have, read in place: Megatron .bin/.idx, .npy files, raw token files."""

from __future__ import annotations

import itertools
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, expected_windows, s3_options
from make_megatron import random_documents, write_megatron

import asyncbatch as ab
from asyncbatch.formats._base import natural_key
from asyncbatch.formats._megatron import DOCUMENT_PAGES, SEQUENCE_PAGES
from asyncbatch.formats._registry import FORMATS
from asyncbatch.stores._base import ObjectInfo
from asyncbatch.stores._local import LocalStore

_names = itertools.count()
#: (url, start, end) of every read through the ``counting://`` store.
READS: list[tuple[str, int, int]] = []


class CountingStore(LocalStore):
    """The local store under ``counting://``, recording every byte range it reads (opening
    only: the loader's grouped ``read_into`` is not translated)."""

    async def size(self, url: str) -> int:
        return await super().size(_local(url))

    async def stat(self, url: str) -> ObjectInfo:
        return await super().stat(_local(url))

    async def list(self, url: str) -> list[str]:
        return [f"counting://{u}" for u in await super().list(_local(url))]

    async def read_ranges(self, url: str, *, starts: Any, ends: Any, buffers: Any) -> None:
        READS.extend((url, int(s), int(e)) for s, e in zip(starts, ends, strict=True))
        await super().read_ranges(_local(url), starts=starts, ends=ends, buffers=buffers)


def _local(url: str) -> str:
    return url.removeprefix("counting://")


ab.register_store("counting", lambda scheme, options, max_inflight: CountingStore())

Place = Callable[[Path], tuple[str, dict[str, Any]]]


@pytest.fixture
def place(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> Place:
    """``place(local_path)`` copies a file or folder to the current store and returns its
    ``(url, storage_options)``."""

    def put(path: Path) -> tuple[str, dict[str, Any]]:
        if store == "local":
            return str(path), {}
        name = f"inplace-{next(_names)}"
        if store == "s3":
            import s3fs

            options = s3_options(request.getfixturevalue("s3_endpoint"))
            fs = s3fs.S3FileSystem(
                endpoint_url=options["endpoint_url"], key="testing", secret="testing"
            )
            target = f"{BUCKET}/{name}/{path.name}"
            fs.put(str(path), target, recursive=path.is_dir())
            return f"s3://{target}", options
        root, server = request.getfixturevalue("http_root")
        (root / name).mkdir()
        if path.is_dir():
            shutil.copytree(path, root / name / path.name)
        else:
            shutil.copy(path, root / name / path.name)
        return f"{server.url}/{name}/{path.name}", {}

    return put


def check_windows(
    dataset: ab.Dataset, tokens: npt.NDArray[Any], seq_len: int, **kwargs: Any
) -> list[list[int]]:
    """Every batch of a loader holds the windows the numpy source has at its indexes."""
    ids = []
    with ab.Loader(dataset, batch_size=6, seq_len=seq_len, seed=5, **kwargs) as loader:
        for batch in loader:
            got = batch["tokens"].numpy()
            np.testing.assert_array_equal(
                got, expected_windows(tokens, batch.global_indexes, seq_len)
            )
            ids.append(batch.global_indexes.tolist())
    flat = sum(ids, [])
    samples = len(tokens) // seq_len
    assert len(set(flat)) == len(flat) == samples // 6 * 6  # the tail batch is dropped
    assert set(flat) <= set(range(samples))
    return ids


def check_resume(dataset: ab.Dataset, tokens: npt.NDArray[Any], seq_len: int) -> None:
    kwargs: dict[str, Any] = dict(batch_size=6, seq_len=seq_len, shuffle=True, seed=9)
    with ab.Loader(dataset, **kwargs) as loader:
        full = [b.global_indexes.tolist() for b in loader]
    with ab.Loader(dataset, **kwargs) as loader:
        it = iter(loader)
        first = [next(it).global_indexes.tolist() for _ in range(3)]
        state = loader.state_dict()
    with ab.Loader(dataset, **kwargs) as loader:
        loader.load_state_dict(state)
        rest = []
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, seq_len)
            )
            rest.append(batch.global_indexes.tolist())
    assert first + rest == full


def check_token_dataset(dataset: ab.Dataset, tokens: npt.NDArray[Any], seq_len: int) -> None:
    """Byte-exact windows under the global and the block shuffle, and an exact resume."""
    assert dataset.manifest.format == "tokens"
    assert dataset.manifest.total_elements == len(tokens)
    check_windows(dataset, tokens, seq_len, shuffle=True)
    check_windows(dataset, tokens, seq_len, shuffle="block", block_size=4, window=3)
    check_resume(dataset, tokens, seq_len)


def token_arrays(seed: int, lengths: Sequence[int], dtype: str = "uint16") -> list[Any]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60_000, n).astype(dtype) for n in lengths]


# --- .npy ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_npy_file_reads_byte_exact_windows(place: Place, tmp_path: Path) -> None:
    (tokens,) = token_arrays(1, [5_003])
    np.save(tmp_path / "tokens.npy", tokens)
    url, options = place(tmp_path / "tokens.npy")
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.shards[0].offset == 128
    check_token_dataset(dataset, tokens, seq_len=37)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["local", "s3"])
def test_npy_folder_reads_its_files_in_name_order(place: Place, tmp_path: Path) -> None:
    parts = token_arrays(2, [1_000, 7, 2_500, 1_234])
    folder = tmp_path / "npys"
    folder.mkdir()
    for i, part in enumerate(parts):
        np.save(folder / f"part-{i:02d}.npy", part)
    (folder / "README.txt").write_text("not a shard")
    url, options = place(folder)
    dataset = ab.open_dataset(url, options)
    assert [s.path for s in dataset.manifest.shards] == [f"part-{i:02d}.npy" for i in range(4)]
    check_token_dataset(dataset, np.concatenate(parts), seq_len=50)


def test_npy_header_versions_and_long_headers(tmp_path: Path) -> None:
    tokens = np.arange(300, dtype=np.int32)
    for version in [(1, 0), (2, 0), (3, 0)]:
        path = tmp_path / f"v{version[0]}.npy"
        with open(path, "wb") as f:
            np.lib.format.write_array(f, tokens, version=version)
        dataset = ab.open_dataset(str(path))
        assert dataset.manifest.dtype == np.int32
        with ab.Loader(dataset, batch_size=10, seq_len=30, shuffle=False) as loader:
            (batch,) = list(loader)
        np.testing.assert_array_equal(batch["tokens"].numpy().ravel(), tokens)
    # a structured dtype with many fields has a header longer than the first read
    wide = np.dtype([(f"field_{i}", "<u2") for i in range(40)])
    records = np.zeros(20, dtype=wide)
    records["field_39"] = np.arange(20)
    np.save(tmp_path / "wide.npy", records)
    dataset = ab.open_dataset(str(tmp_path / "wide.npy"))
    assert dataset.manifest.shards[0].offset > 128
    with ab.Loader(dataset, batch_size=4, seq_len=5, shuffle=False) as loader:
        (batch,) = list(loader)
    np.testing.assert_array_equal(batch["field_39"].numpy().ravel(), np.arange(20))


def _raw_npy(path: Path, header: bytes, body: bytes = b"\x00" * 64) -> str:
    path.write_bytes(header + body)
    return str(path)


def _v1_header(text: str) -> bytes:
    padded = text.encode("latin1")
    padded += b" " * (117 - len(padded)) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(padded)) + padded


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (_v1_header("{'descr': '<u2', 'fortran_order': False, 'shape': (4, 8), }"), "1-D"),
        (_v1_header("{'descr': '<u2', 'fortran_order': False, 'shape': (), }"), "1-D"),
        (_v1_header("{'descr': '>u2', 'fortran_order': False, 'shape': (32,), }"), "byte order"),
        (_v1_header("{'descr': '|O', 'fortran_order': False, 'shape': (8,), }"), "fixed-size"),
        (_v1_header("{'descr': '<u2', 'shape': (32,), }"), "header dict"),
        (_v1_header("{'descr': '<u2', 'fortran_order': False, 'shape': (40,), }"), "truncated"),
        (_v1_header("{'descr': '<u2', 'fortran_order': False, 'shape': (20,), }"), "truncated"),
        (_v1_header("not a dict at all"), "header dict"),
        (b"\x93NUMPY\x07\x00" + _v1_header("{}")[8:], "version 7"),
        (b"\x93NUMPY\x01\x00\xff\x0f", "ends inside its header"),
        (b"PK\x03\x04 a zip, maybe", 'format="raw"'),
    ],
)
def test_bad_npy_files_are_format_errors(tmp_path: Path, header: bytes, match: str) -> None:
    url = _raw_npy(tmp_path / "bad.npy", header)
    with pytest.raises(ab.FormatError, match=match) as info:
        ab.open_dataset(url)
    assert url in str(info.value)


def test_npy_files_of_different_dtypes_do_not_mix(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros(10, np.uint16))
    np.save(tmp_path / "b.npy", np.zeros(10, np.uint32))
    with pytest.raises(ab.FormatError, match="b.npy holds uint32"):
        ab.open_dataset(str(tmp_path))


# --- raw token files -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_raw_file_reads_byte_exact_windows(place: Place, tmp_path: Path) -> None:
    (tokens,) = token_arrays(3, [4_099], dtype="uint32")
    tokens.tofile(tmp_path / "part-0.npy")  # OLMo: named .npy, but no header
    url, options = place(tmp_path / "part-0.npy")
    with pytest.raises(ab.FormatError, match='format="raw"'):
        ab.open_dataset(url, options)
    dataset = ab.open_dataset(url, options, format="raw", options={"dtype": "uint32"})
    assert dataset.manifest.shards[0].offset == 0
    check_token_dataset(dataset, tokens, seq_len=41)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["local", "s3"])
def test_folders_read_their_files_in_natural_order(place: Place, tmp_path: Path) -> None:
    numbers = [10, 2, 1, 100, 9]
    parts = dict(zip(numbers, token_arrays(3, [40, 50, 60, 70, 80]), strict=True))
    for kind in ("npy", "raw"):
        folder = tmp_path / kind
        folder.mkdir()
        for number, part in parts.items():
            if kind == "npy":
                np.save(folder / f"p-{number}.npy", part)
            else:
                part.tofile(folder / f"p-{number}.bin")
        url, options = place(folder)
        extra: dict[str, Any] = {"format": "raw", "options": {"dtype": np.uint16}}
        dataset = ab.open_dataset(url, options, **(extra if kind == "raw" else {}))
        suffix = ".npy" if kind == "npy" else ".bin"
        ordered = sorted(numbers)  # p-1, p-2, p-9, p-10, p-100
        assert [s.path for s in dataset.manifest.shards] == [f"p-{n}{suffix}" for n in ordered]
        check_token_dataset(dataset, np.concatenate([parts[n] for n in ordered]), seq_len=7)


def test_natural_key_compares_digit_runs_as_numbers() -> None:
    names = ["p-10.npy", "p-2.npy", "p-02.npy", "q.npy", "p-1.npy", "p.npy", "p-1a.npy"]
    assert sorted(names, key=natural_key) == [
        "p-1.npy",
        "p-1a.npy",
        "p-02.npy",
        "p-2.npy",
        "p-10.npy",
        "p.npy",
        "q.npy",
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["local", "s3"])
def test_raw_folder_reads_its_files_in_name_order(place: Place, tmp_path: Path) -> None:
    parts = token_arrays(4, [300, 2_000, 1])
    folder = tmp_path / "raw"
    folder.mkdir()
    for i, part in enumerate(parts):
        part.tofile(folder / f"part-{i}.npy")
    url, options = place(folder)
    dataset = ab.open_dataset(url, options, format="raw", options={"dtype": np.uint16})
    assert len(dataset.manifest.shards) == 3
    check_token_dataset(dataset, np.concatenate(parts), seq_len=23)


def test_raw_files_need_a_dtype_that_divides_them(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 15)
    with pytest.raises(ab.ConfigError, match="dtype"):
        ab.open_dataset(str(path), format="raw")
    with pytest.raises(ab.ConfigError, match="not a numpy dtype"):
        ab.open_dataset(str(path), format="raw", options={"dtype": "tokens"})
    with pytest.raises(ab.ConfigError, match="only"):
        ab.open_dataset(str(path), format="raw", options={"dtype": "u2", "header": 0})
    with pytest.raises(ab.FormatError, match=r"odd\.bin: 15 bytes is not a whole number"):
        ab.open_dataset(str(path), format="raw", options={"dtype": "uint16"})
    with pytest.raises(ab.NotFoundError, match="missing"):
        ab.open_dataset(str(tmp_path / "missing"), format="raw", options={"dtype": "u2"})


# --- Megatron .bin/.idx ----------------------------------------------------------------------


def megatron_offsets(documents: Sequence[Sequence[npt.NDArray[Any]]], unit: str) -> Any:
    """The element offsets a documents dataset of this fixture must carry."""
    if unit == "sequence":
        lengths = [len(s) for doc in documents for s in doc]
    else:
        lengths = [sum(len(s) for s in doc) for doc in documents]
    return np.concatenate([[0], np.cumsum(lengths)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", ["", ".bin", ".idx"])
def test_megatron_dataset_arrays_equal_the_fixture(
    place: Place, tmp_path: Path, suffix: str
) -> None:
    documents = random_documents(7, 40)
    folder = tmp_path / "megatron"
    folder.mkdir()
    write_megatron(folder / "corpus_text_document", documents)
    url, options = place(folder)
    for unit in ["sequence", "document"]:
        dataset = ab.open_dataset(
            f"{url}/corpus_text_document{suffix}", options, options={"unit": unit, "index_page": 6}
        )
        manifest = dataset.manifest
        assert (manifest.format, manifest.dtype) == ("megatron", np.dtype("uint16"))
        (shard,) = manifest.shards
        assert (shard.path, shard.offset) == ("corpus_text_document.bin", 0)
        assert dataset.shard_urls == [f"{url}/corpus_text_document.bin"]
        # Open keeps a summary: the first offset of each page of 6 entries, then the end.
        offsets = megatron_offsets(documents, unit)
        pages = dataset.arrays[SEQUENCE_PAGES if unit == "sequence" else DOCUMENT_PAGES]
        assert pages.dtype == np.int64
        np.testing.assert_array_equal(pages, np.append(offsets[:-1:6], offsets[-1]))
        assert shard.elements == offsets[-1] == sum(len(s) for doc in documents for s in doc)
        stream = np.concatenate([s for doc in documents for s in doc])
        assert manifest.metadata["documents"] == 40
        assert manifest.metadata["sequences"] == sum(len(doc) for doc in documents)
        with ab.Loader(dataset, batch_size=8, shuffle=False, drop_last=False) as loader:
            for batch in loader:
                for i, sample in enumerate(batch.global_indexes.tolist()):
                    want = stream[offsets[sample] : offsets[sample + 1]]
                    np.testing.assert_array_equal(np.asarray(batch["tokens"][i]), want)


def test_megatron_options_and_dtypes(tmp_path: Path) -> None:
    documents = random_documents(8, 5, dtype="int32")
    write_megatron(tmp_path / "m", documents, dtype="int32", modes=True)  # multimodal: modes
    dataset = ab.open_dataset(str(tmp_path / "m"))  # probed: no manifest, an .idx beside
    assert dataset.manifest.dtype == np.int32
    offsets = megatron_offsets(documents, "sequence")
    np.testing.assert_array_equal(dataset.arrays[SEQUENCE_PAGES], [0, offsets[-1]])
    with ab.Loader(dataset, batch_size=100, shuffle=False, drop_last=False) as loader:
        (batch,) = list(loader)
    np.testing.assert_array_equal(batch["tokens"].offsets.numpy(), offsets)
    with pytest.raises(ab.ConfigError, match="index_page must be a positive integer"):
        ab.open_dataset(str(tmp_path / "m"), options={"index_page": 0})
    with pytest.raises(ab.ConfigError, match="unit"):
        ab.open_dataset(str(tmp_path / "m"), options={"unit": "page"})
    with pytest.raises(ab.ConfigError, match="only"):
        ab.open_dataset(str(tmp_path / "m"), options={"seq_len": 5})
    (tmp_path / "m.bin").unlink()
    with pytest.raises(ab.NotFoundError, match=r"m\.bin"):
        ab.open_dataset(str(tmp_path / "m.idx"))


def _corrupt(tmp_path: Path, change: Callable[[bytearray], bytes | bytearray]) -> str:
    write_megatron(tmp_path / "c", random_documents(9, 6))
    index = bytearray((tmp_path / "c.idx").read_bytes())
    (tmp_path / "c.idx").write_bytes(change(index))
    return str(tmp_path / "c")


def _set(at: int, fmt: str, value: int | bytes) -> Callable[[bytearray], bytearray]:
    def change(index: bytearray) -> bytearray:
        struct.pack_into(fmt, index, at, value)
        return index

    return change


_SEQUENCES = 34  # the byte where the index arrays start (after the header)
_S = sum(len(doc) for doc in random_documents(9, 6))  # sequences in the corrupted fixture


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_set(0, "<9s", b"\x00" * 9), r"not a Megatron index: magic b'\\x00.*expected b'MMIDIDX"),
        (_set(9, "<Q", 2), "version 2, expected 1"),
        (_set(17, "<B", 42), "unknown Megatron dtype code 42"),
        (lambda b: b[:20], "truncated Megatron index: 20 bytes"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00" * 3, "trailing bytes"),
        (_set(18, "<Q", 10**12), "truncated"),
        (_set(_SEQUENCES, "<i", -5), "sequence 0 has length -5"),
        (_set(_SEQUENCES + 4 * _S + 8, "<q", 3), "sequence 1 points at byte 3"),
        (_set(_SEQUENCES + 4 * _S, "<q", 2), "sequence 0 points at byte 2"),
        (_set(_SEQUENCES + 4 * (_S - 1), "<i", 10**6), "has .* bytes .truncated .bin"),
        (_set(_SEQUENCES + 12 * _S + 8, "<q", 99), "document indices"),
        (_set(_SEQUENCES + 12 * _S, "<q", 1), "document indices"),
    ],
)
def test_corrupt_megatron_index_is_a_format_error(
    tmp_path: Path, change: Callable[[bytearray], bytes | bytearray], match: str
) -> None:
    # Found at open (the header, the summary) or where the page at fault is read.
    url = _corrupt(tmp_path, change)
    with pytest.raises(ab.FormatError, match=match) as info:
        dataset = ab.open_dataset(url, options={"unit": "document"})
        with ab.Loader(dataset, batch_size=2, shuffle=False, drop_last=False) as loader:
            list(loader)
    assert f"{url}.idx" in str(info.value)


def test_truncated_megatron_bin_is_a_format_error(tmp_path: Path) -> None:
    write_megatron(tmp_path / "t", random_documents(10, 6))
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-2])
    with pytest.raises(ab.FormatError, match=r"t\.bin has .* bytes"):
        ab.open_dataset(str(tmp_path / "t"))


@pytest.mark.timeout(60)
def test_megatron_bin_with_trailing_bytes_reads_as_megatron_reads_it(tmp_path: Path) -> None:
    documents = random_documents(12, 8)
    write_megatron(tmp_path / "p", documents)
    with open(tmp_path / "p.bin", "ab") as data:
        data.write(b"\xff" * 7)  # padding past the last sequence: Megatron never reads it
    sequences = [s for doc in documents for s in doc]
    dataset = ab.open_dataset(str(tmp_path / "p"))
    seen: dict[int, np.ndarray] = {}
    with ab.Loader(dataset, batch_size=2, shuffle=False) as loader:
        for batch in loader:
            for i, index in enumerate(batch.global_indexes.tolist()):
                seen[index] = np.asarray(batch["tokens"][i])
    assert len(seen) == len(sequences)
    for index, sequence in enumerate(sequences):
        np.testing.assert_array_equal(seen[index], sequence)


@pytest.mark.skipif("documents" not in FORMATS, reason="the documents source is not merged")
@pytest.mark.timeout(60)
def test_megatron_samples_read_through_the_loader(place: Place, tmp_path: Path) -> None:
    documents = random_documents(11, 30)
    folder = tmp_path / "loader"
    folder.mkdir()
    write_megatron(folder / "l", documents)
    url, options = place(folder)  # the .bin and the .idx beside it
    sequences = [s for doc in documents for s in doc]
    dataset = ab.open_dataset(f"{url}/l.bin", options)
    with ab.Loader(dataset, batch_size=4, shuffle=True, seed=2) as loader:
        seen = []
        for batch in loader:
            column = batch["tokens"]
            for i, index in enumerate(batch.global_indexes.tolist()):
                np.testing.assert_array_equal(np.asarray(column[i]), sequences[index])
                seen.append(index)
    assert sorted(seen) == list(range(len(sequences)))


# --- opening reads headers and index arrays only ---------------------------------------------


def test_opening_reads_no_token_data(tmp_path: Path) -> None:
    write_megatron(tmp_path / "m", random_documents(12, 50))
    np.save(tmp_path / "a.npy", np.arange(10_000, dtype=np.uint16))
    (tmp_path / "npys").mkdir()
    for i in range(3):
        np.save(tmp_path / "npys" / f"{i}.npy", np.arange(5_000, dtype=np.uint32))
    np.arange(10_000, dtype=np.uint16).tofile(tmp_path / "raw.npy")

    READS.clear()
    ab.open_dataset(f"counting://{tmp_path}/m")
    idx_size = (tmp_path / "m.idx").stat().st_size
    assert [(f"counting://{tmp_path}/m.idx", 0, idx_size)] == READS  # one read, whole .idx

    READS.clear()
    ab.open_dataset(f"counting://{tmp_path}/a.npy")
    assert [(f"counting://{tmp_path}/a.npy", 0, 128)] == READS  # the header, no token

    READS.clear()
    dataset = ab.open_dataset(f"counting://{tmp_path}/npys")
    assert sorted(READS) == [(f"counting://{tmp_path}/npys/{i}.npy", 0, 128) for i in range(3)]
    assert dataset.url == f"counting://{tmp_path}/npys"

    READS.clear()
    ab.open_dataset(f"counting://{tmp_path}/raw.npy", format="raw", options={"dtype": "u2"})
    assert READS == []


def test_a_large_megatron_index_is_opened_by_its_summary(tmp_path: Path) -> None:
    documents = [[np.zeros(1, np.uint16)] for _ in range(60_000)]  # ~1.2 MB of index
    write_megatron(tmp_path / "big", documents)
    READS.clear()
    dataset = ab.open_dataset(f"counting://{tmp_path}/big")
    # The first 16 KiB, then a pointer a page of 4096 sequences (15), the last pointer and
    # length, the first and the last document index (neighbours merged): never the arrays.
    assert READS[0][1:] == (0, 16 * 2**10)
    assert all(e - s <= 16 for _, s, e in READS[1:]) and len(READS) <= 1 + 15 + 4
    assert dataset.arrays[SEQUENCE_PAGES].tolist() == [*range(0, 60_000, 4096), 60_000]


@pytest.mark.timeout(60)
def test_opening_over_http_reads_only_headers(tmp_path: Path, http_root: tuple[Path, Any]) -> None:
    root, server = http_root
    (root / "inplace-requests").mkdir()
    write_megatron(root / "inplace-requests" / "m", random_documents(13, 20))
    np.save(root / "inplace-requests" / "a.npy", np.arange(1_000, dtype=np.uint16))
    base = f"{server.url}/inplace-requests"
    before = server.requests
    ab.open_dataset(f"{base}/m")
    assert server.requests - before == 1  # GETs: the .idx once; sizes are HEADs
    before = server.requests
    ab.open_dataset(f"{base}/a.npy")
    assert server.requests - before == 1
    with pytest.raises(ab.NotFoundError) as caught:
        ab.open_dataset(f"{base}/nothing-here")
    assert str(caught.value) == (
        f"no dataset at {base}/nothing-here: no manifest ({base}/nothing-here/manifest.json"
        " not found), no Megatron .idx beside it, no .npy files listed in it, no .parquet"
        " files listed under it, no state.json, no .arrow or .feather files listed under it,"
        " no .tar shards listed under it; for data in another layout, name its format with"
        " format= (one of 'megatron', 'npy', 'raw', 'llmbatch', 'parquet', 'arrow',"
        " 'webdataset')"
    )


@pytest.mark.parametrize("store", ["local", "s3"])
@pytest.mark.parametrize("layout", ["megatron", "npy"])
def test_a_state_from_other_bytes_read_in_place_is_refused(
    place: Place, tmp_path: Path, layout: str
) -> None:
    # No manifest, no checksums: the objects' versions (file identity, ETag) stand for the bytes.
    folder = tmp_path / layout
    folder.mkdir()
    documents = random_documents(3, 12)

    def write(flip: bool) -> tuple[str, dict[str, Any]]:
        """The same shape every time; the tokens reversed with ``flip``."""
        sequences = [[s[::-1] if flip else s for s in doc] for doc in documents]
        if layout == "megatron":
            write_megatron(folder / "corpus", sequences)
        else:
            for i, doc in enumerate(sequences):
                np.save(folder / f"part-{i}.npy", np.concatenate(doc))
        url, options = place(folder)
        return (f"{url}/corpus.bin" if layout == "megatron" else url), options

    def loader(url: str, options: dict[str, Any]) -> ab.Loader:
        return ab.Loader(url, storage_options=options, batch_size=2, seq_len=16, shuffle=False)

    url, options = write(flip=False)
    with loader(url, options) as first:
        next(first)
        state = first.state_dict()
    with loader(url, options) as same:  # the same objects, unchanged
        same.load_state_dict(state)
        assert same.state_dict()["batches_done"] == 1
    url, options = write(flip=True)  # rewritten in place (local), or a new upload (S3)
    with loader(url, options) as other:
        shape = other.state_dict()["dataset"].split(":versions=")[0]
        assert shape == state["dataset"].split(":versions=")[0]
        with pytest.raises(
            ab.ResumeStateError, match="dataset .*:versions=.*other object versions"
        ):
            other.load_state_dict(state)
        state["dataset"] = None  # the documented way past the check
        other.load_state_dict(state)


@pytest.mark.parametrize("layout", ["megatron", "npy"])
def test_a_local_copy_of_the_same_bytes_resumes_the_state(tmp_path: Path, layout: str) -> None:
    # Each node of a job often reads its own copy: new inodes and mtimes, the same bytes.
    documents = random_documents(3, 12)
    (tmp_path / "a").mkdir()
    if layout == "megatron":
        write_megatron(tmp_path / "a" / "corpus", documents)
    else:
        for i, doc in enumerate(documents):
            np.save(tmp_path / "a" / f"part-{i}.npy", np.concatenate(doc))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # copy2: the mtime too, so touch them
    for path in (tmp_path / "b").iterdir():
        os.utime(path, ns=(0, 0))

    def loader(folder: str) -> ab.Loader:
        url = (
            str(tmp_path / folder / "corpus.bin")
            if layout == "megatron"
            else str(tmp_path / folder)
        )
        return ab.Loader(url, batch_size=2, seq_len=16, shuffle=True)

    with loader("a") as first:
        next(first)
        state = first.state_dict()
        expected = next(first)
    with loader("b") as copy:
        copy.load_state_dict(state)
        assert torch.equal(next(copy)["tokens"], expected["tokens"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["s3"])
def test_an_object_replaced_after_open_is_never_read_with_the_old_headers(
    place: Place, tmp_path: Path
) -> None:
    # The headers parsed at open describe the bytes of that version; another file of the
    # same size read through them would be wrong rows, silently.
    tokens, other = token_arrays(4, [4_000, 4_000])
    np.save(tmp_path / "tokens.npy", tokens)
    url, options = place(tmp_path / "tokens.npy")
    dataset = ab.open_dataset(url, options)
    replacement = tmp_path / "other.npy"
    np.save(replacement, other)
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=options["endpoint_url"], key="testing", secret="testing")
    fs.put(str(replacement), url)  # another object of the same size, under the same key
    loader = ab.Loader(dataset, batch_size=2, seq_len=16)
    with loader, pytest.raises(ab.ShardChangedError, match="changed since it was pinned"):
        next(loader)
    reopened = ab.open_dataset(url, options)  # opened again: the new bytes, exactly
    with ab.Loader(reopened, batch_size=2, seq_len=16, shuffle=False) as loader:
        batch = next(loader)
        np.testing.assert_array_equal(batch["tokens"].numpy(), other[:32].reshape(2, 16))
