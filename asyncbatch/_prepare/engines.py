"""Where units run: this process (one worker), a local process pool, or Ray tasks.

Each engine takes the units still to do and yields each one's :class:`UnitResult` as it
finishes, in any order; the driver orders them. Every worker process loads the tokenizer once
and runs its units on one core (the tokenizer's own threads off). On the first failure an
engine stops handing out units, lets those running finish (their outputs count for a resume)
and raises the failure.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import pickle
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from .._errors import AsyncBatchError, ConfigError
from .inputs import Unit
from .tokenizer import TokenizerSpec, load
from .unit import Settings, UnitResult, run_unit

ENGINES = ("local", "ray")


def default_workers() -> int:
    """The CPUs this process may run on (its affinity, which a job scheduler sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: ``on_progress(unit index, documents, tokens, input bytes)``: a unit's counts so far.
OnProgress = Callable[[int, int, int, int], None]
#: A pickled tokenizer larger than this goes to the workers through a temporary file.
SPEC_INLINE_BYTES = 16 * 1024
#: Seconds the driver waits, when a run stops, for the unit it runs itself to end its batch.
STOP_SECONDS = 10.0
#: Seconds between two reports of one unit from a worker process.
REPORT_INTERVAL = 0.25


def run_inline(
    units: Sequence[Unit],
    settings: Settings,
    spec: TokenizerSpec,
    on_progress: OnProgress | None = None,
) -> Iterator[UnitResult]:
    """One worker: this process, one unit after another."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        for unit in units:
            report = None if on_progress is None else functools.partial(on_progress, unit.index)
            yield run_unit(unit, settings, spec, report)
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# -- a local process pool -------------------------------------------------------------------------

_SPEC: TokenizerSpec | None = None
_REPORTS: Any = None  # the driver's queue of (unit, documents, tokens, input bytes)


def _start_worker(spec: bytes | str, reports: Any = None) -> None:
    global _SPEC, _REPORTS
    parent = os.getppid()
    threading.Thread(
        target=_exit_with, args=(parent,), name="asyncbatch-parent-watch", daemon=True
    ).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    if isinstance(spec, str):  # a file's path
        with open(spec, "rb") as file:
            spec = file.read()
    _SPEC, _REPORTS = pickle.loads(spec), reports
    if _SPEC.kind != "none":
        load(_SPEC)


def _exit_with(parent: int) -> None:
    """End this worker when the driver is gone (``kill -9``): an orphan would go on writing
    units beside a resumed run."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _pool_unit(unit: Unit, settings: Settings) -> UnitResult:
    assert _SPEC is not None
    report = None
    if _REPORTS is not None:
        queue, last = _REPORTS, [time.monotonic()]

        def report(documents: int, tokens: int, nbytes: int) -> None:
            now = time.monotonic()
            if now - last[0] >= REPORT_INTERVAL:
                last[0] = now
                queue.put_nowait((unit.index, documents, tokens, nbytes))

    return run_unit(unit, settings, _SPEC, report)


def _ready() -> None:
    """A task that only makes the pool start a worker (which loads the tokenizer)."""


@dataclasses.dataclass
class Pool:
    """Worker processes, the tokenizer they load, a future per worker that ends when it has
    loaded, and the queue they report units' progress on (None: no reports)."""

    executor: futures.ProcessPoolExecutor
    spec: TokenizerSpec
    ready: list[futures.Future[None]]
    reports: Any = None
    spec_file: str = ""

    def started(self) -> bool:
        """Whether a worker has loaded (or failed to start: its units then fail clearly)."""
        return any(future.done() for future in self.ready)

    def close(self) -> None:
        """Shut the workers down (those still starting are stopped) and remove the file."""
        if not self.started():  # every unit ran in the driver: the workers are not waited for
            for process in list(getattr(self.executor, "_processes", {}).values()):
                process.terminate()
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.reports is not None:
            self.reports.cancel_join_thread()
            self.reports.close()
            self.reports = None
        if self.spec_file:
            with contextlib.suppress(OSError):
                os.unlink(self.spec_file)
            self.spec_file = ""


def start_pool(spec: TokenizerSpec, workers: int, reports: bool = False) -> Pool:
    """``workers`` spawned processes (not forked: a forked tokenizer's threads deadlock),
    started now, so that they load while the driver checks the done units. ``reports``: the
    workers report each unit's progress every ``REPORT_INTERVAL`` seconds."""
    pickled = check_sendable(spec)
    # A large tokenizer goes through a file: an argument is written down the pipe of each
    # new process, which blocks, once past the pipe's buffer, until that process has started
    # (a second each, one after the other); a path does not. (A driver killed with kill -9
    # leaves that file in the temporary folder.)
    sent: bytes | str = pickled
    spec_file = ""
    if len(pickled) > SPEC_INLINE_BYTES:
        handle, spec_file = tempfile.mkstemp(prefix="asyncbatch-prepare-", suffix=".pickle")
        with os.fdopen(handle, "wb") as file:
            file.write(pickled)
        sent = spec_file
    context = multiprocessing.get_context("spawn")
    queue = context.Queue() if reports else None
    pool = futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(sent, queue)
    )
    ready = [pool.submit(_ready) for _ in range(workers)]  # each submit starts a worker
    return Pool(pool, spec, ready, queue, spec_file)


