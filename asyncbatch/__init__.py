"""asyncbatch: batches read straight from where the data lives.

The layers, from the bytes up (each imports only from those above it here; docs/design.md
has the full table, which tests/test_layers.py checks)::

    errors, batch, layout, checksums, handoff, transform, portal, ...   foundations
    sampling/   the order of samples: Feistel permutation, global and block shuffles,
                ranks, the tail, mixtures
    stores/     read byte ranges of objects: local files (preadv), S3, HTTP, any fsspec
                filesystem; one RetryPolicy for them all; DiskCache, the node-local cache
    manifest    the one file read to open a dataset; dataset: the Dataset it describes
    checks      verify=off|size|block|full on the read path; writer: shards + manifest;
                options: the loaders' options, typed and checked once (LoaderConfig)
    formats/    each format's reader and writer; formats.registry: register_format
    open        open_dataset, by the registered formats; verify: verify_dataset; mixture
    engine      asyncio: planned reads into one buffer per batch, bounded, in order
    loader      Loader (sync iterator on a background loop thread) and AsyncLoader
    workers     LoaderDataset: the loader inside torch DataLoader worker processes
    _prepare/   a raw corpus (JSONL, Parquet, text) tokenized into a documents dataset, in
                units run in a process pool or as Ray tasks
    cli         ``asyncbatch demo | inspect | verify | cache | prepare``
"""

from __future__ import annotations

import importlib
import typing as _typing

# Errors import nothing else; everything that needs numpy or torch loads on first use.
from .errors import AsyncBatchError as AsyncBatchError
from .errors import BucketNotFoundError as BucketNotFoundError
from .errors import CacheWarning as CacheWarning
from .errors import ChecksumError as ChecksumError
from .errors import ConfigError as ConfigError
from .errors import CredentialsError as CredentialsError
from .errors import EndpointError as EndpointError
from .errors import FormatError as FormatError
from .errors import LoaderClosedError as LoaderClosedError
from .errors import ManifestError as ManifestError
from .errors import NotFoundError as NotFoundError
from .errors import PermissionDeniedError as PermissionDeniedError
from .errors import RangeNotSupportedError as RangeNotSupportedError
from .errors import RecordError as RecordError
from .errors import ResumeStateError as ResumeStateError
from .errors import RetriesExhaustedError as RetriesExhaustedError
from .errors import ShardChangedError as ShardChangedError
from .errors import ShortReadError as ShortReadError
from .errors import SlowPathWarning as SlowPathWarning
from .errors import StoreError as StoreError
from .errors import StoreTimeoutError as StoreTimeoutError
from .errors import ThrottledError as ThrottledError
from .errors import TransformError as TransformError
from .errors import UnknownSchemeError as UnknownSchemeError

if _typing.TYPE_CHECKING:
    from ._prepare.driver import PrepareReport as PrepareReport
    from ._prepare.driver import prepare as prepare
    from .batch import Batch as Batch
    from .batch import FieldSchema as FieldSchema
    from .batch import Jagged as Jagged
    from .batch import Strings as Strings
    from .dataset import Dataset as Dataset
    from .formats.documents_write import write_documents as write_documents
    from .formats.documents_write import write_documents_async as write_documents_async
    from .formats.llmbatch_write import write_llmbatch as write_llmbatch
    from .formats.llmbatch_write import write_llmbatch_async as write_llmbatch_async
    from .formats.metadata_codecs import register_codec as register_codec
    from .formats.metadata_write import write_metadata_stream as write_metadata_stream
    from .formats.metadata_write import (
        write_metadata_stream_async as write_metadata_stream_async,
    )
    from .formats.registry import register_format as register_format
    from .handoff import LoaderStatistics as LoaderStatistics
    from .handoff import QueueStatistics as QueueStatistics
    from .loader import AsyncLoader as AsyncLoader
    from .loader import Loader as Loader
    from .mixture import Mixture as Mixture
    from .mixture import mix as mix
    from .open import open_dataset as open_dataset
    from .open import open_dataset_async as open_dataset_async
    from .options import LoaderConfig as LoaderConfig
    from .options import LoaderOptions as LoaderOptions
    from .stores import register_store as register_store
    from .stores.disk_cache import DiskCache as DiskCache
    from .stores.retry import RetryPolicy as RetryPolicy
    from .workers import LoaderDataset as LoaderDataset
    from .writer import write_tokens as write_tokens
    from .writer import write_tokens_async as write_tokens_async

#: Where each public name that needs numpy or torch lives, imported on first use, so that
#: ``import asyncbatch`` and ``asyncbatch --help`` start in milliseconds, not seconds.
_LAZY: dict[str, str] = {
    "Batch": "batch",
    "FieldSchema": "batch",
    "Jagged": "batch",
    "Strings": "batch",
    "Dataset": "dataset",
    "write_documents": "formats.documents_write",
    "write_documents_async": "formats.documents_write",
    "write_llmbatch": "formats.llmbatch_write",
    "write_llmbatch_async": "formats.llmbatch_write",
    "register_codec": "formats.metadata_codecs",
    "write_metadata_stream": "formats.metadata_write",
    "write_metadata_stream_async": "formats.metadata_write",
    "register_format": "formats.registry",
    "LoaderStatistics": "handoff",
    "QueueStatistics": "handoff",
    "AsyncLoader": "loader",
    "Loader": "loader",
    "Mixture": "mixture",
    "mix": "mixture",
    "open_dataset": "open",
    "open_dataset_async": "open",
    "LoaderConfig": "options",
    "LoaderOptions": "options",
    "PrepareReport": "_prepare.driver",
    "prepare": "_prepare.driver",
    "register_store": "stores",
    "DiskCache": "stores.disk_cache",
    "RetryPolicy": "stores.retry",
    "LoaderDataset": "workers",
    "write_tokens": "writer",
    "write_tokens_async": "writer",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AsyncBatchError",
    "AsyncLoader",
    "Batch",
    "BucketNotFoundError",
    "CacheWarning",
    "ChecksumError",
    "ConfigError",
    "CredentialsError",
    "Dataset",
    "DiskCache",
    "EndpointError",
    "FieldSchema",
    "FormatError",
    "Jagged",
    "Loader",
    "LoaderClosedError",
    "LoaderConfig",
    "LoaderDataset",
    "LoaderOptions",
    "LoaderStatistics",
    "ManifestError",
    "Mixture",
    "NotFoundError",
    "PermissionDeniedError",
    "PrepareReport",
    "QueueStatistics",
    "RangeNotSupportedError",
    "RecordError",
    "ResumeStateError",
    "RetriesExhaustedError",
    "RetryPolicy",
    "ShardChangedError",
    "ShortReadError",
    "SlowPathWarning",
    "StoreError",
    "StoreTimeoutError",
    "Strings",
    "ThrottledError",
    "TransformError",
    "UnknownSchemeError",
    "mix",
    "open_dataset",
    "open_dataset_async",
    "prepare",
    "register_codec",
    "register_format",
    "register_store",
    "write_documents",
    "write_documents_async",
    "write_llmbatch",
    "write_llmbatch_async",
    "write_metadata_stream",
    "write_metadata_stream_async",
    "write_tokens",
    "write_tokens_async",
]
