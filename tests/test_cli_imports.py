"""The CLI commands that build no batches (``--help``, ``inspect``, ``verify``, ``index``,
``cache info``) answer without importing torch or pyarrow: torch alone takes seconds to
import on a loaded machine, and only the loaders' batches need it. (``plan`` is not among
them: it costs a run with the loader's and engine's own planning, which import torch.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import asyncbatch as ab

#: Runs each command's ``main`` in this one process, in order, and prints after each its exit
#: code and which of the heavy modules were loaded by then.
CHILD = """
import contextlib, io, json, sys
from asyncbatch._cli import main

for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    heavy = [name for name in ("torch", "pyarrow") if name in sys.modules]
    print(json.dumps({"argv": argv, "code": code, "heavy": heavy}))
"""


def test_commands_that_build_no_batches_do_not_import_torch(tmp_path: Path) -> None:
    documents = str(tmp_path / "documents")
    ab.write_documents(documents, [np.arange(n, dtype=np.uint16) for n in (3, 5, 7)])
    shards = str(tmp_path / "shards")
    ab.write_webdataset(shards, [{"__key__": f"k{i}", "txt": b"x" * i} for i in range(4)])
    commands = [
        (["--help"], 0),
        (["inspect", documents], 0),
        (["inspect", shards], 0),
        (["verify", documents], 0),
        (["verify", shards], 3),  # shards without a manifest: sizes only, no checksums
        (["index", shards, "--no-progress"], 0),
        (["cache", "info", str(tmp_path / "no-cache")], 1),
    ]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([argv for argv, _ in commands])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    results = [json.loads(line) for line in child.stdout.splitlines()]
    assert [r["argv"] for r in results] == [argv for argv, _ in commands]
    for result, (argv, code) in zip(results, commands, strict=True):
        # The first command that loaded a heavy module is the one named.
        assert result["heavy"] == [], f"asyncbatch {' '.join(argv)} imported {result['heavy']}"
        assert result["code"] == code, argv
