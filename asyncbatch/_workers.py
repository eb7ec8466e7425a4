"""The loader inside ``torch.utils.data.DataLoader`` worker processes.

:class:`LoaderDataset` is an ``IterableDataset`` of whole batches. In a DataLoader with
``K`` workers, worker ``k`` reads batches ``k, k + K, k + 2K, …`` of its rank, and the
DataLoader takes one batch from each worker in turn, so it yields exactly the batches a
plain :class:`~asyncbatch.Loader` yields, in the same order, whatever ``K`` is. Workers
never talk to each other; the rank and world size are fixed in the parent (from the
arguments or ``torch.distributed``) and travel to the workers with the dataset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, Unpack, cast

import torch
import torch.utils.data
from torch._utils import ExceptionWrapper

from ._batch import Batch
from ._dataset import Dataset
from ._errors import AsyncBatchError, ConfigError, ShardChangedError
from ._loader import Loader, check_state, resolve_rank, share_args_doc
from ._mixture import Mixture
from ._open import open_dataset
from ._options import LoaderConfig, LoaderOptions, check_names, takes_options
from .sampling._windows import History


def keep_batch(batch: Batch) -> Batch:
    """A DataLoader ``collate_fn`` that hands a :class:`Batch` over as it is."""
    return batch


class WorkerError(ExceptionWrapper):
    """An asyncbatch error of a DataLoader worker, on its way to the parent whole.

    torch rebuilds a worker's error from its type and message, losing ``url``, ``start``,
    ``end``, ``attempts``, ...; this wrapper (torch's own kind, so the DataLoader and its
    pin-memory thread treat it as an error) pickles the error itself and re-raises it.
    """

    def __init__(self, error: AsyncBatchError, worker: int) -> None:
        where = f"in DataLoader worker process {worker}"
        super().__init__((type(error), error, error.__traceback__), where)  # type: ignore[no-untyped-call]
        self.error = error

    def reraise(self) -> NoReturn:
        self.error.add_note(f"Raised {self.where}:\n{self.exc_msg.rstrip()}")
        raise self.error


class LoaderDataset(torch.utils.data.IterableDataset[Batch]):
    """The batches of ``Loader(dataset, ...)`` for a DataLoader with workers.

    Use :meth:`dataloader` (it sets ``batch_size=None`` and a collate function that keeps
    each :class:`Batch` whole). Call :meth:`set_epoch` before each epoch unless the
    DataLoader has ``persistent_workers=True`` (then workers go on to the next epoch
    themselves); save the position with :meth:`state_dict` and the last batch taken.

    A ``transform=`` runs in each worker on that worker's batches; with
    ``multiprocessing_context="spawn"`` or ``"forkserver"`` it must pickle (a module-level
    function, not a lambda).

    It is ``Stateful`` as torchdata's ``StatefulDataLoader`` expects: with ``batch_size=None``
    that loader's own ``state_dict()`` resumes right after the last batch it yielded, with
    or without workers (restore it into a loader with the same ``num_workers``).

    An asyncbatch error in a worker reaches the DataLoader's caller as itself, with its
    attributes (``url``, ``start``, ``end``, ``attempts``, ...), not rebuilt from its message.

    Args: those of :class:`Loader`.
    """

    @takes_options
    def __init__(self, dataset: Dataset | Mixture | str, **options: Unpack[LoaderOptions]) -> None:
        check_names("LoaderDataset", options)
        device = options.get("device")
        if device is not None:
            raise ConfigError(
                f"LoaderDataset takes no device= (got {device!r}): DataLoader workers must not"
                " touch CUDA. Use DataLoader(..., pin_memory=True) and batch.to(device,"
                " non_blocking=True), or ab.Loader(..., device=...) in the training process"
            )
        config = LoaderConfig.of("LoaderDataset", options)
        # Fixed here, in the parent: workers must not ask torch.distributed themselves.
        rank, world_size = resolve_rank(config.rank, config.world_size)
        #: The options every worker's loader reads with (the rank and world size fixed).
        self.config = dataclasses.replace(config, rank=rank, world_size=world_size)
        if isinstance(dataset, str):
            dataset = open_dataset(
                dataset, config.storage_options, retry=config.retry, cache=config.cache
            )
        self.dataset = dataset
        # A loader that never starts: its settings and length, found in the parent process.
        probe = Loader._for_worker((0, 1), dataset, self.config)
        self._settings = probe.state_dict()
        self._length = len(probe)
        self.infinite = probe.infinite
        probe.close()
        self._epoch = 0
        self._position = 0
        self._history: History = ()  # as Loader's: the epoch's earlier world sizes
        #: As Loader's: once the data changed under an iteration, every later one raises it.
        self._changed: ShardChangedError | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; nothing changes when already in it (as Loader)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._position, self._history = epoch, 0, ()

    def state_dict(self, last: Batch | None = None) -> dict[str, Any]:
        """The loader state after ``last`` (a batch this dataset yielded), or else after the
        last batch this object yielded (in a worker: that worker's own share)."""
        state = dict(self._settings)
        if last is None:
            state["epoch"], state["batches_done"] = self._epoch, self._position
        else:
            state["epoch"], state["batches_done"] = last.extra["epoch"], last.extra["batch"] + 1
        if state["epoch"] == self._epoch and self._history:
            state["segments"] = [list(s) for s in self._history]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start the next iteration after the batch ``state`` was saved at (any rank's state,
        on any world size with the same global batch size)."""
        self._epoch, self._position, self._history = check_state(state, self._settings)

    def __len__(self) -> int:
        """Batches per epoch of this rank (all workers together)."""
        if self.infinite:
            raise TypeError("an infinite LoaderDataset has no length")
        return self._length

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            yield from self._batches((0, 1))
            return
        try:
            yield from self._batches((info.id, info.num_workers))
        except AsyncBatchError as exc:
            # Raised here, torch would send the parent only the type and message; as an item
            # it travels whole, and the DataLoader raises it (never yields it).
            yield cast(Batch, WorkerError(exc, info.id))

    def _batches(self, worker: tuple[int, int]) -> Iterator[Batch]:
        """The batches of DataLoader worker ``worker`` (index, count) from the position."""
        if self._changed is not None:
            raise self._changed.with_traceback(None)
        with Loader._for_worker(worker, self.dataset, self.config) as loader:
            loader.load_state_dict(self.state_dict())
            try:
                for batch in loader:
                    # This object's state follows what it yields, so torchdata's
                    # StatefulDataLoader (which calls state_dict() right after each batch, in
                    # the process that yields it) resumes right after it. A worker's copy holds
                    # its own next batch b + K: a run from position p gives worker k batch p + k.
                    index, stride = worker
                    self._epoch = batch.extra["epoch"]
                    self._position = batch.extra["batch"] + stride - index
                    yield batch
            except ShardChangedError as exc:
                self._changed = exc
                raise
            # An epoch ended: the next iteration (the parent's with num_workers=0, or a
            # persistent worker's) starts the next epoch.
            self._epoch, self._position, self._history = loader.epoch, 0, ()

    def dataloader(self, **kwargs: Any) -> torch.utils.data.DataLoader[Batch]:
        """A ``DataLoader`` over this dataset; ``kwargs`` go to it (e.g. ``num_workers``)."""
        for key in ("batch_size", "collate_fn", "sampler", "batch_sampler", "shuffle"):
            if key in kwargs:
                raise ConfigError(f"{key}= is set by LoaderDataset.dataloader, not by the caller")
        collate: Any = keep_batch  # typeshed expects a list-taking collate_fn
        return torch.utils.data.DataLoader(self, batch_size=None, collate_fn=collate, **kwargs)

    def __repr__(self) -> str:
        return f"LoaderDataset({self.dataset!r}, epoch={self._epoch}, position={self._position})"


share_args_doc(LoaderDataset)
