"""LLMBATCH (ZeroBatch v2) files: pre-formed batches of fixed-length token records.

The layout (docs/format.md, byte for byte): a 4096-byte little-endian header ::

    offset size type  field
    0      8    bytes magic "LLMBATCH"
    8      4    u32   version (1)
    12     4    u32   batch_size
    16     4    u32   seq_len
    20     8    u64   num_batches
    28     4    u32   dtype (0 = uint32)
    32     4    u32   seed (of the shuffle done while writing)
    36     4    u32   total_records (before the remainder was dropped)
    40     4056       zeros

then ``num_batches`` slots of ``ceil(batch_size * seq_len * 4 / 4096) * 4096`` bytes, slot
``b`` at ``4096 + b * slot_bytes``, each holding ``[batch_size, seq_len]`` tokens row-major
and zero padding to the page.

A sample is one *record* (``seq_len`` tokens): record ``r`` lives in slot ``r // batch_size``
at row ``r % batch_size``, so the engine's index math, shuffles, ranks and resume states
work unchanged. ``shuffle="block"`` defaults to blocks of the file's ``batch_size``: with a
loader ``batch_size`` equal to it, each batch is one range read (rows of one slot, or of two
neighbouring slots merged across the padding). ``shuffle="batch"``
(:mod:`asyncbatch.sampling._batches`) asks for whole slots, which are planned as one read per
slot straight into the batch buffer, without the record-level planner.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._batch import FieldSchema
from .._dataset import Dataset
from .._errors import ConfigError, FormatError
from .._layout import ReadPlan, ShardMap, WindowPlan
from .._manifest import Manifest, ShardInfo
from ..stores._base import Store
from ._base import Opener, PlannedSource
from ._npy import object_infos
from ._tokens import TOKENS_FIELD, output_dtype

# torch loads inside the functions that build tensors, so that opening a dataset
# (`asyncbatch inspect`, `verify`, `index`) does not import it.
if TYPE_CHECKING:
    import torch

FORMAT = "llmbatch"
MAGIC = b"LLMBATCH"
VERSION = 1
HEADER_SIZE = 4096
PAGE_SIZE = 4096
#: The header fields before the reserved zeros, little-endian.
_HEADER = struct.Struct("<8sIIIQIII")
#: Token dtypes by header code; the layout defines only 0.
DTYPES: dict[int, np.dtype[Any]] = {0: np.dtype("<u4")}


@dataclass(frozen=True, slots=True)
class LLMBatchHeader:
    """The fields of an LLMBATCH header."""

    batch_size: int
    seq_len: int
    num_batches: int
    dtype_code: int = 0
    seed: int = 0
    total_records: int = 0
    version: int = VERSION

    @property
    def dtype(self) -> np.dtype[Any]:
        return DTYPES[self.dtype_code]

    @property
    def raw_batch_bytes(self) -> int:
        return self.batch_size * self.seq_len * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes of one batch slot: its tokens padded up to a whole page."""
        return -(-self.raw_batch_bytes // PAGE_SIZE) * PAGE_SIZE

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.num_batches * self.slot_bytes

    @property
    def data_bytes(self) -> int:
        """Bytes from the end of the header to the last token (the last slot's padding is
        not needed to read it)."""
        if not self.num_batches:
            return 0
        return (self.num_batches - 1) * self.slot_bytes + self.raw_batch_bytes

    def pack(self) -> bytes:
        """The 4096 header bytes."""
        fields = _HEADER.pack(
            MAGIC,
            self.version,
            self.batch_size,
            self.seq_len,
            self.num_batches,
            self.dtype_code,
            self.seed,
            self.total_records,
        )
        return fields + bytes(HEADER_SIZE - len(fields))

    @classmethod
    def parse(cls, data: bytes, url: str, file_size: int) -> LLMBatchHeader:
        """The header of the ``file_size``-byte file at ``url`` from its first bytes ``data``;
        a FormatError naming the URL and the field for anything the layout does not allow."""
        if file_size < HEADER_SIZE or len(data) < _HEADER.size:
            raise FormatError(
                f"{url}: {file_size} bytes, shorter than the {HEADER_SIZE}-byte LLMBATCH header"
            )
        magic, version, batch_size, seq_len, num_batches, code, seed, total = _HEADER.unpack_from(
            data
        )
        if magic != MAGIC:
            raise FormatError(f"{url}: magic is {magic!r}, not {MAGIC!r}: not an LLMBATCH file")
        if version != VERSION:
            raise FormatError(f"{url}: LLMBATCH version {version} is unknown (known: {VERSION})")
        if code not in DTYPES:
            known = ", ".join(f"{c} = {d}" for c, d in DTYPES.items())
            raise FormatError(f"{url}: LLMBATCH dtype code {code} is unknown (known: {known})")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if value < 1:
                raise FormatError(f"{url}: LLMBATCH header field {name} is {value}, must be >= 1")
        header = cls(batch_size, seq_len, num_batches, code, seed, total, version)
        needed = HEADER_SIZE + header.data_bytes
        if needed < file_size < header.file_size:
            raise FormatError(
                f"{url}: {file_size} bytes, between the {needed} the tokens need and the"
                f" {header.file_size} of whole slots (num_batches={num_batches}, slot_bytes="
                f"{header.slot_bytes}): the last slot is cut inside its padding"
            )
        if file_size < needed:
            raise FormatError(
                f"{url}: {file_size} bytes, shorter than the header claims: num_batches="
                f"{num_batches} slots of {header.slot_bytes} bytes (batch_size={batch_size},"
                f" seq_len={seq_len}) need {header.file_size} bytes"
            )
        if file_size > header.file_size:
            raise FormatError(
                f"{url}: {file_size} bytes, longer than the header claims: num_batches="
                f"{num_batches} slots of {header.slot_bytes} bytes need {header.file_size} bytes"
            )
        return header

    def metadata(self) -> dict[str, int]:
        return {
            "version": self.version,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_batches": self.num_batches,
            "dtype_code": self.dtype_code,
            "seed": self.seed,
            "total_records": self.total_records,
            "slot_bytes": self.slot_bytes,
        }


def llmbatch_dataset(
    url: str,
    header: LLMBatchHeader,
    file_size: int,
    storage_options: Mapping[str, Any] | None = None,
) -> Dataset:
    """The dataset of the ``file_size``-byte LLMBATCH file at ``url``: one shard, its
    elements (tokens, slot padding included) starting after the header and running to the
    end of the file (so the object's size is checked as any shard's); the manifest lives in
    memory only."""
    root, name = _split(url)
    nbytes = file_size - HEADER_SIZE
    shard = ShardInfo(name, nbytes, nbytes // header.dtype.itemsize, HEADER_SIZE)
    manifest = Manifest(FORMAT, header.dtype, (shard,), {FORMAT: header.metadata()})
    return Dataset(root, manifest, dict(storage_options or {}))


def _split(url: str) -> tuple[str, str]:
    """``(folder, file name)`` of ``url``, the folder absolute for local paths."""
    if "://" not in url:
        url = os.path.abspath(url)
    root, _, name = url.rpartition("/")
    return root or "/", name


def _header_of(dataset: Dataset) -> LLMBatchHeader:
    fields = dataset.manifest.metadata.get(FORMAT)
    if not isinstance(fields, dict):
        raise ConfigError(f"{dataset.url} ({dataset.manifest.format}) is not an LLMBATCH file")
    return LLMBatchHeader(
        batch_size=fields["batch_size"],
        seq_len=fields["seq_len"],
        num_batches=fields["num_batches"],
        dtype_code=fields["dtype_code"],
        seed=fields["seed"],
        total_records=fields["total_records"],
        version=fields["version"],
    )


# ---------------------------------------------------------------------------- reading


def claims(url: str) -> bool:
    """``.batch`` files (a query string after the name is allowed)."""
    return url.split("?", 1)[0].endswith(".batch")


async def open_llmbatch(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """Open the LLMBATCH file at ``url``: its size and one read of the 4096-byte header."""
    if options:
        raise ConfigError(f"{url}: LLMBATCH files take no open options, got {sorted(options)}")
    (info,) = await object_infos(store, [url])
    size = info.size
    data = bytearray(min(size, HEADER_SIZE))
    if size >= HEADER_SIZE:
        await store.read_ranges(url, starts=[0], ends=[HEADER_SIZE], buffers=[memoryview(data)])
    header = LLMBatchHeader.parse(bytes(data), url, size)
    return replace(llmbatch_dataset(url, header, size, storage_options), versions=(info.version,))


OPENER = Opener(FORMAT, open_llmbatch, claims)


class LLMBatchRecords(PlannedSource):
    """The records of one or several LLMBATCH files (a mixture), one sample each.

    Field ``tokens``: ``[seq_len]`` per sample, the stored uint32 or converted to ``dtype``.
    Ids of file ``d`` start after the records of the files before it.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        seq_len: int | None = None,
        *,
        dtype: npt.DTypeLike | torch.dtype | None = None,
    ) -> None:
        self.datasets: Sequence[Dataset] = list(datasets)
        headers = [_header_of(d) for d in self.datasets]
        first = headers[0]
        for dataset, header in zip(self.datasets, headers, strict=True):
            if seq_len is not None and header.seq_len != seq_len:
                raise ConfigError(
                    f"{dataset.shard_urls[0]}: seq_len={seq_len}, but the LLMBATCH file's"
                    f" records hold {header.seq_len} tokens (leave seq_len=None to take the"
                    " file's)"
                )
            if header.seq_len != first.seq_len or header.dtype != first.dtype:
                raise ConfigError(
                    f"{dataset.shard_urls[0]} holds records of {header.seq_len} {header.dtype}"
                    f" tokens, not {first.seq_len} {first.dtype} as"
                    f" {self.datasets[0].shard_urls[0]}"
                )
        self.seq_len = first.seq_len
        self.stored_dtype = first.dtype
        itemsize = first.dtype.itemsize
        self.sizes = np.array([h.num_batches * h.batch_size for h in headers], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self._id_starts = np.cumsum(self.sizes) - self.sizes
        self._batch = np.array([h.batch_size for h in headers], dtype=np.int64)
        self._slot = np.array([h.slot_bytes // itemsize for h in headers], dtype=np.int64)
        #: Elements of padding at the end of each file's slots.
        self._padding = self._slot - self._batch * self.seq_len
        self._padded = bool(self._padding.any())
        counts = np.array([d.manifest.shards[0].elements for d in self.datasets], dtype=np.int64)
        self._element_base = np.cumsum(counts) - counts
        self.shard_map = ShardMap(counts, itemsize, np.full(counts.size, HEADER_SIZE))
        self.shard_urls: Sequence[str] = [d.shard_urls[0] for d in self.datasets]
        self.shard_dataset = np.arange(len(self.datasets), dtype=np.int64)
        #: ``shuffle="block"``'s default block: the files' batch size (if they share one).
        self.default_block_size = first.batch_size if len(set(self._batch.tolist())) == 1 else None
        #: ``shuffle="batch"``'s unit: the records of one slot (one file only).
        self.slot_rows = first.batch_size if len(self.datasets) == 1 else None
        self._rows = np.arange(first.batch_size, dtype=np.int64)
        self.out_dtype = output_dtype(dtype, first.dtype, self.datasets[0].url)
        converts = self.out_dtype is not None and self.out_dtype != first.dtype
        out_itemsize = self.out_dtype.itemsize if converts and self.out_dtype else 0
        self.sample_bytes = self.seq_len * (itemsize + out_itemsize)
        #: A dtype conversion happens in the read's copy; decoding touches no byte.
        self.converts = False
        if converts and self.out_dtype is not None:
            self.convert = (first.dtype, self.out_dtype)
        self.schema = {
            TOKENS_FIELD: FieldSchema(
                dtype=str(self.out_dtype or first.dtype), shape=(self.seq_len,)
            )
        }

    def element_starts(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """First element of each record in the files' concatenated element stream."""
        which = np.searchsorted(self._id_starts, ids, side="right") - 1
        local = ids - self._id_starts[which]
        batch = self._batch[which]
        slot, row = np.divmod(local, batch)
        starts: npt.NDArray[np.int64] = (
            self._element_base[which] + slot * self._slot[which] + row * self.seq_len
        )
        return starts

    def reads(self, ids: npt.NDArray[np.int64], gap: int) -> WindowPlan:
        """The records ``ids`` as windows of the element stream (whole slots, or records),
        which a local store copies in one call, converting as it copies; planned as
        :meth:`plan` does for any other store."""
        slots = self.whole_slots(ids)
        if slots is None:
            starts = self.element_starts(ids)
            return WindowPlan(
                self.shard_map, starts, self.seq_len, gap, lambda: self.plan(ids, gap)
            )
        raw = int(self._batch[0]) * self.seq_len
        starts = slots * int(self._slot[0])
        return WindowPlan(self.shard_map, starts, raw, gap, lambda: self.plan(ids, gap))

    def plan(self, ids: npt.NDArray[np.int64], gap: int) -> ReadPlan:
        slots = self.whole_slots(ids)
        if slots is None:
            starts = self.element_starts(ids)
            return self.shard_map.plan(starts, self.seq_len, gap, self._padding_between(starts))
        return self.plan_slots(slots, gap)

    def plan_slots(self, slots: npt.NDArray[np.int64], gap: int) -> ReadPlan:
        """Reads of whole ``slots`` (of the one file) into consecutive places of a buffer: one
        per slot (``shuffle="batch"``), or one per run of slots that follow each other in
        the file, read across their padding when it is within ``gap`` (sequential order).

        A handful of numpy calls per group, where the record planner takes ~40 over every
        record; slots read alone or without padding land straight in place.
        """
        itemsize = self.stored_dtype.itemsize
        raw = int(self._batch[0] * self.seq_len) * itemsize
        slot_bytes = int(self._slot[0]) * itemsize
        padding = slot_bytes - raw
        starts = slots * slot_bytes + HEADER_SIZE
        dest = np.arange(slots.size, dtype=np.int64) * raw
        new_run = np.ones(slots.size, dtype=bool)
        if padding <= gap:
            np.not_equal(np.diff(slots), 1, out=new_run[1:])
        if new_run.all():  # the batch shuffle's usual case: every slot alone, in place
            empty = np.empty(0, dtype=np.int64)
            return ReadPlan(
                read_shard=np.zeros(slots.size, dtype=np.int64),
                read_start=starts,
                read_end=starts + raw,
                read_dest=dest,
                piece_read=empty,
                piece_src=empty,
                piece_dest=empty,
                piece_length=empty,
                nbytes=int(slots.size) * raw,
            )
        heads = np.flatnonzero(new_run)
        lasts = np.append(heads[1:] - 1, slots.size - 1)
        direct = (heads == lasts) | (padding == 0)
        # Slots read together across padding land in scratch; each is copied into place.
        run_of = np.cumsum(new_run) - 1
        via = ~direct[run_of]
        return ReadPlan(
            read_shard=np.zeros(heads.size, dtype=np.int64),
            read_start=starts[heads],
            read_end=starts[lasts] + raw,
            read_dest=np.where(direct, dest[heads], -1),
            piece_read=run_of[via],
            piece_src=(starts - starts[heads][run_of])[via],
            piece_dest=dest[via],
            piece_length=np.full(int(via.sum()), raw, dtype=np.int64),
            nbytes=int(slots.size) * raw,
        )

    def _padding_between(self, starts: npt.NDArray[np.int64]) -> int:
        """Bytes of slot padding between records of ``starts`` that are neighbours across a
        slot's end. The planner may read across them on top of its budget: padding is no
        record's bytes, and a slot's padding is within the store's gap, cheaper than one
        more request (so a block of records that straddles two slots is still one read)."""
        if not self._padded:
            return 0
        ordered = np.sort(starts)
        which = np.searchsorted(self._element_base, ordered, side="right") - 1
        padding = self._padding[which]
        opens_slot = (ordered - self._element_base[which]) % self._slot[which] == 0
        after_last_row = np.diff(ordered) == self.seq_len + padding[1:]
        crossing = opens_slot[1:] & after_last_row
        return int(padding[1:][crossing].sum()) * self.stored_dtype.itemsize

    def whole_slots(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
        """The slots ``ids`` are, if they are whole slots of one file each in row order
        (``shuffle="batch"``), else None."""
        rows = self.slot_rows
        if rows is None or not ids.size or ids.size % rows:
            return None
        table = ids.reshape(-1, rows)
        first = table[:, 0]
        if (first % rows).any() or not (table == first[:, None] + self._rows).all():
            return None
        slots: npt.NDArray[np.int64] = first // rows
        return slots

    def decode(self, buffer: npt.NDArray[np.uint8], ids: npt.NDArray[np.int64]) -> dict[str, Any]:
        """The records ``ids`` from the bytes :meth:`reads` described (converted as they were
        read with ``dtype=``)."""
        import torch

        kind = self.stored_dtype if self.convert is None else self.convert[1]
        return {TOKENS_FIELD: torch.from_numpy(buffer.view(kind).reshape(ids.size, self.seq_len))}


def llmbatch_records(
    datasets: Sequence[Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> LLMBatchRecords:
    """Source factory of the ``llmbatch`` format (no format options)."""
    if options:
        raise ConfigError(f"LLMBATCH files take no format_options, got {sorted(options)}")
    if next_token:
        raise ConfigError(
            f"{datasets[0].shard_urls[0]}: LLMBATCH records are whole sequences;"
            " next_token=True cannot read one token past them (shift the targets inside the"
            " record instead)"
        )
    return LLMBatchRecords(datasets, seq_len, dtype=dtype)
