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

from ._base import GetsRanges as GetsRanges
from ._base import GetsVersionedRanges as GetsVersionedRanges
from ._base import ListsInfo as ListsInfo
from ._base import ObjectInfo as ObjectInfo
from ._base import Progress as Progress
from ._base import ReadsRanges as ReadsRanges
from ._base import ReadsTail as ReadsTail
from ._base import ResumesRanges as ResumesRanges
from ._base import Store as Store
from ._base import Unbounded as Unbounded
from ._base import Versioned as Versioned
from ._fsspec_store import fsspec_store as fsspec_store
from ._registry import open_store as open_store
from ._registry import register_store as register_store
from ._registry import registered_stores as registered_stores
from ._registry import scheme_of as scheme_of
from ._validate import check_options as check_options

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
