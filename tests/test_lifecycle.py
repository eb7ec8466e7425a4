"""Lifecycle and resources: errors reach the consumer, Ctrl-C, no leaks, fork and spawn,
descriptor limits, memory bounded in bytes, bad configuration refused up front.

Scenarios that need a process of their own (signals, interpreter exit, rlimits, warnings as
errors in dev mode) run tests/lifecycle_child.py in a subprocess and check its output.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, asyncbatch_threads, s3_options
from faults import Fault, fault_server
from lifecycle_child import read_rest

import asyncbatch as ab
from asyncbatch._errors import ConfigError, StoreError, UnknownSchemeError
from asyncbatch.stores import ObjectInfo
from asyncbatch.stores._local import LocalStore

CHILD = Path(__file__).with_name("lifecycle_child.py")
ROOT = Path(__file__).parent.parent
SLOW_CALLBACK = re.compile(r"Executing <.*> took [0-9.]+ seconds$")


def run_child(
    scenario: str, args: dict[str, Any], *, timeout: float = 60, dev: bool = True
) -> tuple[dict[str, Any], str]:
    """Run a scenario with warnings as errors in dev mode (or, ``dev=False``, at the speed a
    user runs it); its result and its stderr."""
    flags = ["-W", "error", "-X", "dev"] if dev else []
    done = subprocess.run(
        [sys.executable, *flags, str(CHILD), scenario, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    # asyncio's debug mode reports callbacks slower than 0.1 s (imports, a busy machine):
    # timing, not leaks.
    err = "".join(
        line for line in done.stderr.splitlines(keepends=True) if not SLOW_CALLBACK.match(line)
    )
    return json.loads(done.stdout.splitlines()[-1]), err


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture
def dataset(tmp_path: Path) -> ab.Dataset:
    tokens = np.random.default_rng(1).integers(0, 60_000, 8000, dtype=np.uint16)
    return ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=4000)


def ids_of(batches: Any, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for step, batch in enumerate(batches):
        out += batch.global_indexes.tolist()
        if limit is not None and step + 1 == limit:
            break
    return out


# -- 1. errors reach the consumer -----------------------------------------------------------


class Boom(BaseException):
    """Not an Exception: the engine must pass on even these."""


def fail_when(function: Callable[..., Any], bad: Callable[..., bool], error: BaseException) -> Any:
    """``function``, except that it raises ``error`` when called with arguments ``bad`` for.

    Groups are read concurrently, so the failing call is picked by what it reads (batch 2,
    samples 4 and 5), never by how many calls came before it.
    """

    def wrapper(*args: Any) -> Any:
        if bad(*args):
            raise error
        return function(*args)

    return wrapper


#: Batch 2 of the loaders below starts at sample 4: token 400, byte 800 of shard 0.
FAILING_BYTE = 800


class FailingStore(LocalStore):
    """Local files, except that the read of batch 2 raises, as a broken store would."""

    async def size(self, url: str) -> int:
        return await super().size(url.removeprefix("failing://"))

    async def stat(self, url: str) -> ObjectInfo:
        return await super().stat(url.removeprefix("failing://"))

    async def read_into(
        self, urls: list[str], which: Any, starts: Any, ends: Any, *args: Any
    ) -> None:
        if np.any((which == 0) & (starts <= FAILING_BYTE) & (ends > FAILING_BYTE)):
            raise StoreError("injected store failure", urls[0], FAILING_BYTE, FAILING_BYTE + 1)
        await super().read_into(
            [url.removeprefix("failing://") for url in urls], which, starts, ends, *args
        )

    async def read_windows(self, *args: Any) -> bool:
        return False  # declined: every read goes through read_into, which fails one


ab.register_store("failing", lambda scheme, options, *, max_inflight: FailingStore())


def make_loader(kind: str, dataset: ab.Dataset) -> Any:
    return getattr(ab, kind)(dataset, batch_size=2, seq_len=100, shuffle=False, prefetch=2)


def drain(kind: str, loader: Any) -> tuple[list[int], BaseException | None]:
    """Batches and the error an iteration over ``loader`` ends with."""
    got: list[int] = []

    async def run_async() -> None:
        async with loader:
            async for batch in loader:
                got.extend(batch.global_indexes.tolist())

    try:
        if kind == "AsyncLoader":
            asyncio.run(run_async())
        else:
            with loader:
                for batch in loader:
                    got.extend(batch.global_indexes.tolist())
    except BaseException as exc:  # noqa: BLE001 - that is what is tested
        return got, exc
    return got, None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["Loader", "AsyncLoader"])
@pytest.mark.parametrize("where", ["planning", "reading", "store", "decoding", "base-exception"])
def test_engine_errors_reach_the_consumer(
    dataset: ab.Dataset, tmp_path: Path, kind: str, where: str
) -> None:
    """Every batch before the failing group, then the error; nothing waits forever."""
    if where == "store":
        dataset = ab.Dataset("failing://" + dataset.url, dataset.manifest)
    loader = make_loader(kind, dataset)
    engine = loader._engine
    sample_4 = np.fromfile(dataset.shard_urls[0].removeprefix("failing://"), np.uint16)[400:500]

    def plans_sample_4(ids: Any, gap: int) -> bool:
        return 4 in ids.tolist()

    def decodes_sample_4(buffer: Any, count: int) -> bool:
        return np.array_equal(buffer[:200].view(np.uint16), sample_4)

    decode = engine.source.decode
    if where == "planning":  # the engine asks a planned source for its reads with reads()
        reads = engine.source.reads
        engine.source.reads = fail_when(reads, plans_sample_4, ValueError("injected"))
    elif where == "decoding":
        engine.source.decode = fail_when(decode, decodes_sample_4, ValueError("injected"))
    elif where == "base-exception":
        engine.source.decode = fail_when(decode, decodes_sample_4, Boom("injected"))
    elif where == "reading":
        # A shard deleted mid-run: the first batch comes, then shard 1 goes (not yet opened).
        it = iter(loader) if kind == "Loader" else None
        if it is not None:
            first = next(it).global_indexes.tolist()
        os.remove(dataset.shard_urls[1])
    got, error = drain(kind, loader)
    if where == "reading":
        if kind == "Loader":
            got = first + got
        assert isinstance(error, ab.NotFoundError) and "shard-00001" in str(error)
        assert got == list(range(20))  # every window of shard 0 (2000 tokens / 100)
    else:
        # Groups of one batch (prefetch 2): batches 0 and 1, then batch 2 fails.
        expected = {"planning": ValueError, "decoding": ValueError, "store": StoreError}
        assert type(error) is expected.get(where, Boom), repr(error)
        assert got == list(range(4))
    assert asyncbatch_threads() == []


# -- 2. Ctrl-C ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["store", "http", "open", "loader_open"])
def test_sigint_reaches_a_consumer_blocked_in_next(dataset: ab.Dataset, kind: str) -> None:
    """Blocked in next() on a store or an HTTP server that never answers, ("open") in
    open_dataset called inside a running loop, or ("loader_open") in a Loader opening its
    URL on its own loop: SIGINT gets through and stops everything."""
    process = subprocess.Popen(
        [sys.executable, "-X", "dev", str(CHILD), "sigint"]
        + [json.dumps({"path": dataset.url, "kind": kind})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # now blocked in next(): the store never answers
        assert process.poll() is None
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)  # and the process exits by itself
    finally:
        process.kill()
        process.communicate()  # closes the pipes, also after a failure above
    assert process.returncode in (-signal.SIGINT, 130, 1), err
    assert "KeyboardInterrupt" in err
    report = json.loads(out.splitlines()[-1])
    # Caught in the consumer, and the engine stopped, soon after the signal (the store never
    # answers: a consumer the signal did not reach waits forever). The bound is far above
    # the ~0.1 s this takes, so a loaded machine does not fail it.
    assert report["at"] - sent < 10.0, report["at"] - sent
    assert report["threads"] == []
    if kind == "store":  # caught, the loader goes on from the batch that was interrupted
        with ab.Loader(dataset, batch_size=4, seq_len=16) as loader:
            assert report["resumed"] == next(iter(loader)).global_indexes.tolist()
    for noise in ("Task was destroyed", "Unclosed", "Exception in thread", "ResourceWarning"):
        assert noise not in err, err


# -- 3. leaks -------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("store", ["local", "http", "s3"])
def test_no_leaks_or_warnings_on_break_close_gc_and_exit(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """In a process with warnings as errors and dev mode on: stderr stays empty."""
    tokens = np.arange(6000, dtype=np.uint16)
    options: dict[str, Any] = {}
    if store == "local":
        url = ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=3000).url
    elif store == "http":
        root, server = request.getfixturevalue("http_root")
        ab.write_tokens(str(root / "leak-ds"), tokens, shard_size=3000)
        url = f"{server.url}/leak-ds"
    else:
        options = s3_options(request.getfixturevalue("s3_endpoint"))
        url = f"s3://{BUCKET}/leak-ds"
        ab.write_tokens(url, tokens, shard_size=3000, storage_options=options)
    modes = ["break", "close", "gc", "async"]
    if store != "s3":  # threads, descriptors (sockets too) and RSS over breaks, closes, epochs
        modes.append("steady")
    modes.append("exit")  # last: it leaves a loader running for interpreter exit to close
    results, err = run_child("leak", {"modes": modes, "url": url, "options": options})
    assert err == ""
    for mode, result in results.items():
        assert result["threads"] == [], mode
        assert result["ids"] > 0, mode
    # The one warning asked for: a loader dropped while its thread runs.
    assert results["gc"]["warnings"] == ["unclosed Loader("]
    if store != "s3":  # (moto serves ~50 ranges/s: 20 epochs would take too long)
        (threads0, fds0, rss0), (threads1, fds1, rss1) = (
            results["steady"]["before"],
            results["steady"]["after"],
        )
        assert threads0 == threads1 == []
        assert fds1 == fds0
        assert rss1 - rss0 < 16 * 2**20, (rss0, rss1)


def test_unclosed_async_loader_warns_and_stops(dataset: ab.Dataset) -> None:
    async def main() -> None:
        loader = ab.AsyncLoader(dataset, batch_size=4, seq_len=16, prefetch=4)
        await loader.__anext__()
        task = loader._task
        assert task is not None
        with pytest.warns(ResourceWarning, match="unclosed AsyncLoader"):
            del loader
            gc.collect()
        await asyncio.wait([task], timeout=10)
        assert task.cancelled()

    asyncio.run(main())
    assert asyncbatch_threads() == []


# -- 4. fork, forkserver, spawn -------------------------------------------------------------


@pytest.mark.timeout(60)
# Python 3.12+ warns about fork() in a process with threads: that is what is tested here.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("workers", [0, 2])
def test_started_loader_survives_fork_and_spawn(
    dataset: ab.Dataset, method: str, workers: int
) -> None:
    """A loader running in the parent; children read (exactly once) through their own."""
    context = multiprocessing.get_context(method)
    args: dict[str, Any] = dict(batch_size=4, seq_len=50, seed=3, prefetch=4)
    with ab.Loader(dataset, **args) as whole:
        epoch = ids_of(whole)
    assert len(epoch) == len(set(epoch)) == 8000 // 50 // 4 * 4
    with ab.Loader(dataset, **args) as parent:
        first = ids_of(parent, 1)  # started: its thread runs and has prefetched
        if workers == 0:
            results = context.Queue()
            child = context.Process(target=read_rest, args=(parent, results))
            child.start()
            status, rest, threads = results.get(timeout=30)
            child.join(30)
            assert child.exitcode == 0
            assert status == "ok", rest
            assert first + rest == epoch  # every sample exactly once, in order
        else:
            source = ab.LoaderDataset(dataset, **args)
            loader = source.dataloader(num_workers=workers, multiprocessing_context=context)
            assert ids_of(loader) == epoch
        # The parent's own run is untouched by the children.
        assert first + ids_of(parent) == epoch
    assert asyncbatch_threads() == []


def test_loaders_pickle_as_arguments_and_position(dataset: ab.Dataset) -> None:
    """What spawn sends a child: arguments and position, never threads, loops or stores."""
    args: dict[str, Any] = dict(batch_size=4, seq_len=50, seed=3, prefetch=4)
    with ab.Loader(dataset, **args) as whole:
        epoch = ids_of(whole)
    with ab.Loader(dataset, **args) as loader:
        head = ids_of(loader, 5)
        data = pickle.dumps(loader)
        state = loader.state_dict()
    assert len(data) < 4096  # arguments, the manifest and a position: no buffers
    with pickle.loads(data) as copy:
        assert copy._thread is None and copy.state_dict() == state
        assert head + ids_of(copy) == epoch
    with pytest.raises(ab.LoaderClosedError):
        next(pickle.loads(pickle.dumps(loader)))
    async_copy = pickle.loads(pickle.dumps(ab.AsyncLoader(dataset.url, **args)))
    assert isinstance(async_copy, ab.AsyncLoader) and async_copy.dataset is None
    source = ab.LoaderDataset(dataset, **args)
    source.load_state_dict(state)
    assert ids_of(pickle.loads(pickle.dumps(source))) == epoch[len(head) :]


# -- 5. resources ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3000 shards of 32 tokens each."""
    tokens = np.random.default_rng(7).integers(0, 60_000, 3000 * 32, dtype=np.uint16)
    path = tmp_path_factory.mktemp("many") / "ds"
    return ab.write_tokens(str(path), tokens, shard_size=64).url


