"""Loader threads across process events: interpreter exit and ``fork()``.

A :class:`~asyncbatch.Loader` registers itself here while its loop thread runs (from its
first use, or its construction from a URL, until it is closed).

- As interpreter exit begins, before atexit handlers run, every loader still running is
  closed (its tasks cancelled, its stores closed, its thread joined), so a script that
  never called ``close()`` still ends without "Task was destroyed" or "Unclosed client
  session" noise. Threads a loader gave up waiting
  for (after Ctrl-C) are joined too, for a bounded time.
- In a child made by ``fork()`` the loop threads do not exist: each running loader forgets
  its loop, run and stores, so that its next ``next()`` opens its own in the child, and
  interpreter exit in the child leaves the parent's alone. A loader that finds itself in
  another process (its pid check) does the same. The parent's loop, queue and stores stay
  referenced, unused (:func:`forsake`), so that none of them is finalized in the child (a
  pending task, an unclosed loop or a store would complain about, or close, what belongs
  to the parent).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Protocol

#: How long interpreter exit waits for each thread a loader stopped waiting for.
EXIT_JOIN_TIMEOUT = 2.0


class Running(Protocol):
    """What a running loader offers this module."""

    def _close_at_exit(self) -> None: ...

    def _forget_after_fork(self) -> list[object]:
        """Drop the loop, run and stores (not in this process); return the live objects."""
        ...


_running: weakref.WeakSet[Running] = weakref.WeakSet()
#: Threads being stopped; weak, so the ones that finished and nobody holds drop out.
_stragglers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: Runs inherited from the parent process: kept, never used (see the module docstring).
_orphans: list[object] = []


def track(loader: Running) -> None:
    """``loader`` has a running loop thread."""
    _running.add(loader)


def untrack(loader: Running) -> None:
    """``loader``'s loop thread is stopping or gone."""
    _running.discard(loader)


def forsake(objects: list[object]) -> None:
    """What a loader had in its parent process: kept, never used (see the module docstring)."""
    _orphans.extend(objects)


def stopping(thread: threading.Thread) -> None:
    """A loop thread asked to stop: joined (bounded) at exit if it is still running."""
    _stragglers.add(thread)


def _at_exit() -> None:
    for loader in list(_running):
        with contextlib.suppress(Exception):  # one failing close must not keep the rest open
            loader._close_at_exit()
    for thread in list(_stragglers):
        thread.join(EXIT_JOIN_TIMEOUT)
    _stragglers.clear()


def _after_fork_in_child() -> None:
    # Only this thread exists now: no lock is needed (and one held at fork time would hang).
    for loader in list(_running):
        forsake(loader._forget_after_fork())
    _running.clear()
    _stragglers.clear()


def _register_at_exit() -> None:
    """Close loaders as interpreter shutdown begins: before threading joins the executors'
    workers (a run's decode and transform threads) and before any atexit handler, such as
    torch's or a process group's, tears down what a run's threads may be using. A daemon
    thread still inside native code at finalization is killed there (C++ code then aborts
    with "terminate called without an active exception"); closed first, none is left."""
    early = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
    if early is not None:
        early(_at_exit)
    atexit.register(_at_exit)  # a no-op once the first call closed everything


_register_at_exit()
os.register_at_fork(after_in_child=_after_fork_in_child)
