"""The package's modules form layers without an import circle.

Every ``import`` of an asyncbatch module, at module level or inside a function (or under
``TYPE_CHECKING``), is an edge of the graph read here with :mod:`ast`. The graph must be
acyclic, and each module may import only from its own layer or lower ones, as the layer
table of docs/design.md states; every module must appear in that table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncbatch"
DESIGN = ROOT / "docs" / "design.md"


def module_names() -> dict[str, Path]:
    """``"stores/base"``-style names (``"__init__"``: the package) to their files."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).with_suffix("").as_posix()
        names[name] = path
    return names


def is_extension(name: str) -> bool:
    """Whether ``name`` is a C extension module of the package (its source or a build)."""
    folder, _, stem = (PACKAGE / name).as_posix().rpartition("/")
    return any(Path(folder).glob(f"{stem}.c")) or any(Path(folder).glob(f"{stem}.*.so"))


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The asyncbatch modules ``name`` imports anywhere in its file."""
    package = name.split("/")[:-1]  # the package an ``from . import`` starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [
                a.name.split(".", 1)[1] if "." in a.name else ""
                for a in node.names
                if a.name.split(".")[0] == "asyncbatch"
            ]
            targets = [t.replace(".", "/") for t in targets]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif (node.module or "").split(".")[0] == "asyncbatch":
                base = []
                node.module = node.module.split(".", 1)[1] if "." in node.module else None
            else:
                continue
            module = "/".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:  # ``from .formats import tokens``: the submodule
                sub = f"{module}/{alias.name}" if module else alias.name
                if is_extension(sub):
                    continue  # a compiled module (stores/_preadv.c) imports nothing of ours
                targets.append(sub if sub in known or f"{sub}/__init__" in known else module)
        for target in targets:
            target = target if target in known else f"{target}/__init__".lstrip("/")
            assert target in known, f"{name} imports unknown module {target}"
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imported(name, path, set(names)) for name, path in names.items()}


def documented_layers() -> list[list[str]]:
    """The layer table of docs/design.md, lowest first: each row's module names, where
    ``stores/`` stands for every module of that package not named on its own."""
    text = DESIGN.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    layers = []
    for expected, row in enumerate(rows):
        number = int(row.split("|")[1])
        assert number == expected, f"layer rows must be numbered 0, 1, 2, ...: {row}"
        layers.append(re.findall(r"`([^`]+)`", row.split("|")[2]))
    return layers


def layer_of(names: list[str]) -> dict[str, int]:
    layers = documented_layers()
    exact = {m: k for k, row in enumerate(layers) for m in row if not m.endswith("/")}
    packages = {m: k for k, row in enumerate(layers) for m in row if m.endswith("/")}
    out = {}
    for name in names:
        if name in exact:
            out[name] = exact[name]
            continue
        owners = [p for p in packages if name.startswith(p)]
        if owners:
            out[name] = packages[max(owners, key=len)]
    return out


def test_every_module_is_in_the_layer_table() -> None:
    names = sorted(module_names())
    layers = layer_of(names)
    assert [n for n in names if n not in layers] == []
    listed = {m for row in documented_layers() for m in row}
    stale = [m for m in listed if not m.endswith("/") and m not in names]
    assert stale == [], "the layer table names modules that do not exist"


def test_no_import_circle() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_modules_import_only_their_own_layer_or_lower() -> None:
    graph = import_graph()
    layers = layer_of(sorted(graph))
    upward = [
        f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if name in layers and target in layers and layers[target] > layers[name]
    ]
    assert upward == []


def test_the_graph_sees_function_level_imports() -> None:
    """The check itself: an import inside a function body is an edge (cli imports the
    writer only when ``asyncbatch write`` runs)."""
    assert "_writer" in import_graph()["_cli"]


def test_the_engine_knows_no_checksums() -> None:
    """The loader assembles the store stack, checks layer included (``StoreStack``); the
    engine reads through it and imports nothing of verification."""
    assert not import_graph()["_engine"] & {"_checks", "_checksums", "stores/_checked"}
