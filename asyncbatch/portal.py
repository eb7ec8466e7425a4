"""Run one coroutine to completion from synchronous code (opening and writing datasets).

The loaders have their own loop; this is for the short one-off calls around them. Each call
gets a fresh loop, in a helper thread when the calling thread already runs one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` in a new event loop and return its result."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="asyncbatch-portal") as pool:
        return pool.submit(asyncio.run, coroutine).result()
