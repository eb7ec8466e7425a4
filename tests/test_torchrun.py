"""``torchrun --nproc_per_node 2`` (gloo, CPU) over a dataset in S3 (moto server): each rank
takes its share with no communication; a state saved by the pair resumes on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, s3_options
from servers import free_port

import asyncbatch as ab

HERE = Path(__file__).parent


def torchrun(nproc: int, out: Path, *args: str) -> list[dict[str, Any]]:
    out.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / "dist_main.py"),
        "--out",
        str(out),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.timeout(200)
def test_torchrun_two_ranks_then_resume_on_one(tmp_path: Path, s3_endpoint: str) -> None:
    tokens = np.random.default_rng(8).integers(0, 60_000, 40 * 997 + 5, dtype=np.uint16)
    url = f"s3://{BUCKET}/torchrun"
    ab.write_tokens(url, tokens, shard_size=9000, storage_options=s3_options(s3_endpoint))
    common = ["--url", url, "--endpoint", s3_endpoint]

    pair = torchrun(2, tmp_path / "pair", *common, "--batch-size", "6", "--stop", "9")
    assert [r["rank_seen"] for r in pair] == [[0, 2], [1, 2]]  # from torch.distributed
    epoch = [i for r in pair for b in r["batches"] for i in b]
    # 997 samples, global batch 12: 83 global batches; each sample once, on one rank.
    assert len(pair[0]["batches"]) == len(pair[1]["batches"]) == 83
    assert len(epoch) == len(set(epoch)) == 83 * 12

    state = pair[0]["state"]
    assert state["batches_done"] == 9 and pair[1]["state"]["batches_done"] == 9
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    (single,) = torchrun(
        1, tmp_path / "single", *common, "--batch-size", "12", "--stop", "1", "--resume", str(saved)
    )
    before = [i for r in pair for b in r["batches"][:9] for i in b]
    after = [i for b in single["batches"] for i in b]
    assert len(single["batches"]) == 83 - 9
    assert sorted(before + after) == sorted(epoch)
