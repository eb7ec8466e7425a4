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

import typing as _typing

from .._lazy import lazy_names as _lazy_names

if _typing.TYPE_CHECKING:
    from .._layout import ReadPlan as ReadPlan
    from .._layout import ShardMap as ShardMap
    from .._layout import WindowPlan as WindowPlan
    from ._base import OffLoop as OffLoop
    from ._base import Opener as Opener
    from ._base import PlannedSource as PlannedSource
    from ._base import Read as Read
    from ._base import Source as Source
    from ._base import Wait as Wait
    from ._documents_index import index_path as index_path
    from ._documents_index import per_shard_metadata as per_shard_metadata
    from ._documents_index import shard_index_bytes as shard_index_bytes
    from ._documents_index import shard_index_info as shard_index_info

_LAZY: dict[str, str] = {
    "ReadPlan": ".._layout",
    "ShardMap": ".._layout",
    "WindowPlan": ".._layout",
    "OffLoop": "_base",
    "Opener": "_base",
    "PlannedSource": "_base",
    "Read": "_base",
    "Source": "_base",
    "Wait": "_base",
    "index_path": "_documents_index",
    "per_shard_metadata": "_documents_index",
    "shard_index_bytes": "_documents_index",
    "shard_index_info": "_documents_index",
}


__getattr__, __dir__ = _lazy_names(__name__, _LAZY, globals())


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