def check_sendable(spec: TokenizerSpec) -> bytes:
    """``spec`` pickled, as worker processes receive it; a tokenizer they cannot receive is a
    ConfigError, not a pickling error from the pool later."""
    try:
        return pickle.dumps(spec)  # what the pool does with initargs (Ray uses cloudpickle)
    except Exception as exc:  # noqa: BLE001 - PicklingError, TypeError, AttributeError
        raise ConfigError(
            f"the tokenizer cannot be sent to worker processes ({exc}): use a module-level"
            " function, or workers=1"
        ) from exc


def run_pool(
    units: Sequence[Unit],
    settings: Settings,
    workers: Pool,
    count: int,
    on_progress: OnProgress | None = None,
    tick: Callable[[], None] | None = None,
) -> Iterator[UnitResult]:
    """The units on ``workers`` (from :func:`start_pool`, ``count`` processes), 2 per worker
    queued at most; the pool is shut down at the end. Until the first worker has loaded (a
    second or more), this process runs units itself, on a thread: a small run is over before
    any worker is up, and no worker is waited for. The reports go to ``on_progress``; ``tick``
    is called at least every ``REPORT_INTERVAL`` seconds."""
    pool = workers.executor
    todo = iter(units)
    lock = threading.Lock()
    exhausted = threading.Event()
    running: set[futures.Future[UnitResult]] = set()
    inline: queue.Queue[tuple[str, Any]] = queue.Queue()
    before = os.environ.get("TOKENIZERS_PARALLELISM")

    def take() -> Unit | None:
        with lock:
            unit = next(todo, None)
        if unit is None:
            exhausted.set()
        return unit

    stopping = threading.Event()

    def report_here(index: int, *counts: int) -> None:
        if stopping.is_set():  # the run stopped (Ctrl-C, an error): end this unit after its batch
            raise _Stopped
        if on_progress is not None:
            inline.put(("report", (index, *counts)))

    def run_here() -> None:
        try:
            while not workers.started() and not stopping.is_set():
                unit = take()
                if unit is None:
                    break
                report = functools.partial(report_here, unit.index)
                inline.put(("result", run_unit(unit, settings, workers.spec, report)))
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - raised by the generator
            inline.put(("error", exc))
        finally:
            inline.put(("end", None))

    here = threading.Thread(target=run_here, name="asyncbatch-prepare-driver", daemon=True)
    here.start()
    here_open = True

    def stop(error: BaseException) -> NoReturn:
        for other in running:
            other.cancel()
        futures.wait(running)  # those already running finish
        raise error

    def drain(wait: float) -> list[UnitResult]:
        """The reports and the results of the units run here; the workers' reports."""
        nonlocal here_open
        results = []
        while True:
            try:
                kind, value = inline.get(timeout=wait) if wait else inline.get_nowait()
            except queue.Empty:
                break
            wait = 0
            if kind == "report" and on_progress is not None:
                on_progress(*value)
            elif kind == "result":
                results.append(value)
            elif kind == "error":
                here_open = False
                stop(value)
            elif kind == "end":
                here_open = False
        while workers.reports is not None:
            try:
                report = workers.reports.get_nowait()
            except queue.Empty:
                break
            if on_progress is not None:
                on_progress(*report)
        if tick is not None:
            tick()
        return results

    try:
        while True:
            if workers.started():
                while len(running) < 2 * count and not exhausted.is_set():
                    unit = take()
                    if unit is None:
                        break
                    running.add(pool.submit(_pool_unit, unit, settings))
            if not running and not here_open and exhausted.is_set():
                return
            done: set[futures.Future[UnitResult]] = set()
            if running:
                done, running = futures.wait(
                    running, timeout=REPORT_INTERVAL, return_when=futures.FIRST_COMPLETED
                )
            yield from drain(0 if running else REPORT_INTERVAL)
            for future in done:
                error = future.exception()
                if isinstance(error, futures.process.BrokenProcessPool):
                    raise AsyncBatchError(
                        "a prepare worker process died (killed, or out of memory) while running"
                        " units; the units it finished are kept: run again to resume"
                    ) from error
                if error is not None:
                    stop(error)
                yield future.result()
    except BaseException:
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()  # Ctrl-C, or a generator closed early: stop at once
        raise
    finally:
        stopping.set()
        here.join(STOP_SECONDS)  # not left running into the interpreter's exit
        workers.close()
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


