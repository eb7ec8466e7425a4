"""The command line: demo creates and streams its own dataset; inspect summarises one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import asyncbatch as ab


def run(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ASYNCBATCH_CACHE=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "asyncbatch._cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_demo_creates_then_reuses_its_dataset(tmp_path: Path) -> None:
    first = run("demo", "--tokens", "400000", "--seq-len", "128", cache=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "creating the demo dataset" in first.stderr
    assert "M tokens/s" in first.stdout and "time to first" in first.stdout
    second = run("demo", "--tokens", "400000", "--seq-len", "128", "--steps", "5", cache=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "creating" not in second.stderr
    assert "5 x 16 x 128" in second.stdout


def test_inspect_and_errors(tmp_path: Path) -> None:
    ab.write_tokens(str(tmp_path / "ds"), np.arange(1000, dtype=np.uint32), shard_size=1000)
    out = run("inspect", str(tmp_path / "ds"), cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "uint32" in out.stdout and "shards    4" in out.stdout
    assert "bytes     3.9 KiB (4,000 bytes)" in out.stdout
    assert "shard-00000.bin  1,000 bytes  250 elements" in out.stdout
    missing = run("inspect", str(tmp_path / "nope"), cache=tmp_path)
    assert missing.returncode == 1
    assert "not found" in missing.stderr


def test_every_option_shows_its_default_and_demo_uses_the_loaders() -> None:
    import argparse
    import inspect

    from asyncbatch._cli import parser
    from asyncbatch._loader import Loader

    def loader_default(name: str) -> Any:
        for cls in Loader.__mro__:
            init = vars(cls).get("__init__")
            parameter = None if init is None else inspect.signature(init).parameters.get(name)
            if parameter is not None and parameter.default is not parameter.empty:
                return parameter.default
        raise LookupError(name)

    def commands_of(parent: argparse.ArgumentParser) -> list[tuple[str, Any]]:
        """Every (sub)command under ``parent``, ``cache info`` and ``cache clear`` too."""
        found = []
        for action in parent._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, command in action.choices.items():
                    found += [(name, command), *commands_of(command)]
        return found

    root = parser()
    for name, command in [("asyncbatch", root), *commands_of(root)]:
        assert not re.search(r"``|:(meth|class|func|mod):", command.format_help()), name
        options = [a for a in command._actions if a.option_strings and a.dest != "help"]
        for action in options:
            assert action.help and "default" in action.help, (name, action.dest)
        if options:
            assert "default: " in command.format_help(), name
    args = root.parse_args(["demo"])
    assert args.prefetch is None  # the loader sizes its own read-ahead
    assert args.max_inflight == loader_default("max_inflight") == 64


def test_demo_with_nothing_to_read_fails_clearly(tmp_path: Path) -> None:
    out = run("demo", "--tokens", "1000", "--seq-len", "4096", cache=tmp_path)
    assert out.returncode == 1, out.stdout
    assert "asyncbatch: error: nothing to read:" in out.stderr
    assert "1000 elements: 0 samples of seq_len=4096" in out.stderr
    assert "tokens/s" not in out.stdout


def test_help_imports_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, contextlib, io\n"
        "import asyncbatch._cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    asyncbatch._cli.main(['--help'])\n"
        "with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    asyncbatch._cli.main(['demo', '--steps', 'x'])  # an argument error\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stderr


def test_human_bytes() -> None:
    from asyncbatch._cli import human_bytes

    assert human_bytes(0) == "0 bytes"
    assert human_bytes(1) == "1 byte"
    assert human_bytes(1023) == "1,023 bytes"
    assert human_bytes(1024) == "1.0 KiB (1,024 bytes)"
    assert human_bytes(1_288_490_188) == "1.2 GiB (1,288,490,188 bytes)"
    assert human_bytes(2**60) == "1024.0 PiB (1,152,921,504,606,846,976 bytes)"


def test_readme_commands_call_the_venvs_script() -> None:
    # The README sets up .venv and never activates it: a bare `asyncbatch` is not on PATH.
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", readme, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    commands = [line for line in lines if re.match(r"(\S*/)?asyncbatch\s", line)]
    assert commands, "the README shows no asyncbatch command"
    for line in commands:
        assert line.startswith(".venv/bin/asyncbatch "), line


def test_a_mistyped_option_shows_the_commands_usage_and_the_closest_option(
    tmp_path: Path,
) -> None:
    out = run("prepare", "a.jsonl", "--output", "o", "--tokeniser", "t.json", cache=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: asyncbatch prepare ")
    assert "did you mean --tokenizer (not --tokeniser)?" in out.stderr
    other = run("inspect", "x", "--shard", "3", "--opton", "a=b", cache=tmp_path)
    assert other.stderr.startswith("usage: asyncbatch inspect ")
    assert "did you mean --option (not --opton)?" in other.stderr


def _prepared(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"ids": [i] * (i % 50)}) + "\n" for i in range(1200))
    )
    out = tmp_path / "prepared"
    ab.prepare(
        str(tmp_path / "in.jsonl"), str(out), token_field="ids", eos=0, workers=1, progress=False
    )
    return out


def test_inspect_and_verify_of_a_prepared_dataset(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    shown = run("inspect", str(out), cache=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "documents 1,200" in shown.stdout
    assert "prepared with:" in shown.stdout
    for setting in ("token_field: ids", "eos: [0]", "on_error: raise", "input_files: 1"):
        assert f"  {setting}\n" in shown.stdout, setting
    checked = run("verify", str(out), cache=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "checked   1 shards, 1 index files, level block" in checked.stdout
    nbytes = sum(p.stat().st_size for p in (out / "data").iterdir())
    assert re.search(rf"bytes     [\d.]+ KiB \({nbytes:,} bytes\)", checked.stdout), checked.stdout


def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path) -> None:
    # Every subcommand (`inspect ... | head` too) ends in main(), which stops quietly on a
    # closed pipe; `cache info` is the one that imports no torch (a cheap test).
    with subprocess.Popen(
        [sys.executable, "-m", "asyncbatch._cli", "cache", "info", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, ASYNCBATCH_CACHE=str(tmp_path)),
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # as `| head` does once it has its lines, here before any
        err = process.stderr.read().decode()
        process.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert process.returncode == 141
