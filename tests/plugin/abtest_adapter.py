"""A complete asyncbatch adapter: objects are files under a root directory."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

from asyncbatch.stores import ObjectInfo


class DirTransport:
    """Serves ``scheme:///path`` URLs from the local filesystem, one thread per call."""

    def __init__(self, root: str = "/") -> None:
        self.root = root

    def path(self, url: str) -> str:
        return os.path.join(self.root, url.split("://", 1)[1].lstrip("/"))

    async def get_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes]:
        def read() -> list[bytes]:
            with open(self.path(url), "rb") as file:
                fd = file.fileno()
                return [
                    os.pread(fd, end - start, start)
                    for start, end in zip(starts, ends, strict=True)
                ]

        return await asyncio.to_thread(read)

    async def stat(self, url: str) -> ObjectInfo:
        stat = await asyncio.to_thread(os.stat, self.path(url))
        return ObjectInfo(stat.st_size, f"{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}")


def dir_store(scheme: str, options: Mapping[str, Any], *, max_inflight: int) -> DirTransport:
    """The registry's factory: ``storage_options`` go to :class:`DirTransport`."""
    return DirTransport(**options)
