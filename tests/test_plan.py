"""plan(): a run's cost from metadata and the loader's own order and planning, no data read.

Exact: on moto's S3 server at 4 ranks, the plan's requests and bytes equal what real
loaders' statistics() count. Sampled: a synthetic manifest (no data) too big to cost whole
is estimated within the bound the plan states. Bad input: a dataset whose reads need bytes
beyond its metadata is a ConfigError saying what is missing.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, s3_options
from make_megatron import write_megatron

import asyncbatch as ab
from asyncbatch._cli import main
from asyncbatch._dataset import Dataset
from asyncbatch._errors import ConfigError
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch._plan import plan

WORLD = 4


def loaders_count(data: Any, world_size: int = WORLD, **kwargs: Any) -> tuple[int, int, int]:
    """(requests, bytes fetched, bytes delivered) of one epoch of real loaders of ``data``
    (a URL, Dataset or Mixture) at every rank of ``world_size``; ``kwargs`` go to each."""
    requests = fetched = delivered = 0
    for rank in range(world_size):
        with ab.Loader(data, rank=rank, world_size=world_size, **kwargs) as loader:
            for _ in loader:
                pass
            stats = loader.statistics()
        requests += stats.requests
        fetched += stats.bytes_fetched
        delivered += stats.bytes_delivered
    return requests, fetched, delivered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle", [True, "block"])
def test_plan_equals_what_loaders_count_on_s3(s3_endpoint: str, shuffle: bool | str) -> None:
    options = s3_options(s3_endpoint)
    url = f"s3://{BUCKET}/plan-tokens-{shuffle}"
    tokens = np.random.default_rng(1).integers(0, 60_000, 16_000, dtype=np.uint16)
    ab.write_tokens(url, tokens, shard_size=12_000, storage_options=options)
    kwargs: dict[str, Any] = {"batch_size": 4, "seq_len": 100, "shuffle": shuffle}
    if shuffle == "block":
        kwargs["block_size"] = 8
    got = plan(url, world_size=WORLD, storage_options=options, **kwargs)
    assert not got.sampled and got.relative_error == 0
    requests, fetched, delivered = loaders_count(url, storage_options=options, **kwargs)
    assert abs(got.requests - requests) <= 0.02 * requests, (got.requests, requests)
    assert abs(got.bytes_fetched - fetched) <= 0.02 * fetched, (got.bytes_fetched, fetched)
    assert got.bytes_delivered == pytest.approx(delivered)
    assert got.amplification >= 1
    text = str(got)
    assert "S3 Standard list prices" in text and f"{requests:,}" in text


def synthetic(shards: int, tokens: int) -> Dataset:
    """A tokens dataset of ``shards`` shards holding ``tokens`` in all: its manifest only."""
    per = tokens // shards
    infos = tuple(ShardInfo(path=f"s{i}.bin", nbytes=2 * per, elements=per) for i in range(shards))
    return Dataset(
        "s3://bucket/synthetic", Manifest(format="tokens", dtype=np.dtype("<u2"), shards=infos)
    )


@pytest.mark.timeout(60)
def test_sampled_plan_agrees_with_the_whole_within_its_bound() -> None:
    data = synthetic(40, 4 * 10**7)
    kwargs: dict[str, Any] = {"world_size": 16, "batch_size": 8, "seq_len": 2048}
    whole = plan(data, **kwargs)
    part = plan(data, ranks=4, groups=4, max_ids=1000, **kwargs)
    assert not whole.sampled and part.sampled and len(part.ranks) == 4
    bound = max(part.relative_error, 1e-6)
    assert bound < 0.05
    assert abs(part.requests - whole.requests) <= bound * whole.requests
    assert abs(part.bytes_fetched - whole.bytes_fetched) <= bound * whole.bytes_fetched
    assert part.bytes_delivered == pytest.approx(whole.bytes_delivered, rel=1e-9)
    # At most a request per window of 4 KiB, and gaps bridged within the plan's own bytes.
    assert whole.requests <= whole.bytes_delivered / (2 * 2048)
    assert 1 <= whole.amplification <= 2
    assert "error bound" in str(part)


def test_cli_prints_the_plan_and_plots_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "ds")
    ab.write_tokens(url, np.arange(40_000, dtype=np.uint16), shard_size=20_000)
    png = tmp_path / "plan.png"
    argv = ["plan", url, "--world-size", "2", "--batch-size", "4", "--seq-len", "100"]
    assert main([*argv, "--shuffle", "block", "--latency", "20", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "shuffle='block'" in out and "at 20 ms a request" in out and "exact" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*argv, "--epochs", "0"]) == 1
    assert "epochs must be a positive integer" in capsys.readouterr().err


def test_plan_refuses_a_webdataset_without_sidecars(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "shard-0.tar", "w") as tar:
        for key in ("a", "b"):
            data = key.encode() * 10
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ConfigError, match="plan cannot cost .*tar headers or sidecar index"):
        plan(str(tmp_path / "shard-0.tar"), batch_size=1)


def test_plan_refuses_documents_whose_sizes_are_in_their_indexes(tmp_path: Path) -> None:
    url = str(tmp_path / "docs")
    ab.write_documents(url, [np.arange(n, dtype=np.uint16) for n in (5, 9, 3, 7)])
    with pytest.raises(ConfigError, match="give seq_len="):
        plan(url, batch_size=2)
    assert plan(url, batch_size=2, seq_len=4).bytes_delivered > 0


def test_documents_with_one_index_cost_exactly_as_samples(tmp_path: Path) -> None:
    url = str(tmp_path / "docs")
    lengths = np.random.default_rng(2).integers(1, 50, 400)
    ab.write_documents(url, [np.arange(n, dtype=np.uint16) for n in lengths], index="single")
    got = plan(url, batch_size=4, shuffle=True)
    requests, fetched, _ = loaders_count(url, world_size=1, batch_size=4, shuffle=True)
    assert (got.requests, got.bytes_fetched) == (requests, fetched)


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_megatron_pages_cost_exactly_as_loaders_fetch_them(tmp_path: Path, shuffle: str) -> None:
    rng = np.random.default_rng(3)
    documents = [
        [rng.integers(0, 9, int(rng.integers(1, 30)), dtype=np.uint16)] for _ in range(3000)
    ]
    write_megatron(tmp_path / "corpus", documents)
    dataset = ab.open_dataset(str(tmp_path / "corpus.bin"), options={"index_page": 256})
    kwargs: dict[str, Any] = {"batch_size": 4, "seq_len": 64, "shuffle": shuffle}
    got = plan(dataset, world_size=2, **kwargs)
    requests, fetched, _ = loaders_count(dataset, world_size=2, **kwargs)
    assert got.index_bytes > 0
    assert (got.requests, got.bytes_fetched) == (requests, fetched)
    with pytest.raises(ConfigError, match="unit='document'"):
        plan(
            ab.open_dataset(str(tmp_path / "corpus.bin"), options={"unit": "document"}),
            batch_size=4,
            seq_len=64,
        )


def test_parquet_row_groups_cost_exactly_from_the_footers(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"a": np.arange(6000), "b": [str(i) for i in range(6000)]})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "part-0.parquet", row_group_size=500)
    url = str(tmp_path / "pq")
    kwargs: dict[str, Any] = {"batch_size": 16, "shuffle": "block"}
    got = plan(url, world_size=2, **kwargs)
    requests, fetched, _ = loaders_count(url, world_size=2, **kwargs)
    assert (got.requests, got.bytes_fetched) == (requests, fetched)
    with pytest.raises(ConfigError, match="offset index"):
        plan(url, batch_size=16, shuffle=True)


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_paged_document_indexes_cost_within_2_percent(tmp_path: Path, shuffle: str) -> None:
    """Which page holds a window is estimated (documents of equal length in a shard); the
    pages, top levels and their ranges are walked as the source fetches them."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 9, int(n), dtype=np.uint16) for n in rng.integers(20, 380, 4000)]
    url = str(tmp_path / "docs")
    ab.write_documents(url, documents, shard_size=220_000)
    kwargs: dict[str, Any] = {"batch_size": 4, "seq_len": 256, "shuffle": shuffle, "prefetch": 2}
    got = plan(url, world_size=2, **kwargs)
    requests, fetched, _ = loaders_count(url, world_size=2, **kwargs)
    assert got.index_bytes > 0
    assert abs(got.requests - requests) <= 0.02 * requests, (got.requests, requests)
    assert abs(got.bytes_fetched - fetched) <= 0.02 * fetched, (got.bytes_fetched, fetched)


def test_a_mixture_costs_as_its_loaders_count(tmp_path: Path) -> None:
    parts = []
    for name, n in (("a", 30_000), ("b", 50_000)):
        ab.write_tokens(str(tmp_path / name), np.arange(n, dtype=np.uint16), shard_size=20_000)
        parts.append(ab.open_dataset(str(tmp_path / name)))
    mixture = ab.mix(parts, weights=[1, 1], seed=0)
    kwargs: dict[str, Any] = {"batch_size": 4, "seq_len": 100}
    got = plan(mixture, world_size=2, **kwargs)
    requests, fetched, _ = loaders_count(mixture, world_size=2, **kwargs)
    assert (got.requests, got.bytes_fetched) == (requests, fetched)
    assert got.url.startswith("a mixture of")
    with pytest.raises(ConfigError, match="plan takes a Dataset"):
        plan(3, batch_size=1)  # type: ignore[arg-type]
