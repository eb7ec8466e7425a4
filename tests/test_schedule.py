"""Mixtures whose weights follow a schedule: exact counts, each dataset's passes, resume at
any step (other world sizes, StatefulDataLoader workers), a schedule changed at resume."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncbatch as ab
from asyncbatch._errors import ConfigError, ResumeStateError
from asyncbatch.sampling._schedule import Schedule, SchedulePiece

SEQ_LEN = 8
SIZES = (90, 40, 25)
#: Breakpoints at steps 6 and 9 (linear between), a step change at 14.
SCHEDULE: list[tuple[int, list[float]]] = [
    (0, [0.7, 0.2, 0.1]),
    (6, [0.5, 0.3, 0.2]),
    (9, [0.2, 0.2, 0.6]),
    (14, [0.2, 0.2, 0.6]),
    (14, [0.0, 0.9, 0.1]),
]
OTHER: list[tuple[int, list[float]]] = [(0, [0.1, 0.1, 0.8]), (20, [1, 0, 1])]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> list[ab.Dataset]:
    root = tmp_path_factory.mktemp("schedule")
    return [
        ab.write_tokens(
            str(root / f"part{i}"), np.arange(n * SEQ_LEN + 1, dtype=np.uint16), shard_size=1000
        )
        for i, n in enumerate(SIZES)
    ]


def stream(mixture: ab.Mixture, steps: int, world: int, **args: Any) -> list[list[int]]:
    """Global batches (positions in order, rank ``q mod W`` at position ``q``) of ``steps``."""
    per_rank = []
    for rank in range(world):
        options: dict[str, Any] = dict(
            batch_size=8 // world, seq_len=SEQ_LEN, shuffle=True, infinite=True, seed=2
        )
        options.update(args)
        with ab.Loader(mixture, rank=rank, world_size=world, **options) as loader:
            per_rank.append([next(loader).global_indexes.tolist() for _ in range(steps)])
    return [[per_rank[q % world][step][q // world] for q in range(8)] for step in range(steps)]


def by_dataset(ids: list[int]) -> list[list[int]]:
    """Each dataset's samples (local numbers) in stream order."""
    ends = np.cumsum(SIZES)
    out: list[list[int]] = [[] for _ in SIZES]
    for i in ids:
        d = int(np.searchsorted(ends, i, side="right"))
        out[d].append(i - int(ends[d] - SIZES[d]))
    return out


def check_passes(samples: list[int], size: int) -> None:
    """Whole passes are permutations of the dataset, each in a new order; the last one
    (partial) repeats nothing."""
    passes = [samples[i : i + size] for i in range(0, len(samples), size)]
    for p in passes[:-1]:
        assert sorted(p) == list(range(size))
    assert len(set(passes[-1])) == len(passes[-1])
    if len(passes) > 1 and len(passes[1]) == size:
        assert passes[0] != passes[1]


def test_counts_follow_the_schedule_integral() -> None:
    """At every step each dataset's count is within 1 of the schedule's integral, and its
    samples come as its 0th, 1st, 2nd, ...; ramps to 0, zero weights, step changes, 2-5
    datasets, steps of 1 to 96 positions."""
    cases = [
        (SCHEDULE, 8, 3),
        ([(0, [1, 0]), (50, [1, 0]), (50, [0, 1]), (80, [1, 1])], 5, 2),
        ([(0, [5, 1, 1, 1, 0.01]), (200, [0.01, 1, 1, 1, 5])], 96, 5),
        ([(0, [0.97, 0.01, 0.01, 0.01])], 96, 4),
        ([(0, [0.4, 0.3, 0.3, 0.0]), (60, [0, 0, 0.001, 1])], 1, 4),
    ]
    for points, step, n in cases:
        piece = SchedulePiece(Schedule.parse(points, n), 0, [0] * n, step)
        steps = 300
        which, nth = piece.locate_stream(np.arange(steps * step, dtype=np.int64))
        counts = np.zeros((steps + 1, n), dtype=np.int64)
        np.add.at(counts, (np.arange(which.size) // step + 1, which), 1)
        counts = counts.cumsum(axis=0)
        targets = piece.integral(np.arange(steps + 1, dtype=np.float64) * step)
        assert np.abs(counts - targets).max() < 1, points
        for d in range(n):
            assert nth[which == d].tolist() == list(range(int(counts[-1, d])))
        for s in (0, 7, 123, steps):
            assert piece.taken_at(s * step).tolist() == counts[s].tolist()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 5),
    breakpoints=st.lists(
        st.tuples(st.integers(0, 40), st.lists(st.floats(0, 1), min_size=5, max_size=5)),
        min_size=1,
        max_size=4,
    ),
    step=st.integers(1, 40),
)
def test_counts_stay_within_one_for_any_schedule(
    n: int, breakpoints: list[tuple[int, list[float]]], step: int
) -> None:
    points = [(s, [w + 1e-3 * (d == 0) for d, w in enumerate(ws[:n])]) for s, ws in breakpoints]
    points.sort(key=lambda p: p[0])
    try:
        schedule = Schedule.parse(points, n)
    except ConfigError:
        return  # three breakpoints at one step
    piece = SchedulePiece(schedule, 0, [0] * n, step)
    which, _ = piece.locate_stream(np.arange(60 * step, dtype=np.int64))
    counts = np.stack([np.bincount(which[: s * step], minlength=n) for s in range(61)])
    targets = piece.integral(np.arange(61, dtype=np.float64) * step)
    assert np.abs(counts - targets).max() < 1


