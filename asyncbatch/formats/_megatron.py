"""Megatron-LM indexed datasets (``name.bin`` + ``name.idx``), read in place as the
``documents`` format.

The ``.idx`` (Megatron's ``MMapIndexedDataset`` index, version 1) is::

    b"MMIDIDX\\x00\\x00"  version <Q = 1  dtype code <B  sequence count S <Q  entries D <Q
    sequence lengths  int32[S]      tokens in each sequence
    sequence pointers int64[S]      byte offset of each sequence in the .bin
    document indices  int64[D]      0, then the sequence index one past each document's end
    (sequence modes   int8[S])      multimodal datasets only; ignored

(D counts document-index entries: one more than the documents), and the ``.bin`` is the
tokens of every sequence, one after another; as in Megatron, bytes after the last sequence
are allowed and never read. Opening reads the ``.idx`` (one range read, two for indexes over
a MiB) and the ``.bin``'s size, never tokens.

A sample is a Megatron *sequence* (what Megatron's GPT dataset samples from); with
``options={"unit": "document"}`` it is a document (its sequences together). Either way the
dataset has one shard (the ``.bin``) and ``arrays["document_offsets"]``: the element offset
where each sample starts in the token stream, plus the end (``samples + 1`` entries).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dataset import Dataset
from .._errors import ConfigError, FormatError, NotFoundError
from .._manifest import Manifest, ShardInfo
from ..stores._base import Store
from ._base import Opener
from ._npy import object_infos, parent_and_name

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
#: Magic, version, dtype code, sequence count, document count.
HEADER = struct.Struct("<9sQBQQ")
#: Megatron-LM's ``DType`` codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    code: np.dtype(name)
    for code, name in {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }.items()
}
#: Bytes of the ``.idx`` read first; a smaller index is read whole in this one read.
FIRST_READ = 1 << 20
UNITS = ("sequence", "document")


def megatron_prefix(url: str) -> str:
    """``.../name`` for ``.../name``, ``.../name.bin`` or ``.../name.idx``."""
    url = url.rstrip("/")
    return url[:-4] if url.endswith((".bin", ".idx")) else url


async def open_megatron(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """The Megatron dataset at prefix ``url`` as a ``documents`` dataset."""
    extra = sorted(set(options) - {"unit"})
    if extra:
        raise ConfigError(f'Megatron datasets take only options={{"unit": ...}}, got {extra}')
    unit = options.get("unit", "sequence")
    if unit not in UNITS:
        raise ConfigError(f"options unit={unit!r}: expected one of {UNITS}")
    prefix = megatron_prefix(url)
    idx_url, bin_url = f"{prefix}.idx", f"{prefix}.bin"
    idx, bin_ = await object_infos(store, [idx_url, bin_url])
    idx_size, bin_size = idx.size, bin_.size
    index = await read_index(store, idx_url, idx_size)
    dtype, lengths, pointers, documents = parse_index(index, idx_url)
    offsets = sequence_offsets(lengths, pointers, dtype, idx_url, bin_url, bin_size)
    check_documents(documents, lengths.size, idx_url)
    if unit == "document":
        offsets = offsets[documents]
    root, name = parent_and_name(prefix)
    elements = int(offsets[-1])
    # Megatron reads only what its index points at: bytes past the last sequence are no
    # error, just never read.
    nbytes = elements * dtype.itemsize
    shard = ShardInfo(f"{name}.bin", nbytes, elements, trailing=bin_size - nbytes)
    metadata = {
        "read_in_place": "megatron",
        "unit": unit,
        "sequences": int(lengths.size),
        "documents": int(documents.size - 1),
    }
    manifest = Manifest("documents", dtype, (shard,), metadata)
    versions = (idx.version, bin_.version)
    return Dataset(root, manifest, storage_options, {"document_offsets": offsets}, versions)


async def read_index(store: Store, idx_url: str, idx_size: int) -> npt.NDArray[np.uint8]:
    """The whole ``.idx``, checked against the length its header implies."""
    if idx_size < HEADER.size:
        raise FormatError(
            f"{idx_url}: truncated Megatron index: {idx_size} bytes, shorter than the"
            f" {HEADER.size}-byte header"
        )
    first = min(idx_size, FIRST_READ)
    index = np.empty(idx_size, dtype=np.uint8)
    view = memoryview(index)  # type: ignore[arg-type]
    await store.read_ranges(idx_url, starts=[0], ends=[first], buffers=[view[:first]])
    _, expected = parse_header(index[: HEADER.size].tobytes(), idx_url)
    sequences = int.from_bytes(index[18:26].tobytes(), "little")
    if idx_size not in (expected, expected + sequences):
        raise FormatError(
            f"{idx_url}: Megatron index has {idx_size} bytes, but its header implies"
            f" {expected} ({'truncated' if idx_size < expected else 'trailing bytes'})"
        )
    if expected > first:
        await store.read_ranges(
            idx_url, starts=[first], ends=[expected], buffers=[view[first:expected]]
        )
    return index[:expected]


def parse_header(header: bytes, idx_url: str) -> tuple[np.dtype[Any], int]:
    """The token dtype and the index length (without sequence modes) a header describes."""
    magic, version, code, sequences, documents = HEADER.unpack(header)
    if magic != IDX_MAGIC:
        raise FormatError(
            f"{idx_url}: not a Megatron index: magic {magic!r}, expected {IDX_MAGIC!r}"
        )
    if version != IDX_VERSION:
        raise FormatError(f"{idx_url}: Megatron index version {version}, expected {IDX_VERSION}")
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        raise FormatError(
            f"{idx_url}: unknown Megatron dtype code {code} (known: {sorted(DTYPE_CODES)})"
        )
    return dtype, HEADER.size + 12 * sequences + 8 * documents


def parse_index(
    index: npt.NDArray[np.uint8], idx_url: str
) -> tuple[np.dtype[Any], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Dtype, sequence lengths, sequence pointers and document indices of a whole index."""
    dtype, _ = parse_header(index[: HEADER.size].tobytes(), idx_url)
    _, _, _, sequences, documents = HEADER.unpack(index[: HEADER.size].tobytes())
    at = HEADER.size
    lengths = index[at : at + 4 * sequences].view("<i4").astype(np.int64)
    at += 4 * sequences
    pointers = index[at : at + 8 * sequences].view("<i8").astype(np.int64)
    at += 8 * sequences
    document_indices = index[at : at + 8 * documents].view("<i8").astype(np.int64)
    return dtype, lengths, pointers, document_indices


