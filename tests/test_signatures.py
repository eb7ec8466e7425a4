"""The loaders' public signatures: every argument by name, the same in all three, typed."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncbatch as ab
from asyncbatch._loader import _LoaderBase
from asyncbatch._options import LoaderConfig, LoaderOptions

PUBLIC = [ab.Loader, ab.AsyncLoader, ab.LoaderDataset]
ROOT = Path(__file__).resolve().parent.parent


def test_the_three_signatures_are_the_same() -> None:
    loader, *others = [inspect.signature(cls) for cls in PUBLIC]
    for other in others:  # names, order, kinds, defaults and annotations
        assert other == loader
    dataset, *params = loader.parameters.values()
    assert dataset.name == "dataset"
    assert dataset.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {p.kind for p in params} == {inspect.Parameter.KEYWORD_ONLY}
    assert not [p.name for p in params if p.name.startswith("_")]
    # The options object holds exactly what the public classes take, and the shared base
    # builds a loader from it.
    assert ["dataset", *LoaderOptions.__annotations__] == list(loader.parameters)
    assert ["dataset", *(f.name for f in dataclasses.fields(LoaderConfig))] == list(
        loader.parameters
    )
    assert list(inspect.signature(_LoaderBase._setup).parameters) == ["self", "dataset", "config"]


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_a_misspelt_argument_names_the_public_class(cls: type) -> None:
    message = f"{cls.__name__}.__init__() got an unexpected keyword argument 'batch_sise'"
    with pytest.raises(TypeError, match=re.escape(message)):
        cls("unused", batch_sise=4)


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_help_documents_every_argument(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    args = doc[doc.index("Args:") :]
    documented = re.findall(r"^ {4}(\w+): \S", args, flags=re.MULTILINE)
    assert documented == list(inspect.signature(cls).parameters)
    assert "batch_size: Samples per batch on this rank." in args
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "batch_size: Samples per batch on this rank." in text
    assert "Args: those of" not in text


GOOD = """\
import asyncbatch as ab

ab.Loader("data", batch_size=4, seq_len=2048, shuffle="block", tail="wrap", verify="full")
ab.AsyncLoader("data", batch_size=4, shuffle=False, verify="off")
ab.LoaderDataset("data", batch_size=4, shuffle=True, tail="drop")
"""

BAD = """\
import asyncbatch as ab

ab.Loader("data", batch_sise=4)
ab.Loader("data", batch_size=4, seq_len="2048")
ab.AsyncLoader("data", batch_size=4, shuffle="blocks")
ab.LoaderDataset("data", batch_size=4, tail="pad")
ab.Loader("data", batch_size=4, verify="all")
"""


@pytest.mark.timeout(600)  # a cold mypy cache analyses torch (scripts/test warms it first)
def test_mypy_strict_catches_misspelt_and_mistyped_arguments(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            str(tmp_path / "good.py"),
            str(tmp_path / "bad.py"),
        ],
        cwd=ROOT,  # the project's mypy settings and cache
        capture_output=True,
        text=True,
        timeout=540,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert run.returncode == 1, run.stdout + run.stderr
    assert not [line for line in errors if "good.py" in line], run.stdout
    lines = {int(line.split(":")[1]) for line in errors if "bad.py" in line}
    assert lines == {3, 4, 5, 6, 7}, run.stdout
    assert 'Unexpected keyword argument "batch_sise" for "Loader"' in run.stdout
