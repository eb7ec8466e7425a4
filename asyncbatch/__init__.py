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
    plan        plan(): the cost of a run, before it starts, from the loader's own planning
    cli         ``asyncbatch demo | inspect | verify | cache | prepare | index | plan``
"""

from __future__ import annotations

import typing as _typing

# Errors import nothing else; everything that needs numpy or torch loads on first use.
from ._errors import AsyncBatchError as AsyncBatchError
from ._errors import BucketNotFoundError as BucketNotFoundError
from ._errors import CacheWarning as CacheWarning
from ._errors import ChecksumError as ChecksumError
from ._errors import ConfigError as ConfigError
from ._errors import CredentialsError as CredentialsError
from ._errors import DecodeError as DecodeError
from ._errors import EndpointError as EndpointError
from ._errors import FormatError as FormatError
from ._errors import LoaderClosedError as LoaderClosedError
from ._errors import ManifestError as ManifestError
from ._errors import NotFoundError as NotFoundError
from ._errors import PermissionDeniedError as PermissionDeniedError
from ._errors import RangeNotSupportedError as RangeNotSupportedError
from ._errors import RecordError as RecordError
from ._errors import ResumeStateError as ResumeStateError
from ._errors import RetriesExhaustedError as RetriesExhaustedError
from ._errors import ShardChangedError as ShardChangedError
from ._errors import ShortReadError as ShortReadError
from ._errors import SlowPathWarning as SlowPathWarning
from ._errors import StoreError as StoreError
from ._errors import StoreTimeoutError as StoreTimeoutError
from ._errors import ThrottledError as ThrottledError
from ._errors import TransformError as TransformError
from ._errors import UnknownSchemeError as UnknownSchemeError
from ._lazy import lazy_names as _lazy_names

if _typing.TYPE_CHECKING:
    from ._batch import Batch as Batch
    from ._batch import FieldSchema as FieldSchema
    from ._batch import Jagged as Jagged
    from ._batch import Strings as Strings
    from ._dataset import Dataset as Dataset
    from ._handoff import LoaderStatistics as LoaderStatistics
    from ._handoff import QueueStatistics as QueueStatistics
    from ._loader import AsyncLoader as AsyncLoader
    from ._loader import Loader as Loader
    from ._loader import MixtureStatistics as MixtureStatistics
    from ._mixture import Mixture as Mixture
    from ._mixture import mix as mix
    from ._open import open_dataset as open_dataset
    from ._open import open_dataset_async as open_dataset_async
    from ._options import LoaderConfig as LoaderConfig
    from ._options import LoaderOptions as LoaderOptions
    from ._plan import Plan as Plan
    from ._plan import plan as plan
    from ._prepare.driver import PrepareReport as PrepareReport
    from ._prepare.driver import prepare as prepare
    from ._workers import LoaderDataset as LoaderDataset
    from ._writer import write_tokens as write_tokens
    from ._writer import write_tokens_async as write_tokens_async
    from .formats._documents_write import write_documents as write_documents
    from .formats._documents_write import write_documents_async as write_documents_async
    from .formats._llmbatch_write import write_llmbatch as write_llmbatch
    from .formats._llmbatch_write import write_llmbatch_async as write_llmbatch_async
    from .formats._metadata_codecs import register_codec as register_codec
    from .formats._metadata_write import write_metadata_stream as write_metadata_stream
    from .formats._metadata_write import (
        write_metadata_stream_async as write_metadata_stream_async,
    )
    from .formats._registry import register_format as register_format
    from .formats._webdataset_write import IndexReport as IndexReport
    from .formats._webdataset_write import index_webdataset as index_webdataset
    from .formats._webdataset_write import index_webdataset_async as index_webdataset_async
    from .formats._webdataset_write import write_webdataset as write_webdataset
    from .formats._webdataset_write import write_webdataset_async as write_webdataset_async
    from .sampling._schedule import Schedule as Schedule
    from .stores import register_store as register_store
    from .stores._disk_cache import DiskCache as DiskCache
    from .stores._retry import RetryPolicy as RetryPolicy

#: Where each public name that needs numpy or torch lives, imported on first use, so that
#: ``import asyncbatch`` and ``asyncbatch --help`` start in milliseconds, not seconds.
_LAZY: dict[str, str] = {
    "Batch": "_batch",
    "FieldSchema": "_batch",
    "Jagged": "_batch",
    "Strings": "_batch",
    "Dataset": "_dataset",
    "write_documents": "formats._documents_write",
    "write_documents_async": "formats._documents_write",
    "write_llmbatch": "formats._llmbatch_write",
    "write_llmbatch_async": "formats._llmbatch_write",
    "register_codec": "formats._metadata_codecs",
    "write_metadata_stream": "formats._metadata_write",
    "write_metadata_stream_async": "formats._metadata_write",
    "register_format": "formats._registry",
    "IndexReport": "formats._webdataset_write",
    "index_webdataset": "formats._webdataset_write",
    "index_webdataset_async": "formats._webdataset_write",
    "write_webdataset": "formats._webdataset_write",
    "write_webdataset_async": "formats._webdataset_write",
    "LoaderStatistics": "_handoff",
    "QueueStatistics": "_handoff",
    "AsyncLoader": "_loader",
    "Loader": "_loader",
    "MixtureStatistics": "_loader",
    "Mixture": "_mixture",
    "mix": "_mixture",
    "open_dataset": "_open",
    "open_dataset_async": "_open",
    "LoaderConfig": "_options",
    "LoaderOptions": "_options",
    "Plan": "_plan",
    "Schedule": "sampling._schedule",
    "plan": "_plan",
    "PrepareReport": "_prepare.driver",
    "prepare": "_prepare.driver",
    "register_store": "stores",
    "DiskCache": "stores._disk_cache",
    "RetryPolicy": "stores._retry",
    "LoaderDataset": "_workers",
    "write_tokens": "_writer",
    "write_tokens_async": "_writer",
}


__getattr__, __dir__ = _lazy_names(__name__, _LAZY, globals())


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
    "DecodeError",
    "DiskCache",
    "EndpointError",
    "FieldSchema",
    "FormatError",
    "IndexReport",
    "Jagged",
    "Loader",
    "LoaderClosedError",
    "LoaderConfig",
    "LoaderDataset",
    "LoaderOptions",
    "LoaderStatistics",
    "ManifestError",
    "Mixture",
    "MixtureStatistics",
    "NotFoundError",
    "PermissionDeniedError",
    "Plan",
    "PrepareReport",
    "QueueStatistics",
    "RangeNotSupportedError",
    "RecordError",
    "ResumeStateError",
    "RetriesExhaustedError",
    "RetryPolicy",
    "Schedule",
    "ShardChangedError",
    "ShortReadError",
    "SlowPathWarning",
    "StoreError",
    "StoreTimeoutError",
    "Strings",
    "ThrottledError",
    "TransformError",
    "UnknownSchemeError",
    "index_webdataset",
    "index_webdataset_async",
    "mix",
    "open_dataset",
    "open_dataset_async",
    "plan",
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
    "write_webdataset",
    "write_webdataset_async",
]
