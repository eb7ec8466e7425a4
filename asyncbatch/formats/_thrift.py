"""A generic reader and writer of Thrift's compact protocol, the encoding of Parquet's
footers, page headers and page indexes.

No generated code: a struct is a :class:`Struct`, its fields by id in the order they were
read, each with its compact type and value (a list is a :class:`List`, a map a :class:`Map`,
a nested struct a :class:`Struct`). :func:`encode` writes the canonical compact form, so
``encode(parse(data)) == data`` for anything a Thrift writer produced, and a footer can be
read, edited by field id and written back without knowing its schema beyond the ids touched.
A :class:`Template` is an encoding with some values (:class:`Slot`) left to fill, for
writing many structs that differ in a few numbers.
Malformed input is a :class:`ThriftError` (a ValueError) saying where it stopped.
"""

from __future__ import annotations

import struct as _struct
from dataclasses import dataclass, field
from typing import Any

# Compact type codes (a struct field's bool carries its value in the type: TRUE or FALSE).
STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
_INTS = (BYTE, I16, I32, I64)
#: Nesting deeper than this is refused (a corrupt length would otherwise recurse forever).
MAX_DEPTH = 64


class ThriftError(ValueError):
    """Bytes that are not a well-formed compact-protocol value."""


@dataclass
class List:
    """A list or set: the compact type of its elements and the elements."""

    kind: int
    items: list[Any]


@dataclass
class Map:
    kind_key: int
    kind_value: int
    items: list[tuple[Any, Any]]


@dataclass
class Struct:
    """Fields by id, in the order they were read (or set): ``{id: (compact type, value)}``;
    a bool's type is TRUE whatever its value."""

    fields: dict[int, tuple[int, Any]] = field(default_factory=dict)

    def get(self, field_id: int, default: Any = None) -> Any:
        """The value of field ``field_id``, or ``default`` when absent."""
        entry = self.fields.get(field_id)
        return default if entry is None else entry[1]

    def __getitem__(self, field_id: int) -> Any:
        try:
            return self.fields[field_id][1]
        except KeyError:
            raise ThriftError(f"required field {field_id} is missing") from None

    def set(self, field_id: int, kind: int, value: Any) -> None:
        """Set field ``field_id`` (a new one goes last: set ids in increasing order)."""
        self.fields[field_id] = (kind, value)

    def copy(self, drop: tuple[int, ...] = ()) -> Struct:
        """A shallow copy without the fields ``drop``."""
        return Struct({k: v for k, v in self.fields.items() if k not in drop})


@dataclass(frozen=True)
class Slot:
    """A field value left out of a :class:`Template`: an integer of compact type ``kind``,
    or a value given already encoded."""

    kind: int


class Template:
    """The encoding of a struct holding :class:`Slot` values; :meth:`fill` gives the values,
    in the order the slots are written (depth first, by field order)."""

    def __init__(self, value: Struct) -> None:
        out = bytearray()
        self._slots: list[tuple[int, int]] = []
        _write_struct(out, value, self._slots)
        self._bytes = bytes(out)

    def fill(self, *values: int | bytes) -> bytes:
        """The encoding with the slots' values: ints, or bytes written as they are."""
        data = memoryview(self._bytes)
        parts: list[bytes | bytearray | memoryview] = []
        at = 0
        for (position, kind), value in zip(self._slots, values, strict=True):
            parts.append(data[at:position])
            if isinstance(value, bytes):
                parts.append(value)
            else:
                encoded = bytearray()
                _write(encoded, kind, value, self._slots)
                parts.append(encoded)
            at = position
        parts.append(data[at:])
        return b"".join(parts)


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise ThriftError(f"ends at byte {self.at} inside a value")
        self.at += 1
        return self.data[self.at - 1]

    def varint(self) -> int:
        result = shift = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ThriftError(f"a varint longer than 10 bytes at byte {self.at}")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ThriftError(f"a {n}-byte value at byte {self.at} runs past the end")
        self.at += n
        return bytes(self.data[self.at - n : self.at])

    def value(self, kind: int, depth: int) -> Any:
        if kind in (TRUE, FALSE):  # an element of a container: one byte
            return self.byte() == TRUE
        if kind in _INTS:
            return self.zigzag() if kind != BYTE else _signed_byte(self.byte())
        if kind == DOUBLE:
            return _struct.unpack("<d", self.take(8))[0]
        if kind == BINARY:
            return self.take(self.varint())
        if depth > MAX_DEPTH:
            raise ThriftError(f"nested deeper than {MAX_DEPTH} at byte {self.at}")
        if kind in (LIST, SET):
            head = self.byte()
            size, inner = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > len(self.data) - self.at:  # each element takes a byte at least
                raise ThriftError(f"a list of {size} elements at byte {self.at} runs past the end")
            return List(inner, [self.value(inner, depth + 1) for _ in range(size)])
        if kind == MAP:
            size = self.varint()
            if not size:
                return Map(0, 0, [])
            head = self.byte()
            key, val = head >> 4, head & 0x0F
            if size > len(self.data) - self.at:
                raise ThriftError(f"a map of {size} entries at byte {self.at} runs past the end")
            items = [(self.value(key, depth + 1), self.value(val, depth + 1)) for _ in range(size)]
            return Map(key, val, items)
        if kind == STRUCT:
            return self.struct(depth + 1)
        raise ThriftError(f"unknown compact type {kind} at byte {self.at}")

    def struct(self, depth: int = 0) -> Struct:
        fields: dict[int, tuple[int, Any]] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == STOP:
                return Struct(fields)
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            if kind in (TRUE, FALSE):
                fields[last] = (TRUE, kind == TRUE)
            else:
                fields[last] = (kind, self.value(kind, depth))


