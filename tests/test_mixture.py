"""Mixtures: exact weights, each dataset's own order, the repeat policy, resume, bad input."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import s3_options
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loader import run_resume_case
from test_ranks import run_elastic_case

import asyncbatch as ab
from asyncbatch._errors import ConfigError, ResumeStateError
from asyncbatch.sampling._mixture import MixtureOrder, split_by_weight
from asyncbatch.sampling._order import Sequential

SEQ_LEN = 40


def make_tokens(seed: int, windows: int) -> npt.NDArray[np.uint16]:
    return np.random.default_rng(seed).integers(0, 60_000, windows * SEQ_LEN + 3, dtype=np.uint16)


@pytest.fixture
def sources(tmp_path: Path) -> list[npt.NDArray[np.uint16]]:
    return [make_tokens(1, 600), make_tokens(2, 150)]


@pytest.fixture
def mixture(tmp_path: Path, sources: list[npt.NDArray[np.uint16]]) -> ab.Mixture:
    datasets = [
        ab.write_tokens(str(tmp_path / f"part{i}"), tokens, shard_size=5000)
        for i, tokens in enumerate(sources)
    ]
    return ab.mix(datasets, weights=[0.5, 0.5], seed=3)


def windows_of(tokens: npt.NDArray[np.uint16], samples: npt.NDArray[np.int64]) -> Any:
    return tokens[samples[:, None] * SEQ_LEN + np.arange(SEQ_LEN)]


def test_mixture_reads_local_and_s3_with_exact_weights(
    tmp_path: Path, sources: list[npt.NDArray[np.uint16]], s3_endpoint: str
) -> None:
    """One dataset on local disk, one in S3 (moto server): the batches hold their bytes."""
    options = s3_options(s3_endpoint)
    local = ab.write_tokens(str(tmp_path / "local"), sources[0], shard_size=5000)
    remote_url = "s3://asyncbatch-tests/mixture-part"
    ab.write_tokens(remote_url, sources[1], shard_size=5000, storage_options=options)
    mixture = ab.mix([local, remote_url], weights=[3, 1], seed=1, storage_options=options)
    counts: Counter[int] = Counter()
    per_dataset: list[list[int]] = [[], []]
    with ab.Loader(mixture, batch_size=8, seq_len=SEQ_LEN, shuffle=True) as loader:
        assert len(loader) == 750 // 8
        for batch in loader:
            which, samples = mixture.locate(batch.global_indexes, SEQ_LEN)
            tokens = batch["tokens"].numpy()
            for d in (0, 1):
                rows = which == d
                np.testing.assert_array_equal(tokens[rows], windows_of(sources[d], samples[rows]))
                per_dataset[d] += samples[rows].tolist()
            counts.update(which.tolist())
    # 750 samples per epoch split 3:1; the 8-sample batches drop the last 6 positions.
    expected = split_by_weight(750, [3, 1])
    assert abs(counts[0] - expected[0]) + abs(counts[1] - expected[1]) == 6
    # The small dataset (150 samples) runs out: it repeats only in its next epoch's order.
    small = per_dataset[1]
    assert sorted(small[:150]) == list(range(150))
    again = small[150:]  # the start of its second epoch, in another order
    assert 0 < len(again) == len(set(again)) and again != small[: len(again)]
    # The large one (600) is never exhausted: no repeats.
    assert len(set(per_dataset[0])) == len(per_dataset[0])


def test_mixture_epochs_continue_each_dataset(mixture: ab.Mixture) -> None:
    with ab.Loader(mixture, batch_size=10, seq_len=SEQ_LEN, seed=5) as loader:
        epochs = [[i for b in loader for i in b.global_indexes.tolist()] for _ in range(4)]
    large = [[i for i in epoch if i < 600] for epoch in epochs]
    # Weights 1:1 over 750 samples per epoch: 375 of the 600 samples of the large dataset per
    # epoch, so its first epoch ends inside the mixture's second.
    first_pass = large[0] + large[1]
    assert sorted(first_pass[:600]) == list(range(600))
    assert epochs[0] != epochs[1]
    with ab.Loader(mixture, batch_size=10, seq_len=SEQ_LEN, seed=5) as again:
        assert [i for b in again for i in b.global_indexes.tolist()] == epochs[0]


@pytest.mark.parametrize("shuffle", [False, True, "block"])
@pytest.mark.parametrize(("stop", "prefetch"), [(0, 2), (3, 1), (11, 16)])
def test_mixture_resumes_exactly(
    mixture: ab.Mixture, stop: int, prefetch: int, shuffle: bool | str
) -> None:
    run_resume_case(mixture, stop, prefetch, shuffle, 2)  # type: ignore[arg-type]
    run_elastic_case(mixture, stop, shuffle, 2, 3, prefetch)  # type: ignore[arg-type]


def test_mixture_state_names_the_mixture(mixture: ab.Mixture, tmp_path: Path) -> None:
    with ab.Loader(mixture, batch_size=4, seq_len=SEQ_LEN) as loader:
        state = loader.state_dict()
    assert state["dataset"].startswith("mixture:2:") and len(repr(state)) < 1024
    other = ab.mix(list(mixture.datasets), weights=[0.6, 0.4], seed=3)
    with (
        ab.Loader(other, batch_size=4, seq_len=SEQ_LEN) as loader,
        pytest.raises(ResumeStateError, match="dataset"),
    ):
        loader.load_state_dict(state)


def test_mixture_in_dataloader_workers(mixture: ab.Mixture) -> None:
    args: dict[str, Any] = dict(batch_size=6, seq_len=SEQ_LEN, shuffle="block", block_size=20)
    with ab.Loader(mixture, **args) as loader:
        expected = [b.global_indexes.tolist() for b in loader]
    source = ab.LoaderDataset(mixture, **args)
    got = [b.global_indexes.tolist() for b in source.dataloader(num_workers=2)]
    assert got == expected


def test_bad_mixtures_are_refused(tmp_path: Path, mixture: ab.Mixture) -> None:
    a, b = mixture.datasets
    wide = ab.write_tokens(str(tmp_path / "wide"), np.arange(5000, dtype=np.uint32))
    with pytest.raises(ConfigError, match="one dtype"):
        ab.mix([a, wide])
    with pytest.raises(ConfigError, match="2 weights for 3"):
        ab.mix([a, b, a], weights=[1, 2])
    with pytest.raises(ConfigError, match="weights"):
        ab.mix([a, b], weights=[1, float("nan")])
    with pytest.raises(ConfigError, match="weights"):
        ab.mix([a, b], weights=[0, 0])
    with pytest.raises(ConfigError, match="at least one"):
        ab.mix([])
    with pytest.raises(ConfigError, match="samples"):
        ab.mix([a, b], samples=0)
    tiny = ab.mix([a, b], weights=[1, 1e-9])
    with pytest.raises(ConfigError, match="weight 1e-09 of dataset 1"):
        ab.Loader(tiny, batch_size=4, seq_len=SEQ_LEN)
    short = ab.write_tokens(str(tmp_path / "short"), np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match="too short"):
        ab.Loader(ab.mix([a, short]), batch_size=4, seq_len=SEQ_LEN)


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    weights_seed=st.integers(0, 1000),
    samples=st.integers(1, 3000),
    epoch=st.integers(0, 3),
)
def test_mixture_order_counts_and_inner_epochs(
    sizes: list[int], weights_seed: int, samples: int, epoch: int
) -> None:
    weights = (np.random.default_rng(weights_seed).random(len(sizes)) + 0.01).tolist()
    try:
        order = MixtureOrder(sizes, weights, 7, samples, [Sequential(n) for n in sizes])
    except ConfigError:
        assert samples < 100 * len(sizes)  # a weight too small for so short an epoch
        return
    ids = order(epoch, np.arange(samples, dtype=np.int64))
    bases = np.cumsum(sizes) - np.asarray(sizes)
    which = np.searchsorted(np.cumsum(sizes), ids, side="right")
    # Each epoch is one chunk (samples <= 2**16): the counts are exactly the weights' split.
    assert np.bincount(which, minlength=len(sizes)).tolist() == split_by_weight(samples, weights)
    for d, size in enumerate(sizes):
        # Dataset d's samples come in its own order (sequential here), epoch after epoch.
        local = ids[which == d] - bases[d]
        start = epoch * order.counts[d]
        assert local.tolist() == [(start + k) % size for k in range(local.size)]


def test_async_loader_reads_a_mixture_like_the_loader(mixture: ab.Mixture) -> None:
    args: dict[str, Any] = dict(batch_size=8, seq_len=SEQ_LEN, shuffle=True, infinite=True)
    with ab.Loader(mixture, **args) as loader:
        expected = [next(loader).global_indexes.tolist() for _ in range(120)]

    async def collect() -> list[list[int]]:
        out = []
        async with ab.AsyncLoader(mixture, **args) as loader:
            async for batch in loader:
                out.append(batch.global_indexes.tolist())
                if len(out) == 120:  # past the end of the first epoch (93 batches)
                    break
        return out

    assert asyncio.run(collect()) == expected
