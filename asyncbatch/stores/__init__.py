"""Stores: the only code that touches I/O (local files, S3, HTTP, GCS, Azure, fsspec
filesystems, plug-ins).

The public names are what an adapter implements and uses (docs/adapters.md): the
transport protocols (``GetsRanges`` and ``Versioned`` at least), ``ObjectInfo`` (what
``stat`` returns), ``Progress`` (what a resumable read advances), ``Unbounded``,
``check_options`` (unknown storage options refused with the closest name), the registry
(``register_store``, ``open_store``, ...) and ``fsspec_store``, the factory for any fsspec
protocol (``register_store("gs", "asyncbatch.stores:fsspec_store")``).
"""

from __future__ import annotations

from .base import GetsRanges as GetsRanges
from .base import GetsVersionedRanges as GetsVersionedRanges
from .base import ListsInfo as ListsInfo
from .base import ObjectInfo as ObjectInfo
from .base import Progress as Progress
from .base import ReadsRanges as ReadsRanges
from .base import ReadsTail as ReadsTail
from .base import ResumesRanges as ResumesRanges
from .base import Store as Store
from .base import Unbounded as Unbounded
from .base import Versioned as Versioned
from .fsspec_store import fsspec_store as fsspec_store
from .registry import open_store as open_store
from .registry import register_store as register_store
from .registry import registered_stores as registered_stores
from .registry import scheme_of as scheme_of
from .validate import check_options as check_options

__all__ = [
    "GetsRanges",
    "GetsVersionedRanges",
    "ListsInfo",
    "ObjectInfo",
    "Progress",
    "ReadsRanges",
    "ReadsTail",
    "ResumesRanges",
    "Store",
    "Unbounded",
    "Versioned",
    "check_options",
    "fsspec_store",
    "open_store",
    "register_store",
    "registered_stores",
    "scheme_of",
]