@pytest.mark.timeout(60)
def test_thousands_of_shards_under_a_low_descriptor_limit(many_shards: str) -> None:
    """RLIMIT_NOFILE 256 and 3000 shards: every byte right, descriptors capped by the LRU."""
    result, err = run_child("low_fd_limit", {"url": many_shards, "limit": 256, "seq_len": 24})
    assert err == ""
    assert result["shards"] == 3000
    assert "lru_error" not in result, result["lru_error"]
    lru = result["lru"]
    assert lru["seen"] == 3000 * 32 // 24 // 16 * 16
    # The LRU's 128, one being opened per pool thread (8), and the loop's epoll and wake-up
    # socket pair.
    assert lru["peak"] <= lru["before"] + 128 + 8 + 3
    assert lru["after"] == lru["before"]
    # Without the cap the same read runs out of descriptors: a clear error, not a hang.
    assert "Too many open files" in result["no_lru_error"]
    assert ".bin" in result["no_lru_error"]
    assert result["no_lru"]["after"] == result["no_lru"]["before"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case",
    [
        {},
        {"dtype": "int64"},  # decoded into new, wider arrays
        {"next_token": True},  # overlapping windows: merged reads go through scratch
        {"shuffle": "block", "block_size": 8, "window": 4, "coalesce_gap": 0},
    ],
)
def test_memory_is_bounded_in_bytes_by_prefetch(dataset: ab.Dataset, case: dict[str, Any]) -> None:
    """A slow consumer: reserved batches and bytes stay under the prefetch bound."""
    prefetch, batch_size, seq_len = 6, 4, 20
    kwargs: dict[str, Any] = {"shuffle": False, **case}
    window = seq_len + int(kwargs.get("next_token", False))
    itemsize = np.dtype(kwargs.get("dtype", "uint16")).itemsize
    batch_bytes = batch_size * window * itemsize
    # Reads that cannot land in place (overlapping windows, neighbours out of order) go
    # through scratch while their group is read: with coalesce_gap=0 never more bytes than
    # the group's own, and the groups being read hold at most prefetch batches together.
    scratch = prefetch * batch_bytes if ("next_token" in case or "window" in case) else 0
    bound = prefetch * batch_bytes + scratch
    with ab.Loader(
        dataset, batch_size=batch_size, seq_len=seq_len, prefetch=prefetch, **kwargs
    ) as loader:
        it = iter(loader)
        peak = 0
        for _ in range(len(loader) - 1):
            next(it)
            time.sleep(0.002)  # slower than the engine
            stats = loader.statistics()
            assert stats is not None
            peak = max(peak, stats.bytes)
        stats = loader.statistics()
        assert stats is not None
        assert stats.peak_reserved <= prefetch
        assert 0 < stats.peak_bytes <= bound, (stats, bound)
        assert stats.peak_bytes >= peak >= batch_bytes
        next(it)  # the last batch: every byte counted has left the queue
        stats = loader.statistics()
        assert stats is None or (stats.bytes, stats.reserved) == (0, 0), stats


