"""Tokenise a Parquet ``text`` column on the fly with ``transform=``.

The example writes a small Hugging Face-style Parquet dataset (``data/train-*-of-*.parquet``,
a ``text`` column and an ``id`` column, several row groups), trains a small BPE tokenizer
with the ``tokenizers`` package on the same strings (nothing is downloaded), and reads the
dataset with a block shuffle. ``transform=`` turns each batch's strings into padded
``input_ids`` and an ``attention_mask`` on the loader's transform thread, while the next
batches are read; ``tokenizers`` releases the GIL while it encodes.

    python examples/tokenize_parquet.py [--rows 4000] [--batch-size 32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import asyncbatch as ab

WORDS = [
    "the",
    "a",
    "loader",
    "reads",
    "batches",
    "from",
    "object",
    "storage",
    "while",
    "the",
    "model",
    "trains",
    "on",
    "tokens",
]


def sentences(rows: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 24))) for _ in range(rows)]


def write_dataset(root: Path, texts: list[str], files: int = 3) -> None:
    """``root/data/train-0000K-of-0000N.parquet``, row groups of unequal size."""
    (root / "data").mkdir(parents=True)
    for k, part in enumerate(np.array_split(np.arange(len(texts)), files)):
        table = pa.table({"id": part.astype(np.int64), "text": [texts[i] for i in part]})
        pq.write_table(
            table,
            root / "data" / f"train-{k:05d}-of-{files:05d}.parquet",
            row_group_size=max(1, len(part) // 4 + 7),
        )


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
    return tokenizer


class Tokenize:
    """The transform: a batch of rows in, ``input_ids`` / ``attention_mask`` / ``id`` out.
    A class rather than a closure, so it also pickles into DataLoader workers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, batch: ab.Batch) -> dict[str, Any]:
        encodings = self.tokenizer.encode_batch(batch["text"].to_pylist())
        return {
            "input_ids": torch.tensor([e.ids for e in encodings]),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
            "id": batch["id"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000, help="rows to write (4000)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch (32)")
    parser.add_argument("--workdir", type=Path, help="where to write (a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.workdir or Path(scratch)
        texts = sentences(args.rows)
        write_dataset(root, texts)
        tokenize = Tokenize(train_tokenizer(texts))
        seen: list[int] = []
        tokens = 0
        # Opening reads each file's footer only; the columns chosen are all that is fetched.
        dataset = ab.open_dataset(str(root / "data"), options={"columns": ["id", "text"]})
        with ab.Loader(
            dataset, batch_size=args.batch_size, shuffle="block", transform=tokenize
        ) as loader:
            for batch in loader:
                seen += batch["id"].tolist()
                tokens += int(batch["attention_mask"].sum())
                # Row for row, the tokens are those of the text with that id.
                ids = tokenize.tokenizer.encode(texts[int(batch["id"][0])]).ids
                assert batch["input_ids"][0][: len(ids)].tolist() == ids
        full = args.rows // args.batch_size * args.batch_size
        assert len(seen) == len(set(seen)) == full, "every row at most once"
        print(
            f"{len(seen)} rows in {len(seen) // args.batch_size} batches, {tokens} tokens,"
            f" each row once, tokenised off the training thread"
        )


if __name__ == "__main__":
    main()
