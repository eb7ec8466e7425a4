"""``prepare()``: check the settings and the output, plan the units, skip those already done,
run the rest on an engine, and write the manifest from the units' done records, last."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .._checksums import (
    ALGORITHM,
    DEFAULT_CHECKSUM_BLOCK,
    decode_blocks,
    num_blocks,
    parse_digest,
)
from .._dataset import join_url, read_object
from .._errors import ConfigError, NotFoundError, StoreError
from .._manifest import MANIFEST_NAME, Manifest, ShardInfo
from .._portal import run_sync
from .._progress import Progress
from ..formats._documents_index import per_shard_metadata
from ..stores import open_store
from . import engines
from .inputs import InputFile, Unit, expand_inputs, plan_units
from .tokenizer import TokenizerSpec, make_spec, output_dtype, special_ids
from .unit import Settings, done_url, record_checksum, unit_fingerprint

DEFAULT_SHARD_SIZE = 256 * 2**20
#: The default unit size is the inputs' total bytes over ``UNITS_TARGET``, within
#: ``[MIN_UNIT_SIZE, MAX_UNIT_SIZE]``: enough units that every core stays busy to the end of
#: a run (a worker's last unit is ~1/1000 of the run), few enough that a unit's fixed cost
#: (a few ms: its files and done record) stays small beside its tokenization (~1 s a MiB).
UNITS_TARGET = 1024
MIN_UNIT_SIZE = 2**20
MAX_UNIT_SIZE = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class PrepareReport:
    """What a :func:`prepare` run did. ``units_already_done`` were recognised from an earlier
    run and not redone; ``seconds`` is the whole call; ``peak_rss`` the largest peak resident
    memory of a process that ran units (bytes); ``timeline`` the ``(unit, start, end)`` of
    each unit run, in seconds from the start of the call (how busy the workers were)."""

    output: str
    documents: int
    tokens: int
    skipped_records: int
    skipped_files: int
    units: int
    units_already_done: int
    shards: int
    dtype: str
    seconds: float
    peak_rss: int
    timeline: tuple[tuple[int, float, float], ...] = ()

    def summary(self) -> str:
        """The one line the command ends with."""
        skipped = ""
        if self.skipped_records or self.skipped_files:
            skipped = f", {self.skipped_records:,} records and {self.skipped_files:,} files skipped"
        return (
            f"prepared {self.documents:,} documents, {self.tokens:,} tokens ({self.dtype})"
            f" in {self.shards:,} shards{skipped}: {self.units:,} units,"
            f" {self.units_already_done:,} already done, {self.units - self.units_already_done:,}"
            f" run, in {self.seconds:.1f} s -> {self.output}"
        )


def prepare(
    inputs: str | Sequence[str],
    output: str,
    *,
    tokenizer: Any = None,
    text_field: str = "text",
    token_field: str | None = None,
    eos: int | str | Sequence[int | str] | None = None,
    bos: int | str | Sequence[int | str] | None = None,
    metadata_fields: Sequence[str] = (),
    shard_size: int = DEFAULT_SHARD_SIZE,
    unit_size: int | None = None,
    workers: int | None = None,
    engine: Literal["local", "ray"] = "local",
    ray_address: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    vocab_size: int | None = None,
    checksum_block: int | None = DEFAULT_CHECKSUM_BLOCK,
    progress: bool = True,
) -> PrepareReport:
    """Tokenize a raw corpus into a documents dataset at ``output`` (see docs/prepare.md).

    ``inputs``: URLs, globs, folders or prefixes of JSONL (plain, ``.gz``, ``.zst``), Parquet
    or text files (one document per file), on any store; files in the order given, each
    argument's by name. ``tokenizer``: a ``tokenizer.json`` path or URL, a
    ``tokenizers.Tokenizer``, a ``tiktoken.Encoding`` or a callable ``list[str] ->
    list[list[int]]``; or ``token_field=`` names a column of ids taken as they are. ``bos`` /
    ``eos``: ids or token strings added to every document (nothing by default).
    ``unit_size``: input bytes per unit of work (large uncompressed JSONL files are cut into
    byte ranges, Parquet files into runs of row groups); by default
    :func:`default_unit_size` of the inputs. The output
    is byte-identical for any ``workers`` and ``engine``; a run started again with the same
    arguments redoes only the units not finished. Bad records raise ``RecordError``
    (``on_error="skip"``: skipped and counted).
    """
    started, wall = time.perf_counter(), time.time()
    _check_args(shard_size, unit_size, workers, engine, on_error, vocab_size, metadata_fields)
    if (tokenizer is None) == (token_field is None):
        raise ConfigError(
            "give exactly one of tokenizer= (texts from text_field) and token_field= (ids"
            " taken as they are)"
        )
    options = dict(storage_options or {})
    root = output.rstrip("/")
    # Every check before any worker starts or any byte is written: a wrong input path, a
    # tokenizer that does not load or an output that cannot be written fails at once and
    # leaves nothing behind.
    files = expand_inputs(inputs, options)
    spec = make_spec(tokenizer, vocab_size, options)
    dtype = output_dtype(spec)
    eos_ids, bos_ids = special_ids(spec, eos, "eos"), special_ids(spec, bos, "bos")
    if unit_size is None:
        unit_size = default_unit_size(files)
    units = plan_units(files, unit_size, options, skip=on_error == "skip")
    wanted = workers or engines.default_workers()
    if engine == "local" and wanted > 1:  # whatever the number of units
        engines.check_sendable(spec)
    run_sync(_check_writable(root, options))
    pool = None
    try:
        settings = Settings(
            root,
            options,
            spec.fingerprint,
            text_field,
            token_field,
            bos_ids,
            eos_ids,
            dtype.str,
            shard_size,
            checksum_block,
            on_error,
            tuple(metadata_fields),
            spec.vocab_size,
        )
        records = run_sync(_done_records(units, settings))
        already = sum(record is not None for record in records)
        todo = [unit for unit, record in zip(units, records, strict=True) if record is None]
        if todo:
            run_sync(_withdraw_manifest(root, options))
        # No more workers than units to run: a small run spawns no process it cannot use
        # (and runs units in this process while the workers start).
        count = min(wanted, len(todo))
        if engine == "local" and count > 1:
            pool = engines.start_pool(spec, count, reports=progress)
        peak = 0
        timeline: list[tuple[int, float, float]] = []
        monitor = _Monitor(units, todo) if progress and todo else None
        try:
            for result in _run(
                todo, settings, spec, engine, workers, ray_address, pool, count, monitor
            ):
                records[result.record["unit"]] = result.record
                peak = max(peak, result.peak_rss)
                timeline.append((result.record["unit"], result.started - wall, result.ended - wall))
                if monitor is not None:
                    record = result.record
                    monitor.unit(record["unit"], record["documents"], record["tokens"], -1)
        finally:
            if monitor is not None:
                monitor.bar.close()
        done = [record for record in records if record is not None]
        assert len(done) == len(units)
        manifest = _manifest(done, dtype, settings, len(files))
        run_sync(_write(root, MANIFEST_NAME, manifest.to_json().encode(), options))
    finally:
        if pool is not None:
            pool.close()
    return PrepareReport(
        output=root,
        documents=sum(r["documents"] for r in done),
        tokens=sum(r["tokens"] for r in done),
        skipped_records=sum(r["skipped_records"] for r in done),
        skipped_files=sum(r["skipped_files"] for r in done),
        units=len(units),
        units_already_done=already,
        shards=len(manifest.shards),
        dtype=dtype.name,
        seconds=time.perf_counter() - started,
        peak_rss=peak,
        timeline=tuple(sorted(timeline)),
    )


def _check_args(
    shard_size: Any,
    unit_size: Any,
    workers: Any,
    engine: Any,
    on_error: Any,
    vocab_size: Any,
    metadata_fields: Any,
) -> None:
    for name, value in (("shard_size", shard_size), ("unit_size", unit_size)):
        if name == "unit_size" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive number of bytes, got {value!r}")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ConfigError(f"workers must be a positive integer or None, got {workers!r}")
    if engine not in engines.ENGINES:
        raise ConfigError(f"engine must be one of {engines.ENGINES}, got {engine!r}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
    ):
        raise ConfigError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if isinstance(metadata_fields, str) or not all(
        isinstance(name, str) and name for name in metadata_fields
    ):
        raise ConfigError(
            f"metadata_fields must be a sequence of field names, got {metadata_fields!r}"
        )


def default_unit_size(files: Sequence[InputFile]) -> int:
    """The unit size of a run over ``files``, from their sizes alone (never the worker count,
    so the output is the same for any): their total over ``UNITS_TARGET``, within
    ``[MIN_UNIT_SIZE, MAX_UNIT_SIZE]``."""
    total = sum(file.size for file in files)
    return min(MAX_UNIT_SIZE, max(MIN_UNIT_SIZE, -(-total // UNITS_TARGET)))


def _run(
    todo: Sequence[Unit],
    settings: Settings,
    spec: TokenizerSpec,
    engine: str,
    workers: int | None,
    address: str | None,
    pool: engines.Pool | None,
    count: int,
    monitor: _Monitor | None,
) -> Any:
    if not todo:
        return iter(())
    if engine == "ray":  # units counted as they finish
        return engines.run_ray(todo, settings, spec, workers, address)
    on_progress = None if monitor is None else monitor.unit
    if pool is None:
        return engines.run_inline(todo, settings, spec, on_progress)
    tick = None if monitor is None else monitor.bar.tick
    return engines.run_pool(todo, settings, pool, count, on_progress, tick)


class _Monitor:
    """The progress of a run in input bytes (so the rate and ETA stay live while a unit
    runs), with its documents, tokens and tokens/s, from the units' reports as they go."""

    def __init__(self, units: Sequence[Unit], todo: Sequence[Unit]) -> None:
        self.weights = {unit.index: unit.weight for unit in todo}
        total = sum(unit.weight for unit in units)
        already = total - sum(self.weights.values())
        note = ""
        if len(todo) < len(units):
            note = f"{len(units) - len(todo):,} of {len(units):,} units already done"
        self.bar = Progress(total, "prepare", "B", initial=already, note=note)
        self.seen: dict[int, tuple[int, int, int]] = {}
        self.documents = self.tokens = 0
        self.started = time.perf_counter()

    def unit(self, index: int, documents: int, tokens: int, nbytes: int) -> None:
        """Unit ``index`` has done this much so far (``nbytes`` -1: all of it)."""
        weight = self.weights.get(index, 0)
        nbytes = weight if nbytes < 0 else min(nbytes, weight)
        old = self.seen.get(index, (0, 0, 0))
        new = (max(old[0], documents), max(old[1], tokens), max(old[2], nbytes))
        self.seen[index] = new
        self.documents += new[0] - old[0]
        self.tokens += new[1] - old[1]
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.note(f"{self.documents:,} docs, {self.tokens:,} tokens, {rate / 1e6:.2f} M tok/s")
        self.bar.update(new[2] - old[2])


