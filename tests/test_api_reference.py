"""The API reference (docs/api.md through mkdocstrings) shows what a user reads: no raw
Sphinx role and no private base class, for every public name and its members."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import griffe

import asyncbatch as ab

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r":[a-z]+:`")


def load_extension() -> griffe.Extension:
    spec = importlib.util.spec_from_file_location("griffe_roles", ROOT / "scripts/griffe_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    extension: griffe.Extension = module.SphinxRoles()
    return extension


def test_public_names_render_without_roles_or_private_bases() -> None:
    package = griffe.load(
        "asyncbatch",
        search_paths=[str(ROOT)],
        extensions=griffe.load_extensions(load_extension()),
        resolve_aliases=True,
    )
    for name in ab.__all__:
        obj = package[name].final_target
        objects = [obj, *(m for m in obj.members.values() if not m.name.startswith("_"))]
        for item in objects:
            if item.is_alias and not item.resolved:
                continue
            text = item.docstring.value if item.docstring else ""
            assert not ROLE.search(text), f"{item.path}: {ROLE.search(text)}"
        if isinstance(obj, griffe.Class):
            private = [str(b) for b in obj.bases if str(b).rsplit(".", 1)[-1].startswith("_")]
            assert not private, f"{obj.path} shows {private}"
    # Without the extension both are there: the checks above can fail.
    raw = griffe.load("asyncbatch", search_paths=[str(ROOT)], resolve_aliases=True)
    loader = raw["Loader"].final_target
    assert ROLE.search(loader.docstring.value)
    assert any(str(b).rsplit(".", 1)[-1].startswith("_") for b in loader.bases)
