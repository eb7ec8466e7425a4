"""Documents: jagged samples and packed windows, byte-exact through every store and loader.

Every expectation is computed from the numpy documents the test wrote, never from the
library's own index math: document ``d`` is ``documents[d]``, and a packed window's document
ids come from repeating each document's number over its tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import BUCKET, s3_options
from faults import fault_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loader import run_resume_case
from test_ranks import run_elastic_case

import asyncbatch as ab
from asyncbatch._checksums import DEFAULT_CHECKSUM_BLOCK, block_digests, digest, format_digest
from asyncbatch._errors import ConfigError, ManifestError
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch._verify import verify_dataset
from asyncbatch.formats._documents_index import (
    index_path,
    per_shard_metadata,
    shard_index_bytes,
    shard_index_info,
)

_names = itertools.count()
Documents = list[npt.NDArray[np.uint16]]
#: The writers' index layouts: one index per shard (the default), one for the whole dataset.
LAYOUTS = ["per_shard", "single"]


def make_documents(seed: int, count: int) -> Documents:
    """Mostly short documents, some empty, a few longer than the test windows and shards."""
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / 30, count) - 1
    lengths[rng.choice(count, count // 20, replace=False)] = 0
    lengths[rng.choice(count, count // 50, replace=False)] = 700
    return [rng.integers(0, 60_000, n, dtype=np.uint16) for n in lengths.tolist()]


def stream_of(documents: Documents) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.int64]]:
    """The concatenated tokens, and the number of the document each token belongs to."""
    tokens = np.concatenate(documents)
    owner = np.repeat(np.arange(len(documents)), [d.size for d in documents])
    return tokens, owner


@pytest.fixture(scope="module")
def documents() -> Documents:
    return make_documents(0, 400)


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    """Each index layout in turn."""
    name: str = request.param
    return name


@pytest.fixture
def write_docs(store: str, layout: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """``write_docs(documents, **kwargs)`` writes to the current store in the current index
    layout; ``(url, options)``."""

    def write(docs: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        kwargs.setdefault("index", layout)
        name = f"docs-{next(_names)}"
        if store == "local":
            url = str(tmp_path / name)
            ab.write_documents(url, docs, **kwargs)
            return url, {}
        if store == "s3":
            options = s3_options(request.getfixturevalue("s3_endpoint"))
            url = f"s3://{BUCKET}/{name}"
            ab.write_documents(url, docs, storage_options=options, **kwargs)
            return url, options
        root, server = request.getfixturevalue("http_root")
        ab.write_documents(str(root / name), docs, **kwargs)
        return f"{server.url}/{name}", {}

    return write


@pytest.fixture(scope="module", params=LAYOUTS)
def local_docs(
    tmp_path_factory: pytest.TempPathFactory, documents: Documents, request: pytest.FixtureRequest
) -> ab.Dataset:
    return ab.write_documents(
        str(tmp_path_factory.mktemp("docs") / "ds"), documents, shard_size=999, index=request.param
    )


def check_jagged(batch: ab.Batch, documents: Documents, max_len: int | None = None) -> None:
    column = batch["tokens"]
    assert isinstance(column, ab.Jagged)
    wanted = [documents[i][:max_len] for i in batch.global_indexes.tolist()]
    assert column.lengths.tolist() == [d.size for d in wanted]
    assert column.offsets[0] == 0 and column.values.numel() == column.offsets[-1]
    np.testing.assert_array_equal(column.values.numpy(), np.concatenate(wanted))


def reference_window(
    tokens: npt.NDArray[Any], owner: npt.NDArray[np.int64], start: int, seq_len: int, width: int
) -> dict[str, Any]:
    """What a packed window must hold, one token at a time."""
    ids = owner[start : start + width]
    cu, positions, position = [0], [], 0
    for t in range(width):
        if t and ids[t] != ids[t - 1]:
            position = 0
            if t < seq_len:
                cu.append(t)
        positions.append(position)
        position += 1
    return {
        "tokens": tokens[start : start + width],
        "document_ids": ids,
        "position_ids": np.array(positions),
        "cu_seqlens": np.array([*cu, seq_len]),
    }


def check_packed(
    batch: ab.Batch,
    tokens: npt.NDArray[Any],
    owner: npt.NDArray[np.int64],
    seq_len: int,
    next_token: bool = False,
    starts: npt.NDArray[np.int64] | None = None,
) -> None:
    width = seq_len + int(next_token)
    if starts is None:
        starts = batch.global_indexes * seq_len
    assert batch["tokens"].shape == batch["document_ids"].shape == (batch.batch_size, width)
    assert batch["cu_seqlens"].values.dtype == torch.int32
    for row, start in enumerate(starts.tolist()):
        want = reference_window(tokens, owner, start, seq_len, width)
        np.testing.assert_array_equal(batch["tokens"][row].numpy(), want["tokens"])
        np.testing.assert_array_equal(batch["document_ids"][row].numpy(), want["document_ids"])
        np.testing.assert_array_equal(batch["position_ids"][row].numpy(), want["position_ids"])
        np.testing.assert_array_equal(batch["cu_seqlens"][row].numpy(), want["cu_seqlens"])


# ---------------------------------------------------------------------------------------------
# Through every store


@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_documents_read_back_exactly(write_docs: Any, documents: Documents, shuffle: Any) -> None:
    # Shards of 500 tokens: documents of 700 cross one or two shard ends.
    url, options = write_docs(documents, shard_size=1000)
    seen = []
    extra = {"block_size": 8, "window": 3} if shuffle == "block" else {}
    with ab.Loader(
        url, batch_size=16, shuffle=shuffle, drop_last=False, storage_options=options, **extra
    ) as loader:
        assert loader.dataset is not None
        assert loader.dataset.manifest.format == "documents"
        for batch in loader:
            check_jagged(batch, documents)
            seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(len(documents)))
    if not shuffle:
        assert seen == list(range(len(documents)))


@pytest.mark.parametrize("next_token", [False, True])
def test_packing_is_token_windows_plus_boundaries(
    write_docs: Any, documents: Documents, next_token: bool
) -> None:
    url, options = write_docs(documents, shard_size=1000)
    tokens, owner = stream_of(documents)
    seq_len = 64
    seen = []
    with ab.Loader(
        url, batch_size=8, seq_len=seq_len, next_token=next_token, storage_options=options
    ) as loader:
        for batch in loader:
            check_packed(batch, tokens, owner, seq_len, next_token)
            seen += batch.global_indexes.tolist()
    # The tail rule of the tokens format: only what does not fill a last window is left out.
    windows = (tokens.size - int(next_token)) // seq_len
    assert len(seen) == len(set(seen)) == windows // 8 * 8


def test_open_reads_the_manifest_and_the_index_only(
    documents: Documents, request: pytest.FixtureRequest
) -> None:
    root, server = request.getfixturevalue("http_root")
    ab.write_documents(str(root / "open-count"), documents, shard_size=1000, index="single")
    before = server.requests
    dataset = ab.open_dataset(f"{server.url}/open-count")
    assert server.requests - before == 2  # one GET each: manifest.json, documents.idx
    offsets = dataset.arrays["document_offsets"]
    assert offsets.dtype == np.int64 and offsets.size == len(documents) + 1
    assert offsets[-1] == dataset.manifest.total_elements == sum(d.size for d in documents)
    # Per-shard indexes: the manifest alone.
    ab.write_documents(str(root / "open-count-2"), documents, shard_size=1000)
    before = server.requests
    dataset = ab.open_dataset(f"{server.url}/open-count-2")
    assert server.requests - before == 1
    counts = dataset.arrays["shard_documents"]
    assert counts.sum() == len(documents) and counts.size == len(dataset.manifest.shards)


def test_block_shuffle_reads_blocks_of_documents_in_few_requests(
    documents: Documents, request: pytest.FixtureRequest
) -> None:
    """Counted at the HTTP server: neighbouring documents merge into one read."""
    root, server = request.getfixturevalue("http_root")
    ab.write_documents(str(root / "blocks"), documents, shard_size=2**20, index="single")
    counts = {}
    for name, args in {
        "global": {"shuffle": True, "prefetch": 2},
        "block": {"shuffle": "block", "block_size": 32, "window": 2},
    }.items():
        with server.lock:
            server.requests = 0
        with ab.Loader(f"{server.url}/blocks", batch_size=16, coalesce_gap=0, **args) as loader:
            batches = sum(1 for _ in loader)
        counts[name] = (server.requests - 2) / batches  # less the manifest and the index
    # Global: about one request per non-empty document; block: a few per window of 64.
    assert counts["global"] > 12, counts
    assert counts["block"] < 2, counts


# ---------------------------------------------------------------------------------------------
# Output forms


def test_nested_output(local_docs: ab.Dataset, documents: Documents) -> None:
    with ab.Loader(local_docs, batch_size=8, format_options={"output": "nested"}) as loader:
        batch = next(iter(loader))
    nested = batch["tokens"]
    assert nested.is_nested and nested.layout == torch.jagged
    for got, i in zip(nested.unbind(), batch.global_indexes.tolist(), strict=True):
        np.testing.assert_array_equal(got.numpy(), documents[i])


def test_padded_output_with_lengths_and_mask(local_docs: ab.Dataset, documents: Documents) -> None:
    options = {"output": "padded", "pad_id": 7}
    with ab.Loader(local_docs, batch_size=8, dtype=torch.int64, format_options=options) as loader:
        for batch in itertools.islice(loader, 5):
            docs = [documents[i] for i in batch.global_indexes.tolist()]
            width = max(d.size for d in docs)  # the batch's longest document
            padded, mask = batch["tokens"], batch["attention_mask"]
            assert padded.dtype == torch.int64 and padded.shape == (8, width)
            assert batch["lengths"].tolist() == [d.size for d in docs]
            for row, doc in enumerate(docs):
                np.testing.assert_array_equal(padded[row, : doc.size].numpy(), doc)
                assert (padded[row, doc.size :] == 7).all()
                assert mask[row].tolist() == [True] * doc.size + [False] * (width - doc.size)


def test_max_len_cuts_documents_and_fixes_the_padded_width(
    local_docs: ab.Dataset, documents: Documents
) -> None:
    with ab.Loader(local_docs, batch_size=10, format_options={"max_len": 50}) as loader:
        for batch in loader:
            check_jagged(batch, documents, max_len=50)
    options = {"output": "padded", "max_len": 50}
    with ab.Loader(local_docs, batch_size=10, format_options=options) as loader:
        for batch in loader:
            assert batch["tokens"].shape == batch["attention_mask"].shape == (10, 50)
            assert batch["tokens"].dtype == torch.uint16
            for row, i in enumerate(batch.global_indexes.tolist()):
                n = min(50, documents[i].size)
                np.testing.assert_array_equal(batch["tokens"][row, :n].numpy(), documents[i][:n])
            assert batch.schema["tokens"].shape == (50,)


def test_dtype_conversion_and_structured_documents(tmp_path: Path) -> None:
    kind = np.dtype([("token", "<u4"), ("loss", "<u1")])
    rng = np.random.default_rng(3)
    docs = []
    for n in rng.integers(0, 20, 50).tolist():
        doc = np.zeros(n, dtype=kind)
        doc["token"] = rng.integers(0, 2**32 - 1, n)
        doc["loss"] = rng.integers(0, 2, n)
        docs.append(doc)
    dataset = ab.write_documents(str(tmp_path / "structured"), docs, shard_size=64)
    with ab.Loader(dataset, batch_size=5, shuffle=False) as loader:
        for batch in loader:
            for name in ("token", "loss"):
                want = np.concatenate([docs[i][name] for i in batch.global_indexes.tolist()])
                np.testing.assert_array_equal(batch[name].values.numpy(), want)
    plain = ab.write_documents(str(tmp_path / "plain"), [[1, 2, 3], [40_000]], dtype=np.uint16)
    with ab.Loader(plain, batch_size=2, dtype=torch.int32, shuffle=False) as loader:
        column = next(iter(loader))["tokens"]
    assert column.values.dtype == torch.int32 and column.values.tolist() == [1, 2, 3, 40_000]


def test_packing_without_token_ids_keeps_cu_seqlens(
    local_docs: ab.Dataset, documents: Documents
) -> None:
    tokens, owner = stream_of(documents)
    args: dict[str, Any] = dict(batch_size=8, seq_len=96, seed=5)
    with ab.Loader(local_docs, format_options={"token_ids": False}, **args) as loader:
        lean = list(itertools.islice(loader, 6))
    with ab.Loader(local_docs, **args) as loader:
        full = list(itertools.islice(loader, 6))
    for small, big in zip(lean, full, strict=True):
        assert set(small) == {"tokens", "cu_seqlens"}
        assert small.global_indexes.tolist() == big.global_indexes.tolist()
        assert torch.equal(small["cu_seqlens"].values, big["cu_seqlens"].values)
        check_packed(big, tokens, owner, 96)


# ---------------------------------------------------------------------------------------------
# The packing property


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 25), min_size=1, max_size=30),
    seq_len=st.integers(1, 20),
    next_token=st.booleans(),
    shard_tokens=st.integers(1, 50),
    index=st.sampled_from(LAYOUTS),
)
def test_packing_never_crosses_a_document_without_a_boundary(
    lengths: list[int], seq_len: int, next_token: bool, shard_tokens: int, index: str
) -> None:
    documents = [np.arange(n, dtype=np.uint16) + 100 * d for d, n in enumerate(lengths)]
    tokens, owner = stream_of(documents)
    if tokens.size - int(next_token) < seq_len:
        return  # no window at all
    with tempfile.TemporaryDirectory() as root:
        dataset = ab.write_documents(
            f"{root}/ds", documents, dtype=np.uint16, shard_size=2 * shard_tokens, index=index
        )
        args = dict(seq_len=seq_len, next_token=next_token, shuffle=False, drop_last=False)
        with ab.Loader(dataset, batch_size=3, **args) as loader:
            count = 0
            for batch in loader:
                check_packed(batch, tokens, owner, seq_len, next_token)
                count += batch.batch_size
    assert count == (tokens.size - int(next_token)) // seq_len


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=40),
    shard_tokens=st.integers(1, 60),
    batch_size=st.integers(1, 7),
    shuffle=st.sampled_from([False, True, "block"]),
    max_len=st.none() | st.integers(1, 30),
    index=st.sampled_from(LAYOUTS),
)
def test_document_samples_are_the_documents(
    lengths: list[int],
    shard_tokens: int,
    batch_size: int,
    shuffle: Any,
    max_len: int | None,
    index: str,
) -> None:
    documents = [np.arange(n, dtype=np.uint16) + 100 * d for d, n in enumerate(lengths)]
    extra = {"block_size": 3, "window": 2} if shuffle == "block" else {}
    options = {} if max_len is None else {"max_len": max_len}
    with tempfile.TemporaryDirectory() as root:
        dataset = ab.write_documents(
            f"{root}/ds", documents, dtype=np.uint16, shard_size=2 * shard_tokens, index=index
        )
        seen = []
        with ab.Loader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=False,
            format_options=options,
            **extra,
        ) as loader:
            for batch in loader:
                check_jagged(batch, documents, max_len)
                seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(len(documents)))


# ---------------------------------------------------------------------------------------------
# Loaders, shuffles, ranks, resume, workers, mixtures


def take_ids(loader: Any, limit: int | None = None) -> list[int]:
    return [i for b in itertools.islice(loader, limit) for i in b.global_indexes.tolist()]


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_async_loader_delivers_the_same_documents(local_docs: ab.Dataset, shuffle: Any) -> None:
    kwargs: dict[str, Any] = dict(batch_size=8, shuffle=shuffle, seed=4, prefetch=3)
    with ab.Loader(local_docs, **kwargs) as loader:
        sync = [(b.global_indexes.tolist(), b["tokens"].values.clone()) for b in loader]

    async def collect() -> list[tuple[list[int], torch.Tensor]]:
        async with ab.AsyncLoader(local_docs.url, **kwargs) as loader:
            return [(b.global_indexes.tolist(), b["tokens"].values.clone()) async for b in loader]

    got = asyncio.run(collect())
    assert len(sync) == len(got) == 400 // 8
    for (ids_a, values_a), (ids_b, values_b) in zip(sync, got, strict=True):
        assert ids_a == ids_b and torch.equal(values_a, values_b)


@pytest.mark.parametrize("shuffle", [False, True, "block"])
@pytest.mark.parametrize(("stop", "prefetch", "world_size"), [(0, 2, 1), (3, 1, 2), (9, 8, 2)])
def test_documents_resume_exactly(
    local_docs: ab.Dataset,
    documents: Documents,
    shuffle: Any,
    stop: int,
    prefetch: int,
    world_size: int,
) -> None:
    extra = {"block_size": 6, "window": 3} if shuffle == "block" else {}
    every = []
    for rank in range(world_size):
        kwargs: dict[str, Any] = dict(
            batch_size=5, shuffle=shuffle, seed=8, prefetch=prefetch, rank=rank,
            world_size=world_size, **extra,
        )  # fmt: skip
        with ab.Loader(local_docs, **kwargs) as loader:
            full = take_ids(loader)
        with ab.Loader(local_docs, **kwargs) as loader:
            first = take_ids(loader, stop)
            state = loader.state_dict()
        with ab.Loader(local_docs, **kwargs) as loader:
            loader.load_state_dict(state)
            rest = []
            for batch in loader:
                check_jagged(batch, documents)
                rest += batch.global_indexes.tolist()
        assert first + rest == full
        every += full
    assert len(every) == len(set(every)) == 400 // (5 * world_size) * 5 * world_size


@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_packed_windows_resume_exactly(local_docs: ab.Dataset, shuffle: Any) -> None:
    # The tokens format's own resume cases (seq_len 40), run on packed documents.
    run_resume_case(local_docs, 7, 4, shuffle, 2)
    run_elastic_case(local_docs, 5, shuffle, 2, 3, 4)


@pytest.mark.parametrize("kind", ["jagged", "padded", "packed"])
def test_dataloader_workers_deliver_the_loaders_batches(
    local_docs: ab.Dataset, documents: Documents, kind: str
) -> None:
    args: dict[str, Any] = dict(batch_size=6, shuffle="block", block_size=10, seed=1)
    if kind == "packed":
        args["seq_len"] = 48
    if kind == "padded":
        args["format_options"] = {"output": "padded", "max_len": 64}
    with ab.Loader(local_docs, **args) as loader:
        expected = [b.global_indexes.tolist() for b in loader]
    source = ab.LoaderDataset(local_docs, **args)
    tokens, owner = stream_of(documents)
    got = []
    for batch in source.dataloader(num_workers=2):  # batches pickled across processes
        if kind == "packed":
            check_packed(batch, tokens, owner, 48)
        elif kind == "padded":
            rows = [documents[i][:64] for i in batch.global_indexes.tolist()]
            mask = batch["attention_mask"]
            assert batch["tokens"].shape == mask.shape == (6, 64)
            np.testing.assert_array_equal(batch["tokens"][mask].numpy(), np.concatenate(rows))
        else:
            check_jagged(batch, documents)
        got.append(batch.global_indexes.tolist())
    assert got == expected


@pytest.mark.parametrize(
    "layouts", [("per_shard", "per_shard"), ("single", "per_shard"), ("per_shard", "single")]
)
def test_mixture_of_document_datasets_local_and_s3(
    tmp_path: Path, s3_endpoint: str, documents: Documents, layouts: tuple[str, str]
) -> None:
    small = make_documents(9, 60)
    options = s3_options(s3_endpoint)
    local = ab.write_documents(str(tmp_path / "big"), documents, shard_size=999, index=layouts[0])
    remote = f"s3://{BUCKET}/mixture-docs-{next(_names)}"
    ab.write_documents(remote, small, shard_size=2000, storage_options=options, index=layouts[1])
    mixture = ab.mix([local, remote], weights=[1, 1], seed=2, storage_options=options)
    parts = [documents, small]
    sizes = np.array([len(documents), len(small)])
    ends = np.cumsum(sizes)
    counts = [0, 0]
    with ab.Loader(mixture, batch_size=8, shuffle=True, format_options={"max_len": 300}) as loader:
        for batch in loader:
            which = np.searchsorted(ends, batch.global_indexes, side="right")
            local_ids = batch.global_indexes - (ends - sizes)[which]
            wanted = [
                parts[w][i][:300] for w, i in zip(which.tolist(), local_ids.tolist(), strict=True)
            ]
            assert batch["tokens"].lengths.tolist() == [d.size for d in wanted]
            np.testing.assert_array_equal(batch["tokens"].values.numpy(), np.concatenate(wanted))
            for w in which.tolist():
                counts[w] += 1
    assert abs(counts[0] - counts[1]) <= 8  # equal weights
    # Packing over the mixture: windows never cross datasets; document ids run through both.
    tokens = [stream_of(p)[0] for p in parts]
    with ab.Loader(mixture, batch_size=4, seq_len=32, shuffle=True) as loader:
        for batch in itertools.islice(loader, 20):
            windows = np.array([(t.size // 32) for t in tokens])
            window_ends = np.cumsum(windows)
            which = np.searchsorted(window_ends, batch.global_indexes, side="right")
            local_ids = batch.global_indexes - (window_ends - windows)[which]
            for row, (w, i) in enumerate(zip(which.tolist(), local_ids.tolist(), strict=True)):
                stream, owner = stream_of(parts[w])
                want = reference_window(stream, owner + w * len(documents), i * 32, 32, 32)
                np.testing.assert_array_equal(batch["tokens"][row].numpy(), want["tokens"])
                np.testing.assert_array_equal(
                    batch["document_ids"][row].numpy(), want["document_ids"]
                )
                np.testing.assert_array_equal(batch["cu_seqlens"][row].numpy(), want["cu_seqlens"])


# ---------------------------------------------------------------------------------------------
# A dataset built in memory from the contract alone (as the Megatron opener builds one)


def test_in_memory_dataset_with_headers_reads_by_the_contract(
    tmp_path: Path, documents: Documents
) -> None:
    tokens, owner = stream_of(documents)
    half = tokens.size // 2
    shards = []
    for k, part in enumerate([tokens[:half], tokens[half:]]):
        header = bytes(range(16 + k))  # a header before the tokens, of another size per shard
        (tmp_path / f"part{k}.bin").write_bytes(header + part.tobytes())
        shards.append(ShardInfo(f"part{k}.bin", part.nbytes, part.size, len(header)))
    offsets = np.cumsum([0] + [d.size for d in documents])
    dataset = ab.Dataset(
        str(tmp_path),
        Manifest("documents", np.dtype(np.uint16), tuple(shards)),
        arrays={"document_offsets": offsets},
    )
    with ab.Loader(dataset, batch_size=9, drop_last=False) as loader:
        assert sorted(take_ids(loader)) == list(range(len(documents)))
    with ab.Loader(dataset, batch_size=9) as loader:
        for batch in loader:
            check_jagged(batch, documents)
    with ab.Loader(dataset, batch_size=9, seq_len=50) as loader:
        for batch in loader:
            check_packed(batch, tokens, owner, 50)
    bare = ab.Dataset(str(tmp_path), dataset.manifest)
    with pytest.raises(ManifestError, match=f"{tmp_path}.*document_offsets"):
        ab.Loader(bare, batch_size=2)


# ---------------------------------------------------------------------------------------------
# Errors


def test_index_that_disagrees_with_the_shards_is_refused(tmp_path: Path) -> None:
    dataset = ab.write_documents(
        str(tmp_path / "ds"), [[1, 2, 3], [4, 5], [6]], dtype=np.uint16, index="single"
    )
    index = tmp_path / "ds" / "documents.idx"
    url = str(index)
    cases = {
        "decrease": np.array([0, 3, 2, 6]),
        "end at element 5": np.array([0, 3, 5, 5]),
        "first document offset is 1": np.array([1, 3, 5, 6]),
        "3 documents": np.array([0, 6]),
    }
    for message, offsets in cases.items():
        index.write_bytes(offsets.astype("<i8").tobytes())
        with pytest.raises(ManifestError, match=message) as caught:
            ab.open_dataset(dataset.url)
        assert url in str(caught.value)
    index.write_bytes(b"\0" * 13)
    with pytest.raises(ManifestError, match="13 bytes"):
        ab.open_dataset(dataset.url)
    index.unlink()
    with pytest.raises(ManifestError, match=f"{url}.*missing"):
        ab.open_dataset(dataset.url)


def test_bad_format_options_and_arguments(local_docs: ab.Dataset) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"format_options": {"outptu": "padded"}}, "unknown format_options"),
        ({"format_options": {"output": "dense"}}, "output='dense'"),
        ({"format_options": {"max_len": 0}}, "max_len"),
        ({"format_options": {"pad_id": 1}}, "pad_id applies"),
        ({"format_options": {"output": "padded", "pad_id": -1}}, "pad_id=-1"),
        ({"format_options": {"output": "padded", "pad_id": "0"}}, "pad_id must be a number"),
        ({"format_options": {"max_len": 9}, "seq_len": 8}, "packed"),
        ({"next_token": True}, "next_token"),
        ({"format_options": {"token_ids": False}}, "token_ids applies to packing"),
        ({"format_options": {"token_ids": "no"}, "seq_len": 8}, "token_ids must be"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            ab.Loader(local_docs, batch_size=2, **kwargs)
    tokens = ab.write_tokens(f"{local_docs.url}-tokens", np.arange(9, dtype=np.uint16))
    with pytest.raises(ConfigError, match="seq_len"):
        ab.Loader(tokens, batch_size=2)  # a token stream without seq_len


def test_writer_refuses_bad_documents(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="document 1 has shape"):
        ab.write_documents(str(tmp_path / "a"), [np.arange(3), np.zeros((2, 2))])
    with pytest.raises(ConfigError, match="do not fit"):
        ab.write_documents(str(tmp_path / "b"), [[1, 70_000]], dtype=np.uint16)
    with pytest.raises(ConfigError, match="1-D arrays"):
        ab.write_documents(str(tmp_path / "c"), np.arange(10))
    with pytest.raises(ConfigError, match="dtype="):
        ab.write_documents(str(tmp_path / "d"), [])
    empty = ab.write_documents(str(tmp_path / "e"), [], dtype=np.uint16, index="single")
    assert ab.open_dataset(empty.url).arrays["document_offsets"].tolist() == [0]
    empty = ab.write_documents(str(tmp_path / "e2"), [], dtype=np.uint16)
    opened = ab.open_dataset(empty.url)
    assert opened.arrays["shard_documents"].tolist() == [] and not opened.manifest.shards
    with pytest.raises(ConfigError, match="index='both'"):
        ab.write_documents(str(tmp_path / "e3"), [[1]], index="both")

    def failing() -> Any:
        yield from ([7] * 50 for _ in range(10))
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        ab.write_documents(str(tmp_path / "f"), failing(), dtype=np.uint16, shard_size=64)
    written = {p.name for p in (tmp_path / "f").iterdir()}
    assert any(n.startswith("shard-") for n in written)  # shards went out, not the rest
    assert not written & {"manifest.json", "documents.idx"}


@pytest.mark.parametrize("index", LAYOUTS)
def test_empty_documents_anywhere(tmp_path: Path, index: str) -> None:
    """Empty documents, also after the last token (past the last shard) or only empty ones."""
    for name, docs in {"trailing": [[], [1, 2], [3], [], []], "only": [[], []]}.items():
        dataset = ab.write_documents(
            str(tmp_path / name), docs, dtype=np.uint16, shard_size=2, index=index
        )
        with ab.Loader(dataset, batch_size=len(docs), shuffle=False) as loader:
            column = next(iter(loader))["tokens"]
        assert column.lengths.tolist() == [len(d) for d in docs]
        assert column.values.tolist() == [t for d in docs for t in d]


@pytest.mark.parametrize("index", LAYOUTS)
@pytest.mark.parametrize("verify", ["block", "full"])
def test_checksums_cover_document_shards(tmp_path: Path, verify: str, index: str) -> None:
    documents = make_documents(4, 80)
    dataset = ab.write_documents(
        str(tmp_path / "ds"), documents, shard_size=1000, checksum_block=256, index=index
    )
    assert all(s.checksum is not None and s.block_checksums for s in dataset.manifest.shards)
    opened = ab.open_dataset(dataset.url)
    assert opened.manifest.shards == dataset.manifest.shards  # recorded in manifest.json
    with ab.Loader(opened, batch_size=8, shuffle=False, verify=verify) as loader:
        for batch in loader:
            check_jagged(batch, documents)
    shard = tmp_path / "ds" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[300] ^= 0xFF
    shard.write_bytes(bytes(data))
    with (
        ab.Loader(opened, batch_size=8, shuffle=False, verify=verify) as loader,
        pytest.raises(ab.ChecksumError, match="shard-00001.bin"),
    ):
        for _ in loader:
            pass


# ---------------------------------------------------------------------------------------------
# The per-shard layout: what the writer writes, what a reader fetches, and when it refuses


def test_per_shard_writer_cuts_shards_at_document_ends(tmp_path: Path) -> None:
    # Whole indexes (the earlier per-shard files; paged ones: test_documents_paged.py).
    docs = [[1, 2], [3], [], [4, 5, 6, 7, 8, 9, 10, 11], [], [12], [13, 14]]
    dataset = ab.write_documents(
        str(tmp_path / "ds"), docs, dtype=np.uint16, shard_size=6, page_documents=None
    )
    root = tmp_path / "ds"
    # Shards close after the document reaching 6 bytes (3 tokens); the empty document after
    # one joins it; the document of 8 tokens makes one larger shard.
    metadata = dataset.manifest.metadata
    assert metadata["document_index"] == "per_shard" and metadata["documents"] == len(docs)
    assert metadata["shard_documents"] == [3, 2, 2]
    assert [s.elements for s in dataset.manifest.shards] == [3, 8, 3]
    paths = [e["path"] for e in metadata["shard_indexes"]]
    assert paths == ["shard-00000.idx", "shard-00001.idx", "shard-00002.idx"]
    wanted = [[0, 2, 3, 3], [0, 8, 8], [0, 1, 3]]
    for path, entry, local in zip(paths, metadata["shard_indexes"], wanted, strict=True):
        raw = (root / path).read_bytes()
        assert np.frombuffer(raw, "<i8").tolist() == local
        assert entry["bytes"] == len(raw) and entry["checksum"] == format_digest(digest(raw))
    # The helpers a writer of its own (prepare) uses give the same entries.
    infos = [
        shard_index_info(p, shard_index_bytes(o, page_documents=None))
        for p, o in zip(paths, wanted, strict=True)
    ]
    assert per_shard_metadata([3, 2, 2], infos) == metadata
    with ab.Loader(dataset, batch_size=len(docs), shuffle=False) as loader:
        column = next(iter(loader))["tokens"]
    assert column.lengths.tolist() == [len(d) for d in docs]
    assert column.values.tolist() == [t for d in docs for t in d]


def test_a_rank_fetches_only_the_indexes_of_its_shards_once(
    tmp_path: Path, documents: Documents
) -> None:
    """Counted at the server: opening reads the manifest alone; each index file is fetched
    once at most, and only when a batch touches its shard (whole indexes; paged ones:
    test_documents_paged.py)."""
    dataset = ab.write_documents(
        str(tmp_path / "ds"), documents, shard_size=2000, page_documents=None
    )
    shards = len(dataset.manifest.shards)
    counts = np.array(dataset.manifest.metadata["shard_documents"])
    assert shards > 8
    with fault_server(tmp_path) as server:
        url = f"{server.url}/ds"
        opened = ab.open_dataset(url)
        # manifest.json: its size, then its bytes
        assert (server.count("GET"), server.count("HEAD")) == (1, 1)
        assert server.sent("GET") == server.sent("GET", "manifest.json") < 2**16
        for args in (
            {"shuffle": False},
            {"shuffle": True},
            {"shuffle": "block", "block_size": 16, "window": 2},
            {"seq_len": 64, "shuffle": True},
            {"seq_len": 64, "shuffle": False, "rank": 1, "world_size": 3},
        ):
            server.reset()
            with ab.Loader(opened, batch_size=8, seed=3, **args) as loader:
                for batch in loader:
                    if "seq_len" not in args:
                        check_jagged(batch, documents)
            fetched = {
                path.rsplit("/", 1)[1]: n
                for (method, path), n in server.requests.items()
                if method == "GET" and path.endswith(".idx")
            }
            assert set(fetched.values()) <= {1}, (args, fetched)
            assert len(fetched) <= shards
        # The first batch of documents 0..7 fetches the index of their shards only.
        server.reset()
        with ab.Loader(opened, batch_size=8, shuffle=False, prefetch=1) as loader:
            next(iter(loader))
            first = int(np.searchsorted(np.cumsum(counts), 7, side="right"))
            index_gets = [
                p for (m, p), _ in server.requests.items() if m == "GET" and p.endswith(".idx")
            ]
        assert 1 <= len(index_gets) <= first + 3  # prefetch reads a little ahead
        assert "shard-00000.idx" in index_gets[0]


@pytest.mark.parametrize("kind", ["samples", "packed"])
def test_a_small_index_cache_still_reads_exactly(
    tmp_path: Path, documents: Documents, kind: str
) -> None:
    dataset = ab.write_documents(str(tmp_path / "ds"), documents, shard_size=1500)
    tokens, owner = stream_of(documents)
    args: dict[str, Any] = {"batch_size": 8, "shuffle": True, "seed": 2}
    args["format_options"] = {"index_cache_bytes": 0}  # every index fetched again when needed
    if kind == "packed":
        args["seq_len"] = 40
    with ab.Loader(dataset, **args) as loader:
        for batch in loader:
            if kind == "packed":
                check_packed(batch, tokens, owner, 40)
            else:
                check_jagged(batch, documents)
    with pytest.raises(ConfigError, match="index_cache_bytes"):
        ab.Loader(dataset, batch_size=2, format_options={"index_cache_bytes": -1})


def _rewrite_manifest(root: Path, change: Any) -> None:
    path = root / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw["metadata"])
    path.write_text(json.dumps(raw))


def test_per_shard_index_that_disagrees_is_refused(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    root = tmp_path / "ds"
    ab.write_documents(str(root), docs, dtype=np.uint16, shard_size=6, page_documents=None)
    saved = (root / "manifest.json").read_text()
    index = root / "shard-00001.idx"  # documents [4, 5] and [6]
    url = str(index)

    def first_batch(**kwargs: Any) -> None:
        with ab.Loader(str(root), batch_size=4, shuffle=False, **kwargs) as loader:
            next(iter(loader))

    # In the manifest: counts, sizes (at open, naming the index and its bytes).
    for change, message in [
        (lambda m: m.update(documents=5), "do not add up to the 5 documents"),
        (lambda m: m["shard_indexes"][1].update(bytes=16), rf"{url} \(bytes \[0, 16\)\)"),
        (lambda m: m.update(shard_documents=[2]), "1 shard_documents"),
        (lambda m: m.pop("shard_indexes"), "no valid per-shard document index"),
    ]:
        (root / "manifest.json").write_text(saved)
        _rewrite_manifest(root, change)
        with pytest.raises(ManifestError, match=message):
            ab.open_dataset(str(root))
    (root / "manifest.json").write_text(saved)
    good = index.read_bytes()
    # In the file, as the first batch fetches it: its checksum, then (none recorded) its
    # offsets, each error naming the file and the bytes at fault.
    index.write_bytes(np.array([0, 3, 2], "<i8").tobytes())
    with pytest.raises(ab.FormatError, match=f"{url}: bytes \\[0, 24\\): checksum"):
        first_batch()
    _rewrite_manifest(root, lambda m: [e.pop("checksum") for e in m["shard_indexes"]])
    # Read by range (the indexes do not fit the cache): each document's two offsets.
    index.write_bytes(np.array([0, 3, 2], "<i8").tobytes())
    with pytest.raises(ab.FormatError, match=rf"{url}: bytes \[8, 24\): document 1's offsets 3, 2"):
        first_batch(format_options={"index_cache_bytes": 0})
    for offsets, message in [
        ([0, 3, 2], r"bytes \[8, 24\): document offsets decrease"),
        ([0, 2, 2], r"bytes \[16, 24\): the last document offset is 2, but the shard holds 3"),
        ([1, 2, 3], r"bytes \[0, 8\): the first document offset is 1"),
    ]:
        index.write_bytes(np.array(offsets, "<i8").tobytes())
        with pytest.raises(ab.FormatError, match=f"{url}: {message}"):
            first_batch()
    index.write_bytes(good + b"\0" * 8)  # longer than its entry: the size check names it
    with pytest.raises(ManifestError, match=f"size mismatch: {url} has 32 bytes"):
        first_batch()
    index.unlink()
    with pytest.raises(ab.FormatError, match=f"{url}: a document index the manifest names"):
        first_batch()
    with pytest.raises(ab.FormatError, match="missing"):
        first_batch(verify="off")


def test_verify_checks_the_index_files(tmp_path: Path) -> None:
    documents = make_documents(5, 60)
    root = tmp_path / "ds"
    dataset = ab.write_documents(str(root), documents, shard_size=1000)
    report = verify_dataset(dataset.url)
    shards = len(dataset.manifest.shards)
    assert report.clean and report.shards == 2 * shards
    index = root / "shard-00001.idx"
    data = bytearray(index.read_bytes())
    data[9] ^= 0xFF
    index.write_bytes(bytes(data))
    report = verify_dataset(dataset.url)
    assert [bad.url for bad in report.bad] == [str(index)]
    # A loader with verify="full" reads each index whole before its first use, too.
    with (
        ab.Loader(dataset.url, batch_size=8, shuffle=False, verify="full") as loader,
        pytest.raises(ab.ChecksumError, match="shard-00001.idx"),
    ):
        for _ in loader:
            pass


def write_many_documents(root: Path, count: int, per_shard: int) -> npt.NDArray[np.int64]:
    """A per-shard documents dataset of ``count`` short documents (0 to 5 tokens, each token
    its document's number modulo 60,000), written with numpy and the writers' helpers as
    ``prepare`` wrote one before paged indexes (whole ones): fast for millions of documents.
    The documents' lengths."""
    lengths = np.random.default_rng(1).integers(0, 6, count)
    tokens = np.repeat(np.arange(count) % 60_000, lengths).astype(np.uint16)
    ends = np.cumsum(lengths)
    root.mkdir(parents=True)
    shards, infos, counts = [], [], []
    for k, first in enumerate(range(0, count, per_shard)):
        last = min(count, first + per_shard)
        start = int(ends[first - 1]) if first else 0
        data = tokens[start : int(ends[last - 1])].tobytes()
        name = f"shard-{k:05d}.bin"
        (root / name).write_bytes(data)
        blocks = block_digests(data, DEFAULT_CHECKSUM_BLOCK)
        shards.append(ShardInfo(name, len(data), len(data) // 2, 0, digest(data), blocks))
        local = np.concatenate([[0], ends[first:last] - start])
        raw = shard_index_bytes(local, page_documents=None)
        (root / index_path(name)).write_bytes(raw)
        infos.append(shard_index_info(index_path(name), raw))
        counts.append(last - first)
    manifest = Manifest(
        "documents",
        np.dtype(np.uint16),
        tuple(shards),
        per_shard_metadata(counts, infos),
        checksum="xxh3_64",
        checksum_block=DEFAULT_CHECKSUM_BLOCK,
    )
    (root / "manifest.json").write_text(manifest.to_json())
    return lengths


def test_millions_of_documents_open_from_the_manifest_over_s3(
    tmp_path: Path, s3_endpoint: str
) -> None:
    """5×10^6 documents in 50 shards over moto's S3: counted at the server (a proxy in front
    of it), opening reads the manifest alone; the first batch adds the index of one shard
    and its documents' bytes."""
    import s3fs

    count, per_shard = 5_000_000, 100_000
    lengths = write_many_documents(tmp_path / "many", count, per_shard)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    fs.put(str(tmp_path / "many"), f"{BUCKET}/many", recursive=True)
    index_bytes = 8 * (per_shard + 1)
    with fault_server(upstream=s3_endpoint) as proxy:
        options = s3_options(proxy.url)
        dataset = ab.open_dataset(f"s3://{BUCKET}/many", options)
        assert dataset.manifest.metadata["documents"] == count
        assert (proxy.count("GET"), proxy.count("HEAD")) == (1, 1)  # manifest.json
        assert proxy.sent("GET") == proxy.sent("GET", "manifest.json") <= 2**20
        proxy.reset()
        with ab.Loader(dataset, batch_size=64, shuffle=False, prefetch=1) as loader:
            batch = next(iter(loader))
            index_gets = proxy.count("GET", ".idx")
            index_sent = proxy.sent("GET", ".idx")
            shard_sent = proxy.sent("GET", ".bin")
        column = batch["tokens"]
        assert column.lengths.tolist() == lengths[:64].tolist()
        assert column.values.tolist() == np.repeat(np.arange(64), lengths[:64]).tolist()
        # Shard 0's index (the others are never touched), and a few KiB of tokens.
        assert (index_gets, index_sent) == (1, index_bytes)
        assert shard_sent < 2**16
        # Indexes that do not fit the cache: an exact shuffle reads each document's offsets.
        proxy.reset()
        options = {"index_cache_bytes": 2**20}
        with ab.Loader(
            dataset, batch_size=16, shuffle=True, prefetch=1, format_options=options
        ) as loader:
            batch = next(iter(loader))
            index_gets = proxy.count("GET", ".idx")
            index_sent = proxy.sent("GET", ".idx")
        ids = np.asarray(batch.global_indexes)
        assert batch["tokens"].lengths.tolist() == lengths[ids].tolist()
        # A group or two of 16 documents: at most a request each, gaps bridged only where
        # cheaper than a request (one S3 request's worth at most), far below whole indexes.
        assert 0 < index_gets <= 16 * 2 and index_sent < index_bytes // 4
        # A rank of a block shuffle touches a few shards, each index fetched once.
        proxy.reset()
        args: dict[str, Any] = dict(shuffle="block", rank=3, world_size=8, seed=1)
        with ab.Loader(dataset, batch_size=64, **args) as loader:
            for _ in itertools.islice(loader, 20):
                pass
        gets = [n for (m, p), n in proxy.requests.items() if m == "GET" and p.endswith(".idx")]
        assert gets and set(gets) == {1} and len(gets) < 50


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_local_documents_in_fewer_ranges_than_jobs(
    local_docs: ab.Dataset, documents: Documents, shuffle: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copy jobs of 64 bytes, no reads made on the loop: a group's few documents are fewer
    # than the jobs their bytes make (at the defaults, the same with documents of megabytes).
    from asyncbatch.stores import _local

    monkeypatch.setattr(_local, "GATHER_JOB_BYTES", 64)
    monkeypatch.setattr(_local, "INLINE_BYTES", 0)
    seen = []
    extra = {"block_size": 8, "window": 3} if shuffle == "block" else {}
    with ab.Loader(local_docs, batch_size=4, shuffle=shuffle, drop_last=False, **extra) as loader:
        for batch in loader:
            check_jagged(batch, documents)
            seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(len(documents)))
