"""The format registry: which source reads each ``manifest.format``, which openers find data
in layouts without a manifest, and which formats read index arrays at open.

Every format, built in or not, is added by :func:`register_format`; the built-in ones are
registered at the end of this module, in one place. The format modules themselves register
nothing, so importing one has no side effect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from ._arrow import ARROW_OPENER, arrow_rows
from ._base import Opener, Source, SourceFactory
from ._documents import documents, load_document_index
from ._llmbatch import OPENER as LLMBATCH_OPENER
from ._llmbatch import llmbatch_records
from ._megatron import MEGATRON_OPENER
from ._megatron_source import megatron_documents
from ._metadata import load_metadata_layout, metadata_windows
from ._npy import NPY_OPENER, RAW_OPENER
from ._parquet import PARQUET_OPENER, parquet_rows
from ._tokens import token_windows
from ._webdataset import WEBDATASET_OPENER, webdataset_samples

if TYPE_CHECKING:
    from .._dataset import Dataset
    from ..stores._base import Store

#: ``load(dataset, store) -> dataset``: read a dataset's index arrays (document offsets, ...)
#: into ``Dataset.arrays`` after its manifest is read.
IndexLoader = Callable[["Dataset", "Store"], Awaitable["Dataset"]]

_SOURCES: dict[str, SourceFactory] = {}
_INDEX_LOADERS: dict[str, IndexLoader] = {}
_OPENERS: dict[str, Opener] = {}  # in registration order: the order claims and probes run

#: Source factories by ``manifest.format`` (read-only; add with :func:`register_format`).
FORMATS: Mapping[str, SourceFactory] = MappingProxyType(_SOURCES)
#: Index loaders by ``manifest.format`` (read-only).
INDEX_LOADERS: Mapping[str, IndexLoader] = MappingProxyType(_INDEX_LOADERS)


def openers() -> tuple[Opener, ...]:
    """The openers of layouts without a manifest, in the order they are tried."""
    return tuple(_OPENERS.values())


def register_format(
    name: str,
    *,
    source: SourceFactory | None = None,
    index_loader: IndexLoader | None = None,
    opener: Opener | None = None,
    clobber: bool = False,
) -> None:
    """Register the format ``name``; refuses to replace a registered part unless ``clobber``.

    ``source(datasets, *, seq_len, next_token, dtype, **options)`` builds the
    :class:`~asyncbatch.formats._base.Source` of datasets whose manifest says
    ``"format": name``. ``index_loader(dataset, store)`` reads their index arrays at open.
    ``opener`` (its ``name`` must be ``name``) opens data of this layout that has no
    manifest; ``open_dataset(format=name)`` picks it, and it joins the openers tried, after
    those registered before it, when no format is named.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a format name must be a non-empty string, got {name!r}")
    if source is None and index_loader is None and opener is None:
        raise ConfigError(f"register_format({name!r}): give a source, index_loader or opener")
    if opener is not None and opener.name != name:
        raise ConfigError(f"register_format({name!r}): the opener is named {opener.name!r}")
    parts: list[tuple[dict[str, Any], Any]] = [
        (_SOURCES, source),
        (_INDEX_LOADERS, index_loader),
        (_OPENERS, opener),
    ]
    for table, part in parts:  # check all before changing any: a refusal changes nothing
        if part is not None and not clobber and name in table and table[name] is not part:
            raise ConfigError(
                f"format {name!r} is already registered (pass clobber=True to replace it)"
            )
    for table, part in parts:
        if part is not None:
            table[name] = part


def one_format(datasets: Sequence[Dataset]) -> str:
    """The format of ``datasets``; a ConfigError naming each one's when they differ."""
    kinds = {d.manifest.format for d in datasets}
    if len(kinds) != 1:
        urls = ", ".join(f"{d.url} ({d.manifest.format})" for d in datasets)
        raise ConfigError(
            f"a mixture must be of one format, got {urls}: one source reads every batch, and"
            " the formats' fields differ (a token stream has no documents, rows have no"
            " windows); write the datasets in one format"
        )
    return kinds.pop()


def make_source(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool = False,
    dtype: Any = None,
    options: Mapping[str, Any] | None = None,
) -> Source:
    """The source for ``datasets`` (all of one format), with format-specific ``options``."""
    kind = one_format(datasets)
    factory = FORMATS.get(kind)
    if factory is None:
        raise ConfigError(
            f"{datasets[0].url} holds format {kind!r}, which this asyncbatch cannot read"
            f" (known: {', '.join(sorted(FORMATS))})"
        )
    return factory(
        datasets, seq_len=seq_len, next_token=next_token, dtype=dtype, **dict(options or {})
    )


def _register_builtin_formats() -> None:
    """The formats asyncbatch reads out of the box; openers in the order they are tried."""
    register_format("tokens", source=token_windows)
    register_format("documents", source=documents, index_loader=load_document_index)
    register_format("metadata_stream", source=metadata_windows, index_loader=load_metadata_layout)
    register_format("megatron", source=megatron_documents, opener=MEGATRON_OPENER)
    register_format("npy", opener=NPY_OPENER)
    register_format("raw", opener=RAW_OPENER)
    register_format("llmbatch", source=llmbatch_records, opener=LLMBATCH_OPENER)
    register_format("parquet", source=parquet_rows, opener=PARQUET_OPENER)
    register_format("arrow", source=arrow_rows, opener=ARROW_OPENER)
    register_format("webdataset", source=webdataset_samples, opener=WEBDATASET_OPENER)


_register_builtin_formats()
