"""The loaders' options, declared once (asyncbatch/_options.py): the TypedDict that types them
and the frozen config that holds them agree; the config checks and normalises once and is
what a loader, its pickle and a LoaderDataset's workers share; help(), mypy and the API
reference see every option with its default."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import pydoc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import asyncbatch as ab
from asyncbatch._defaults import MAX_INFLIGHT
from asyncbatch._options import NAMES, LoaderConfig, LoaderOptions

ROOT = Path(__file__).resolve().parent.parent


def test_the_typeddict_and_the_config_declare_the_same_options() -> None:
    typed = {
        name: annotation.__forward_arg__.removeprefix("Required[").removesuffix("]")
        if name == "batch_size"
        else annotation.__forward_arg__
        for name, annotation in LoaderOptions.__annotations__.items()
    }
    declared = {field.name: field.type for field in dataclasses.fields(LoaderConfig)}
    assert list(typed) == list(declared) == list(NAMES)
    assert typed == declared


def test_help_shows_every_option_with_its_default() -> None:
    signature = inspect.signature(ab.Loader)
    for field in dataclasses.fields(LoaderConfig):
        parameter = signature.parameters[field.name]
        assert parameter.annotation == field.type
        if field.name == "batch_size":
            assert parameter.default is inspect.Parameter.empty
        else:
            assert parameter.default == field.default
    assert signature.parameters["max_inflight"].default == MAX_INFLIGHT
    text = pydoc.render_doc(ab.AsyncLoader, renderer=pydoc.plaintext)
    assert f"max_inflight: 'int' = {MAX_INFLIGHT}" in text
    assert "shuffle: 'Shuffle' = True" in text


def test_the_config_is_checked_normalised_frozen_and_pickles() -> None:
    config = LoaderConfig(batch_size=2, shuffle="block", next_token=1)  # type: ignore[arg-type]
    assert (config.shuffle, config.window, config.next_token) == ("block", 8, True)
    assert config.storage_options == {} and config.device is None
    assert LoaderConfig(batch_size=2).shuffle == "global"
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    with pytest.raises(ab.ConfigError, match="window must be a positive integer, got 0"):
        LoaderConfig(batch_size=2, shuffle="block", window=0)
    with pytest.raises(TypeError, match=r"^Mine.__init__\(\) got an unexpected keyword .*'sed'"):
        LoaderConfig.of("Mine", {"batch_size": 2, "sed": 1})


def test_loaders_share_one_config(tmp_path: Path) -> None:
    ab.write_tokens(str(tmp_path / "d"), np.arange(2_000, dtype=np.uint16))
    dataset = ab.LoaderDataset(str(tmp_path / "d"), batch_size=4, seq_len=8, rank=1, world_size=2)
    assert (dataset.config.rank, dataset.config.world_size) == (1, 2)
    with ab.Loader(dataset.dataset, batch_size=4, seq_len=8, shuffle=False) as loader:
        first = next(loader)
        copy = pickle.loads(pickle.dumps(loader))
    with copy:
        assert copy.config == loader.config and copy.config.shuffle == "none"
        assert next(copy)["tokens"].tolist() == (first["tokens"].numpy() + 4 * 8).tolist()


WRAPPER = """\
from typing import Unpack

import asyncbatch as ab


def make(url: str, **options: Unpack[ab.LoaderOptions]) -> ab.Loader:
    return ab.Loader(url, **options)


make("data", batch_size=4, shuffle="block", window=2)
make("data", batch_size=4, windw=2)
ab.Loader("data", shuffle=False)
ab.AsyncLoader("data", batch_size=4, device=3)
ab.LoaderDataset("data", batch_size=4, retry="always")
"""


@pytest.mark.timeout(600)  # a cold mypy cache analyses torch (scripts/test warms it first)
def test_mypy_checks_options_passed_on_by_a_wrapper(tmp_path: Path) -> None:
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(tmp_path / "wrapper.py")],
        cwd=ROOT,  # the project's mypy settings and cache
        capture_output=True,
        text=True,
        timeout=540,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert {int(line.split(":")[1]) for line in errors} == {11, 12, 13, 14}, run.stdout
    assert 'Unexpected keyword argument "windw" for "make"' in run.stdout
    assert 'Missing named argument "batch_size" for "Loader"' in run.stdout


def test_the_api_reference_lists_every_option_with_its_default() -> None:
    griffe = pytest.importorskip("griffe")
    extensions = griffe.load_extensions(str(ROOT / "scripts" / "griffe_options.py"))
    package = griffe.load("asyncbatch", search_paths=[str(ROOT)], extensions=extensions)
    for path in ("_loader.Loader", "_loader.AsyncLoader", "_workers.LoaderDataset"):
        parameters = package[f"{path}.__init__"].parameters
        assert [p.name for p in parameters] == ["self", "dataset", *NAMES], path
        assert str(parameters["max_inflight"].default) == "MAX_INFLIGHT"
        assert str(parameters["shuffle"].default) == "True"
        assert parameters["batch_size"].default is None
        assert str(parameters["seq_len"].annotation) == "int | None"
