"""The Arrow IPC layouts, read from their bytes: message framing and the few FlatBuffers
tables asyncbatch needs (``Message``, ``RecordBatch``, ``Footer``), parsed by hand as
:mod:`~asyncbatch.formats._thrift` parses Parquet's footers.

Both layouts are a sequence of *encapsulated messages*: ``0xFFFFFFFF``, an int32 length
``L``, ``L`` bytes of FlatBuffers metadata (padded to 8), then the message's body. The
stream layout is just that, from byte 0, ended by ``0xFFFFFFFF 00000000``. The file layout
(Feather v2) is ``ARROW1\\0\\0``, the same stream, a ``Footer`` table, its int32 length and
``ARROW1``; the footer's blocks say where each record batch's message starts, its metadata
length and its body length, but not its rows: those are in the message itself.

A record batch's metadata lists a ``FieldNode`` (length, null count) per array of the schema
depth first, and a ``Buffer`` (offset and length in the body) per buffer of those arrays: how
many buffers each type has is :func:`type_layout`. pyarrow parses schemas; everything else
here is plain struct unpacking, checked against the bytes at hand.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .._errors import FormatError

#: The first and last six bytes of the file layout (the first padded to 8).
FILE_MAGIC = b"ARROW1"
CONTINUATION = b"\xff\xff\xff\xff"
#: The stream's end: a continuation marker and a zero length.
END_OF_STREAM = CONTINUATION + b"\x00\x00\x00\x00"
# MessageHeader union types (Message.fbs).
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3
#: BodyCompression codecs by number, as pyarrow names them (LZ4_FRAME, ZSTD); -1: none.
CODECS = {0: "lz4", 1: "zstd"}
NO_CODEC = -1


@dataclass(frozen=True)
class Message:
    """One encapsulated message: where it starts, its metadata length (with the 8-byte
    prefix), its header type, body length and, for a record batch, its rows, nodes
    (length, null count of each, flat), buffers (offset, length in the body of each, flat)
    and codec (:data:`NO_CODEC` when uncompressed)."""

    start: int
    metadata_length: int
    kind: int
    body_length: int
    rows: int = 0
    nodes: tuple[int, ...] = ()
    buffers: tuple[int, ...] = ()
    codec: int = NO_CODEC

    @property
    def body_start(self) -> int:
        return self.start + self.metadata_length

    @property
    def end(self) -> int:
        return self.body_start + self.body_length


class _Table:
    """A FlatBuffers table at byte ``at`` of ``data``; ``where`` names the bytes in errors."""

    def __init__(self, data: bytes, at: int, where: str) -> None:
        self.data, self.at, self.where = data, at, where
        vtable = at - self._unpack("<i", at)
        self.vtable = vtable
        self.vtable_size = self._unpack("<H", vtable)

    def _unpack(self, fmt: str, at: int) -> Any:
        try:
            if at < 0:
                raise struct.error("negative offset")
            return struct.unpack_from(fmt, self.data, at)[0]
        except struct.error as exc:
            raise FormatError(f"{self.where}: corrupt FlatBuffers metadata ({exc})") from exc

    def _field(self, index: int) -> int:
        """Offset of field ``index`` in the table, 0 when absent."""
        slot = 4 + 2 * index
        return self._unpack("<H", self.vtable + slot) if slot < self.vtable_size else 0

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        offset = self._field(index)
        return default if not offset else int(self._unpack(fmt, self.at + offset))

    def _target(self, index: int) -> int | None:
        offset = self._field(index)
        if not offset:
            return None
        at = self.at + offset
        return at + int(self._unpack("<I", at))

    def table(self, index: int) -> _Table | None:
        target = self._target(index)
        return None if target is None else _Table(self.data, target, self.where)

    def structs(self, index: int, width: int) -> tuple[int, int]:
        """Start and count of a vector of structs of ``width`` bytes (0, 0 when absent)."""
        target = self._target(index)
        if target is None:
            return 0, 0
        count = int(self._unpack("<I", target))
        if target + 4 + count * width > len(self.data):
            raise FormatError(f"{self.where}: corrupt FlatBuffers metadata (a vector runs out)")
        return target + 4, count


def _root(data: bytes, where: str) -> _Table:
    if len(data) < 8:
        raise FormatError(f"{where}: {len(data)} bytes of metadata is too short")
    return _Table(data, int.from_bytes(data[:4], "little"), where)


_u8 = struct.Struct("<B").unpack_from
_i8 = struct.Struct("<b").unpack_from
_u16 = struct.Struct("<H").unpack_from
_i32 = struct.Struct("<i").unpack_from
_u32 = struct.Struct("<I").unpack_from
_i64 = struct.Struct("<q").unpack_from


#: Zeros past a table's last field: the fields its vtable leaves out are absent.
_ABSENT = (0,) * 8


def _fields(meta: bytes, table: int) -> tuple[int, ...]:
    """The offsets (0: absent) of the fields of the FlatBuffers table at ``table``, the
    first eight at least."""
    vtable = table - _i32(meta, table)[0]
    size = _u16(meta, vtable)[0]
    if vtable < 0 or size < 4 or size % 2:
        raise struct.error(f"bad vtable at {vtable}")
    return struct.unpack_from(f"<{(size - 4) // 2}H", meta, vtable + 4) + _ABSENT


def _vector(meta: bytes, field: int) -> tuple[int, ...]:
    """The vector of structs of two int64 whose offset is at ``field`` (none: empty),
    flat: a tuple is cheaper than an array for the few a header holds."""
    if not field:
        return ()
    target = field + _u32(meta, field)[0]
    count = _u32(meta, target)[0]
    if target + 4 + count * 16 > len(meta):
        raise struct.error("a vector runs out")
    return struct.unpack_from(f"<{2 * count}q", meta, target + 4)


def parse_message(data: bytes, start: int, url: str) -> Message:
    """The message whose encapsulated bytes (prefix and whole metadata) are ``data``, found
    at byte ``start`` of ``url``."""
    if data[:4] != CONTINUATION:
        raise FormatError(
            f"{url}: message at byte {start}: bad continuation marker {bytes(data[:4]).hex()}"
            " (expected ffffffff; streams written before Arrow 0.15 are not read)"
        )
    length = int.from_bytes(data[4:8], "little", signed=True)
    if length < 8 or len(data) != 8 + length:
        raise FormatError(
            f"{url}: message at byte {start}: metadata length {length} does not fit the bytes read"
        )
    meta = bytes(data[8:])
    try:
        root = _u32(meta, 0)[0]
        fields = _fields(meta, root)
        kind = _u8(meta, root + fields[1])[0] if fields[1] else 0
        body = _i64(meta, root + fields[3])[0] if fields[3] else 0
        if body < 0:
            raise FormatError(f"{url}: message at byte {start}: negative body length {body}")
        if kind != RECORD_BATCH:
            return Message(start, 8 + length, kind, body)
        if not fields[2]:
            raise FormatError(
                f"{url}: message at byte {start}: a record batch message without its header"
            )
        field = root + fields[2]
        header = field + _u32(meta, field)[0]
        own = _fields(meta, header)
        rows = _i64(meta, header + own[0])[0] if own[0] else 0
        nodes = _vector(meta, header + own[1] if own[1] else 0)
        buffers = _vector(meta, header + own[2] if own[2] else 0)
        codec = NO_CODEC
        if own[3]:
            field = header + own[3]
            compression = field + _u32(meta, field)[0]
            codec_at = _fields(meta, compression)[0]
            codec = _i8(meta, compression + codec_at)[0] if codec_at else 0
    except struct.error as exc:
        raise FormatError(
            f"{url}: message at byte {start}: corrupt FlatBuffers metadata ({exc})"
        ) from exc
    if codec != NO_CODEC and codec not in CODECS:
        raise FormatError(f"{url}: message at byte {start}: unknown body compression {codec}")
    # Offset and length each within the body (their sum could overflow int64).
    pairs = zip(buffers[::2], buffers[1::2], strict=True)
    if buffers and (min(buffers) < 0 or any(n > body - at for at, n in pairs)):
        raise FormatError(
            f"{url}: message at byte {start}: a buffer lies outside its body of {body} bytes"
        )
    if rows < 0 or (nodes and min(nodes) < 0):
        raise FormatError(
            f"{url}: message at byte {start}: negative lengths in the record batch header"
        )
    return Message(start, 8 + length, kind, body, rows, nodes, buffers, codec)


def parse_footer(data: bytes, url: str, start: int) -> list[tuple[int, int, int]]:
    """The record batch blocks ``(offset, metadata length, body length)`` of a file layout's
    footer (the FlatBuffers bytes ``data``, at byte ``start`` of ``url``)."""
    root = _root(data, f"{url}: footer at byte {start}")
    first, count = root.structs(3, 24)
    blocks = []
    for k in range(count):
        offset, meta, body = struct.unpack_from("<qi4xq", data, first + 24 * k)
        blocks.append((int(offset), int(meta), int(body)))
    return blocks


def type_layout(kind: Any, pa: Any, name: str) -> tuple[int, int]:
    """``(nodes, buffers)`` an array of Arrow type ``kind`` takes in a record batch, its
    children included (the order of the IPC format's depth-first walk)."""
    t = pa.types
    if t.is_null(kind):
        return 1, 0
    if t.is_dictionary(kind):
        return 1, 2
    if t.is_struct(kind):
        nodes, buffers = 1, 1
        for i in range(kind.num_fields):
            n, b = type_layout(kind.field(i).type, pa, name)
            nodes, buffers = nodes + n, buffers + b
        return nodes, buffers
    if t.is_union(kind):
        nodes, buffers = 1, 1 if kind.mode == "sparse" else 2
        for i in range(kind.num_fields):
            n, b = type_layout(kind.field(i).type, pa, name)
            nodes, buffers = nodes + n, buffers + b
        return nodes, buffers
    if t.is_map(kind) or t.is_list(kind) or t.is_large_list(kind):
        n, b = type_layout(
            kind.value_field.type if not t.is_map(kind) else _entries(kind, pa), pa, name
        )
        return 1 + n, 2 + b
    if t.is_fixed_size_list(kind):
        n, b = type_layout(kind.value_type, pa, name)
        return 1 + n, 1 + b
    if t.is_string(kind) or t.is_binary(kind) or t.is_large_string(kind):
        return 1, 3
    if t.is_large_binary(kind):
        return 1, 3
    if t.is_run_end_encoded(kind):
        n1, b1 = type_layout(kind.run_end_type, pa, name)
        n2, b2 = type_layout(kind.value_type, pa, name)
        return 1 + n1 + n2, b1 + b2
    if (
        t.is_primitive(kind)
        or t.is_decimal(kind)
        or t.is_fixed_size_binary(kind)
        or t.is_temporal(kind)
    ):
        return 1, 2
    raise FormatError(
        f"column {name!r} has Arrow type {kind}, whose IPC layout asyncbatch does not read"
    )


def _entries(kind: Any, pa: Any) -> Any:
    return pa.struct([kind.key_field, kind.item_field])