class _Stopped(Exception):
    """Ends a unit the driver runs itself once the run has stopped."""


# -- Ray ---------------------------------------------------------------------------------------


def run_ray(
    units: Sequence[Unit],
    settings: Settings,
    spec: TokenizerSpec,
    workers: int | None,
    address: str | None,
) -> Iterator[UnitResult]:
    """Each unit a Ray task of one CPU; ``ray.init()`` (a local cluster, or ``address``)
    unless Ray is already initialised in this process, and shut down again if it started
    here."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("engine='ray' needs Ray: pip install 'asyncbatch[ray]'") from exc
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address, "log_to_driver": False}
        if address is None and workers is not None:
            kwargs["num_cpus"] = workers
        ray.init(**kwargs)
        started = True
    try:
        # A unit redone writes the same bytes: Ray may retry one whose worker died.
        remote = ray.remote(num_cpus=1, max_retries=2)(run_unit)
        spec_ref = ray.put(spec)  # sent to the object store once, not once per task
        cpus = ray.cluster_resources().get("CPU", 1)  # type: ignore[no-untyped-call]
        limit = 2 * (workers or max(1, int(cpus)))
        todo = iter(units)
        running: list[Any] = []
        try:
            while True:
                while len(running) < limit:
                    unit = next(todo, None)
                    if unit is None:
                        break
                    running.append(remote.remote(unit, settings, spec_ref))
                if not running:
                    return
                ready, running = ray.wait(running, num_returns=1)
                try:
                    result: UnitResult = ray.get(ready[0])
                except ray.exceptions.RayError as exc:
                    if running:  # those already running finish: their units count on resume
                        ray.wait(running, num_returns=len(running))
                        running = []
                    cause = getattr(exc, "cause", None)
                    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(
                        cause, Exception
                    ):
                        raise cause from None
                    raise AsyncBatchError(
                        f"a Ray task of prepare failed ({type(exc).__name__}: {exc}); the units"
                        " finished are kept: run again to resume"
                    ) from exc
                yield result
        except BaseException:
            for ref in running:  # Ctrl-C, or the caller stopped: stop at once
                ray.cancel(ref, force=True)
            raise
    finally:
        if started:
            ray.shutdown()