#: Seconds an output store may take to answer the write check.
WRITE_CHECK_SECONDS = 5


async def _check_writable(root: str, options: dict[str, Any]) -> None:
    """Fail at once, before any tokenization, when ``root`` cannot be written; the probe
    written is removed again."""
    probe = join_url(root, "done/.write-check")
    try:
        await asyncio.wait_for(_write(root, "done/.write-check", b"", options), WRITE_CHECK_SECONDS)
        await asyncio.wait_for(_remove(probe, options), WRITE_CHECK_SECONDS)
    except TimeoutError as exc:
        raise StoreError(
            f"cannot write the output {root}: no answer in {WRITE_CHECK_SECONDS} s", probe
        ) from exc
    except StoreError as exc:
        raise type(exc)(f"cannot write the output {root}: {exc}", probe) from exc
    except OSError as exc:
        raise StoreError(f"cannot write the output {root}: {exc}", probe) from exc


async def _remove(url: str, options: dict[str, Any]) -> None:
    from .inputs import filesystem

    fs, path = filesystem(url, options)
    await asyncio.to_thread(fs.rm, path)


async def _write(root: str, name: str, data: bytes, options: dict[str, Any]) -> None:
    store = open_store(root, options)
    try:
        await store.write(join_url(root, name), data)
    finally:
        await store.close()


