"""LLMBATCH files: read one written from the layout description alone, write the same bytes,
one range read per batch with the block recipe, and clear errors for bad files."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, s3_options
from servers import RangeHTTPServer, http_server

import asyncbatch as ab
from asyncbatch._errors import ConfigError, FormatError

_names = itertools.count()


def reference_file(
    records: npt.NDArray[Any],
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    version: int = 1,
    dtype_code: int = 0,
    magic: bytes = b"LLMBATCH",
) -> bytes:
    """An LLMBATCH file built from the layout description alone (not asyncbatch's writer):
    header fields packed one by one at their documented offsets, then page-padded slots."""
    total, seq_len = records.shape
    if shuffle:  # the documented shuffle: numpy's default_rng(seed).permutation
        records = records[np.random.default_rng(seed).permutation(total)]
    num_batches = total // batch_size
    header = bytearray(4096)
    header[0:8] = magic
    struct.pack_into("<I", header, 8, version)
    struct.pack_into("<I", header, 12, batch_size)
    struct.pack_into("<I", header, 16, seq_len)
    struct.pack_into("<Q", header, 20, num_batches)
    struct.pack_into("<I", header, 28, dtype_code)
    struct.pack_into("<I", header, 32, seed)
    struct.pack_into("<I", header, 36, total)
    raw = batch_size * seq_len * 4
    padded = (raw + 4095) // 4096 * 4096
    out = bytearray(header)
    for b in range(num_batches):
        block = records[b * batch_size : (b + 1) * batch_size].astype("<u4").tobytes()
        out += block + bytes(padded - raw)
    assert len(out) == 4096 + num_batches * padded
    return bytes(out)


def file_records(records: npt.NDArray[Any], batch_size: int, seed: int = 0) -> npt.NDArray[Any]:
    """The records in file order (after the writer's shuffle, remainder dropped)."""
    kept = records.shape[0] // batch_size * batch_size
    return records[np.random.default_rng(seed).permutation(records.shape[0])][:kept]


@pytest.fixture
def records() -> npt.NDArray[np.uint32]:
    # 203 records of 24 tokens: 8 per batch is 768 bytes, padded to a 4096-byte slot.
    return np.random.default_rng(1).integers(0, 2**32, (203, 24), dtype=np.uint32)


@pytest.fixture
def put_file(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """``put_file(data)`` stores ``data`` as a ``.batch`` object of the current store with
    plain tools (files, s3fs); returns ``(url, storage_options)``."""

    def put(data: bytes, suffix: str = ".batch") -> tuple[str, dict[str, Any]]:
        name = f"file-{next(_names)}{suffix}"
        if store == "local":
            path = tmp_path / name
            path.write_bytes(data)
            return str(path), {}
        if store == "s3":
            import s3fs

            options = s3_options(request.getfixturevalue("s3_endpoint"))
            s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe(f"{BUCKET}/{name}", data)
            return f"s3://{BUCKET}/{name}", options
        root, server = request.getfixturevalue("http_root")
        (root / name).write_bytes(data)
        return f"{server.url}/{name}", {}

    return put


def read_all(url: str, options: dict[str, Any], **kwargs: Any) -> list[ab.Batch]:
    with ab.Loader(url, storage_options=options, **kwargs) as loader:
        return list(loader)


@pytest.mark.parametrize("shuffle", [False, True])
def test_independent_file_reads_correctly(
    store: str, put_file: Any, records: npt.NDArray[np.uint32], shuffle: bool
) -> None:
    url, options = put_file(reference_file(records, 8, seed=7))
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.format == "llmbatch"
    fields = dataset.manifest.metadata["llmbatch"]
    assert fields["batch_size"] == 8 and fields["seq_len"] == 24 and fields["num_batches"] == 25
    assert fields["seed"] == 7 and fields["total_records"] == 203 and fields["slot_bytes"] == 4096
    expected = file_records(records, 8, seed=7)
    batches = read_all(url, options, batch_size=5, shuffle=shuffle, prefetch=4)
    for batch in batches:
        got = batch["tokens"]
        assert got.dtype == torch.uint32 and got.shape[1] == 24
        np.testing.assert_array_equal(got.numpy(), expected[batch.global_indexes])
    ids = np.concatenate([b.global_indexes for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(200))
    assert shuffle != np.array_equal(ids, np.arange(200))


def test_writer_output_equals_the_independent_file(
    store: str, records: npt.NDArray[np.uint32], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cases = [
        ({"batch_size": 8, "seed": 7}, records),  # padded slots
        ({"batch_size": 64, "seed": 2**32 - 1}, records[:, :16].astype(np.int64)),  # no padding
        ({"batch_size": 5, "shuffle": False}, iter(np.array_split(records, 4))),  # iterable
        ({"batch_size": 7}, (r for r in records[:50])),  # single records
    ]
    for i, (kwargs, tokens) in enumerate(cases):
        if store == "s3" and i % 2:  # moto is slow; the writer's code is the same
            continue
        name = f"out-{next(_names)}.batch"
        options: dict[str, Any] = {}
        if store == "local":
            url = read_url = str(tmp_path / name)
        elif store == "s3":
            options = s3_options(request.getfixturevalue("s3_endpoint"))
            url = read_url = f"s3://{BUCKET}/{name}"
        else:  # the HTTP server is read-only: write to its folder, read through it
            root, server = request.getfixturevalue("http_root")
            url, read_url = str(root / name), f"{server.url}/{name}"
        written = ab.write_llmbatch(url, tokens, storage_options=options, **kwargs)
        source = [records, records[:, :16], records, records[:50]][i]
        expected = reference_file(
            source,
            kwargs["batch_size"],
            seed=kwargs.get("seed", 0),
            shuffle=kwargs.get("shuffle", True),
        )
        with fsspec.open(read_url, "rb", **options) as f:
            assert f.read() == expected
        assert ab.open_dataset(read_url, options).manifest == written.manifest
        # And it reads back: the records in file order.
        order = ab.open_dataset(read_url, options)
        with ab.Loader(order, batch_size=3, shuffle=False, dtype=torch.int64) as loader:
            first = list(loader)[0]["tokens"].numpy()  # the whole epoch: no read left in flight
        stored = np.frombuffer(expected[4096:], dtype="<u4")[: 3 * source.shape[1]]
        np.testing.assert_array_equal(first.ravel(), stored)


@pytest.mark.parametrize("seq_len", [24, 256])
def test_one_read_per_batch_with_the_block_recipe(tmp_path: Path, seq_len: int) -> None:
    # seq_len 24: 768-byte batches in 4096-byte slots; 256: 8 KiB batches, no padding.
    # A server of its own: requests other tests left in flight would count here.
    data = np.random.default_rng(2).integers(0, 2**32, (403, seq_len), dtype=np.uint32)
    (tmp_path / "blocks.batch").write_bytes(reference_file(data, 8, seed=1))
    with http_server(tmp_path) as server:
        _count_reads_per_batch(server, f"{server.url}/blocks.batch", data, seq_len)


def _count_reads_per_batch(
    server: RangeHTTPServer, url: str, data: npt.NDArray[np.uint32], seq_len: int
) -> None:
    before = server.requests
    dataset = ab.open_dataset(url)
    assert server.requests - before == 1  # the header, nothing else
    expected = file_records(data, 8, seed=1)
    # Merge reads across one slot's padding, no further: in this small file the remote
    # default (128 KiB) would merge everything and hide the count.
    padding = dataset.manifest.metadata["llmbatch"]["slot_bytes"] - 8 * seq_len * 4
    reads = {}
    for shuffle in ("block", "global"):
        before = server.requests
        with ab.Loader(
            dataset, batch_size=8, shuffle=shuffle, seed=4, coalesce_gap=padding
        ) as loader:
            if shuffle == "block":
                assert loader.block_size == 8  # the format's default: one file batch
            batches = list(loader)
        reads[shuffle] = server.requests - before
        assert len(batches) == 50
        for batch in batches:
            ids = batch.global_indexes
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected[ids])
    # A block is 8 consecutive records (its edges move every epoch, so it may take rows of
    # two neighbouring slots); the window mixes 8 blocks into 8 batches. A slot's padding
    # (seq_len 24: 3328 of 4096 bytes) is read across between neighbouring records, on top
    # of the planner's budget, so a block is one read with padding or without (seq_len
    # 256). Only the block that wraps past the last record needs one more.
    assert reads["block"] <= len(batches) + 1
    assert reads["global"] > 3 * reads["block"]


def test_global_shuffle_ranks_and_resume(
    store: str, put_file: Any, records: npt.NDArray[np.uint32]
) -> None:
    if store == "s3":  # moto serves ~50 ranges/s
        records = records[:67]
    url, options = put_file(reference_file(records, 8, seed=5))
    expected = file_records(records, 8, seed=5)
    args: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 9, "prefetch": 4}
    full = read_all(url, options, **args)
    # Ranks: two ranks of batch 2 take the same global batches, split between them.
    per_rank = [
        read_all(url, options, **{**args, "batch_size": 2}, rank=r, world_size=2) for r in (0, 1)
    ]
    for whole, a, b in zip(full, *per_rank, strict=True):
        both = np.concatenate([a.global_indexes, b.global_indexes])
        assert sorted(both.tolist()) == sorted(whole.global_indexes.tolist())
        for part in (a, b):
            np.testing.assert_array_equal(part["tokens"].numpy(), expected[part.global_indexes])
    # Resume after batch 11: the remaining batches, byte for byte.
    with ab.Loader(url, storage_options=options, **args) as loader:
        taken = list(itertools.islice(loader, 11))
        state = loader.state_dict()
    with ab.Loader(url, storage_options=options, **args) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    for got, want in zip(taken + rest, full, strict=True):
        np.testing.assert_array_equal(got.global_indexes, want.global_indexes)
        assert torch.equal(got["tokens"], want["tokens"])


def test_block_shuffle_resume_and_workers(tmp_path: Path, records: npt.NDArray[np.uint32]) -> None:
    url = str(tmp_path / "w.batch")
    ab.write_llmbatch(url, records, batch_size=8, seed=3)
    expected = file_records(records, 8, seed=3)
    args: dict[str, Any] = {"batch_size": 8, "shuffle": "block", "seed": 1}
    full = read_all(url, {}, **args)
    with ab.Loader(url, **args) as loader:
        taken = list(itertools.islice(loader, 11))
        state = loader.state_dict()
    with ab.Loader(url, **args) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    for got, want in zip(taken + rest, full, strict=True):
        assert torch.equal(got["tokens"], want["tokens"])
        np.testing.assert_array_equal(got["tokens"].numpy(), expected[got.global_indexes])
    source = ab.LoaderDataset(url, **args)
    got = sorted(b.global_indexes.tolist() for b in source.dataloader(num_workers=2))
    assert got == sorted(b.global_indexes.tolist() for b in full)


def test_mixture_of_files_and_dtype_conversion(
    tmp_path: Path, records: npt.NDArray[np.uint32]
) -> None:
    a = ab.write_llmbatch(str(tmp_path / "a.batch"), records, batch_size=8, seed=1)
    b = ab.write_llmbatch(str(tmp_path / "b.batch"), records[:100], batch_size=5, seed=2)
    expected = np.concatenate(
        [file_records(records, 8, seed=1), file_records(records[:100], 5, seed=2)]
    )
    mixture = ab.mix([a, b], weights=[1, 1], seed=0, samples=150)
    with ab.Loader(mixture, batch_size=6, dtype=torch.int64) as loader:
        seen = 0
        for batch in loader:
            assert batch["tokens"].dtype == torch.int64
            np.testing.assert_array_equal(batch["tokens"].numpy(), expected[batch.global_indexes])
            seen += batch.batch_size
    assert seen == 150


def _corrupt(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


def test_bad_files_are_format_errors(
    store: str, put_file: Any, records: npt.NDArray[np.uint32]
) -> None:
    good = reference_file(records, 8)
    cases = {
        "magic is b'LLMBATCX'": _corrupt(good, 0, b"LLMBATCX"),
        "version 2 is unknown": _corrupt(good, 8, struct.pack("<I", 2)),
        "dtype code 3 is unknown": _corrupt(good, 28, struct.pack("<I", 3)),
        "shorter than the header claims: num_batches=25": good[:-4000],
        "num_batches=26 slots of 4096 bytes": _corrupt(good, 20, struct.pack("<Q", 26)),
        "longer than the header claims": good + bytes(4096),
        "the last slot is cut inside its padding": good[:-1],
        "field seq_len is 0": _corrupt(good, 16, struct.pack("<I", 0)),
        "shorter than the 4096-byte LLMBATCH header": good[:100],
    }
    if store == "s3":  # moto is slow: the header checks are the same code for every store
        cases = dict(list(cases.items())[::3])
    for message, data in cases.items():
        url, options = put_file(data)
        with pytest.raises(FormatError, match=message) as error:
            ab.open_dataset(url, options)
        assert url in str(error.value)


def test_a_last_slot_without_padding_reads(tmp_path: Path, records: npt.NDArray[np.uint32]) -> None:
    data = reference_file(records, 8)
    path = tmp_path / "short-tail.batch"
    path.write_bytes(data[: -(4096 - 8 * 24 * 4)])  # the last batch's padding left out
    with ab.Loader(str(path), batch_size=8, shuffle=False) as loader:
        last = list(loader)[-1]
    np.testing.assert_array_equal(last["tokens"].numpy(), file_records(records, 8)[-8:])


def test_bad_arguments_are_config_errors(tmp_path: Path, records: npt.NDArray[np.uint32]) -> None:
    url = str(tmp_path / "c.batch")
    ab.write_llmbatch(url, records, batch_size=8)
    with pytest.raises(
        ConfigError, match="c.batch: seq_len=32, but the LLMBATCH file's records hold 24"
    ):
        ab.Loader(url, batch_size=4, seq_len=32)
    with pytest.raises(ConfigError, match="next_token=True"):
        ab.Loader(url, batch_size=4, next_token=True)
    with pytest.raises(ConfigError, match="format_options"):
        ab.Loader(url, batch_size=4, format_options={"x": 1})
    with pytest.raises(ConfigError, match="no open options"):
        ab.open_dataset(url, options={"dtype": "u2"})
    with pytest.raises(ConfigError, match="LLMBATCH stores tokens as uint32"):
        ab.write_llmbatch(url, records, batch_size=8, dtype=np.uint16)
    with pytest.raises(ConfigError, match=r"do not fit dtype uint32"):
        ab.write_llmbatch(url, np.full((8, 24), -1), batch_size=8)
    with pytest.raises(ConfigError, match="batch_size must be"):
        ab.write_llmbatch(url, records, batch_size=0)
    with pytest.raises(ConfigError, match="seed must be"):
        ab.write_llmbatch(url, records, batch_size=8, seed=2**32)
    with pytest.raises(ConfigError, match="a record of 24 tokens, but seq_len=10"):
        ab.write_llmbatch(url, records, batch_size=8, seq_len=10)
    with pytest.raises(ConfigError, match=r"shape \(2, 3, 4\)"):
        ab.write_llmbatch(url, np.zeros((2, 3, 4), dtype=np.uint32), batch_size=8)
    with ab.Loader(url, batch_size=4, seq_len=24, shuffle=False) as loader:
        assert next(loader)["tokens"].shape == (4, 24)  # the file's seq_len, given, is fine
    with pytest.raises(ConfigError, match="needs checksums"):
        ab.Loader(url, batch_size=4, verify="full")  # the layout has no checksums
    # A file cut after it was opened: an error naming it, never short data.
    dataset = ab.open_dataset(url)
    with open(url, "r+b") as file:
        file.truncate(4096 * 3)
    with (
        ab.Loader(dataset, batch_size=8, shuffle=False) as loader,
        pytest.raises((ab.ManifestError, ab.ShortReadError), match="c.batch"),
    ):
        list(loader)
    ab.write_llmbatch(url, records, batch_size=8)
    # Any name opens with format="llmbatch"; the suffix only lets it be recognised.
    other = tmp_path / "records.bin"
    other.write_bytes((tmp_path / "c.batch").read_bytes())
    assert ab.open_dataset(str(other), format="llmbatch").shard_urls == [str(other)]
