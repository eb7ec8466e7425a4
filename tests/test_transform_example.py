"""examples/tokenize_parquet.py runs as written: a Parquet text column tokenised by transform=."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tokenize_parquet.py"


@pytest.mark.timeout(120)
def test_tokenize_parquet_example(tmp_path: Path) -> None:
    args = ["--rows=600", "--batch-size=16", f"--workdir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("592 rows in 37 batches,"), done.stdout
    assert "each row once" in done.stdout
    assert len(list((tmp_path / "data").glob("train-*-of-00003.parquet"))) == 3
