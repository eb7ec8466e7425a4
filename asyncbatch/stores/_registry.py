"""URL scheme → store factory, and the stack built over what the factory returns.

Built-in schemes are import strings, loaded on first use. Third-party packages add schemes
through the ``asyncbatch.stores`` entry-point group (``scheme = "package.module:factory"``,
looked up again whenever a scheme is unknown, so a package installed after import is found)
or :func:`register_store`. Any other protocol fsspec resolves (its known implementations
and classes added with ``fsspec.register_implementation``) is served by the fsspec
transport.

A factory is called as ``factory(scheme, storage_options, max_inflight=N, retry=policy)``
and returns a transport (see :mod:`~asyncbatch.stores._base`); ``retry`` (a
:class:`~asyncbatch.stores._retry.RetryPolicy`) is passed only to factories that accept it,
so factories written before it existed keep working. The registry stacks the guards of
:mod:`~asyncbatch.stores._stack` over it, whatever the factory accepted.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import fsspec

from .._errors import ConfigError, UnknownSchemeError
from ._base import ObjectInfo, Store
from ._cache import CachedStore
from ._checked import CheckedStore, Expected
from ._counting import ReadCounts
from ._disk_cache import DiskCache
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._stack import stacked
from ._validate import check_url

#: Returns a transport: at least ``get_ranges`` (or ``read_ranges``) and ``stat``.
StoreFactory = Callable[..., object]

ENTRY_POINT_GROUP = "asyncbatch.stores"

_BUILTIN: dict[str, str] = {
    "file": "asyncbatch.stores._local:local_store",
    "s3": "asyncbatch.stores._s3:s3_store",
    "s3a": "asyncbatch.stores._s3:s3_store",
    "http": "asyncbatch.stores._http:http_store",
    "https": "asyncbatch.stores._http:http_store",
    "az": "asyncbatch.stores._azure:azure_store",
    "abfs": "asyncbatch.stores._azure:azure_store",
    "abfss": "asyncbatch.stores._azure:azure_store",
    "gs": "asyncbatch.stores._gcs:gcs_store",
    "gcs": "asyncbatch.stores._gcs:gcs_store",
}

#: The extra that installs a built-in store's packages.
_EXTRAS = {"s3": "s3", "s3a": "s3", "http": "http", "https": "http"}
_EXTRAS |= {"az": "azure", "abfs": "azure", "abfss": "azure", "gs": "gcs", "gcs": "gcs"}

_registry: dict[str, StoreFactory | str] = dict(_BUILTIN)
#: Schemes found served by fsspec (and no entry point) at their first use.
_fsspec_served: set[str] = set()

#: Read-only view of the registered schemes (values: factories or import strings).
registered_stores: Mapping[str, StoreFactory | str] = MappingProxyType(_registry)


def register_store(scheme: str, factory: StoreFactory | str, *, clobber: bool = False) -> None:
    """Serve URLs of ``scheme`` with ``factory``; refuses to replace one unless ``clobber``."""
    scheme = scheme.lower()
    if not clobber and scheme in _registry and _registry[scheme] != factory:
        raise ConfigError(
            f"a store is already registered for scheme {scheme!r}: {_registry[scheme]!r}"
            " (pass clobber=True to replace it)"
        )
    _registry[scheme] = factory


def scheme_of(url: str) -> str:
    """The URL's scheme; ``file`` for plain paths."""
    if "://" not in url:
        return "file"
    return urlsplit(url).scheme.lower() or "file"


def _load_entry_points() -> None:
    """Add the entry points' schemes; those registered in code win."""
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(entry.name.lower(), entry.value)


def _fsspec_knows(scheme: str) -> bool:
    """Whether fsspec resolves ``scheme``: a known implementation, or a class registered with
    ``fsspec.register_implementation`` (which ``available_protocols()`` does not list)."""
    return scheme in fsspec.registry or scheme in fsspec.available_protocols()


def _resolve(scheme: str, target: StoreFactory | str) -> StoreFactory:
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    try:
        factory: StoreFactory = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        extra = f"; pip install 'asyncbatch[{_EXTRAS[scheme]}]'" if scheme in _EXTRAS else ""
        raise ConfigError(f"the {scheme!r} store needs a package: {exc}{extra}") from exc
    return factory


def _accepts_retry(factory: StoreFactory) -> bool:
    """Whether ``factory`` takes the ``retry`` keyword (or any keyword)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume the old signature
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "retry" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def store_factory(scheme: str) -> StoreFactory:
    """The factory serving ``scheme``; raises :class:`UnknownSchemeError` if none does."""
    # Scanning entry points costs ~20 ms: done for a scheme nobody serves yet, and once
    # for a scheme fsspec serves (an installed plug-in may take it over).
    if scheme not in _registry and scheme not in _fsspec_served:
        _load_entry_points()
    target = _registry.get(scheme)
    if target is None and _fsspec_knows(scheme):
        _fsspec_served.add(scheme)
        target = "asyncbatch.stores._fsspec_store:fsspec_store"
    if target is None:
        known = ", ".join(sorted(_registry))
        # Schemes are short: one wrong letter of two ("s4") is still a likely typo.
        close = difflib.get_close_matches(scheme, sorted(_registry), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownSchemeError(
            f"no store for URL scheme {scheme!r}{hint}; registered: {known}; add one with"
            " asyncbatch.register_store or the 'asyncbatch.stores' entry-point group",
            scheme,
        )
    return _resolve(scheme, target)


def open_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    max_inflight: int = 64,
    retry: RetryPolicy | None = None,
    counts: ReadCounts | None = None,
    cache: DiskCache | None = None,
    seen: dict[str, ObjectInfo] | None = None,
    expected: Expected | None = None,
    pins: Mapping[str, str] | None = None,
) -> Store:
    """A new store for ``url``'s scheme, to be used (and closed) in the current event loop.

    Every URL a dataset, loader or writer opens passes here, so this is where a malformed
    one (``S3://b/k``, ``s3:/b/k``) is refused, before any request. The stack, from the
    top: the checks against what is ``expected`` of each object (if given: sizes, block or
    whole checksums, see :mod:`~asyncbatch.stores._checked`), the node-local ``cache`` (if
    any; ``seen`` keeps what it stat'ed across a loader's stores; it vets the blocks it
    fetches against the ``expected`` block checksums), the guards of
    :func:`~asyncbatch.stores._stack.stacked` (exact lengths, pins, typed errors, retries
    and timeouts under ``retry``; objects of ``pins`` pinned at those versions from the
    start; the transport's byte-range reads counted in ``counts``), the transport.
    """
    check_url(url, _registry)
    scheme = scheme_of(url)
    factory = store_factory(scheme)
    options = dict(storage_options or {})
    policy = retry or DEFAULT_POLICY
    if _accepts_retry(factory):
        transport = factory(scheme, options, max_inflight=max_inflight, retry=policy)
    else:
        transport = factory(scheme, options, max_inflight=max_inflight)
    store = stacked(transport, policy, pins, counts)
    if cache is not None:
        check = None if expected is None else expected.fill_check()
        store = CachedStore(store, cache, counts, seen, check)
    return store if expected is None else CheckedStore(store, expected)
