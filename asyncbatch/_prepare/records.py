"""Reading the records of one unit: texts (or token ids) in input order, in batches.

Each record comes with where it is (``line 12``, ``line at byte 4096``, ``row 7``), so a bad
one is a :class:`~asyncbatch._errors.RecordError` naming the file, the place and the unit. With
``on_error="skip"`` bad records are counted instead, and a file that cannot be read further
ends its unit where it broke (counted as a skipped file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, RecordError
from .inputs import Unit, filesystem

#: Bytes read from an input at a time, and records per batch handed to the tokenizer.
CHUNK_BYTES = 8 * 2**20
BATCH_RECORDS = 1024
#: Characters per batch: long documents make smaller batches, bounding memory (the tokenizer's
#: encodings of a batch take about 100 bytes per token).
BATCH_CHARS = 2**20
#: Said by an error about a record that ``on_error="skip"`` would have skipped.
SKIP_HINT = "to skip bad records and count them: --on-error skip, or on_error='skip'"


@dataclasses.dataclass(slots=True)
class Batch:
    """Texts (``token_field`` unset) or token id arrays, with where each came from."""

    values: list[Any] = dataclasses.field(default_factory=list)
    where: list[str] = dataclasses.field(default_factory=list)
    #: Each record's ``metadata_fields`` as one JSON object (empty without metadata fields).
    meta: list[bytes] = dataclasses.field(default_factory=list)
    chars: int = 0


@dataclasses.dataclass(slots=True)
class Skipped:
    records: int = 0
    files: int = 0
    #: The first few reasons, for the report.
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, error: RecordError, records: int = 1) -> None:
        self.records += records
        if len(self.examples) < 5:
            self.examples.append(str(error))


class RecordReader:
    """The records of one unit, in batches (:meth:`batches`)."""

    def __init__(
        self,
        unit: Unit,
        *,
        text_field: str,
        token_field: str | None,
        on_error: str,
        options: Mapping[str, Any],
        metadata_fields: tuple[str, ...] = (),
    ) -> None:
        self.unit = unit
        self.meta_fields = metadata_fields
        self.field = token_field or text_field
        self.tokens = token_field is not None
        self.skip = on_error == "skip"
        self.options = options
        self.skipped = Skipped()
        #: The unit's input bytes read so far (of ``unit.weight``; an estimate for Parquet).
        self.consumed = 0

    def error(self, message: str, where: str, skippable: bool = False) -> RecordError:
        """A RecordError naming the file, ``where`` and the unit; a ``skippable`` one, raised,
        says how to skip such records instead."""
        unit = self.unit
        if skippable and not self.skip:
            message += f" ({SKIP_HINT})"
        return RecordError(
            f"{unit.url}, {where} (unit {unit.index}): {message}", unit.url, where, unit.index
        )

    def unreadable(self, message: str, where: str) -> RecordError:
        """A file that cannot be read from ``where`` on: skipped whole with ``on_error="skip"``."""
        error = self.error(message, where, skippable=True)
        error.unreadable = True  # type: ignore[attr-defined]
        return error

    def batches(self) -> Iterator[Batch]:
        unit = self.unit
        read = {"jsonl": self._jsonl, "parquet": self._parquet, "text": self._text}[unit.kind]
        batch = Batch()
        try:
            for value, where, size, meta in read():
                batch.values.append(value)
                batch.where.append(where)
                if meta is not None:
                    batch.meta.append(meta)
                batch.chars += size
                if len(batch.values) >= BATCH_RECORDS or batch.chars >= BATCH_CHARS:
                    yield batch
                    batch = Batch()
        except RecordError as exc:
            if not self.skip or not getattr(exc, "unreadable", False):
                raise
            self.skipped.files += 1
            self.skipped.add(exc, records=0)
        if batch.values:
            yield batch

    # -- one reader per kind: (value, where, size) per record -----------------------------------

    @contextlib.contextmanager
    def _open(self) -> Iterator[Any]:
        """The file, decompressed; ``self._raw`` the file as stored (its position is the
        compressed bytes read)."""
        fs, path = filesystem(self.unit.url, self.options)
        try:
            raw = fs.open(path, "rb")
        except Exception as exc:  # noqa: BLE001 - any failure to open is an unreadable file
            raise self.unreadable(f"cannot open the file: {exc!r}", "file") from exc
        with raw:
            self._raw = raw
            if self.unit.compression is None:
                yield raw
                return
            from fsspec.compression import compr

            try:
                handle = compr[self.unit.compression](raw, mode="rb")
            except Exception as exc:  # noqa: BLE001
                raise self.unreadable(f"cannot open the file: {exc!r}", "file") from exc
            with handle:
                yield handle

    def _meta(self, values: Mapping[str, Any], where: str) -> bytes | None:
        """The record's metadata fields as compact JSON (a missing field is null); ``b""``
        for a record skipped because JSON cannot hold them (NaN, invalid Unicode)."""
        if not self.meta_fields:
            return None
        picked = {name: values.get(name) for name in self.meta_fields}
        try:
            text = json.dumps(picked, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            return text.encode("utf-8")
        except (ValueError, UnicodeEncodeError) as exc:
            self._bad(f"metadata fields {self.meta_fields} cannot be stored as JSON: {exc}", where)
            return b""

    def _text(self) -> Iterator[tuple[Any, str, int, bytes | None]]:
        with self._open() as handle:
            raw = self._read(handle, "file")
        self.consumed = self.unit.weight
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            error = self.error(f"invalid UTF-8 at byte {exc.start}", "file", skippable=True)
            if not self.skip:
                raise error from exc
            self.skipped.add(error)
            return
        yield text, "file", len(raw), self._meta({}, "file")

    def _read(self, handle: Any, where: str, size: int = -1) -> bytes:
        try:
            data: bytes = handle.read(size)
        except Exception as exc:  # noqa: BLE001 - corrupt gzip/zstd, a broken connection
            raise self.unreadable(f"cannot read the file: {exc!r}", where) from exc
        return data

    def _lines(self) -> Iterator[tuple[bytes, int, int]]:
        """``(line, byte offset, line number or 0)`` of each line starting in the unit."""
        unit = self.unit
        whole = unit.end == 0  # compressed or small: the whole file
        end = unit.end if not whole else 2**63
        with self._open() as handle:
            at = 0
            skip_first = False
            if unit.start > 0:
                handle.seek(unit.start - 1)
                at, skip_first = unit.start - 1, True
            number = 0 if unit.start else 1
            pending = b""
            compressed = unit.compression is not None
            while True:
                chunk = self._read(handle, f"byte {at + len(pending)}", CHUNK_BYTES)
                if not chunk:
                    break
                if compressed:
                    self.consumed = min(self._raw.tell(), unit.weight)
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    start, at = at, at + len(line) + 1
                    if not compressed:
                        self.consumed = max(0, min(start - unit.start, unit.weight))
                    if skip_first:
                        skip_first = False
                        continue
                    if start >= end:
                        return
                    yield line, start, number
                    if number:
                        number += 1
                if at >= end:
                    return
            if pending and not skip_first and at < end:
                yield pending, at, number

    def _jsonl(self) -> Iterator[tuple[Any, str, int, bytes | None]]:
        field, tokens = self.field, self.tokens
        for line, offset, number in self._lines():
            where = f"line {number}" if number else f"line at byte {offset}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                self._bad(f"invalid UTF-8 at byte {offset + exc.start}", where, exc)
                continue
            if offset == 0 and text.startswith("\ufeff"):
                text = text[1:]  # a byte-order mark
            if not text.strip():
                continue  # blank lines are no records
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                self._bad(f"malformed JSON: {_json_problem(exc)}", where, exc)
                continue
            if not isinstance(record, dict):
                self._bad(f"a JSON {type(record).__name__}, not an object", where)
                continue
            if field not in record:
                self._bad(f"no field {field!r} (fields: {', '.join(record)[:200]})", where)
                continue
            value = record[field]
            if tokens:
                ids = self._ids(value, where)
                meta = self._meta(record, where)
                if ids is not None and meta != b"":
                    yield ids, where, ids.size, meta
            elif isinstance(value, str):
                if not _encodable(value):
                    self._bad(f"field {field!r} holds a lone surrogate (invalid Unicode)", where)
                    continue
                meta = self._meta(record, where)
                if meta != b"":
                    yield value, where, len(line), meta
            else:
                self._bad(f"field {field!r} is a {type(value).__name__}, not a string", where)

    def _ids(self, value: Any, where: str) -> npt.NDArray[np.int64] | None:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            self._bad(f"field {self.field!r} is not a list of integers", where)
            return None
        try:
            return np.array(value, dtype=np.int64) if value else np.zeros(0, np.int64)
        except OverflowError:
            raise ConfigError(
                f"{self.unit.url}, {where} (unit {self.unit.index}): a token id of"
                f" {self.field!r} is outside the int64 range; ids must fit the output dtype"
            ) from None

    def _bad(self, message: str, where: str, cause: BaseException | None = None) -> None:
        error = self.error(message, where, skippable=True)
        if not self.skip:
            raise error from cause
        self.skipped.add(error)

    def _parquet(self) -> Iterator[tuple[Any, str, int, bytes | None]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        unit, field = self.unit, self.field
        with self._open() as handle:
            try:
                parquet = pq.ParquetFile(handle)
                schema = parquet.schema_arrow
            except Exception as exc:  # noqa: BLE001
                raise self.unreadable(f"cannot read the Parquet footer: {exc!r}", "footer") from exc
            problem = self._column_problem(schema, pa)
            if problem:
                error = self.error(problem, "file", skippable=True)
                if not self.skip:
                    raise error
                rows = sum(parquet.metadata.row_group(g).num_rows for g in unit.row_groups)
                self.skipped.add(error, records=rows)  # every row of the unit lacks the text
                return
            row = unit.first_row
            rows = sum(parquet.metadata.row_group(g).num_rows for g in unit.row_groups)
            extra = [name for name in self.meta_fields if name != field]
            batches = parquet.iter_batches(
                batch_size=BATCH_RECORDS, row_groups=list(unit.row_groups), columns=[field, *extra]
            )
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except Exception as exc:  # noqa: BLE001
                    raise self.unreadable(f"cannot read the file: {exc!r}", f"row {row}") from exc
                column = batch.column(0)
                metas = self._parquet_meta(batch, row)
                if self.tokens:
                    yield from self._parquet_ids(column, row, metas)
                else:
                    for i, text in enumerate(column.to_pylist()):
                        if text is None:
                            self._bad(f"column {field!r} is null", f"row {row + i}")
                        elif metas[i] != b"":
                            yield text, f"row {row + i}", len(text), metas[i]
                row += len(column)
                self.consumed = unit.weight * (row - unit.first_row) // max(rows, 1)

    def _parquet_meta(self, batch: Any, row: int) -> list[bytes | None]:
        if not self.meta_fields:
            return [None] * batch.num_rows
        columns = {name: batch.column(name).to_pylist() for name in set(self.meta_fields)}
        return [
            self._meta({name: values[i] for name, values in columns.items()}, f"row {row + i}")
            for i in range(batch.num_rows)
        ]

    def _column_problem(self, schema: Any, pa: Any) -> str | None:
        field = self.field
        for name in (field, *self.meta_fields):
            if schema.get_field_index(name) < 0:
                return f"no column {name!r} (columns: {', '.join(schema.names)[:200]})"
        for name in self.meta_fields:
            if not _holds_json(schema.field(name).type, pa):
                return (
                    f"metadata column {name!r} is {schema.field(name).type}: metadata_fields"
                    " take strings, numbers, booleans, and lists or structs of them (JSON)"
                )
        kind = schema.field(field).type
        if self.tokens:
            ok = pa.types.is_list(kind) or pa.types.is_large_list(kind)
            ok = ok and pa.types.is_integer(kind.value_type)
        else:
            if pa.types.is_dictionary(kind):
                kind = kind.value_type  # a pandas category column
            ok = kind in (pa.string(), pa.large_string())
        wanted = "a list of integers" if self.tokens else "a string"
        return None if ok else f"column {field!r} is {kind}, not {wanted}"

    def _parquet_ids(
        self, column: Any, row: int, metas: list[bytes | None]
    ) -> Iterator[tuple[Any, str, int, bytes | None]]:
        offsets = column.offsets.to_numpy()
        if column.values.null_count:
            self._bad(f"column {self.field!r} holds a null id", f"rows from {row}")
            return
        values = column.values.to_numpy(zero_copy_only=False)
        if values.dtype == np.uint64 and values.size and int(values.max()) >= 2**63:
            raise ConfigError(
                f"{self.unit.url}, rows from {row} (unit {self.unit.index}): token id"
                f" {int(values.max())} does not fit the output dtype"
            )
        values = values.astype(np.int64, copy=False)
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        for i in range(len(column)):
            where = f"row {row + i}"
            if nulls[i]:
                self._bad(f"column {self.field!r} is null", where)
                continue
            if metas[i] == b"":
                continue
            ids = values[offsets[i] : offsets[i + 1]]
            yield ids, where, ids.size, metas[i]


def _json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong and its column: ``Unterminated string starting at column 10``,
    ``Expecting value at column 3`` (json's own messages may already end in "at")."""
    joiner = " " if exc.msg.endswith(" at") else " at "
    return f"{exc.msg}{joiner}column {exc.colno}"


def _holds_json(kind: Any, pa: Any) -> bool:
    """Whether the values of an Arrow type, as ``to_pylist`` gives them, are JSON values."""
    types = pa.types
    if types.is_dictionary(kind):
        return _holds_json(kind.value_type, pa)
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        return _holds_json(kind.value_type, pa)
    if types.is_struct(kind):
        return all(_holds_json(kind.field(i).type, pa) for i in range(kind.num_fields))
    return bool(
        types.is_string(kind)
        or types.is_large_string(kind)
        or types.is_integer(kind)
        or (types.is_floating(kind) and not types.is_float16(kind))
        or types.is_boolean(kind)
        or types.is_null(kind)
    )


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON's ``\\ud800`` escapes make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
