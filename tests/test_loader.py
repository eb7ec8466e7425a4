"""Loader semantics: sync and async agree, exact resume, epochs, closing, bad arguments."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import WriteDataset, asyncbatch_threads, expected_windows

import asyncbatch as ab
from asyncbatch._errors import ConfigError, LoaderClosedError, ResumeStateError


@pytest.fixture
def dataset(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> ab.Dataset:
    return ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=2222)


def ids_of(loader: Any, limit: int | None = None) -> list[list[int]]:
    out = []
    for step, batch in enumerate(loader):
        out.append(batch.global_indexes.tolist())
        if limit is not None and step + 1 == limit:
            break
    return out


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_sync_and_async_deliver_the_same_batches(dataset: ab.Dataset, shuffle: bool | str) -> None:
    kwargs: dict[str, Any] = dict(batch_size=8, seq_len=32, shuffle=shuffle, seed=3, prefetch=5)
    with ab.Loader(dataset, **kwargs) as loader:
        sync = [(b.global_indexes.tolist(), b["tokens"].clone()) for b in loader]

    async def collect() -> list[tuple[list[int], torch.Tensor]]:
        async with ab.AsyncLoader(dataset.url, **kwargs) as loader:
            return [(b.global_indexes.tolist(), b["tokens"].clone()) async for b in loader]

    result = asyncio.run(collect())
    assert len(sync) == len(result) == (dataset.manifest.total_elements // 32) // 8
    for (ids_a, tok_a), (ids_b, tok_b) in zip(sync, result, strict=True):
        assert ids_a == ids_b
        assert torch.equal(tok_a, tok_b)


def run_resume_case(
    dataset: ab.Dataset, stop: int, prefetch: int, shuffle: bool | str, world_size: int
) -> None:
    """Stop after ``stop`` batches, resume from the state in a new loader, compare.

    (tests/test_ranks.py runs the elastic variant: resuming on another world size.)
    """
    for rank in range(world_size):
        kwargs: dict[str, Any] = dict(
            batch_size=5,
            seq_len=40,
            shuffle=shuffle,
            seed=11,
            prefetch=prefetch,
            rank=rank,
            world_size=world_size,
        )
        if shuffle == "block":
            kwargs.update(block_size=6, window=3)
        with ab.Loader(dataset, **kwargs) as loader:
            full = ids_of(loader)
        with ab.Loader(dataset, **kwargs) as loader:
            first = ids_of(loader, stop) if stop else []
            state = loader.state_dict()
        with ab.Loader(dataset, **kwargs) as loader:
            loader.load_state_dict(state)
            rest = ids_of(loader)
        assert first + rest == full, (stop, prefetch, shuffle, world_size, rank)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True, "block"])
@pytest.mark.parametrize("prefetch", [1, 4, 16])
@pytest.mark.parametrize("stop", [0, 1, 7, 49])
def test_resume_delivers_exactly_the_remaining_batches(
    dataset: ab.Dataset, stop: int, prefetch: int, shuffle: bool | str, world_size: int
) -> None:
    run_resume_case(dataset, stop, prefetch, shuffle, world_size)


def test_state_is_after_the_last_batch_handed_over(dataset: ab.Dataset) -> None:
    with ab.Loader(dataset, batch_size=4, seq_len=16, prefetch=8) as loader:
        it = iter(loader)
        next(it)
        next(it)
        stats = loader.statistics()
        assert stats is not None and stats.peak_reserved <= 8
        state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, 2)
    assert len(repr(state)) < 1024


def test_epochs_differ_and_repeat_from_the_seed(dataset: ab.Dataset) -> None:
    with ab.Loader(dataset, batch_size=16, seq_len=50, seed=1) as loader:
        epoch0, epoch1 = ids_of(loader), ids_of(loader)
        assert loader.epoch == 2
        loader.set_epoch(1)
        assert ids_of(loader) == epoch1
    assert epoch0 != epoch1
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))


def test_ranks_partition_the_epoch(dataset: ab.Dataset) -> None:
    per_rank = []
    for rank in range(3):
        with ab.Loader(dataset, batch_size=4, seq_len=50, rank=rank, world_size=3) as loader:
            per_rank.append(sum(ids_of(loader), []))
    assert len({len(ids) for ids in per_rank}) == 1  # same number of batches on every rank
    union = sum(per_rank, [])
    assert len(set(union)) == len(union)


def test_drop_last_false_keeps_the_partial_batch(dataset: ab.Dataset, tokens: Any) -> None:
    windows = tokens.size // 50
    with ab.Loader(dataset, batch_size=64, seq_len=50, shuffle=False, drop_last=False) as loader:
        batches = list(loader)
    assert [b.batch_size for b in batches] == [64] * (windows // 64) + [windows % 64]
    last = batches[-1]
    np.testing.assert_array_equal(
        last["tokens"].numpy(), expected_windows(tokens, last.global_indexes, 50)
    )


def test_output_dtype_and_structured_fields(tmp_path: Path) -> None:
    record = np.dtype([("token", "<u4"), ("doc", "<u2")])
    data = np.zeros(1000, dtype=record)
    data["token"] = np.arange(1000) * 7
    data["doc"] = np.arange(1000) // 100
    ab.write_tokens(str(tmp_path / "rec"), data, shard_size=600)
    with ab.Loader(str(tmp_path / "rec"), batch_size=3, seq_len=10, shuffle=False) as loader:
        batch = next(iter(loader))
    assert set(batch) == {"token", "doc"}
    assert batch["token"].dtype == torch.uint32
    assert batch["doc"][2].tolist() == [0] * 10
    assert batch["token"][1].tolist() == (np.arange(10, 20) * 7).tolist()
    ab.write_tokens(str(tmp_path / "u16"), np.arange(500, dtype=np.uint16))
    with ab.Loader(str(tmp_path / "u16"), batch_size=2, seq_len=10, dtype=torch.int64) as loader:
        batch = next(iter(loader))
    assert batch["tokens"].dtype == torch.int64
    assert batch.schema["tokens"].dtype == "int64"


def test_early_break_and_close_leave_nothing_behind(dataset: ab.Dataset) -> None:
    fds_before = _open_fds()
    for _ in range(3):
        with ab.Loader(dataset, batch_size=4, seq_len=16, prefetch=6) as loader:
            for step, _batch in enumerate(loader):
                if step == 3:
                    break
        loader.close()  # idempotent
    assert asyncbatch_threads() == []
    assert _open_fds() == fds_before
    with pytest.raises(LoaderClosedError):
        next(iter(loader))


def test_async_loader_closes_its_task(dataset: ab.Dataset) -> None:
    async def main() -> None:
        async with ab.AsyncLoader(dataset, batch_size=4, seq_len=16, prefetch=3) as loader:
            async for _ in loader:
                break
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())
    assert asyncbatch_threads() == []


def test_unclosed_loader_warns(dataset: ab.Dataset) -> None:
    loader = ab.Loader(dataset, batch_size=4, seq_len=16)
    next(iter(loader))
    with pytest.warns(ResourceWarning, match="unclosed"):
        del loader
        gc.collect()
    assert asyncbatch_threads() == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": -1}, "seq_len"),
        ({"prefetch": 0}, "prefetch"),
        ({"shuffle": "sideways"}, "shuffle"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"tail": "loop"}, "tail"),
        ({"dtype": "not-a-dtype"}, "dtype"),
        ({"max_inflight": 1.5}, "max_inflight"),
    ],
)
def test_bad_arguments_fail_at_construction(
    dataset: ab.Dataset, kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {"batch_size": 4, "seq_len": 16, **kwargs}
    with pytest.raises(ConfigError, match=match):
        ab.Loader(dataset, **args)
    assert asyncbatch_threads() == []


def test_foreign_state_is_refused(dataset: ab.Dataset, tmp_path: Path) -> None:
    with ab.Loader(dataset, batch_size=4, seq_len=16) as loader:
        state = loader.state_dict()
    with (
        ab.Loader(dataset, batch_size=8, seq_len=16) as other,
        pytest.raises(ResumeStateError, match="batch_size"),
    ):
        other.load_state_dict(state)
    small = ab.write_tokens(str(tmp_path / "small"), np.arange(300, dtype=np.uint16))
    with (
        ab.Loader(small, batch_size=4, seq_len=16) as other,
        pytest.raises(ResumeStateError, match="dataset"),
    ):
        other.load_state_dict(state)


def _open_fds() -> dict[str, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


@pytest.mark.parametrize("shuffle", [True, "block", False])
def test_statistics_count_what_the_server_served_over_the_loader_life(
    tokens: npt.NDArray[np.uint16], http_root: tuple[Path, Any], shuffle: bool | str
) -> None:
    """``statistics()`` counts every GET the server answered, the bytes delivered, and goes
    on counting across epochs; it can still be read after an epoch ended. Plans of at least
    one request's cost (``coalesce_gap``) fetch at most twice what they deliver."""
    root, server = http_root
    name = f"stats-{shuffle}"
    ab.write_tokens(str(root / name), tokens, shard_size=8192)
    batch_size, seq_len = 8, 256
    with ab.Loader(
        f"{server.url}/{name}",
        batch_size=batch_size,
        seq_len=seq_len,
        shuffle=shuffle,
        coalesce_gap=batch_size * seq_len * tokens.itemsize,
    ) as loader:
        empty = loader.statistics()
        assert (empty.batches, empty.requests, empty.bytes_fetched) == (0, 0, 0)
        before = server.requests
        batches = sum(1 for _ in loader)
        stats = loader.statistics()
        assert stats.batches == batches == len(loader)
        assert stats.bytes_delivered == batches * batch_size * seq_len * tokens.itemsize
        assert stats.requests == server.requests - before > 0
        assert stats.bytes_delivered <= stats.bytes_fetched <= 2 * stats.bytes_delivered
        assert sum(1 for _ in loader) == batches
        again = loader.statistics()
        assert again.batches == 2 * batches
        assert again.bytes_delivered == 2 * stats.bytes_delivered
        assert again.requests == server.requests - before


