"""Public names of a package loaded on first use (PEP 562), so that importing the package
imports none of the modules that define them (``import asyncbatch`` loads neither numpy nor
torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, modules: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``namespace``, ``globals()``)
    for the names ``modules`` maps to the module defining each, relative to ``package``
    (``"_loader"``, ``".._layout"``)."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        relative = module if module.startswith(".") else f".{module}"
        value = getattr(importlib.import_module(relative, package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(modules))

    return __getattr__, __dir__