async def _done_records(units: Sequence[Unit], settings: Settings) -> list[dict[str, Any] | None]:
    """Each unit's done record if it checks out (its checksum and fingerprint, and every file
    it names at its recorded size), else None."""
    store = open_store(settings.output, dict(settings.storage_options))
    slots = asyncio.Semaphore(32)

    async def one(unit: Unit) -> dict[str, Any] | None:
        async with slots:
            url = done_url(settings.output, unit.index)
            try:
                raw = await read_object(store, url)
            except NotFoundError:
                return None
            try:
                record = json.loads(raw)
            except ValueError:
                return None
            if not isinstance(record, dict) or record.get("record_checksum") != record_checksum(
                record
            ):
                return None
            if record.get("fingerprint") != unit_fingerprint(unit, settings):
                return None
            for shard in record["shards"]:
                files = [
                    (shard["path"], shard["bytes"]),
                    (shard["index"]["path"], shard["index"]["bytes"]),
                ]
                meta = shard.get("metadata")
                if meta is not None:
                    files += [(meta["data"], meta["bytes"]), (meta["index"], 8 * meta["count"] + 8)]
                for path, nbytes in files:
                    try:
                        if await store.size(join_url(settings.output, path)) != nbytes:
                            return None
                    except NotFoundError:
                        return None
            return record

    try:
        return list(await asyncio.gather(*(one(unit) for unit in units)))
    finally:
        await store.close()


