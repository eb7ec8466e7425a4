"""The programs in examples/ run as written, at tiny sizes, and check what they claim."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float) -> str:
    """Run ``examples/name`` in a fresh interpreter as a user would; its output."""
    # One thread per process: the examples start several on a small machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def read_log(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(240)
def test_train_gpt_s3_resumes_exactly(tmp_path: Path) -> None:
    steps, stop_at = 5, 2
    out = run_example(
        "train_gpt_s3.py",
        f"--steps={steps}",
        f"--stop-at={stop_at}",
        "--batch-size=4",
        "--tokens=20000",
        f"--workdir={tmp_path}",
        "--timeout=70",
        timeout=230,
    )
    assert "the resumed run continues exactly" in out
    for rank in range(2):
        reference = read_log(tmp_path / "reference" / f"rank{rank}.jsonl")
        resumed = read_log(tmp_path / "resumed" / f"rank{rank}.jsonl")
        assert [r["step"] for r in resumed] == list(range(1, steps + 1))
        # The run that stopped and the one that resumed read the reference's batches.
        assert [r["ids"] for r in resumed] == [r["ids"] for r in reference]
    # Both ranks read different windows: each its own share of the global batch.
    first = [read_log(tmp_path / "reference" / f"rank{rank}.jsonl")[0]["ids"] for rank in (0, 1)]
    assert not set(first[0]) & set(first[1])
    checkpoint = tmp_path / "checkpoint"
    assert json.loads((checkpoint / "loader-rank0.json").read_text())
    assert (checkpoint / "model.pt").is_file()


@pytest.mark.timeout(120)
def test_train_images_s3_trains_and_resumes_exactly() -> None:
    out = run_example(
        "train_images_s3.py",
        "--images=300",
        "--epochs=1",
        "--batch-size=32",
        "--stop-at=2",
        timeout=110,
    )
    assert "wrote 300 JPEGs" in out
    assert re.search(r"epoch 0: 300 images, [\d,]+ images/s, loss ", out), out
    assert "stopped after 2 batches, resumed: the same 10 batches" in out


@pytest.mark.timeout(60)
def test_async_eval(tmp_path: Path) -> None:
    out = run_example("async_eval.py", "--tokens=20000", f"--root={tmp_path}", timeout=50)
    # 20,000 tokens in windows of 64 + 1 (next_token): (20,000 - 1) // 64 whole windows, each
    # read once in each set; the example itself checks the order.
    assert out.count("312 windows, 19,968 targets") == 2, out
    assert "mean loss" in out


@pytest.mark.timeout(60)
def test_megatron_in_place(tmp_path: Path) -> None:
    out = run_example(
        "megatron_in_place.py", "--documents=60", "--seq-len=64", f"--root={tmp_path}", timeout=50
    )
    assert "sequences as samples: 60 sequences read, equal to those written" in out
    assert "packed windows: tokens (8, 64)" in out


@pytest.mark.timeout(180)
def test_the_prepare_guides_example_runs_as_written(tmp_path: Path) -> None:
    # The first Python block after "## Example" in docs/prepare.md, run in an empty folder.
    guide = (EXAMPLES.parent / "docs" / "prepare.md").read_text()
    code = guide.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^prepared \d+ documents", done.stdout, re.MULTILINE), done.stdout
    assert "torch.Size([4, 128])" in done.stdout
    assert (tmp_path / "prepared" / "manifest.json").is_file()
