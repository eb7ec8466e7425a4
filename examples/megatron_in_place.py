"""Read a Megatron-LM indexed dataset (``name.bin`` + ``name.idx``) in place, no conversion.

Run::

    python examples/megatron_in_place.py                   # writes a small one to a temp folder
    python examples/megatron_in_place.py --prefix /data/corpus_text_document   # your own

Opening reads the ``.idx`` header and a summary of it (one pointer per page of 4096
sequences), never the whole index, and the ``.bin``'s size; batches read the pages of the
index and the tokens they need, by range. The same works over any store:
``ab.open_dataset("s3://bucket/corpus_text_document.bin")``.

Two ways to read it:

- **sequences as samples** (no ``seq_len``): sample ``i`` is Megatron's sequence ``i``; a
  batch's ``tokens`` is an ``ab.Jagged`` (one values tensor plus offsets);
- **packed windows** (``seq_len=L``): sample ``i`` is the window ``[i·L, i·L + L)`` of the
  concatenated sequences, with ``cu_seqlens``, ``document_ids`` and ``position_ids`` beside it.

Without ``--prefix`` the script writes a dataset itself, following the byte layout of
Megatron-LM's ``_IndexWriter``, and checks that what it reads back equals what it wrote.
"""

from __future__ import annotations

import argparse
import struct
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

import asyncbatch as ab


def write_megatron(prefix: Path, sequences: list[npt.NDArray[np.uint16]]) -> None:
    """``prefix.bin`` and ``prefix.idx`` as Megatron-LM writes them: one sequence per document,
    uint16 tokens (dtype code 8)."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2])
    documents = np.arange(len(sequences) + 1, dtype=np.int64)  # 0, then one past each document
    prefix.with_suffix(".bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    with prefix.with_suffix(".idx").open("wb") as index:
        index.write(b"MMIDIDX\x00\x00")  # magic
        index.write(struct.pack("<Q", 1))  # version
        index.write(struct.pack("<B", 8))  # dtype code: uint16
        index.write(struct.pack("<Q", len(lengths)))  # sequences
        index.write(struct.pack("<Q", len(documents)))  # document-index entries: documents + 1
        index.write(lengths.tobytes())
        index.write(pointers.astype(np.int64).tobytes())
        index.write(documents.tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=Path, help="an existing NAME (NAME.bin and NAME.idx)")
    parser.add_argument("--root", type=Path, help="where to write one (default: a temp folder)")
    parser.add_argument("--documents", type=int, default=500, help="when writing one")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    written: list[npt.NDArray[np.uint16]] | None = None
    prefix = args.prefix
    if prefix is None:
        root = args.root or Path(tempfile.mkdtemp(prefix="asyncbatch-megatron-"))
        root.mkdir(parents=True, exist_ok=True)
        prefix = root / "corpus_text_document"
        rng = np.random.default_rng(0)
        written = [
            rng.integers(0, 50_000, int(rng.integers(1, 600)), dtype=np.uint16)
            for _ in range(args.documents)
        ]
        write_megatron(prefix, written)
        print(f"wrote {len(written)} documents to {prefix}.bin/.idx")

    dataset = ab.open_dataset(f"{prefix}.bin")  # the .idx beside it is found by name
    print(f"opened {prefix}.bin: {dataset}")

    # 1. Sequences as samples, in order: every sequence once, exactly as stored.
    seen = 0
    with ab.Loader(dataset, batch_size=16, shuffle=False, drop_last=False) as loader:
        for batch in loader:
            column = batch["tokens"]  # ab.Jagged: column[i] is sample i's tokens
            for i, index in enumerate(batch.global_indexes.tolist()):
                if written is not None:
                    np.testing.assert_array_equal(np.asarray(column[i]), written[index])
                seen += 1
    print(
        f"sequences as samples: {seen} sequences read"
        + (", equal to those written" * bool(written))
    )

    # 2. Packed windows, shuffled, as a pretraining run reads them.
    with ab.Loader(
        dataset, batch_size=8, seq_len=args.seq_len, shuffle=True, seed=0, dtype=torch.int64
    ) as loader:
        batch = next(iter(loader))
        tokens, cu_seqlens = batch["tokens"], batch["cu_seqlens"]
        if written is not None:
            stream = np.concatenate(written)
            for i, window in enumerate(batch.global_indexes.tolist()):
                start = window * args.seq_len
                np.testing.assert_array_equal(
                    tokens[i].numpy(), stream[start : start + args.seq_len]
                )
        print(
            f"packed windows: tokens {tuple(tokens.shape)}, cu_seqlens of the first window"
            f" {cu_seqlens[0].tolist()}; {loader.statistics().requests} read requests so far"
            " (prefetch included)"
        )


if __name__ == "__main__":
    main()