# -- 6. bad configuration -------------------------------------------------------------------

BAD = [
    ({"batch_size": 0}, ConfigError, "batch_size.*0"),
    ({"batch_size": -3}, ConfigError, "batch_size.*-3"),
    ({"batch_size": 2.5}, ConfigError, "batch_size.*2.5"),
    ({"batch_size": True}, ConfigError, "batch_size.*True"),
    ({"seq_len": 0}, ConfigError, "seq_len.*0"),
    ({"prefetch": 0}, ConfigError, "prefetch.*0"),
    ({"prefetch": -2}, ConfigError, "prefetch.*-2"),
    ({"max_inflight": 0}, ConfigError, "max_inflight.*0"),
    ({"seed": "7"}, ConfigError, "seed.*'7'"),
    ({"coalesce_gap": -1}, ConfigError, "coalesce_gap.*-1"),
    ({"coalesce_gap": True}, ConfigError, "coalesce_gap.*True"),
    ({"shuffle": "sideways"}, ConfigError, "shuffle.*sideways"),
    ({"tail": "loop"}, ConfigError, "tail.*loop"),
    ({"shuffle": "block", "window": 0}, ConfigError, "window.*0"),
    ({"shuffle": "block", "block_size": -4}, ConfigError, "block_size.*-4"),
    ({"shuffle": True, "window": 4}, ConfigError, "window"),
    ({"dtype": "not-a-dtype"}, ConfigError, "dtype.*not-a-dtype"),
    ({"rank": 2, "world_size": 2}, ConfigError, "rank.*2"),
    ({"world_size": 0, "rank": 0}, ConfigError, "world_size.*0"),
    ({"storage_options": {"max_open_filez": 9}}, ConfigError, "max_open_filez"),
    ({"dataset": 42}, ConfigError, "dataset.*42"),
    ({"dataset": "nope://bucket/ds"}, UnknownSchemeError, "'nope'"),
    ({"dataset": "s3:/bucket/ds"}, ConfigError, "use s3://bucket/ds"),
    ({"dataset": "S3://bucket/ds"}, ConfigError, "use s3://bucket/ds"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kwargs", "error", "match"), BAD)
@pytest.mark.parametrize("kind", ["Loader", "AsyncLoader", "LoaderDataset"])
def test_bad_configuration_fails_at_construction(
    dataset: ab.Dataset, kind: str, kwargs: dict[str, Any], error: type, match: str
) -> None:
    """The field and value named, before any thread starts."""
    args: dict[str, Any] = {"batch_size": 4, "seq_len": 16, **kwargs}
    source = args.pop("dataset", dataset.url)
    if kind == "AsyncLoader" and isinstance(source, str) and "storage_options" not in kwargs:
        source = dataset if source == dataset.url else source
    before = asyncbatch_threads()

    async def construct() -> None:
        async with ab.AsyncLoader(source, **args):
            pass

    with pytest.raises(error, match=match):
        if kind == "AsyncLoader":
            asyncio.run(construct())
        else:
            getattr(ab, kind)(source, **args)
    assert asyncbatch_threads() == before == []


def test_a_failed_read_leaves_no_task_behind(tmp_path: Path) -> None:
    """A read that fails while reads of other shards are in flight: the engine cancels and
    awaits them before its loop closes, so nothing is reported destroyed or left pending."""
    tokens = np.arange(200_000, dtype=np.uint16)
    ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=5_000)  # 64-token windows span 2
    for _ in range(3):  # asyncio's dev mode slows the reads enough to hide the race
        result, err = run_child("ignored_range", {"root": str(tmp_path)}, dev=False)
        assert result == {"error": "RangeNotSupportedError"}
        assert err == ""


@pytest.mark.timeout(30)
def test_aclose_wakes_a_task_waiting_for_a_batch(dataset: ab.Dataset, tmp_path: Path) -> None:
    async def main() -> BaseException | None:
        with fault_server(tmp_path) as server:
            server.inject(default=Fault(stall=60), path=".bin")  # data never arrives
            loader = ab.AsyncLoader(f"{server.url}/ds", batch_size=2, seq_len=10)
            await loader.open()
            waiter = asyncio.ensure_future(anext(loader))
            await asyncio.sleep(0.3)
            assert not waiter.done()  # it waits for reads that stall
            await loader.aclose()
            # Bounded by the test's timeout: before the fix the waiter waited forever.
            done = await asyncio.wait({waiter}, timeout=10)
            assert waiter in done[0]
            return waiter.exception()

    error = asyncio.run(main())
    assert isinstance(error, ab.LoaderClosedError)


@pytest.mark.timeout(30)
def test_close_from_another_thread_wakes_next(dataset: ab.Dataset, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def consume(loader: ab.Loader) -> None:
        try:
            next(loader)
        except BaseException as exc:  # noqa: BLE001 - the test checks its type
            errors.append(exc)

    with fault_server(tmp_path) as server:
        server.inject(default=Fault(stall=60), path=".bin")
        loader = ab.Loader(f"{server.url}/ds", batch_size=2, seq_len=10)
        consumer = threading.Thread(target=consume, args=(loader,))
        consumer.start()
        while server.count("GET") < 2:  # the manifest, then data reads that stall
            time.sleep(0.01)
        time.sleep(0.1)
        loader.close()
        consumer.join(10)
    assert not consumer.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], ab.LoaderClosedError), repr(errors[0])


