"""One unit of work: its records tokenized and written as shards of whole documents, each
with its index, then the unit's done record, last.

A unit's files are named from the unit and its fingerprint (``data/u000012-3f9a0c1e-0000.bin``,
``.idx``; ``done/u000012.json``) and depend on nothing but its input and the settings: a unit
redone after a crash overwrites its partial files with the same bytes, on any engine, and a
run with other settings (or an edited input) writes other files, never over those a done
record of another fingerprint names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checksums import block_digests, digest, encode_blocks, format_digest
from .._dataset import join_url
from .._errors import ConfigError
from .._portal import run_sync
from ..formats._documents_index import index_path, shard_index_bytes, shard_index_info
from ..stores import open_store
from .inputs import Unit
from .records import Batch, RecordReader
from .tokenizer import TokenizerSpec, encoder

#: Bumped when a unit's output for the same settings changes: older units are redone.
FORMAT_VERSION = 1
DONE_FOLDER = "done"
DATA_FOLDER = "data"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every unit of one run shares (picklable; the tokenizer travels apart, named here
    by its fingerprint)."""

    output: str
    storage_options: Mapping[str, Any]
    tokenizer: str
    text_field: str
    token_field: str | None
    bos: tuple[int, ...]
    eos: tuple[int, ...]
    dtype: str
    shard_size: int
    checksum_block: int | None
    on_error: str
    metadata_fields: tuple[str, ...] = ()
    vocab_size: int | None = None  # ids at or past it are refused; shapes nothing

    def shaping(self) -> dict[str, Any]:
        """Every setting that shapes the output (recorded in the manifest)."""
        return {
            "format": FORMAT_VERSION,
            "tokenizer": self.tokenizer,
            "text_field": self.text_field,
            "token_field": self.token_field,
            "bos": list(self.bos),
            "eos": list(self.eos),
            "dtype": self.dtype,
            "shard_size": self.shard_size,
            "checksum_block": self.checksum_block,
            "on_error": self.on_error,
            "metadata_fields": list(self.metadata_fields),
        }

    @functools.cached_property
    def fingerprint(self) -> str:
        """Of :meth:`shaping`: a unit's files and done record are valid for it alone."""
        return json.dumps(self.shaping(), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class UnitResult:
    """A finished unit: its done record (as written) and the peak memory of its process."""

    record: dict[str, Any]
    peak_rss: int  # bytes, of the process that ran it, over its life so far
    started: float = 0.0  # time.time() when it started and ended, in the process that ran it
    ended: float = 0.0


def unit_fingerprint(unit: Unit, settings: Settings) -> str:
    text = json.dumps([unit.describe(), settings.fingerprint], sort_keys=True)
    return format_digest(digest(text.encode()))


def done_url(output: str, index: int) -> str:
    return join_url(output, f"{DONE_FOLDER}/u{index:06d}.json")


def record_checksum(record: Mapping[str, Any]) -> str:
    """The checksum a done record carries of all its other fields."""
    body = {k: v for k, v in record.items() if k != "record_checksum"}
    return format_digest(digest(json.dumps(body, sort_keys=True).encode()))


#: ``report(documents, tokens, input_bytes)``: a unit's counts so far, after each batch.
Report = Callable[[int, int, int], None]


def run_unit(
    unit: Unit, settings: Settings, spec: TokenizerSpec, report: Report | None = None
) -> UnitResult:
    """Run ``unit`` in this process (its own event loop for the writes); ``report`` is told
    its documents, tokens and input bytes so far after every batch."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a worker is one core
    started = time.time()
    record = run_sync(_run(unit, settings, spec, report))
    return UnitResult(record, peak_rss(), started, time.time())


def peak_rss() -> int:
    """This process's peak resident memory in bytes: Linux's ``VmHWM`` (``ru_maxrss`` of a
    spawned process also counts its parent's before the exec), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


async def _run(
    unit: Unit, settings: Settings, spec: TokenizerSpec, report: Report | None
) -> dict[str, Any]:
    reader = RecordReader(
        unit,
        text_field=settings.text_field,
        token_field=settings.token_field,
        on_error=settings.on_error,
        options=settings.storage_options,
        metadata_fields=settings.metadata_fields,
    )
    encode = encoder(spec) if settings.token_field is None else None
    fingerprint = unit_fingerprint(unit, settings)
    store = open_store(settings.output, dict(settings.storage_options))
    try:
        shards = _Shards(store, settings, f"{DATA_FOLDER}/u{unit.index:06d}-{fingerprint[:8]}")
        documents = tokens = 0
        for batch in reader.batches():
            flat, lengths = _tokens(batch, encode, settings, reader, spec.kind == "callable")
            documents += lengths.size
            tokens += flat.size
            await shards.add(flat, lengths, batch.meta)
            if report is not None:
                report(documents, tokens, reader.consumed)
        written = await shards.finish()
        record: dict[str, Any] = {
            "unit": unit.index,
            "input": unit.describe(),
            "fingerprint": fingerprint,
            "documents": documents,
            "tokens": tokens,
            "skipped_records": reader.skipped.records,
            "skipped_files": reader.skipped.files,
            "skipped_examples": reader.skipped.examples,
            "shards": written,
        }
        record["record_checksum"] = record_checksum(record)
        await store.write(done_url(settings.output, unit.index), json.dumps(record).encode())
    finally:
        await store.close()
    return record


def _tokens(
    batch: Batch, encode: Any, settings: Settings, reader: RecordReader, untrusted: bool
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """The documents of ``batch`` as one flat array of the output dtype and their lengths,
    ``bos`` and ``eos`` added; an id the dtype (or ``vocab_size``) cannot hold is a
    ConfigError. ``untrusted``: a user's callable, whose answer is checked."""
    unit = reader.unit
    if encode is not None:
        try:
            ids: Sequence[Any] = encode(batch.values)
        except Exception as exc:
            # Not skipped under on_error="skip": a tokenizer that fails is a bug to see.
            where = f"{batch.where[0]} to {batch.where[-1]}" if batch.where else "no record"
            raise reader.error(
                f"the tokenizer raised {type(exc).__name__}: {exc} (on the records of {where})",
                batch.where[0] if batch.where else "",
            ) from exc
        if untrusted and (not isinstance(ids, Sequence) or len(ids) != len(batch.values)):
            raise ConfigError(
                f"the tokenizer returned {len(ids) if isinstance(ids, Sequence) else ids!r}"
                f" token lists for {len(batch.values)} texts ({unit.url}, unit {unit.index});"
                " it must return one list of ids per text"
            )
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        if untrusted:
            flat = np.array(list(itertools.chain.from_iterable(ids)))
            if flat.size and flat.dtype.kind not in "iu":
                raise ConfigError(
                    f"the tokenizer returned ids of type {flat.dtype} ({unit.url}, unit"
                    f" {unit.index}); ids must be integers"
                )
            body = flat.astype(np.int64)
        else:
            body = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
    else:
        ids = batch.values
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        body = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    dtype = np.dtype(settings.dtype)
    limit = settings.vocab_size or int(np.iinfo(dtype).max) + 1
    if body.size:
        high, low = int(body.max()), int(body.min())
        if high >= limit or low < 0:
            bad = np.flatnonzero((body >= limit) | (body < 0))[0]
            document = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
            raise ConfigError(
                f"{unit.url}, {batch.where[document]} (unit {unit.index}): token id"
                f" {int(body[bad])} is outside [0, {limit}), the ids of the output dtype"
                f" {dtype.name} and vocabulary; pass vocab_size= or a tokenizer with the"
                " right vocabulary"
            )
    bos, eos = settings.bos, settings.eos
    if not bos and not eos:
        return body.astype(dtype), lengths
    full = lengths + len(bos) + len(eos)
    starts = np.cumsum(full) - full
    out = np.empty(int(full.sum()), dtype)
    body_starts = np.cumsum(lengths) - lengths
    out[np.repeat(starts + len(bos) - body_starts, lengths) + np.arange(body.size)] = body
    for j, token in enumerate(bos):
        out[starts + j] = token
    for j, token in enumerate(eos):
        out[starts + len(bos) + lengths + j] = token
    return out, full


class _Shards:
    """Documents cut into shards of about ``shard_size`` bytes at document ends; each shard
    written with its index of local offsets."""

    def __init__(self, store: Any, settings: Settings, stem: str) -> None:
        self.store, self.settings, self.stem = store, settings, stem
        self.itemsize = np.dtype(settings.dtype).itemsize
        self.per_shard = max(1, settings.shard_size // self.itemsize)
        self.parts: list[npt.NDArray[Any]] = []
        self.lengths: list[npt.NDArray[np.int64]] = []
        self.meta: list[bytes] = []
        self.fill = 0
        self.written: list[dict[str, Any]] = []

    async def add(
        self, flat: npt.NDArray[Any], lengths: npt.NDArray[np.int64], meta: list[bytes]
    ) -> None:
        """Append documents: their tokens back to back, their lengths, and their metadata
        (one JSON object each, or none at all without metadata fields)."""
        while lengths.size:
            if self.fill >= self.per_shard:
                # Empty documents still fit the full shard; one with tokens opens the next.
                empty = int(np.argmax(lengths > 0)) if lengths.any() else lengths.size
                self.lengths.append(lengths[:empty])
                self.meta += meta[:empty]
                lengths, meta = lengths[empty:], meta[empty:]
                if lengths.size:
                    await self._flush()
                continue
            ends = np.cumsum(lengths)
            # The first document that fills the shard closes it; all of them otherwise.
            full = int(np.searchsorted(ends, self.per_shard - self.fill, side="left"))
            take = min(full + 1, lengths.size)
            count = int(ends[take - 1])
            self.parts.append(flat[:count])
            self.lengths.append(lengths[:take])
            self.meta += meta[:take]
            self.fill += count
            flat, lengths, meta = flat[count:], lengths[take:], meta[take:]

    async def finish(self) -> list[dict[str, Any]]:
        if self.lengths:
            await self._flush()
        return self.written

    async def _flush(self) -> None:
        data = np.concatenate(self.parts) if self.parts else np.zeros(0, self.settings.dtype)
        lengths = np.concatenate(self.lengths)
        meta = self.meta
        self.parts, self.lengths, self.meta, self.fill = [], [], [], 0
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        path = f"{self.stem}-{len(self.written):04d}.bin"
        raw = memoryview(np.ascontiguousarray(data).view(np.uint8))  # type: ignore[arg-type]
        index = shard_index_bytes(offsets)
        block = self.settings.checksum_block
        whole, blocks = await asyncio.to_thread(_digests, raw, block)
        output = self.settings.output
        await self.store.write(join_url(output, path), raw)
        await self.store.write(join_url(output, index_path(path)), index)
        shard: dict[str, Any] = {
            "path": path,
            "bytes": len(raw),
            "elements": int(data.size),
            "documents": int(lengths.size),
            "checksum": whole,
            "index": shard_index_info(index_path(path), index),
        }
        if blocks is not None:
            shard["block_checksums"] = blocks
        if self.settings.metadata_fields:
            shard["metadata"] = await self._write_meta(path, meta)
        self.written.append(shard)

    async def _write_meta(self, path: str, meta: list[bytes]) -> dict[str, Any]:
        """The shard's document metadata as the metadata stream stores values: JSON Lines
        (``.meta.bin``) and their byte offsets (``.meta.idx``, int64)."""
        data = b"".join(value + b"\n" for value in meta)
        sizes = np.fromiter((len(value) + 1 for value in meta), np.int64, len(meta))
        offsets = np.zeros(len(meta) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        index = offsets.astype("<i8").tobytes()
        stem = path.removesuffix(".bin")
        output = self.settings.output
        await self.store.write(join_url(output, f"{stem}.meta.bin"), data)
        await self.store.write(join_url(output, f"{stem}.meta.idx"), index)
        return {
            "index": f"{stem}.meta.idx",
            "data": f"{stem}.meta.bin",
            "count": len(meta),
            "bytes": len(data),
            "index_checksum": format_digest(digest(index)),
            "checksum": format_digest(digest(data)),
        }


def _digests(raw: memoryview, block: int | None) -> tuple[str, str | None]:
    whole = format_digest(digest(raw))
    blocks = encode_blocks(block_digests(raw, block)) if block else None
    return whole, blocks
