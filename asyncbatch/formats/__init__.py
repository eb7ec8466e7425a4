"""Formats: how a sample maps to byte spans and how bytes decode into fields.

``base`` holds the types a format implements (:class:`~asyncbatch.formats.base.Source`,
:class:`~asyncbatch.formats.base.Opener`); each format's reader and writer are separate
modules (``documents`` and ``documents_write``, ...); ``registry`` registers them all with
:func:`~asyncbatch.register_format`. Importing this package imports none of them: the
public names below, the pieces of the per-shard document index a writer of its own needs
(``prepare``'s), load on first use.
"""

from __future__ import annotations

import importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .documents_index import index_path as index_path
    from .documents_index import per_shard_metadata as per_shard_metadata
    from .documents_index import shard_index_bytes as shard_index_bytes
    from .documents_index import shard_index_info as shard_index_info

_LAZY: dict[str, str] = {
    "index_path": "documents_index",
    "per_shard_metadata": "documents_index",
    "shard_index_bytes": "documents_index",
    "shard_index_info": "documents_index",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["index_path", "per_shard_metadata", "shard_index_bytes", "shard_index_info"]
