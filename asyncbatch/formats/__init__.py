"""Formats: how a sample maps to byte spans and how bytes decode into fields.

Each format's reader and writer are separate modules (``documents`` and
``documents_write``, ...); ``registry`` registers them all with
:func:`~asyncbatch.register_format`. The public names here are what a format of one's own
implements and uses (``Source``, ``PlannedSource``, the steps ``Read``, ``OffLoop`` and
``Wait``, ``Opener``, ``ShardMap`` and its plans: docs/format.md) and the pieces of the
per-shard document index a writer of its own needs (``prepare``'s). Importing this package
imports none of them; each loads on first use.
"""

from __future__ import annotations

import importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ..layout import ReadPlan as ReadPlan
    from ..layout import ShardMap as ShardMap
    from ..layout import WindowPlan as WindowPlan
    from .base import OffLoop as OffLoop
    from .base import Opener as Opener
    from .base import PlannedSource as PlannedSource
    from .base import Read as Read
    from .base import Source as Source
    from .base import Wait as Wait
    from .documents_index import index_path as index_path
    from .documents_index import per_shard_metadata as per_shard_metadata
    from .documents_index import shard_index_bytes as shard_index_bytes
    from .documents_index import shard_index_info as shard_index_info

_LAZY: dict[str, str] = {
    "ReadPlan": "..layout",
    "ShardMap": "..layout",
    "WindowPlan": "..layout",
    "OffLoop": "base",
    "Opener": "base",
    "PlannedSource": "base",
    "Read": "base",
    "Source": "base",
    "Wait": "base",
    "index_path": "documents_index",
    "per_shard_metadata": "documents_index",
    "shard_index_bytes": "documents_index",
    "shard_index_info": "documents_index",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    relative = module if module.startswith(".") else f".{module}"
    value = getattr(importlib.import_module(relative, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "OffLoop",
    "Opener",
    "PlannedSource",
    "Read",
    "ReadPlan",
    "ShardMap",
    "Source",
    "Wait",
    "WindowPlan",
    "index_path",
    "per_shard_metadata",
    "shard_index_bytes",
    "shard_index_info",
]
