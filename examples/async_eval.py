"""Evaluate a model on two held-out sets at once with ``AsyncLoader`` in one event loop.

Run::

    python examples/async_eval.py                      # writes two small sets to a temp folder
    python examples/async_eval.py --tokens 2000000     # bigger

Each set is read with ``async for`` in the caller's event loop (no loader thread): while one
evaluation waits for bytes, the other runs. The model's forward pass runs in a worker thread
(``asyncio.to_thread``), so it does not block the loop that issues the reads. Evaluation reads
every window once, in order (``shuffle=False``, ``drop_last=False``); the script checks that.
Any URL works in place of the local folders: ``s3://bucket/valid``, ``https://host/valid``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import asyncbatch as ab

VOCAB = 256
SEQ_LEN = 64


class Bigram(nn.Module):
    """The smallest language model: next-token logits from the current token alone."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


@torch.no_grad()
def batch_loss(model: nn.Module, tokens: torch.Tensor) -> tuple[float, int]:
    """Summed next-token cross-entropy of a batch, and the number of targets."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return loss.item(), targets.numel()


async def evaluate(name: str, url: str, model: nn.Module, batch_size: int) -> float:
    total, count, windows = 0.0, 0, []
    async with ab.AsyncLoader(
        url,
        batch_size=batch_size,
        seq_len=SEQ_LEN,
        next_token=True,
        dtype=torch.int64,
        shuffle=False,
        drop_last=False,  # evaluation counts the last, short batch too
    ) as loader:
        async for batch in loader:
            loss, targets = await asyncio.to_thread(batch_loss, model, batch["tokens"])
            total += loss
            count += targets
            windows.extend(batch.global_indexes.tolist())
        stats = loader.statistics()
    # Every window of the set, once and in order: nothing skipped, nothing read twice.
    assert windows == list(range(len(windows))), f"{name}: windows out of order"
    mean = total / count
    print(
        f"{name}: {len(windows)} windows, {count:,} targets, loss {mean:.3f} "
        f"(perplexity {np.exp(mean):.1f}); {stats.requests} read requests"
    )
    return mean


async def main(args: argparse.Namespace) -> None:
    root = Path(args.root or tempfile.mkdtemp(prefix="asyncbatch-eval-"))
    rng = np.random.default_rng(0)
    urls = {}
    for name in ("valid", "test"):
        tokens = rng.integers(0, VOCAB, args.tokens, dtype=np.uint16)
        urls[name] = str(root / name)
        ab.write_tokens(urls[name], tokens, shard_size=256 * 1024)
    torch.manual_seed(0)
    model = Bigram().eval()
    losses = await asyncio.gather(
        *(evaluate(name, url, model, args.batch_size) for name, url in urls.items())
    )
    # Random tokens: a model can do no better than log(VOCAB) on them.
    print(f"mean loss {sum(losses) / len(losses):.3f}; uniform guess {np.log(VOCAB):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=300_000, help="tokens per set")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--root", help="folder for the sets (default: a new temporary one)")
    asyncio.run(main(parser.parse_args()))