@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        ({"seq_len": 2048}, "1000 elements: 0 samples of seq_len=2048, fewer than the 4"),
        (
            {"batch_size": 64, "rank": 1, "world_size": 2},
            "100 samples of seq_len=10, fewer than the 128 .* 64 x 2 = 128",
        ),
        ({"infinite": True, "seq_len": 999}, "1 samples of seq_len=999, fewer than the 4"),
        ({"drop_last": False, "rank": 0, "world_size": 200}, "100 samples .* world_size=200"),
    ],
)
def test_a_loader_with_nothing_to_read_fails_at_construction(
    tmp_path: Path, kwargs: dict[str, Any], sizes: str
) -> None:
    url = str(tmp_path / "small")
    ab.write_tokens(url, np.arange(1000, dtype=np.uint16))
    args: dict[str, Any] = {"batch_size": 4, "seq_len": 10, **kwargs}
    match = f"nothing to read: {url} holds .*{sizes}"
    with pytest.raises(ConfigError, match=match):
        ab.Loader(url, **args)
    with pytest.raises(ConfigError, match=match):
        ab.LoaderDataset(url, **args)
    with pytest.raises(ConfigError, match=match):
        ab.AsyncLoader(ab.open_dataset(url), **args)

    async def main() -> None:
        loader = ab.AsyncLoader(url, **args)  # a URL is opened on entry
        with pytest.raises(ConfigError, match=match):
            async with loader:
                pass

    asyncio.run(main())
    assert asyncbatch_threads() == []


