"""Formats: how a sample maps to byte spans and how bytes decode into fields.

Each format registers a source factory under its ``manifest.format`` name in
:data:`~asyncbatch.formats.base.FORMATS`; layouts without an asyncbatch manifest (data users
already have) register an :class:`~asyncbatch.formats.base.Opener` in
:data:`~asyncbatch.formats.base.OPENERS`.
"""

from __future__ import annotations

from .base import FORMATS as FORMATS
from .base import INDEX_LOADERS as INDEX_LOADERS
from .base import OPENERS as OPENERS
from .base import Opener as Opener
from .base import PlannedSource as PlannedSource
from .base import Source as Source
from .base import make_source as make_source
from .documents import documents, load_document_index
from .llmbatch import OPENER as LLMBATCH_OPENER
from .llmbatch import llmbatch_records
from .megatron import MEGATRON_OPENER
from .metadata import load_metadata_layout, metadata_windows
from .npy import NPY_OPENER, RAW_OPENER
from .parquet import PARQUET_OPENER, parquet_rows
from .tokens import TokenWindows as TokenWindows
from .tokens import token_windows

FORMATS["tokens"] = token_windows
FORMATS["documents"] = documents
INDEX_LOADERS["documents"] = load_document_index
FORMATS["metadata_stream"] = metadata_windows
INDEX_LOADERS["metadata_stream"] = load_metadata_layout
OPENERS.extend([MEGATRON_OPENER, NPY_OPENER, RAW_OPENER])
FORMATS["llmbatch"] = llmbatch_records
OPENERS.append(LLMBATCH_OPENER)
FORMATS["parquet"] = parquet_rows
OPENERS.append(PARQUET_OPENER)

__all__ = [
    "FORMATS",
    "INDEX_LOADERS",
    "OPENERS",
    "Opener",
    "PlannedSource",
    "Source",
    "TokenWindows",
    "make_source",
]