def sequence_offsets(
    lengths: npt.NDArray[np.int64],
    pointers: npt.NDArray[np.int64],
    dtype: np.dtype[Any],
    idx_url: str,
    bin_url: str,
    bin_size: int,
) -> npt.NDArray[np.int64]:
    """Element offsets of the sequences in the ``.bin`` plus the end, after checking that
    the pointers are consistent: each sequence starts where the one before ends, from 0."""
    if lengths.size and lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise FormatError(f"{idx_url}: sequence {bad} has length {lengths[bad]}")
    ends = np.cumsum(lengths * dtype.itemsize)
    expected = np.concatenate([[0], ends[:-1]]) if lengths.size else ends
    wrong = np.flatnonzero(pointers != expected)
    if wrong.size:
        bad = int(wrong[0])
        raise FormatError(
            f"{idx_url}: sequence {bad} points at byte {pointers[bad]} of {bin_url}, expected"
            f" {expected[bad]} (sequence pointers must follow the sequence lengths)"
        )
    end = int(ends[-1]) if ends.size else 0
    if end > bin_size:
        raise FormatError(
            f"{idx_url}: its sequences end at byte {end}, but {bin_url} has {bin_size} bytes"
            " (truncated .bin, or an index of another file)"
        )
    offsets: npt.NDArray[np.int64] = np.concatenate([[0], ends]) // dtype.itemsize
    return offsets.astype(np.int64)


def check_documents(documents: npt.NDArray[np.int64], sequences: int, idx_url: str) -> None:
    """Document indices run from 0 to the sequence count, never backwards."""
    if (
        documents.size == 0
        or documents[0] != 0
        or documents[-1] != sequences
        or np.any(np.diff(documents) < 0)
    ):
        shown = np.array2string(documents, threshold=8)
        raise FormatError(
            f"{idx_url}: document indices {shown} do not run from 0 up to the {sequences} sequences"
        )


async def probe_megatron(url: str, store: Store) -> bool:
    """Whether a ``.idx`` sits at ``url``'s prefix."""
    try:
        await store.size(f"{megatron_prefix(url)}.idx")
    except NotFoundError:
        return False
    return True


MEGATRON_OPENER = Opener(
    "megatron",
    open_megatron,
    claims=lambda url: url.rstrip("/").endswith((".bin", ".idx")),
    probe=probe_megatron,
    probes_for="no Megatron .idx beside it",
)
