"""Stores: the only code that touches I/O (local files, S3, HTTP, fsspec filesystems, plug-ins).

An adapter returns ``ObjectInfo`` from ``stat``; a resumable one advances a ``Progress``; see
docs/adapters.md."""

from __future__ import annotations

from .base import ObjectInfo as ObjectInfo
from .base import Progress as Progress
from .base import Store as Store
from .registry import open_store as open_store
from .registry import register_store as register_store
from .registry import registered_stores as registered_stores
from .registry import scheme_of as scheme_of

__all__ = [
    "ObjectInfo",
    "Progress",
    "Store",
    "open_store",
    "register_store",
    "registered_stores",
    "scheme_of",
]
