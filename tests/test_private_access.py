"""asyncbatch touches no private attribute of another library (botocore, aiobotocore, s3fs,
...): a release of one could remove it and silently change what asyncbatch does (before, a
missing botocore attribute sent every S3 GET through botocore's 3.9x slower path).

The check reads the source (``ast``): an attribute whose name starts with one underscore
(``x._name``, or ``getattr(x, "_name")``) on anything but ``self`` or ``cls`` must be a name
asyncbatch itself defines (assigns, or defines as a function, class or slot), else it belongs
to another library. fsspec's async methods (``fs._cat_file``, or reached as
``getattr(fs, f"_{method}")``) are its documented async interface, not private attributes.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "asyncbatch"

#: Underscore names that the standard library documents as public.
DOCUMENTED = {
    "_exit",  # os._exit
    "_asdict",  # namedtuple
    "_replace",
    "_fields",
    "_make",
}

#: Private attributes of other libraries that asyncbatch still reads, outside the stores
#: (file, attribute): a ProcessPoolExecutor's processes (to end them when the driver dies),
#: tiktoken's pattern (to tell tokenizers apart). Each reads them with getattr and a default.
KNOWN = {
    ("asyncbatch/_prepare/engines.py", "_processes"),
    ("asyncbatch/_prepare/tokenizer.py", "_pat_str"),
    # On main since this test was written: CPython's hook that runs before the interpreter
    # joins threads at exit (concurrent.futures registers its own with it).
    ("asyncbatch/_lifecycle.py", "_register_atexit"),
}


def _fsspec_async_names() -> set[str]:
    """fsspec's async interface: an async filesystem's coroutines, named after its methods
    with one underscore (``_cat_file``, ``_info``; gcsfs's ``_set_session``)."""
    from fsspec.asyn import AsyncFileSystem

    return {
        name
        for name in dir(AsyncFileSystem)
        if _private(name) and inspect.iscoroutinefunction(getattr(AsyncFileSystem, name))
    } | {"_set_session"}


REFLECTION = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(trees: list[ast.Module]) -> set[str]:
    """Every name asyncbatch binds: assignment targets (names and attributes), functions,
    classes, parameters and ``__slots__`` entries."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                for item in ast.walk(node.value):
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        names.add(item.value)
    return names


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _accesses(tree: ast.Module) -> Iterator[tuple[int, str, ast.expr]]:
    """(line, attribute, source of the object) of every underscore attribute reached on
    something other than ``self`` / ``cls``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value):
            yield node.lineno, node.attr, node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in REFLECTION
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _is_self(node.args[0])
        ):
            yield node.lineno, node.args[1].value, node.args[0]


#: Names the S3 and fsspec stores bind to botocore, aiobotocore, s3fs and fsspec objects (a
#: client, a filesystem, a session, credentials, ...), bare or as ``self.<name>``: an
#: underscore attribute on one of them is foreign even where asyncbatch has one so named.
FOREIGN = {
    "client",
    "fs",
    "session",
    "http_session",
    "credentials",
    "frozen",
    "signer",
    "config",
    "request",
    "response",
    "_client",
    "_fs",
    "_connection",
    "_credentials",
    "botocore",
    "aiobotocore",
    "s3fs",
    "fsspec",
}


def _root(node: ast.expr) -> str | None:
    """The name an expression starts from (``self.<attr>`` counts as ``<attr>``)."""
    while True:
        if isinstance(node, ast.Attribute):
            if _is_self(node.value):
                return node.attr
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Await):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def foreign_private(sources: dict[str, str]) -> list[str]:
    """``file:line: object._name`` for each private attribute of another library that
    ``sources`` (file name -> source) reach."""
    trees = {name: ast.parse(source, name) for name, source in sources.items()}
    ours = _defined(list(trees.values())) | DOCUMENTED
    fsspec_async = _fsspec_async_names()
    return [
        f"{name}:{line}: {ast.unparse(owner)}.{attribute}"
        for name, tree in sorted(trees.items())
        for line, attribute, owner in _accesses(tree)
        if not (_root(owner) == "fs" and attribute in fsspec_async)
        and (attribute not in ours or _root(owner) in FOREIGN)
    ]


def test_asyncbatch_reaches_no_private_attribute_of_another_library() -> None:
    sources = {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert len(sources) > 40
    found = foreign_private(sources)
    known = [f for f in found if (f.split(":")[0], f.rsplit(".", 1)[1]) in KNOWN]
    assert [f for f in found if f not in known] == []


@pytest.mark.parametrize(
    "line",
    [
        # What stores/s3_signed.py and fsspec_store.py read before.
        "credentials = self._client._request_signer._credentials",
        "endpoint = await client._resolve_endpoint_ruleset(operation, params, context)",
        "session = getattr(client._endpoint, 'http_session', None)",
        "verify = getattr(http_session, '_verify', True)",
        "signer = getattr(client, '_request_signer', None)",
        "fs._s3 = None",
    ],
)
def test_the_check_finds_what_the_s3_store_used_to_read(line: str) -> None:
    # The names asyncbatch defines itself (its own _credentials, _session, _verify) do not
    # hide an access to botocore's.
    ours = (
        "class Store:\n"
        "    def __init__(self):\n"
        "        self._client = self._credentials = self._session = self._verify = None\n"
    )
    module = f"async def f(self, client, fs, http_session):\n    {line}\n"
    found = foreign_private({"ours.py": ours, "s3.py": module})
    assert found and all(where.startswith("s3.py:2: ") for where in found)


def test_the_check_allows_our_own_private_names() -> None:
    ours = (
        "class Store:\n"
        "    __slots__ = ('_pins',)\n"
        "    def _pin(self): ...\n"
        "def use(store, other):\n"
        "    store._pin(); other._pins.clear(); self._anything = 1\n"
    )
    assert foreign_private({"ours.py": ours}) == []
