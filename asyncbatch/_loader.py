"""The loaders: :class:`Loader` (a synchronous, stateful iterator) and :class:`AsyncLoader`.

Both run the same :class:`~asyncbatch._engine.Engine`. ``Loader`` runs it on one background
thread with its own event loop for its whole life: started on first use (at construction
when given a URL, which it opens there) and stopped by :meth:`Loader.close`; each run
(epoch, ``for`` loop, resume) is a task on it, reading through the stores and threads the
first run opened. ``AsyncLoader`` runs it as a task in the caller's loop, its stores kept
across runs in that loop until :meth:`AsyncLoader.aclose`. Iterating past the end of an epoch
raises ``StopIteration`` and moves the loader to the next epoch, so each ``for`` loop over a
loader is one epoch, each with its own order.

``state_dict()`` names the position after the last batch *handed to the caller*, never one
merely prefetched, so resuming from it delivers exactly the batches an uninterrupted run
would have delivered next.

Lifecycle (docs/reliability.md): Ctrl-C in ``next()`` stops the engine and keeps the
position; a loader left running is closed at interpreter exit; after ``fork()`` the child
forgets the parent's loop and stores (one pid check) and opens its own; a loader pickles as
its arguments and position.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import threading
import warnings
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeVar, Unpack

import torch

from . import _lifecycle as lifecycle
from ._batch import Batch
from ._checks import shard_checks
from ._dataset import Dataset
from ._decode import Decoding
from ._defaults import PREFETCH_BYTES
from ._device import READY, ToDevice, ready
from ._engine import GROUPS_IN_QUEUE, LOCAL_GROUPS_IN_QUEUE, Engine, group_size
from ._errors import ConfigError, LoaderClosedError, ResumeStateError, ShardChangedError
from ._handoff import (
    WAIT_SLICE,
    BatchQueue,
    DeliveryCounts,
    Final,
    LoaderStatistics,
    QueueStatistics,
)
from ._mixture import Mixture
from ._open import open_dataset_async
from ._options import LoaderConfig, LoaderOptions, takes_options
from ._resources import StoreStack
from ._transform import Transform
from .formats._base import (
    AlignedBlocks,
    DescribesFiles,
    ReadsScattered,
    Source,
    StoredAsBatches,
    SuggestsBlocks,
)
from .formats._registry import make_source
from .sampling._batches import BatchOrder
from .sampling._mixture import MixtureOrder, ScheduledMixtureOrder
from .sampling._order import (
    EpochOrder,
    SampleOrder,
    derive_key,
    make_sample_order,
)
from .sampling._schedule import Schedule, SchedulePiece
from .sampling._windows import History, Segment, extend_history
from .stores._counting import ReadCounts
from .stores._disk_cache import DiskCache
from .stores._registry import scheme_of

T = TypeVar("T")

STATE_VERSION = 3
MAX_DEFAULT_PREFETCH = 128
#: The same for runs that read local files only (their groups copy without the GIL).
MAX_LOCAL_DEFAULT_PREFETCH = 1024
#: After Ctrl-C in ``next()``, how long to wait for the engine thread before re-raising (it
#: goes on stopping by itself; interpreter exit joins it). Stopping takes milliseconds; the
#: bound is for a machine so loaded that closing connections and pools takes seconds.
INTERRUPT_JOIN_TIMEOUT = 5.0
#: With ``shuffle="block"``: the default block holds about this many bytes of samples (and
#: a window ``options.DEFAULT_WINDOW`` blocks).
BLOCK_BYTES = 2**20
#: The default block grows at most this many times past ``BLOCK_BYTES`` to make a window a
#: whole number of batches.
MAX_BLOCK_GROWTH = 4
#: Settings a saved state must share with the loader resuming it. The rank, world size and
#: per-rank batch size may change, as long as the global batch (their product) does not.
MUST_MATCH = (
    "seed",
    "shuffle",
    "block_size",
    "window",
    "seq_len",
    "next_token",
    "drop_last",
    "tail",
    "global_batch_size",
)


@dataclass(frozen=True, slots=True)
class MixtureStatistics(LoaderStatistics):
    """:class:`LoaderStatistics`, and for a mixture what each dataset gave the stream."""

    #: Samples of each dataset in the stream up to the position after the last batch taken,
    #: all ranks together (empty: not a mixture, or not open yet).
    dataset_samples: tuple[int, ...] = ()
    #: Their tokens (``seq_len`` per sample); empty without ``seq_len``.
    dataset_tokens: tuple[int, ...] = ()


#: A change of a mixture's weights at resume: (stream position, counts there, schedule).
MixtureChange = tuple[int, tuple[int, ...], Schedule]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` of a :class:`LoaderConfig` (checked): as given, rank 0 of a
    world size given alone, else from ``torch.distributed`` when it is initialised, else
    ``(0, 1)``."""
    if world_size is not None:
        return rank or 0, world_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_block_size(sample_bytes: int, window: int, global_batch: int, batch_size: int) -> int:
    """About ``BLOCK_BYTES`` of samples, rounded so that a rank's window (``window`` blocks)
    is a whole number of global batches, hence of batches at every world size with this
    global batch (so a state resumes elastically), else of this rank's batches; as is when
    either would grow the block more than ``MAX_BLOCK_GROWTH`` times."""
    base = max(1, BLOCK_BYTES // sample_bytes)
    for multiple in (global_batch, batch_size):
        step = multiple // math.gcd(multiple, window)
        size = max(1, round(base / step)) * step
        if size <= MAX_BLOCK_GROWTH * base:
            return size
    return base


def check_state(state: Mapping[str, Any], mine: Mapping[str, Any]) -> tuple[int, int, History]:
    """``(epoch, batches_done, history)`` of ``state`` if a loader whose state is ``mine``
    can resume it, the history extended to ``mine``'s world size; a ResumeStateError naming
    the first setting that differs otherwise."""
    if state.get("version") != STATE_VERSION:
        raise ResumeStateError(f"unsupported loader state version {state.get('version')!r}")
    for key in MUST_MATCH:
        if state.get(key) != mine[key]:
            raise ResumeStateError(
                f"cannot resume: the state has {key}={state.get(key)!r}, this loader {mine[key]!r}"
            )
    if mine["dataset"] is not None and state.get("dataset") not in (None, mine["dataset"]):
        why = ""
        if (
            str(state.get("dataset")).split(":versions=")[0]
            == mine["dataset"].split(":versions=")[0]
        ):
            why = (
                ": the same shape, other object versions (other bytes, or an upload made again;"
                ' state["dataset"] = None resumes it anyway)'
            )
        raise ResumeStateError(
            f"cannot resume: the state is for dataset {state.get('dataset')!r},"
            f" this loader reads {mine['dataset']!r}{why}"
        )
    epoch, done = state.get("epoch"), state.get("batches_done")
    if (
        not isinstance(epoch, int)
        or not isinstance(done, int)
        or isinstance(epoch, bool)
        or isinstance(done, bool)
        or epoch < 0
        or done < 0
    ):
        raise ResumeStateError(f"invalid position in state: epoch={epoch!r}, batches_done={done!r}")
    segments = _segments(state.get("segments"), mine["global_batch_size"], done)
    if segments is None:
        raise ResumeStateError(
            f"invalid world-size history in state: segments={state.get('segments')!r}"
        )
    return epoch, done, extend_history(segments, mine["world_size"], done)


def _segments(value: Any, global_batch: int, done: int) -> list[Segment] | None:
    """``value`` as segments if it is pairs ``[world_size, first batch]``, the first at batch
    0, the starts rising up to ``done``, each world size dividing the global batch."""
    if not isinstance(value, list | tuple) or not value:
        return None
    segments: list[Segment] = []
    for segment in value:
        if not isinstance(segment, list | tuple) or len(segment) != 2:
            return None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in segment):
            return None
        world, first = segment
        start = segments[-1][1] if segments else -1
        if world < 1 or global_batch % world or first <= start or first > done:
            return None
        segments.append((world, first))
    return segments if segments[0][1] == 0 else None


