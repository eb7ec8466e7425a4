"""Write a Megatron-LM indexed dataset (``prefix.bin`` + ``prefix.idx``) without asyncbatch.

Follows the layout of Megatron-LM's ``_IndexWriter`` (megatron/core/datasets/
indexed_dataset.py) byte for byte, so the tests read data built the way Megatron builds it:
the 9-byte magic ``MMIDIDX\\x00\\x00``, version ``<Q`` 1, the dtype code ``<B``, the sequence
count ``<Q``, the document-index entry count ``<Q`` (documents + 1), then sequence lengths
(int32), sequence pointers (int64 byte offsets into the .bin) and document indices (int64:
0, then the index one past each document's last sequence), and for multimodal data one int8
mode per sequence.

Run as a script to write a small random dataset: ``python tests/make_megatron.py PREFIX``.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

MAGIC = b"MMIDIDX\x00\x00"
CODES = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}


def write_megatron(
    prefix: str | Path,
    documents: Sequence[Sequence[npt.NDArray[np.integer]]],
    dtype: str = "uint16",
    *,
    modes: bool = False,
) -> None:
    """Write ``documents`` (each a list of token sequences) as ``prefix.bin/.idx``."""
    lengths: list[int] = []
    pointers: list[int] = []
    document_indices = [0]
    itemsize = np.dtype(dtype).itemsize
    position = 0
    with open(f"{prefix}.bin", "wb") as data:
        for document in documents:
            for sequence in document:
                pointers.append(position)
                lengths.append(len(sequence))
                position += len(sequence) * itemsize
                data.write(np.asarray(sequence, dtype=dtype).tobytes())
            document_indices.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as index:
        index.write(MAGIC)
        index.write(struct.pack("<Q", 1))
        index.write(struct.pack("<B", CODES[dtype]))
        index.write(struct.pack("<Q", len(lengths)))
        index.write(struct.pack("<Q", len(document_indices)))
        index.write(np.array(lengths, dtype=np.int32).tobytes())
        index.write(np.array(pointers, dtype=np.int64).tobytes())
        index.write(np.array(document_indices, dtype=np.int64).tobytes())
        if modes:
            index.write(np.zeros(len(lengths), dtype=np.int8).tobytes())


def write_megatron_lengths(
    prefix: str | Path,
    lengths: npt.NDArray[np.integer],
    dtype: str = "uint16",
    *,
    sparse: bool = False,
) -> None:
    """``prefix.bin/.idx`` of one sequence a document, of ``lengths`` tokens each, written
    with numpy (millions of documents in seconds). Token ``t`` of the stream is ``t % 251``;
    with ``sparse`` the ``.bin`` is a sparse file of zeros instead (a corpus of gigabytes that
    takes no disk: for timing the index, not the tokens)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = (np.cumsum(lengths) - lengths) * itemsize
    total = int(lengths.sum())
    with open(f"{prefix}.bin", "wb") as data:
        if sparse:
            data.truncate(total * itemsize)
        else:
            for start in range(0, total, 1 << 24):
                stop = min(total, start + (1 << 24))
                data.write((np.arange(start, stop) % 251).astype(dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as index:
        index.write(MAGIC)
        index.write(struct.pack("<QBQQ", 1, CODES[dtype], lengths.size, lengths.size + 1))
        index.write(lengths.astype(np.int32).tobytes())
        index.write(pointers.astype(np.int64).tobytes())
        index.write(np.arange(lengths.size + 1, dtype=np.int64).tobytes())


def random_documents(
    seed: int, count: int, dtype: str = "uint16", max_sequences: int = 3, max_length: int = 300
) -> list[list[npt.NDArray[np.integer]]]:
    """``count`` documents of 1 to ``max_sequences`` sequences of 1 to ``max_length`` tokens."""
    rng = np.random.default_rng(seed)
    high = min(np.iinfo(dtype).max, 60_000)
    return [
        [
            rng.integers(0, high, int(rng.integers(1, max_length + 1)), dtype=dtype)
            for _ in range(int(rng.integers(1, max_sequences + 1)))
        ]
        for _ in range(count)
    ]


if __name__ == "__main__":
    write_megatron(sys.argv[1], random_documents(0, 100))
