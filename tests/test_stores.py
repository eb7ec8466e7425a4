"""Every store returns exactly the bytes of the source, or a typed error naming URL and range."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import WriteDataset, expected_windows

import asyncbatch as ab
from asyncbatch.stores import open_store


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("next_token", [False, True])
def test_batches_equal_source_windows(
    write_dataset: WriteDataset, tokens: npt.NDArray[np.uint16], shuffle: bool, next_token: bool
) -> None:
    # Shards of 3001 elements: windows of 64 (+1) often cross shard ends.
    url, options = write_dataset(tokens, shard_size=3001 * 2)
    seen = []
    with ab.Loader(
        url,
        batch_size=7,
        seq_len=64,
        shuffle=shuffle,
        next_token=next_token,
        prefetch=4,
        storage_options=options,
    ) as loader:
        for batch in loader:
            got = batch["tokens"].numpy()
            assert got.dtype == np.uint16
            np.testing.assert_array_equal(
                got, expected_windows(tokens, batch.global_indexes, 64, next_token)
            )
            seen.append(batch.global_indexes)
    ids = np.concatenate(seen)
    windows = (tokens.size - int(next_token)) // 64
    assert ids.size == windows // 7 * 7
    assert np.unique(ids).size == ids.size
    if not shuffle:
        np.testing.assert_array_equal(ids, np.arange(ids.size))


@pytest.mark.parametrize("verify", ["size", "block"])
def test_dtype_is_exact_on_every_store(
    write_dataset: WriteDataset, tokens: npt.NDArray[np.uint16], verify: str
) -> None:
    # Local files convert in the store's copy; S3 and HTTP, and every store under
    # verify="block", read the stored bytes and cast them afterwards.
    url, options = write_dataset(tokens, shard_size=3000)
    dataset = ab.open_dataset(url, storage_options=options)
    for next_token in (False, True):
        with ab.Loader(
            dataset,
            batch_size=8,
            seq_len=64,
            next_token=next_token,
            dtype=torch.int64,
            verify=verify,
            prefetch=8,
        ) as loader:
            for batch in loader:
                expected = expected_windows(tokens, batch.global_indexes, 64, next_token)
                np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
                assert batch["tokens"].dtype == torch.int64


def test_concurrent_first_calls_create_one_client(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups of a run start together: their first calls on a new S3 store create one
    filesystem (one client session), never one each with all but the last lost unclosed,
    even when creating it waits (credentials fetched over the network)."""
    from conftest import BUCKET, s3_options

    from asyncbatch.stores._fsspec_store import FsspecStore

    url = f"s3://{BUCKET}/first-calls/blob"
    options = s3_options(s3_endpoint)
    created: list[object] = []
    create = FsspecStore._create

    async def counted(self: FsspecStore) -> Any:
        # Creating yields to the loop, as it does where credentials are fetched over the
        # network (an instance profile, SSO): the other calls come meanwhile.
        await asyncio.sleep(0.05)
        fs = await create(self)
        created.append(fs)
        return fs

    monkeypatch.setattr(FsspecStore, "_create", counted)

    async def main() -> list[int]:
        store = open_store(url, options)
        try:
            return await asyncio.gather(*(store.size(url) for _ in range(8)))
        finally:
            await store.close()

    async def write() -> None:
        store = open_store(url, options)
        try:
            await store.write(url, b"x" * 100)
        finally:
            await store.close()

    asyncio.run(write())
    created.clear()
    assert asyncio.run(main()) == [100] * 8
    assert len(created) == 1
