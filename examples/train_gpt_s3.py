"""Train a tiny GPT on token data in S3 with ``torchrun`` on 2 ranks, stop, and resume exactly.

Run the whole demo (needs ``pip install 'asyncbatch[s3]' 'moto[server]'``)::

    python examples/train_gpt_s3.py
    python examples/train_gpt_s3.py --steps 6 --stop-at 2 --workdir /tmp/gpt   # smaller

It starts moto's S3 server on 127.0.0.1 (a stand-in for S3, in its own process), writes a token
dataset to ``s3://examples/tokens`` with ``ab.write_tokens``, and runs this file's ``train``
command under ``torchrun --nproc_per_node 2`` (gloo, CPU) three times:

1. the reference: ``--steps`` steps without a stop;
2. a run that saves a checkpoint at ``--stop-at`` (the model, the optimizer, and each rank's
   ``loader.state_dict()``) and exits;
3. a run that loads the checkpoint and trains on to ``--steps``.

It then checks, rank by rank and step by step, that run 3 read the batches of the reference
(the same ``global_indexes``) and reached the same losses, and exits 1 if not.

On real S3, run the training part alone (credentials from the usual AWS variables)::

    torchrun --nproc_per_node 2 examples/train_gpt_s3.py train \\
        --url s3://my-bucket/tokens --checkpoint ckpt --step-log logs --steps 1000 --stop-at 500
    # ... later, the same command with --resume continues from ckpt

Rank and world size reach the loader from ``torch.distributed``: each rank reads its own
share of every global batch, with no communication between ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import asyncbatch as ab

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/local_s3.py, run as a file
from local_s3 import MOTO_OPTIONS, free_port, moto_server  # noqa: E402

VOCAB = 512
SEQ_LEN = 32
BUCKET = "examples"


# --- the model: a GPT of about 220 K parameters, pure torch ---------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 64, heads: int = 4, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(SEQ_LEN, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length))
        # True above the diagonal: a position attends to itself and the ones before it.
        mask = torch.ones(length, length, dtype=torch.bool).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


# --- one rank of a training run (run by torchrun) -------------------------------------------


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = {"endpoint_url": args.endpoint, **MOTO_OPTIONS} if args.endpoint else {}
    checkpoint: Path = args.checkpoint
    log_path = args.step_log / f"rank{rank}.jsonl"
    args.step_log.mkdir(parents=True, exist_ok=True)
    step = 0
    with ab.Loader(
        args.url,
        batch_size=args.batch_size,
        seq_len=SEQ_LEN,
        next_token=True,  # SEQ_LEN + 1 tokens per window: inputs and their targets
        dtype=torch.int64,
        shuffle=True,
        seed=0,
        infinite=True,  # epochs follow each other; the steps decide when to stop
        storage_options=options,
    ) as loader:
        if args.resume:
            saved = torch.load(checkpoint / "model.pt")
            model.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
            # Each rank saved its own loader state; a few integers, so JSON is enough.
            loader.load_state_dict(json.loads((checkpoint / f"loader-rank{rank}.json").read_text()))
        with log_path.open("a" if args.resume else "w") as log:
            for batch in loader:
                tokens = batch["tokens"]
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                record = {"step": step, "loss": loss.item(), "ids": batch.global_indexes.tolist()}
                log.write(json.dumps(record) + "\n")
                if step == args.stop_at:
                    save_checkpoint(checkpoint, rank, step, model.module, optimizer, loader)
                    break
                if step == args.steps:
                    break
    dist.destroy_process_group()


def save_checkpoint(
    directory: Path, rank: int, step: int, model: nn.Module, optimizer: Any, loader: ab.Loader
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # state_dict() is the position after the last batch handed to this loop, never a batch
    # merely prefetched, so the resumed run starts with the batch after this step's.
    (directory / f"loader-rank{rank}.json").write_text(json.dumps(loader.state_dict()))
    if rank == 0:  # DDP keeps the weights equal on every rank
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, directory / "model.pt")
    dist.barrier()  # every rank's file is written before any rank exits


# --- the demo: moto, the data, three torchrun runs, the check -------------------------------


def torchrun(args: argparse.Namespace, endpoint: str, log: Path, *extra: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # the module behind the torchrun command
        "--nproc_per_node=2",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        __file__,
        "train",
        f"--url=s3://{BUCKET}/tokens",
        f"--endpoint={endpoint}",
        f"--checkpoint={args.workdir / 'checkpoint'}",
        f"--step-log={log}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        *extra,
    ]
    # One thread per rank: two ranks on a small machine, not two thread pools fighting.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, timeout=args.timeout)


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def demo(args: argparse.Namespace) -> int:
    if args.workdir is None:
        args.workdir = Path(tempfile.mkdtemp(prefix="asyncbatch-gpt-"))
    with moto_server() as endpoint:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, **MOTO_OPTIONS).mkdir(BUCKET)
        # Token ids below VOCAB: a repeating pattern plus noise, so the loss has something to
        # learn. Several shards, so batches cross shard ends as on a real corpus.
        rng = np.random.default_rng(0)
        tokens = (np.arange(args.tokens) * 7 % VOCAB + rng.integers(0, 3, args.tokens)) % VOCAB
        url = f"s3://{BUCKET}/tokens"
        options = {"endpoint_url": endpoint, **MOTO_OPTIONS}
        ab.write_tokens(
            url, tokens.astype(np.uint16), shard_size=64 * 1024, storage_options=options
        )
        print(f"wrote {args.tokens:,} tokens to {url} on moto at {endpoint}")

        started = time.perf_counter()
        torchrun(args, endpoint, args.workdir / "reference")
        print(f"reference: {args.steps} steps on 2 ranks ({time.perf_counter() - started:.1f} s)")
        torchrun(args, endpoint, args.workdir / "resumed", f"--stop-at={args.stop_at}")
        print(f"stopped after step {args.stop_at}, checkpoint in {args.workdir / 'checkpoint'}")
        torchrun(args, endpoint, args.workdir / "resumed", "--resume")
        print(f"resumed from step {args.stop_at} to {args.steps}")
    ok = True
    for rank in range(2):
        reference = read_log(args.workdir / "reference" / f"rank{rank}.jsonl")
        resumed = read_log(args.workdir / "resumed" / f"rank{rank}.jsonl")
        same_batches = [r["ids"] for r in reference] == [r["ids"] for r in resumed]
        same_losses = len(reference) == len(resumed) == args.steps and all(
            math.isclose(a["loss"], b["loss"], rel_tol=1e-4)
            for a, b in zip(reference, resumed, strict=True)
        )
        ok = ok and same_batches and same_losses
        losses = ", ".join(f"{r['loss']:.3f}" for r in resumed)
        print(f"rank {rank}: batches equal: {same_batches}, losses equal: {same_losses} ({losses})")
    print("the resumed run continues exactly" if ok else "MISMATCH: the resumed run differs")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("train", help="one rank of a training run (under torchrun)")
    run.add_argument("--url", required=True)
    run.add_argument("--endpoint", help="an S3-compatible endpoint (default: AWS)")
    run.add_argument("--checkpoint", type=Path, required=True)
    run.add_argument("--step-log", type=Path, required=True, help="folder of per-rank step logs")
    run.add_argument("--resume", action="store_true", help="start from --checkpoint")
    for command in (parser, run):
        command.add_argument("--steps", type=int, default=20)
        command.add_argument("--batch-size", type=int, default=8, help="per rank")
    run.add_argument("--stop-at", type=int, help="save a checkpoint after this step and exit")
    parser.add_argument("--stop-at", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    parser.add_argument("--timeout", type=float, default=300, help="per torchrun, in seconds")
    args = parser.parse_args()
    if args.command == "train":
        train(args)
    else:
        sys.exit(demo(args))


if __name__ == "__main__":
    main()
