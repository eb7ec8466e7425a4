"""Checks of what a user configures: a store's URL and its ``storage_options``.

Mistakes here cannot be fixed by retrying, so they fail at once, before any request, with a
:class:`~asyncbatch._errors.ConfigError` that names the value and the fix.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping
from typing import Any

import fsspec

from .._errors import ConfigError

#: ``scheme:`` then at most one slash and something else: ``s3:/bucket/key``, ``s3:bucket``.
_SHORT_SLASHES = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(/?)(?!/)(.*)$", re.DOTALL)


def check_url(url: str, schemes: Collection[str]) -> None:
    """Refuse a URL whose scheme is not lower case, or that misses a slash after a known
    scheme (``s3:/bucket/key`` would otherwise be read as a local path); ``schemes`` are the
    registered ones (fsspec's protocols count too)."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        if scheme != scheme.lower():
            raise ConfigError(
                f"URL scheme {scheme!r} must be lower case: use {scheme.lower()}://{rest}"
                f" instead of {url}"
            )
        return
    match = _SHORT_SLASHES.match(url)
    if match is None:
        return
    scheme, slash, rest = match.group(1).lower(), match.group(2), match.group(3)
    # fsspec's own schemes only with a slash: some take none (data:text/plain,...).
    fsspec_knows = scheme in fsspec.registry or scheme in fsspec.available_protocols()
    if scheme in schemes or (slash and fsspec_knows):
        # file: keeps the path's own slash (file:/tmp/x is file:///tmp/x).
        fixed = f"{scheme}://{slash + rest if scheme == 'file' else rest}"
        raise ConfigError(f"URL {url!r} needs two slashes after '{match.group(1)}:': use {fixed}")


def check_options(store: str, options: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse ``storage_options`` the ``store`` does not take, listing those it does and the
    closest match of each unknown one."""
    unknown = sorted(set(options) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        if close:
            hints.append(f"did you mean {close[0]!r} for {name!r}?")
    hint = f" ({' '.join(hints)})" if hints else ""
    raise ConfigError(
        f"unknown storage_options for {store}: {', '.join(map(repr, unknown))}{hint};"
        f" known: {', '.join(sorted(known))}"
    )
