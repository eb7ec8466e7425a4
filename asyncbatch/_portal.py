"""Run one coroutine to completion from synchronous code (opening and writing datasets).

The loaders have their own loop; this is for the short one-off calls around them. Each call
gets a fresh loop, in a helper thread when the calling thread already runs one (a notebook,
an async application calling sync code). Either way Ctrl-C cancels the coroutine, so its
stores close, and the call returns only once the helper thread is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` in a new event loop and return its result."""
    if not _loop_running():
        # Outside the except clause: an error of the coroutine must not read as raised
        # while handling "no running event loop".
        return asyncio.run(coroutine)  # cancels the coroutine on Ctrl-C itself
    loop = asyncio.new_event_loop()
    task = loop.create_task(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-portal") as pool:
        future = pool.submit(_run_to_end, loop, task)
        try:
            return future.result()
        except BaseException:
            # Interrupted while waiting (Ctrl-C): without this the pool's shutdown would wait
            # for a coroutine that may never finish (a stalled server).
            with contextlib.suppress(RuntimeError):  # the loop already finished and closed
                loop.call_soon_threadsafe(task.cancel)
            raise


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _run_to_end(loop: asyncio.AbstractEventLoop, task: asyncio.Task[T]) -> T:
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(task)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