def _signed_byte(b: int) -> int:
    return b - 256 if b > 127 else b


def parse(data: bytes | memoryview) -> tuple[Struct, int]:
    """The struct at the start of ``data`` and the bytes it took."""
    reader = _Reader(data)
    return reader.struct(), reader.at


def parse_all(data: bytes | memoryview, what: str = "struct") -> Struct:
    """The struct ``data`` holds exactly (trailing bytes are a ThriftError)."""
    value, used = parse(data)
    if used != len(data):
        raise ThriftError(f"the {what} ends at byte {used} of {len(data)}")
    return value


def _varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(out: bytearray, n: int) -> None:
    _varint(out, (n << 1) ^ (n >> 63))


def _write(out: bytearray, kind: int, value: Any, slots: list[tuple[int, int]]) -> None:
    if isinstance(value, Slot):
        slots.append((len(out), value.kind))
    elif kind in (TRUE, FALSE):
        out.append(TRUE if value else FALSE)
    elif kind == BYTE:
        out.append(value & 0xFF)
    elif kind in _INTS:
        _zigzag(out, value)
    elif kind == DOUBLE:
        out += _struct.pack("<d", value)
    elif kind == BINARY:
        _varint(out, len(value))
        out += value
    elif kind in (LIST, SET):
        size = len(value.items)
        out.append((min(size, 15) << 4) | value.kind)
        if size >= 15:
            _varint(out, size)
        for item in value.items:
            _write(out, value.kind, item, slots)
    elif kind == MAP:
        _varint(out, len(value.items))
        if value.items:
            out.append((value.kind_key << 4) | value.kind_value)
        for key, val in value.items:
            _write(out, value.kind_key, key, slots)
            _write(out, value.kind_value, val, slots)
    elif kind == STRUCT:
        _write_struct(out, value, slots)
    else:
        raise ThriftError(f"unknown compact type {kind}")


def _write_struct(out: bytearray, value: Struct, slots: list[tuple[int, int]]) -> None:
    last = 0
    for field_id, (kind, item) in value.fields.items():
        code = (TRUE if item else FALSE) if kind in (TRUE, FALSE) else kind
        if 0 < field_id - last <= 15:
            out.append(((field_id - last) << 4) | code)
        else:
            out.append(code)
            _zigzag(out, field_id)
        if kind not in (TRUE, FALSE):
            _write(out, kind, item, slots)
        last = field_id
    out.append(STOP)


def encode(value: Struct) -> bytes:
    """The compact encoding of ``value``."""
    out = bytearray()
    slots: list[tuple[int, int]] = []
    _write_struct(out, value, slots)
    if slots:
        raise ThriftError("a struct with slots encodes as a Template")
    return bytes(out)