async def _withdraw_manifest(root: str, options: dict[str, Any]) -> None:
    """Remove a manifest of an earlier run before any unit is redone, so that no reader opens
    shards being rewritten."""
    from .inputs import filesystem

    fs, path = filesystem(join_url(root, MANIFEST_NAME), options)
    try:
        if await asyncio.to_thread(fs.exists, path):
            await asyncio.to_thread(fs.rm, path)
    except OSError as exc:
        raise StoreError(
            f"cannot remove the earlier manifest {root}/{MANIFEST_NAME}: {exc}"
        ) from exc


def _manifest(
    records: Sequence[dict[str, Any]],
    dtype: np.dtype[Any],
    settings: Settings,
    files: int,
) -> Manifest:
    """The manifest of the units' shards in unit order (metadata only: no data is read)."""
    block = settings.checksum_block
    shards = []
    counts: list[int] = []
    indexes: list[dict[str, Any]] = []
    for record in records:
        for shard in record["shards"]:
            blocks = None
            if block is not None:
                blocks = decode_blocks(shard["block_checksums"], num_blocks(shard["bytes"], block))
            shards.append(
                ShardInfo(
                    shard["path"],
                    shard["bytes"],
                    shard["elements"],
                    checksum=parse_digest(shard["checksum"]),
                    block_checksums=blocks,
                )
            )
            counts.append(shard["documents"])
            indexes.append(shard["index"])
    metas = [s["metadata"] for r in records for s in r["shards"] if "metadata" in s]
    extra: dict[str, Any] = {}
    if settings.metadata_fields:
        extra["document_metadata"] = {
            "fields": list(settings.metadata_fields),
            "codec": {"name": "json", "options": {}},
            "shards": metas,
        }
    metadata = {
        **per_shard_metadata(counts, indexes),
        **extra,
        "prepare": {
            **settings.shaping(),
            "input_files": files,
            "units": len(records),
            "skipped_records": sum(r["skipped_records"] for r in records),
            "skipped_files": sum(r["skipped_files"] for r in records),
        },
    }
    return Manifest(
        "documents",
        dtype,
        tuple(shards),
        metadata,
        checksum=ALGORITHM,
        checksum_block=block,
    )