class _LoaderBase:
    """Options, state and the meaning of queue items, shared by both loaders.

    The public classes take ``(dataset, **options: Unpack[LoaderOptions])`` (so mypy and a
    misspelt name's TypeError name the public class), check the options into a
    :class:`LoaderConfig` and build the loader from it in :meth:`_setup`, where a pickle and
    a DataLoader worker start too.
    """

    #: ``(index, count)`` of the DataLoader worker this loader reads for: its batches
    #: ``index, index + count, ...`` (set before :meth:`_setup` by :meth:`_for_worker`).
    _worker: tuple[int, int] = (0, 1)
    #: The options, checked and normalised (frozen): ``loader.config.seed``, ...
    config: LoaderConfig

    def _setup(self, dataset: Dataset | Mixture | str, config: LoaderConfig) -> None:
        """The state of a new loader of ``dataset`` with ``config`` (checked already)."""
        if not isinstance(dataset, Dataset | Mixture | str):
            raise ConfigError(f"dataset must be a Dataset, a Mixture or a URL, got {dataset!r}")
        self.config = config
        #: This rank and the world size (asked of ``torch.distributed`` when not given).
        self.rank, self.world_size = resolve_rank(config.rank, config.world_size)
        #: Batches read ahead; with ``prefetch=None`` known once the dataset is open.
        self.prefetch = config.prefetch or 0
        #: ``decode=`` with ``prefetch=None``: the decoded batches queued stay within the
        #: default's bytes (a decoded image is many times its file, by a ratio no plan knows).
        self._decoded_bound = (
            PREFETCH_BYTES if config.prefetch is None and config.decode is not None else None
        )
        #: Samples per block of the block shuffle (None without it); known once the dataset
        #: is open.
        self.block_size: int | None = None
        self._dataset_arg = dataset
        self._engine: Engine | None = None
        self._data: Dataset | Mixture | None = None
        self._epoch = 0
        self._position = 0  # batches of the current epoch handed to the caller
        #: The world sizes the current epoch ran on before this loader's (block shuffle).
        self._history: History = ()
        #: A mixture's weights from the start of the run (None: the mixture's own), and the
        #: changes a resume with ``schedule="continue"`` made, in order.
        self._mix_first: tuple[float, ...] | Schedule | None = None
        self._mix_changes: tuple[MixtureChange, ...] = ()
        #: The stream position where the mixture's own weights take over (when opened).
        self._mix_pending: int | None = None
        self._queue: BatchQueue | None = None
        #: The queue of the latest run, kept for statistics() after the run ended.
        #: The last run's queue figures: a run's queue (and the batches it holds) goes with it.
        self._last_statistics: QueueStatistics | None = None
        #: Counts over the loader's life, across runs and epochs.
        self._read_counts = ReadCounts()
        self._delivered = DeliveryCounts()
        self._closed = False
        #: Set once a run found the data changed under it: every later run raises it too.
        self._changed: ShardChangedError | None = None
        #: The process this loader's loop, stores and threads belong to (see _check_pid).
        self._pid = os.getpid()

    @property
    def infinite(self) -> bool:
        """Whether the loader goes on to the next epoch without stopping."""
        return self.config.infinite

    @property
    def cache(self) -> DiskCache | None:
        """The node-local cache reads go through (None: none); see docs/reliability.md."""
        cache = self.config.cache
        assert cache is None or isinstance(cache, DiskCache)  # LoaderConfig made it one
        return cache

    @property
    def transform(self) -> Transform | None:
        """Called on each batch off the consumer's thread, in order (asyncbatch._transform)."""
        return self.config.transform

    @property
    def device(self) -> torch.device | None:
        """Where batches are delivered (None: the CPU); see asyncbatch._device."""
        device = self.config.device
        assert device is None or isinstance(device, torch.device)  # LoaderConfig made it one
        return device

    def _build(self, data: Dataset | Mixture) -> Engine:
        config = self.config
        datasets = data.datasets if isinstance(data, Mixture) else (data,)
        source = make_source(
            datasets,
            seq_len=config.seq_len,
            next_token=config.next_token,
            dtype=config.dtype,
            options=config.format_options,
        )
        if isinstance(source, ReadsScattered):
            source.scattered = config.shuffle == "global"
        sample_bytes = source.sample_bytes
        if config.shuffle == "block":
            assert config.window is not None
            # A format may say which block suits its layout (LLMBATCH: one batch slot).
            self.block_size = (
                config.block_size
                or (source.default_block_size if isinstance(source, SuggestsBlocks) else None)
                or default_block_size(
                    sample_bytes,
                    config.window,
                    config.batch_size * self.world_size,
                    config.batch_size,
                )
            )
        samples: SampleOrder | None = None
        num_samples = source.num_samples
        if isinstance(data, Mixture) and config.shuffle != "batch":
            samples = self._mixture_order(data, source)
            num_samples = samples.num_samples
        order: EpochOrder | BatchOrder
        if config.shuffle == "batch":
            order = self._batch_order(data, source)
        else:
            order = EpochOrder(
                num_samples,
                config.batch_size,
                shuffle=config.shuffle,
                seed=config.seed,
                rank=self.rank,
                world_size=self.world_size,
                drop_last=config.drop_last,
                tail=config.tail,
                block_size=self.block_size or 1,
                window=config.window or 1,
                samples=samples,
                # A format whose blocks are its read units keeps block edges on them.
                aligned_blocks=isinstance(source, AlignedBlocks) and source.aligned_blocks,
            )
        if order.batches_per_epoch == 0:  # else an epoch would silently yield nothing
            raise ConfigError(self._nothing_to_read(data, num_samples))
        self._data = data
        batch_bytes = config.batch_size * sample_bytes
        worker, stride = self._worker
        # A block shuffle reads best a whole window at a time: each rank reads windows of
        # its own, this many batches (a DataLoader worker: this many of its batches span one).
        want = 0
        if self.block_size is not None and config.window is not None:
            want = -(-self.block_size * config.window // (config.batch_size * stride))
        local = all(scheme_of(dataset.url) == "file" for dataset in source.datasets)
        if config.prefetch is None:
            most = MAX_LOCAL_DEFAULT_PREFETCH if local else MAX_DEFAULT_PREFETCH
            default = max(2, min(most, PREFETCH_BYTES // batch_bytes))
            # Windows in the queue as groups are: local, four (one's copies, without the
            # GIL, run beside the next one's planning and the one before's hand-over).
            self.prefetch = max(
                default, (LOCAL_GROUPS_IN_QUEUE if local else GROUPS_IN_QUEUE) * want
            )
        self._engine = Engine(
            source,
            order,
            stack=self._store_stack(source),
            group=group_size(self.prefetch, batch_bytes, want, local),
            coalesce_gap=config.coalesce_gap,
            worker=worker,
            stride=stride,
            unit=max(1, want),
            transform=(
                config.transform if self.device is None else ToDevice(self.device, config.transform)
            ),
            # The memory of batches gone is kept for later groups up to the prefetch bound.
            keep_bytes=self.prefetch * batch_bytes,
            decoding=None
            if config.decode is None
            else Decoding(
                config.decode,
                source.schema,
                sample_transform=config.sample_transform,
                on_error=config.on_error,
                threads=config.decode_threads,
                shard_urls=source.shard_urls,
                shard_samples=_shard_samples(source),
            ),
        )
        return self._engine

    def _store_stack(self, source: Source) -> StoreStack:
        """The layers of the stores the engine reads through: what the checks layer
        verifies of each shard (None with ``verify="off"``; the cache checks the blocks it
        fetches against the manifests' block checksums at every other level), retries, read
        counts and the cache."""
        config = self.config
        expected = None
        if config.verify != "off":
            expected = shard_checks(
                source.datasets,
                config.verify,
                urls=source.shard_urls,
                files=source.described_files if isinstance(source, DescribesFiles) else None,
                blocks=True if self.cache is not None else None,
            )
        return StoreStack(
            max_inflight=config.max_inflight,
            retry=config.retry,
            counts=self._read_counts,
            cache=self.cache,
            expected=expected,
        )

    def _nothing_to_read(self, data: Dataset | Mixture, num_samples: int) -> str:
        """Why a loader over ``num_samples`` samples has no batch, with the sizes."""
        if isinstance(data, Dataset):
            what = f"{data.url} holds {data.manifest.total_elements} elements:"
        else:
            what = f"the mixture of {len(data.datasets)} datasets holds"
        window = "" if self.config.seq_len is None else f" of seq_len={self.config.seq_len}"
        need = self.config.batch_size * self.world_size
        cut = f"batch_size x world_size = {self.config.batch_size} x {self.world_size} = {need}"
        if not self.config.drop_last:
            need, cut = self.world_size, f"one per rank, world_size={self.world_size}"
        return (
            f"nothing to read: {what} {num_samples} samples{window}, fewer than the {need}"
            f" one batch on every rank needs ({cut})"
        )

    def _batch_order(self, data: Dataset | Mixture, source: Source) -> BatchOrder:
        """``shuffle="batch"``: the order of a file's pre-built batches (one file only)."""
        if isinstance(data, Mixture):
            raise ConfigError(
                f"shuffle='batch' keeps the batches of one LLMBATCH file whole; a mixture of"
                f" {len(data.datasets)} datasets has no batches of its own (use True or 'block')"
            )
        # Formats stored as batches say how many records a slot holds (LLMBATCH).
        rows = source.slot_rows if isinstance(source, StoredAsBatches) else None
        if rows is None:
            raise ConfigError(
                f"shuffle='batch' needs data stored as batches (LLMBATCH .batch files);"
                f" {data.url} is format {data.manifest.format!r} (use True or 'block')"
            )
        return BatchOrder(
            source.num_samples // rows,
            rows,
            self.config.batch_size,
            seed=self.config.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.config.drop_last,
            tail=self.config.tail,
        )

    def _mixture_order(
        self, mixture: Mixture, source: Source
    ) -> MixtureOrder | ScheduledMixtureOrder:
        """The mixture's order: fixed weights as ever, else schedule pieces (docs/sampling.md)."""
        config, shuffle = self.config, self.config.shuffle
        assert isinstance(shuffle, str)  # LoaderConfig made it its name
        sizes = source.sizes.tolist()
        for dataset, size in zip(mixture.datasets, sizes, strict=True):
            if size == 0:
                raise ConfigError(
                    f"{dataset.url} is too short: it holds no sample (seq_len={config.seq_len})"
                )
        inner = [
            make_sample_order(
                size, shuffle, derive_key(config.seed, d), self.block_size or 1, config.window or 1
            )
            for d, size in enumerate(sizes)
        ]
        first = mixture.weights if self._mix_first is None else self._mix_first
        step = config.batch_size * self.world_size
        length = mixture.samples or sum(sizes)
        fixed = None
        if isinstance(first, Schedule):
            length = length // step * step
            pieces = [SchedulePiece(first, 0, [0] * len(sizes), step, self.world_size)]
        else:
            fixed = MixtureOrder(sizes, first or sizes, mixture.seed, length, inner)
            pieces = []
            if not self._mix_changes and self._mix_pending is None:
                return fixed  # fixed weights, never changed: as before schedules
        pieces += [
            SchedulePiece(w, start, taken, step, self.world_size)
            for start, taken, w in self._mix_changes
        ]
        order = ScheduledMixtureOrder(sizes, length, inner, fixed, pieces)
        if self._mix_pending is not None:
            start, self._mix_pending = self._mix_pending, None
            weights = mixture.weights or sizes
            schedule = (
                weights
                if isinstance(weights, Schedule)
                else Schedule.parse([(0, weights)], len(sizes))
            )
            taken = tuple(order.taken_at(start).tolist())
            self._mix_changes += ((start, taken, schedule),)
            return self._mixture_order(mixture, source)
        return order

    def _stream_position(self) -> int:
        """The mixture's stream position after the last batch taken."""
        assert self._engine is not None
        order = self._engine.order
        assert isinstance(order, EpochOrder)
        done = min(self._position * order.batch_size * self.world_size, order.positions_per_epoch)
        return self._epoch * order.samples.num_samples + done

    def _mixture_state(self) -> dict[str, Any] | None:
        """What a state says of a mixture: its weights over the run and each dataset's count."""
        mixture = self._data
        if not isinstance(mixture, Mixture) or self._engine is None:
            return None
        samples = self._engine.order
        if not isinstance(samples, EpochOrder):
            return None
        order = samples.samples
        assert isinstance(order, MixtureOrder | ScheduledMixtureOrder)
        first = mixture.weights if self._mix_first is None else self._mix_first
        taken = order.taken_at(self._stream_position()).tolist()
        return {
            "blend": mixture.fingerprint(weights=False),
            "samples_per_epoch": order.num_samples,
            "first": _weights_data(first),
            "changes": [[start, list(t), w.to_data()] for start, t, w in self._mix_changes],
            "samples": taken,
            "tokens": [n * self.config.seq_len for n in taken] if self.config.seq_len else [],
        }

    @property
    def dataset(self) -> Dataset | Mixture | None:
        """The dataset (or mixture) once opened: at construction (``Loader``), on entry
        (``AsyncLoader``)."""
        return self._data

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; nothing changes when the loader is already in it.

        So calling ``set_epoch(epoch)`` at the top of every epoch (as with torch's
        ``DistributedSampler``) is safe after ``load_state_dict`` resumed mid-epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch == self._epoch:
            return
        self._discard_run()
        self._epoch, self._position, self._history = epoch, 0, ()

    def statistics(self) -> MixtureStatistics:
        """The prefetch queue of the current run (or of the last one, once it ended), and
        what the loader fetched and delivered over its whole life."""
        now = self._queue.statistics() if self._queue is not None else self._last_statistics
        counts, delivered = self._read_counts, self._delivered
        mixture = self._mixture_state() or {}
        return MixtureStatistics(
            capacity=now.capacity if now else 0,
            reserved=now.reserved if now else 0,
            ready=now.ready if now else 0,
            peak_reserved=now.peak_reserved if now else 0,
            bytes=now.bytes if now else 0,
            peak_bytes=now.peak_bytes if now else 0,
            batches=delivered.batches,
            requests=counts.requests,
            bytes_fetched=counts.bytes_fetched,
            bytes_delivered=delivered.bytes,
            cache_hits=counts.cache_hits,
            cache_misses=counts.cache_misses,
            skipped_samples=self._skipped_samples(),
            dataset_samples=tuple(mixture.get("samples", ())),
            dataset_tokens=tuple(mixture.get("tokens", ())),
        )

    def _skipped_samples(self) -> int:
        decoding = self._engine.decoding if self._engine is not None else None
        return decoding.skipped if decoding is not None else 0

    def _new_queue(self, loop: asyncio.AbstractEventLoop) -> BatchQueue:
        """The prefetch queue of a new run."""
        self._queue = BatchQueue(self.prefetch, loop, self._delivered, self._decoded_bound)
        return self._queue

    def _drop_queue(self) -> None:
        """Keep the run's queue figures for statistics(), not its batches (GPU memory too)."""
        if self._queue is not None:
            self._last_statistics = self._queue.statistics()
            # What the decoded batches taught the queue holds for the next runs too.
            self.prefetch = min(self.prefetch, self._queue.capacity)
        self._queue = None

    def state_dict(self) -> dict[str, Any]:
        """A few plain values that let ``load_state_dict`` resume after the last batch taken.

        A mixture's adds ``"mixture"``: its weights over the run (the first ones and each
        change made at a resume) and the samples and tokens each dataset gave so far."""
        dataset = self.dataset
        state = {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "batches_done": self._position,
            # [world_size, first global batch] of each stretch of the epoch: the block shuffle
            # deals rank windows by world size, so a change of it mid-epoch is replayed.
            "segments": [list(s) for s in self._history] or [[self.world_size, 0]],
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "block_size": self.block_size,
            "window": self.config.window,
            "seq_len": self.config.seq_len,
            "next_token": self.config.next_token,
            "drop_last": self.config.drop_last,
            "tail": self.config.tail,
            "global_batch_size": self.config.batch_size * self.world_size,
            "batch_size": self.config.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "dataset": dataset.fingerprint() if dataset is not None else None,
        }
        mixture = self._mixture_state()
        if mixture is not None:
            state["mixture"] = mixture
        return state

    def load_state_dict(
        self, state: Mapping[str, Any], *, schedule: Literal["continue"] | None = None
    ) -> None:
        """Continue from ``state``; a state saved under other settings is a ResumeStateError.

        The state of any rank resumes every rank, on the same world size or another one with
        the same global batch size (``batch_size * world_size``): the rest of the epoch
        holds exactly the samples not yet delivered, none skipped or repeated.

        ``schedule="continue"``: the state of a mixture with other weights (or another
        schedule) resumes this one: this mixture's weights apply from the state's position
        on, and each dataset goes on in its own order where it stopped.
        """
        if schedule not in (None, "continue"):
            raise ConfigError(f"schedule={schedule!r}: expected None or 'continue'")
        mine = self.state_dict()
        data = self._data if self._data is not None else self._dataset_arg
        mixture = state.get("mixture")
        change = False
        if isinstance(data, Mixture) and isinstance(mixture, Mapping):
            if schedule == "continue" and mixture.get("blend") == data.fingerprint(weights=False):
                change = state.get("dataset") != data.fingerprint()
                mine["dataset"] = state.get("dataset")
        elif schedule == "continue":
            raise ResumeStateError("schedule='continue' resumes a mixture's state only")
        epoch, done, history = check_state(state, mine)
        first, changes = self._mix_first, self._mix_changes
        if isinstance(data, Mixture) and isinstance(mixture, Mapping):
            first, changes = _mixture_parts(mixture, len(data.datasets))
        self._discard_run()
        self._epoch, self._position, self._history = epoch, done, history
        self._mix_first, self._mix_changes, self._mix_pending = first, changes, None
        if change:
            assert isinstance(mixture, Mapping)
            length = mixture.get("samples_per_epoch")
            step = self.config.batch_size * self.world_size
            if not isinstance(length, int) or length % step:
                raise ResumeStateError(
                    f"cannot change the weights of a mixture whose epoch ({length!r} samples) is"
                    f" not whole global batches of {step}: pass mix(..., samples=) a multiple"
                )
            self._mix_pending = epoch * length + done * step
        if isinstance(data, Mixture) and self._engine is not None:
            order = self._engine.order
            assert isinstance(order, EpochOrder)
            order.samples = self._mixture_order(data, self._engine.source)
            order._block.cache_clear()

    def _take(self, item: Any) -> Batch | None:
        """The batch to hand over, or None at the end of the epoch; raises the run's error."""
        if isinstance(item, Batch):
            if item.extra["epoch"] != self._epoch:  # an infinite run went on to the next
                self._history = ()
            self._epoch, self._position = item.extra["epoch"], item.extra["batch"] + 1
            return ready(item) if READY in item.extra else item
        assert isinstance(item, Final)
        self._run_finished()
        if isinstance(item.error, ShardChangedError) and self._changed is None:
            item.error.add_note(
                "Later runs of this loader raise it again (a new run would pin the new bytes:"
                " two versions in one epoch); open the dataset again to read the new data."
            )
            self._changed = item.error
        if item.error is not None:
            raise item.error
        self._epoch, self._position, self._history = self._epoch + 1, 0, ()
        return None

    def __len__(self) -> int:
        """Batches per epoch (known once the dataset is open)."""
        if self._engine is None:
            raise TypeError("len() is known once the dataset is open")
        return self._engine.order.batches_per_epoch

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its options and position, never its thread, loop or stores (spawn)."""
        dataset = self._data if self._data is not None else self._dataset_arg
        state = (self._epoch, self._position, self._history, self._closed)
        mix = (self._mix_first, self._mix_changes, self._mix_pending)
        return (_restore, (type(self), dataset, self.config, self._worker, state, mix))

    @classmethod
    def _for_worker(
        cls, worker: tuple[int, int], dataset: Dataset | Mixture | str, config: LoaderConfig
    ) -> Self:
        """A loader of ``dataset`` with ``config`` reading DataLoader worker ``worker``'s
        share of the batches (an argument no public signature shows)."""
        loader = cls.__new__(cls)
        loader._worker = worker  # before _setup, which builds the engine with it
        loader._setup(dataset, config)
        return loader

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError(f"{type(self).__name__} used after close()")

    def _check_unchanged(self) -> None:
        """Before a new run: the ShardChangedError an earlier run of this loader met, if any."""
        if self._changed is not None:
            raise self._changed.with_traceback(None)

    def _wake_consumer(self) -> None:
        """Closing: a consumer waiting for the current run's next item (another thread, another
        task) gets :class:`LoaderClosedError`; a cancelled run puts no final item itself."""
        if self._queue is not None:
            closed = LoaderClosedError(f"{type(self).__name__} closed while waiting for a batch")
            self._queue.put(Final(closed))

    def _check_pid(self) -> None:
        """In a child made by ``fork()``: forget what the parent's runs had (loop, thread,
        stores, run), so that this process opens its own; kept referenced, unused."""
        if self._pid != os.getpid():
            lifecycle.forsake(self._forget_after_fork())

    def _forget_after_fork(self) -> list[object]:
        """Drop the parent's run, loop and stores (not in this process); return them."""
        self._pid = os.getpid()
        return self._engine.forget() if self._engine is not None else []

    def _discard_run(self) -> None:
        raise NotImplementedError

    def _run_finished(self) -> None:
        raise NotImplementedError


def _shard_samples(source: Source) -> list[int] | None:
    """Samples of each shard of ``source``, where its manifests count samples (WebDataset,
    Parquet, Arrow: their elements); None where they count something else (tokens)."""
    counts = [shard.elements for data in source.datasets for shard in data.manifest.shards]
    return counts if sum(counts) == source.num_samples else None


def _restore(
    cls: type[_LoaderBase],
    dataset: Dataset | Mixture | str,
    config: LoaderConfig,
    worker: tuple[int, int],
    state: tuple[int, int, History, bool],
    mix: tuple[Any, tuple[MixtureChange, ...], int | None] = (None, (), None),
) -> _LoaderBase:
    loader = cls._for_worker(worker, dataset, config)
    loader._epoch, loader._position, loader._history, loader._closed = state
    loader._mix_first, loader._mix_changes, loader._mix_pending = mix
    if mix != (None, (), None) and isinstance(loader._data, Mixture) and loader._engine:
        order = loader._engine.order
        assert isinstance(order, EpochOrder)
        order.samples = loader._mixture_order(loader._data, loader._engine.source)
        order._block.cache_clear()
    return loader


def _weights_data(weights: tuple[float, ...] | Schedule | None) -> Any:
    """A mixture's weights as plain data: a list, a schedule's ``[[step, weights], ...]``,
    or None (in proportion to the sizes)."""
    if isinstance(weights, Schedule):
        return {"schedule": weights.to_data()}
    return None if weights is None else list(weights)


def _mixture_parts(
    mixture: Mapping[str, Any], datasets: int
) -> tuple[tuple[float, ...] | Schedule | None, tuple[MixtureChange, ...]]:
    """The first weights and the changes a state's ``"mixture"`` names, checked."""
    try:
        first_data = mixture.get("first")
        first: tuple[float, ...] | Schedule | None = None
        if isinstance(first_data, Mapping):
            first = Schedule.parse(first_data["schedule"], datasets)
        elif first_data is not None:
            first = tuple(float(w) for w in first_data)
            if len(first) != datasets:
                raise ValueError(f"{len(first)} weights")
        changes: list[MixtureChange] = []
        for start, taken, weights in mixture.get("changes", []):
            counts = tuple(int(t) for t in taken)
            if len(counts) != datasets or sum(counts) != start:
                raise ValueError(f"counts {counts} at position {start}")
            changes.append((int(start), counts, Schedule.parse(weights, datasets)))
        return first, tuple(changes)
    except (ConfigError, TypeError, ValueError, KeyError) as exc:
        raise ResumeStateError(f"invalid mixture in state: {exc}") from exc


class Loader(_LoaderBase):
    """Synchronous, stateful batch iterator; the engine runs on its own background thread.

    Use as ``with Loader(...) as loader: for batch in loader: ...``, or call :meth:`close`.
    Each ``for`` loop is one epoch. Bad values raise :class:`~asyncbatch.ConfigError` here,
    naming the argument; so does a loader with nothing to read. A URL is opened here. The
    options, checked and normalised, are ``loader.config`` (a frozen ``LoaderConfig``).

    Args:
        dataset: A :class:`~asyncbatch.Dataset`, a :class:`~asyncbatch.Mixture`, or the URL
            of a dataset (local path, ``s3://``, ``http(s)://``, any fsspec URL).
        batch_size: Samples per batch on this rank.
        seq_len: Tokens per sample (a window over the token stream); ``None``: the format's
            own sample (a document, a record).
        shuffle: ``True`` or ``"global"``: an exact shuffle of all samples, new each epoch;
            ``"block"``: blocks of ``block_size`` samples in random order, mixed within
            ``window`` blocks (one read per block); ``"batch"``: an LLMBATCH file's
            pre-built batches kept whole, in a new order each epoch; ``False`` or
            ``"none"``: in order.
        seed: Seed of the shuffle; the order depends only on it and the epoch.
        prefetch: Batches read ahead (bounds memory); ``None``: as many as fit in 64 MiB,
            2 to 128 (1024 when every dataset is local files), or two block-shuffle windows
            (four of local files); with ``decode=``, as many decoded batches as fit in
            64 MiB, from the first one decoded on.
        max_inflight: Read requests in flight at once.
        next_token: One more token per window, for next-token targets.
        dtype: Output dtype (numpy or torch); ``None``: as stored. One that cannot hold
            every stored value is a ConfigError.
        drop_last: Drop the last, partial batch of each epoch.
        tail: With ``drop_last=False``, what a rank does with the samples left over:
            ``"drop"`` them, or ``"wrap"`` to the epoch's start so every rank yields as many
            batches.
        block_size: Samples per block of ``shuffle="block"``; ``None``: about 1 MiB of
            samples, or the format's own block (LLMBATCH: one batch).
        window: Blocks shuffled together by ``shuffle="block"``; ``None``: 8.
        infinite: Go on to the next epoch without stopping.
        rank: This rank; ``None`` (with ``world_size``): from ``torch.distributed`` when
            initialised, else 0.
        world_size: Ranks reading together; each reads its own share, with no communication.
        coalesce_gap: What one more request costs, in bytes: a gap between two reads is
            fetched when cheaper; ``None``: the store's (128 KiB remote, 16 KiB local).
        storage_options: Passed to the store (e.g. s3fs's ``endpoint_url``, ``key``).
        retry: An :class:`~asyncbatch.RetryPolicy`; ``None``: the default policy.
        format_options: Options of the dataset's format (see docs/format.md).
        verify: ``"size"``: each shard's size checked on first use; ``"block"`` /
            ``"full"``: bytes checked against the manifest's checksums; ``"off"``.
        cache: A path or :class:`~asyncbatch.DiskCache`: a node-local cache of the bytes
            read; ``None``: none.
        transform: Called on each batch off the consumer's thread, in order, within the
            prefetch bound: takes the :class:`~asyncbatch.Batch`, returns a Batch or a dict
            of tensors; what it raises reaches ``next()`` as a TransformError.
        device: ``"cuda"`` (or ``"cuda:1"``, ...): each batch copied to the device from its
            own memory on a side CUDA stream on the transform thread, ahead of the consumer,
            whose stream waits for the copy when it takes the batch; ``None``: the CPU.
        decode: Decode binary fields (WebDataset members, Parquet or Arrow binary columns)
            on a pool of threads: ``"image"`` every field whose name's last extension is an
            image type, to uint8 ``[3, H, W]`` RGB tensors (Pillow:
            ``pip install 'asyncbatch[images]'``); or a dict of field names (or last
            extensions) to ``"image"`` or a callable of the bytes (``int``, ``float`` and
            ``str`` read them as UTF-8 text). Fields of equal shapes are stacked, others
            come as lists (docs/format.md).
        sample_transform: With ``decode=``, called on each sample's decoded fields (a dict)
            on the decode pool, returning a dict of fields; ``transform=`` still gets the
            whole batch after.
        on_error: With ``decode=``: ``"raise"`` a DecodeError naming shard, sample and field;
            ``"skip"`` the sample (its batch is shorter; counted in ``statistics()``).
        decode_threads: Threads of the decode pool; ``None``: the cores the process may use.
    """

    @takes_options
    def __init__(self, dataset: Dataset | Mixture | str, **options: Unpack[LoaderOptions]) -> None:
        self._setup(dataset, LoaderConfig.of("Loader", options))

    def _setup(self, dataset: Dataset | Mixture | str, config: LoaderConfig) -> None:
        super()._setup(dataset, config)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if not isinstance(dataset, str):
            self._build(dataset)
            return
        try:  # opened on the loader's own loop, which its runs use next
            opening = open_dataset_async(
                dataset, self.config.storage_options, retry=self.config.retry, cache=self.cache
            )
            self._build(self._call(opening))
        except BaseException:
            self._stop(INTERRUPT_JOIN_TIMEOUT)  # nobody will close a loader never made
            raise

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            self._check_open()
        if self._pid != os.getpid():  # a child made by fork(): the parent's loop is not here
            self._check_pid()
        if self._queue is None:
            self._check_unchanged()
            self._start()
        assert self._queue is not None
        assert self._thread is not None
        try:
            item = self._queue.get(self._thread.is_alive)
        except BaseException:
            # Ctrl-C, or an engine thread that died: stop the engine, its loop and thread.
            # The position is still after the last batch handed over, so a later next()
            # goes on from there, on a new loop.
            self._stop(INTERRUPT_JOIN_TIMEOUT)
            raise
        batch = self._take(item)
        if batch is None:
            raise StopIteration
        return batch

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        """The loader's loop, its thread started on first use."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="asyncbatch-loader", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
            lifecycle.track(self)
        return self._loop

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, run on the loader's loop; waited for in short slices, so that
        Ctrl-C gets through (it cancels ``work``)."""
        future = asyncio.run_coroutine_threadsafe(work, self._start_loop())
        thread = self._thread
        try:
            while not concurrent.futures.wait([future], WAIT_SLICE).done:
                if thread is None or not thread.is_alive():
                    raise RuntimeError("the asyncbatch loop thread stopped without a result")
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def _start(self) -> None:
        assert self._engine is not None
        loop = self._start_loop()
        queue = self._new_queue(loop)
        run = self._engine.run(
            queue, self._epoch, self._position, infinite=self.infinite, history=self._history
        )
        asyncio.run_coroutine_threadsafe(run, loop)

    def _discard_run(self) -> None:
        """Stop the run under way (if any) and wait until it has ended; the loop, its
        stores and threads stay for the next run."""
        if self._queue is None:
            return
        self._drop_queue()
        self._check_pid()
        if self._thread is None or self._thread is threading.current_thread():
            return
        if not self._thread.is_alive():
            self._stop()
            return
        assert self._engine is not None
        self._call(self._engine.stop_runs())

    def _run_finished(self) -> None:
        self._drop_queue()  # the run put its Final item: it has ended, or ends now

    def _stop(self, timeout: float | None = None) -> BaseException | None:
        """Stop the engine: cancel its run, close its stores and threads, stop the loop and
        wait (up to ``timeout``) for its thread; the first error closing a store."""
        loop, thread = self._loop, self._thread
        self._drop_queue()
        self._loop = self._thread = None
        if loop is None or thread is None:
            return None
        lifecycle.untrack(self)
        closing = _shut_down(self._engine)
        try:
            future = asyncio.run_coroutine_threadsafe(closing, loop)
        except RuntimeError:  # the loop already finished and closed (its thread died)
            closing.close()
            return None
        if thread is threading.current_thread():  # garbage collected on its own thread
            return None
        lifecycle.stopping(thread)  # in case the join below times out or is interrupted
        thread.join(timeout)
        if future.done() and not future.cancelled():
            return future.exception()
        return None

    def _forget_after_fork(self) -> list[object]:
        kept: list[object] = [self._loop, self._queue, self._thread]
        self._queue = None  # no figures: its lock may have been held by a thread at the fork
        self._loop = self._thread = None
        return kept + super()._forget_after_fork()

    def _close_at_exit(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine and release its thread, tasks, stores and files; idempotent.

        Raises the first error a store's close raised (after releasing everything)."""
        if self._closed:
            return
        self._closed = True
        self._wake_consumer()
        self._check_pid()
        error = self._stop()
        if self._engine is not None:
            self._engine.close()
        if error is not None:
            raise error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is None or self._closed:
            return
        try:
            if self._queue is not None:  # dropped while a run reads ahead
                warnings.warn(
                    f"unclosed {self!r}: use 'with Loader(...)' or call close()",
                    ResourceWarning,
                    stacklevel=2,
                    source=self,
                )
        finally:  # also when warnings are errors
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        config = self.config
        return f"Loader({self.dataset!r}, batch_size={config.batch_size}, seq_len={config.seq_len})"


async def _shut_down(engine: Engine | None) -> None:
    """On the loader's loop: close what the engine's runs opened, then stop the loop."""
    try:
        if engine is not None:
            await engine.aclose()
    finally:
        asyncio.get_running_loop().stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loader's thread: its loop, until stopped; then, as ``asyncio.run`` ends, every
    task left cancelled and finished, and the loop closed."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class AsyncLoader(_LoaderBase):
    """The same batches as :class:`Loader`, for ``async for`` in the caller's event loop.

    Use as ``async with AsyncLoader(...) as loader: async for batch in loader: ...``. A URL
    is opened on entry (or the first batch), in the caller's loop.

    Args: those of :class:`Loader`.
    """

    @takes_options
    def __init__(self, dataset: Dataset | Mixture | str, **options: Unpack[LoaderOptions]) -> None:
        self._setup(dataset, LoaderConfig.of("AsyncLoader", options))

    def _setup(self, dataset: Dataset | Mixture | str, config: LoaderConfig) -> None:
        super()._setup(dataset, config)
        if not isinstance(dataset, str):
            self._build(dataset)
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    async def open(self) -> Self:
        """Open the dataset if given by URL (reads its manifest); called by ``async with``."""
        self._check_open()
        if self._engine is None:
            assert isinstance(self._dataset_arg, str)
            self._build(
                await open_dataset_async(
                    self._dataset_arg,
                    self.config.storage_options,
                    retry=self.config.retry,
                    cache=self.cache,
                )
            )
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Batch:
        self._check_open()
        self._check_pid()
        if self._engine is None:
            await self.open()
        queue = self._queue
        if queue is None:
            self._check_unchanged()
            assert self._engine is not None
            queue = self._new_queue(asyncio.get_running_loop())
            self._task = asyncio.create_task(
                self._engine.run(
                    queue,
                    self._epoch,
                    self._position,
                    infinite=self.infinite,
                    history=self._history,
                ),
                name="asyncbatch-engine",
            )
        batch = self._take(await queue.aget())
        if batch is None:
            raise StopAsyncIteration
        return batch

    def _discard_run(self) -> None:
        # Cancelling is enough to stop reading; aclose() also waits for the task to finish.
        task, self._task = self._task, None
        self._drop_queue()
        if task is not None and not task.done():
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def _run_finished(self) -> None:
        # A failed group ends the run while the engine may still wait for queue space.
        self._discard_run()

    def _forget_after_fork(self) -> list[object]:
        kept: list[object] = [self._task, self._queue, *self._stopping]
        self._task, self._queue, self._stopping = None, None, set()
        return kept + super()._forget_after_fork()

    async def aclose(self) -> None:
        """Stop the engine task and wait until its stores are closed; idempotent.

        Raises the first error a store's close raised (after closing everything)."""
        if self._closed:
            return
        self._closed = True
        self._wake_consumer()
        self._check_pid()
        self._discard_run()
        stopping, self._stopping = self._stopping, set()
        await asyncio.gather(*stopping, return_exceptions=True)
        if self._engine is not None:
            try:
                # The stores of this loop; those of a loop the runs left close in theirs.
                await self._engine.aclose()
            finally:
                self._engine.release()
                self._engine.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is None or self._closed or self._pid != os.getpid():
            return
        task = self._task
        try:
            if task is not None and not task.done():
                warnings.warn(
                    f"unclosed {type(self).__name__}: use 'async with AsyncLoader(...)'"
                    " or await aclose()",
                    ResourceWarning,
                    stacklevel=2,
                    source=self,
                )
        finally:  # the engine task stops; its loop (asyncio.run) waits for it at the end
            if task is not None:
                with contextlib.suppress(RuntimeError):  # that loop is already closed
                    task.get_loop().call_soon_threadsafe(task.cancel)
            # The stores close in their loop once its runs have ended (or as it ends).
            engine.release()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def args_section(cls: type) -> str:
    """The "Args:" section of ``cls``'s docstring ("" without docstrings, ``python -OO``)."""
    doc = cls.__doc__ or ""
    start = doc.find("\n    Args:\n")
    return doc[start:].rstrip() if start >= 0 else ""


def share_args_doc(cls: type) -> None:
    """Let ``help(cls)`` show :class:`Loader`'s per-argument docs in place of the pointer
    ``Args: those of :class:`Loader`.`` (the signatures are the same, tests check it)."""
    pointer = "\n    Args: those of :class:`Loader`."
    if cls.__doc__ and pointer in cls.__doc__:
        cls.__doc__ = cls.__doc__.replace(pointer, args_section(Loader))


share_args_doc(AsyncLoader)
