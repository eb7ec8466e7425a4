"""URL scheme → store factory.

Built-in schemes are import strings, loaded on first use. Third-party packages add schemes
through the ``asyncbatch.stores`` entry-point group (``scheme = "package.module:factory"``)
or :func:`register_store`. Any other scheme fsspec knows is served by the fsspec store.

A factory is called as ``factory(scheme, storage_options, max_inflight=N)`` and returns an
object implementing :class:`~asyncbatch.stores.base.Store`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import fsspec

from ..errors import ConfigError, UnknownSchemeError
from .base import Store

StoreFactory = Callable[..., Store]

ENTRY_POINT_GROUP = "asyncbatch.stores"

_BUILTIN: dict[str, str] = {
    "file": "asyncbatch.stores.local:local_store",
    "s3": "asyncbatch.stores.fsspec_store:fsspec_store",
    "s3a": "asyncbatch.stores.fsspec_store:fsspec_store",
    "http": "asyncbatch.stores.fsspec_store:fsspec_store",
    "https": "asyncbatch.stores.fsspec_store:fsspec_store",
}

_registry: dict[str, StoreFactory | str] = dict(_BUILTIN)
_entry_points_loaded = False

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
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(entry.name.lower(), entry.value)


def _resolve(target: StoreFactory | str) -> StoreFactory:
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    factory: StoreFactory = getattr(importlib.import_module(module), name)
    return factory


def store_factory(scheme: str) -> StoreFactory:
    """The factory serving ``scheme``; raises :class:`UnknownSchemeError` if none does."""
    _load_entry_points()
    target = _registry.get(scheme)
    if target is None and scheme in fsspec.available_protocols():
        target = "asyncbatch.stores.fsspec_store:fsspec_store"
    if target is None:
        known = ", ".join(sorted(_registry))
        raise UnknownSchemeError(
            f"no store for URL scheme {scheme!r}; registered: {known}; add one with"
            " asyncbatch.register_store or the 'asyncbatch.stores' entry-point group",
            scheme,
        )
    return _resolve(target)


def open_store(
    url: str, storage_options: Mapping[str, Any] | None = None, *, max_inflight: int = 64
) -> Store:
    """A new store for ``url``'s scheme, to be used (and closed) in the current event loop."""
    scheme = scheme_of(url)
    return store_factory(scheme)(scheme, dict(storage_options or {}), max_inflight=max_inflight)