class SlowToClose(LocalStore):
    """Local files under ``slowclose://`` URLs, whose store takes a while to close."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = threading.Event()
        self.closed = False

    async def size(self, url: str) -> int:
        return await super().size(url.removeprefix("slowclose://"))

    async def stat(self, url: str) -> ObjectInfo:
        return await super().stat(url.removeprefix("slowclose://"))

    async def read_into(self, urls: list[str], *args: Any) -> None:
        await super().read_into([url.removeprefix("slowclose://") for url in urls], *args)

    async def read_windows(self, urls: list[str], *args: Any) -> bool:
        return await super().read_windows([url.removeprefix("slowclose://") for url in urls], *args)

    async def close(self) -> None:
        self.closing.set()
        await asyncio.sleep(0.3)  # as a client session's close waits for its connections
        await super().close()
        self.closed = True


@pytest.mark.timeout(30)
def test_closing_the_loader_while_its_run_ends_lets_the_stores_close(
    dataset: ab.Dataset,
) -> None:
    """The run read its whole epoch and ends while the loader is closed: the stores, kept
    for the loader's next run, still close to the end, however long that takes, before
    close() returns. Cut short, an S3 store left its client session open."""
    made: list[SlowToClose] = []

    def factory(scheme: str, options: Any, *, max_inflight: int) -> SlowToClose:
        made.append(SlowToClose())
        return made[-1]

    ab.register_store("slowclose", factory, clobber=True)
    slow = ab.Dataset("slowclose://" + dataset.url, dataset.manifest)
    loader = ab.Loader(slow, batch_size=40, seq_len=100)  # 2 batches: one run reads them all
    assert next(loader)["tokens"].shape == (40, 100)
    assert len(made) == 1
    assert not made[0].closing.is_set()  # kept for the next run
    loader.close()
    assert made[0].closed
    assert asyncbatch_threads() == []


def test_a_closed_loader_keeps_no_prefetched_batch(tmp_path: Path) -> None:
    # On a GPU (device=) these would be GPU memory held for as long as the loader object.
    url = str(tmp_path / "ds")
    ab.write_tokens(url, np.arange(500_000, dtype=np.uint16))
    gc.collect()
    # Batches an earlier test left to the collector are not this loader's.
    before = {id(o) for o in gc.get_objects() if type(o) is ab.Batch}
    loader = ab.Loader(url, batch_size=4, seq_len=64, prefetch=32)
    kept = next(iter(loader))
    deadline = time.monotonic() + 10
    while loader.statistics().ready < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader.statistics().ready >= 8  # batches read ahead and waiting
    loader.close()
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is ab.Batch and id(o) not in before]
    assert len(alive) == 1 and alive[0] is kept
    assert loader.statistics().peak_reserved > 1  # the run's figures outlive its batches