@pytest.mark.parametrize("world", [1, 4])
def test_no_repeat_within_a_pass(datasets: list[ab.Dataset], world: int) -> None:
    """Over 40 steps (320 samples; the two small datasets pass several times) every dataset
    is read pass after pass, each pass a new permutation; ranks 1 and 4 agree."""
    mixture = ab.mix(datasets, weights=SCHEDULE, seed=4)
    batches = stream(mixture, 40, world)
    for d, samples in enumerate(by_dataset([i for b in batches for i in b])):
        check_passes(samples, SIZES[d])
    if world == 4:  # the same samples in each global batch; ranks share them out evenly
        assert [sorted(b) for b in batches] == [sorted(b) for b in stream(mixture, 40, 1)]


@pytest.mark.parametrize(("stop", "world", "resumed_world"), [(3, 1, 1), (8, 2, 4), (13, 4, 1)])
def test_resume_at_any_step(
    datasets: list[ab.Dataset], stop: int, world: int, resumed_world: int
) -> None:
    """Stop before, inside and across the breakpoints; resume on the same or another world
    size (global batch 8): the batches are the uninterrupted run's, and the state counts
    each dataset's samples so far."""
    mixture = ab.mix(datasets, weights=SCHEDULE, seed=4)
    whole = stream(mixture, 20, 1)
    options: dict[str, Any] = dict(seq_len=SEQ_LEN, shuffle=True, infinite=True, seed=2)
    with ab.Loader(mixture, batch_size=8 // world, rank=0, world_size=world, **options) as one:
        for _ in range(stop):
            next(one)
        state = one.state_dict()
        stats = one.statistics()
    delivered = [len(s) for s in by_dataset([i for b in whole[:stop] for i in b])]
    assert state["mixture"]["samples"] == delivered == list(stats.dataset_samples)
    assert list(stats.dataset_tokens) == [n * SEQ_LEN for n in delivered]
    per_rank = []
    for rank in range(resumed_world):
        with ab.Loader(
            mixture, batch_size=8 // resumed_world, rank=rank, world_size=resumed_world, **options
        ) as loader:
            loader.load_state_dict(state)
            per_rank.append([next(loader).global_indexes.tolist() for _ in range(20 - stop)])
    rest = [
        [per_rank[q % resumed_world][s][q // resumed_world] for q in range(8)]
        for s in range(20 - stop)
    ]
    if resumed_world == 1:
        assert rest == whole[stop:]
    else:  # the same samples in each global batch, dealt to the ranks for this world size
        assert rest == stream(mixture, 20, resumed_world)[stop:]
        assert [sorted(b) for b in rest] == [sorted(b) for b in whole[stop:]]


# torchdata 0.11 calls torch.set_vital on import, which torch 2.13 deprecates.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_with_workers_resumes_a_schedule(datasets: list[ab.Dataset]) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    mixture = ab.mix(datasets, weights=SCHEDULE, seed=4)
    args: dict[str, Any] = dict(batch_size=8, seq_len=SEQ_LEN, shuffle=True, seed=2)

    def loader() -> Any:
        return StatefulDataLoader(ab.LoaderDataset(mixture, **args), batch_size=None, num_workers=2)

    whole = [b.global_indexes.tolist() for b in loader()]
    assert len(whole) == sum(SIZES) // 8
    first = loader()
    batches = iter(first)
    head = [next(batches).global_indexes.tolist() for _ in range(7)]  # past step 6
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b.global_indexes.tolist() for b in resumed] == whole


@pytest.mark.parametrize(("stop", "world"), [(5, 1), (11, 4)])
def test_changed_schedule_continues_each_dataset(
    datasets: list[ab.Dataset], stop: int, world: int
) -> None:
    """A state saved under SCHEDULE resumes under OTHER only with schedule="continue": the
    batches before are the old run's, the counts after follow OTHER from the change on, and
    each dataset's samples over both runs repeat none within a pass and skip none."""
    old = ab.mix(datasets, weights=SCHEDULE, seed=4)
    new = ab.mix(datasets, weights=OTHER, seed=4)
    before = stream(old, stop, world)
    options: dict[str, Any] = dict(seq_len=SEQ_LEN, shuffle=True, infinite=True, seed=2)
    with ab.Loader(old, batch_size=8 // world, rank=0, world_size=world, **options) as loader:
        for _ in range(stop):
            next(loader)
        state = loader.state_dict()
    steps = 30
    per_rank = []
    for rank in range(world):
        with ab.Loader(new, batch_size=8 // world, rank=rank, world_size=world, **options) as one:
            with pytest.raises(ResumeStateError, match="dataset"):
                one.load_state_dict(state)
            one.load_state_dict(state, schedule="continue")
            per_rank.append([next(one).global_indexes.tolist() for _ in range(steps - 1)])
            if rank == 0:
                later = one.state_dict()
            per_rank[-1].append(next(one).global_indexes.tolist())
    after = [[per_rank[q % world][s][q // world] for q in range(8)] for s in range(steps)]
    ids = [i for b in before + after for i in b]
    for d, samples in enumerate(by_dataset(ids)):
        check_passes(samples, SIZES[d])
    # From the change on, the counts follow OTHER's integral (steps counted from 0).
    piece = SchedulePiece(Schedule.parse(OTHER, 3), stop * 8, state["mixture"]["samples"], 8)
    counts = np.asarray(state["mixture"]["samples"])
    for s, batch in enumerate(after, start=stop + 1):
        counts = counts + np.asarray([len(x) for x in by_dataset(batch)])
        assert np.abs(counts - piece.integral(np.asarray([s * 8.0]))[0]).max() < 1
    # The new run's state names both schedules and resumes without the flag.
    assert later["mixture"]["changes"][0][:2] == [stop * 8, state["mixture"]["samples"]]
    with ab.Loader(new, batch_size=8, **options) as again:
        again.load_state_dict(later)
        assert sorted(next(again).global_indexes.tolist()) == sorted(after[-1])


def test_bad_schedules_are_refused(datasets: list[ab.Dataset], tmp_path: Path) -> None:
    bad: list[tuple[Any, str]] = [
        ([(5, [1, 1, 1]), (2, [1, 1, 1])], "must not decrease"),
        ([(0, [1, 1])], "2 weights for 3 datasets at schedule step 0"),
        ([(0, [1, -1, 1])], "step 0 must be finite"),
        ([(0, [0, 0, 0])], "not all 0"),
        ([(-1, [1, 1, 1])], "non-negative integer"),
        ([(0, [1, 1, 1]), (3, [1, 1, 1]), (3, [1, 1, 0]), (3, [0, 1, 1])], "more than two"),
        ([(0, [1, 1, 1], 3)], "expected \\(step, weights\\)"),
    ]
    for weights, match in bad:
        with pytest.raises(ConfigError, match=match):
            ab.mix(datasets, weights=weights)
    fixed = ab.mix(datasets, weights=[1, 1, 1], seed=4)
    options: dict[str, Any] = dict(batch_size=8, seq_len=SEQ_LEN)
    with ab.Loader(fixed, **options) as loader:
        next(iter(loader))
        state = loader.state_dict()
    other_blend = ab.mix(datasets, weights=OTHER, seed=5)
    with ab.Loader(other_blend, **options) as loader:
        with pytest.raises(ResumeStateError, match="dataset"):
            loader.load_state_dict(state, schedule="continue")
        with pytest.raises(ConfigError, match="schedule="):
            loader.load_state_dict(state, schedule="replace")  # type: ignore[arg-type]
    # A fixed-weight mixture of 155 samples: its epoch is no whole number of global batches.
    with (
        ab.Loader(ab.mix(datasets, weights=OTHER, seed=4), **options) as loader,
        pytest.raises(ResumeStateError, match="whole global batches"),
    ):
        loader.load_state_dict(state, schedule="continue")
    damaged = {**state, "mixture": {**state["mixture"], "changes": [[8, [1, 2, 3], OTHER]]}}
    with (
        ab.Loader(fixed, **options) as loader,
        pytest.raises(ResumeStateError, match="invalid mixture"),
    ):
        loader.load_state_dict(damaged)


def test_documents_follow_a_schedule(tmp_path: Path) -> None:
    """Documents (one sample each, seq_len=None) mix by schedule as windows do."""
    rng = np.random.default_rng(0)
    parts = [
        ab.write_documents(
            str(tmp_path / f"docs{i}"),
            [rng.integers(0, 100, rng.integers(1, 9), dtype=np.uint16) for _ in range(n)],
        )
        for i, n in enumerate((30, 20))
    ]
    mixture = ab.mix(parts, weights=[(0, [1, 0]), (4, [1, 0]), (4, [0, 1])], seed=1)
    with ab.Loader(mixture, batch_size=5, shuffle=True, infinite=True) as loader:
        batches = [next(loader) for _ in range(8)]
        stats = loader.statistics()
    which = [mixture.locate(b.global_indexes, None)[0].tolist() for b in batches]  # type: ignore[arg-type]
    assert which[:4] == [[0] * 5] * 4 and which[4:] == [[1] * 5] * 4
    assert stats.dataset_samples == (20, 20) and stats.dataset_tokens == ()


def test_async_loader_and_pickle_continue_a_changed_schedule(datasets: list[ab.Dataset]) -> None:
    """AsyncLoader takes the change before it opens the data (at entry); a pickled Loader
    keeps it: both read what Loader reads."""
    old = ab.mix(datasets, weights=SCHEDULE, seed=4)
    new = ab.mix(datasets, weights=OTHER, seed=4)
    options: dict[str, Any] = dict(batch_size=8, seq_len=SEQ_LEN, shuffle=True, infinite=True)
    with ab.Loader(old, **options) as loader:
        for _ in range(7):
            next(loader)
        state = loader.state_dict()
    with ab.Loader(new, **options) as loader:
        loader.load_state_dict(state, schedule="continue")
        copy = pickle.loads(pickle.dumps(loader))
        expected = [next(loader).global_indexes.tolist() for _ in range(6)]
    with copy:
        assert [next(copy).global_indexes.tolist() for _ in range(6)] == expected

    async def collect() -> list[list[int]]:
        out = []
        async with ab.AsyncLoader(new, **options) as reader:
            reader.load_state_dict(state, schedule="continue")
            async for batch in reader:
                out.append(batch.global_indexes.tolist())
                if len(out) == 6:
                    break
        return out

    assert asyncio.run(collect()) == expected
    loader = ab.AsyncLoader(new, **options)  # not open yet: the change waits for the data

    async def before_entry() -> list[int]:
        loader.load_state_dict(state, schedule="continue")
        async with loader:
            return (await anext(loader)).global_indexes.tolist()

    assert asyncio.run(before_entry()) == expected[0]


@pytest.mark.parametrize(("world", "batch"), [(4, 16), (8, 16), (6, 10)])
def test_ranks_share_each_dataset_evenly(world: int, batch: int) -> None:
    """Each rank's count of each dataset stays near its 1/W share of the integral at every
    step (within 2.5 here; measured in docs/sampling.md), while the global counts stay
    within 1."""
    step = world * batch
    piece = SchedulePiece(Schedule.parse(SCHEDULE, 3), 0, [0, 0, 0], step, world)
    steps = 400
    which, _ = piece.locate_stream(np.arange(steps * step, dtype=np.int64))
    targets = piece.integral(np.arange(steps + 1, dtype=np.float64) * step)
    per_step = which.reshape(steps, batch, world)  # [step, j, rank]: position j·W + rank
    for rank in range(world):
        counts = np.zeros((steps + 1, 3), dtype=np.int64)
        for d in range(3):
            counts[1:, d] = (per_step[:, :, rank] == d).sum(axis=1).cumsum()
        assert np.abs(counts - targets / world).max() < 2.5, rank