@pytest.mark.parametrize(
    ("stored", "refused", "accepted"),
    [
        (np.uint16, [torch.int16, torch.int8, torch.float16, torch.uint8], [torch.int32, "f4"]),
        (np.uint32, [torch.int32, torch.float32], [torch.int64, np.float64]),
    ],
)
def test_a_lossy_output_dtype_is_refused(
    tmp_path: Path, stored: Any, refused: list[Any], accepted: list[Any]
) -> None:
    # Ids above 32767 (uint16) or 2**31 (uint32): a narrower dtype would wrap or round them.
    top = np.iinfo(stored).max
    tokens = np.array([0, 1, 40_000, top] * 50, dtype=stored)
    url = str(tmp_path / "ds")
    ab.write_tokens(url, tokens)
    docs = ab.write_documents(str(tmp_path / "docs"), [tokens[:7], tokens[7:20]], dtype=stored)
    for dtype in refused:
        with pytest.raises(ConfigError, match=f"dtype={dtype!r} cannot hold every .* of {url}"):
            ab.Loader(url, batch_size=2, seq_len=8, dtype=dtype)
        with pytest.raises(ConfigError, match="cannot hold every"):
            ab.Loader(docs, batch_size=2, dtype=dtype)
    for dtype in accepted:
        with ab.Loader(url, batch_size=2, seq_len=8, shuffle=False, dtype=dtype) as loader:
            batch = next(loader)
        assert batch["tokens"][0, :4].tolist() == [0, 1, 40_000, top]
    with pytest.raises(ConfigError, match="bfloat16 has no numpy equivalent"):
        ab.Loader(url, batch_size=2, seq_len=8, dtype=torch.bfloat16)


