"""The suite does not depend on the folder the checkout is in: ``git clone`` names it
``asyncbatch``, so every path under it holds ``/asyncbatch/``, tests included. Tests tell the
package's frames and files from others by module name (``asyncbatch.`` in a frame's
``__name__``), never by a path's text."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Tests that look at stack frames or file paths of the package: run from such a checkout.
PATH_SENSITIVE = ["test_engine.py::test_the_local_fast_path_is_the_documented_steps"]


def test_tests_match_no_package_path_text() -> None:
    # A frame or file told apart by "/asyncbatch/" in its path also matches every test file
    # of a checkout named asyncbatch.
    pattern = re.compile(r"""["'][/\\]?asyncbatch[/\\]["']""")
    offenders = [
        f"{path.name}:{number}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        if path.name != "test_checkout.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, f"paths matched by their text: {offenders}"


def test_path_sensitive_tests_pass_from_a_checkout_named_asyncbatch(tmp_path: Path) -> None:
    checkout = tmp_path / "asyncbatch"
    shutil.copytree(
        ROOT / "tests", checkout / "tests", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *(f"tests/{test}" for test in PATH_SENSITIVE),
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"{len(PATH_SENSITIVE)} passed" in result.stdout
