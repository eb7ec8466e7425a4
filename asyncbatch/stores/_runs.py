"""Which run of a loader the current task reads for.

A store lives as long as its loader, across the loader's runs (epochs, ``for`` loops,
resumes). The engine starts each run with :func:`begin_run`, which gives the run's task (and
the tasks it starts) a number of its own; a store that keeps state across runs reads it with
:func:`current_run` and may check that state again when a new run begins: the local store
checks each file it keeps open against its path on the file's first use in each run, so a
file replaced or deleted between epochs is refused, not read from the old descriptor.
Outside a loader's run (opening a dataset, writing one) the number is 0.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar

_RUN: ContextVar[int] = ContextVar("asyncbatch_run", default=0)
_numbers = itertools.count(1)


def begin_run() -> None:
    """The current task (and the tasks it starts from now on) reads for a new run."""
    _RUN.set(next(_numbers))


def current_run() -> int:
    """The number of the run the current task reads for (0: none)."""
    return _RUN.get()