def test_a_state_from_other_bytes_of_the_same_shape_is_refused(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    # write_tokens records shard checksums: they are the dataset's content identity.
    first = ab.write_tokens(str(tmp_path / "a"), tokens, shard_size=2222)
    other = ab.write_tokens(str(tmp_path / "b"), tokens[::-1].copy(), shard_size=2222)
    copy = ab.write_tokens(str(tmp_path / "c"), tokens, shard_size=2222)
    with ab.Loader(first, batch_size=4, seq_len=16) as loader:
        next(loader)
        state = loader.state_dict()
    with (
        ab.Loader(other, batch_size=4, seq_len=16) as resumed,
        pytest.raises(ResumeStateError, match="the state is for dataset .*xxh3_64="),
    ):
        resumed.load_state_dict(state)
    with ab.Loader(copy, batch_size=4, seq_len=16) as resumed:  # the same bytes elsewhere
        resumed.load_state_dict(state)
        assert resumed.state_dict()["batches_done"] == 1


@pytest.mark.parametrize("store", ["local", "s3"])
def test_without_checksums_a_state_from_other_bytes_is_refused(
    write_dataset: WriteDataset, tokens: npt.NDArray[np.uint16]
) -> None:
    url, options = write_dataset(tokens, shard_size=2222)
    fs, root = fsspec.core.url_to_fs(url, **options)
    manifest = ab.open_dataset(url, options).manifest
    bare = dataclasses.replace(  # as an outside writer may leave it: no checksums
        manifest,
        checksum=None,
        checksum_block=None,
        shards=tuple(
            dataclasses.replace(s, checksum=None, block_checksums=None) for s in manifest.shards
        ),
    )
    fs.pipe(f"{root}/manifest.json", bare.to_json().encode())
    with ab.Loader(url, batch_size=4, seq_len=16, storage_options=options) as loader:
        next(loader)
        state = loader.state_dict()
    with ab.Loader(url, batch_size=4, seq_len=16, storage_options=options) as same:
        same.load_state_dict(state)  # the same objects, unchanged
    shard = f"{root}/{manifest.shards[0].path}"
    fs.pipe(shard, fs.cat(shard)[::-1])  # other bytes, the same size
    with (
        ab.Loader(url, batch_size=4, seq_len=16, storage_options=options) as other,
        pytest.raises(ResumeStateError, match="other object versions"),
    ):
        other.load_state_dict(state)
