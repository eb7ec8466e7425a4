"""The compact-protocol reader and writer: pyarrow's footers, page headers and offset indexes
read and written back byte for byte; every compact type round-trips; bad bytes are errors."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from asyncbatch.formats import _thrift as thrift

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def parquet_bytes(**options: Any) -> bytes:
    """A file of every column kind, with statistics, key-value metadata and ``options``."""
    n = 300
    table = pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "tokens": pa.array([list(range(i % 5)) for i in range(n)], pa.list_(pa.int32())),
            "text": pa.array([None if i % 11 == 0 else f"t{i % 13}" for i in range(n)]),
            "vec": pa.array([[i, -i] for i in range(n)], pa.list_(pa.float32(), 2)),
            "flag": pa.array([i % 3 == 0 for i in range(n)]),
        }
    ).replace_schema_metadata({"note": "x" * 40})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=120, data_page_size=256, **options)
    return sink.getvalue()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"write_page_index": True, "compression": "zstd"},
        {"write_page_index": True, "data_page_version": "2.0", "use_dictionary": False},
        {"write_statistics": False, "compression": "snappy", "store_schema": False},
    ],
)
def test_footers_indexes_and_page_headers_round_trip(options: dict[str, Any]) -> None:
    data = parquet_bytes(**options)
    length = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - length : -8]
    parsed = thrift.parse_all(footer)
    assert thrift.encode(parsed) == footer
    assert parsed[3] == 300  # num_rows
    groups = parsed[4].items
    assert [g[3] for g in groups] == [120, 120, 60]
    indexes = 0
    for group in groups:
        for chunk in group[1].items:
            meta = chunk[3]
            start = meta.get(11) or meta[9]
            header, used = thrift.parse(data[start:])
            assert thrift.encode(header) == data[start : start + used]
            if chunk.get(4) is not None:
                at, size = chunk[4], chunk[5]
                index = thrift.parse_all(data[at : at + size])
                assert thrift.encode(index) == data[at : at + size]
                assert index[1].items[0][3] == 0  # the first page starts at row 0
                indexes += 1
    assert bool(indexes) == bool(options.get("write_page_index"))


def test_every_compact_type_round_trips() -> None:
    inner = thrift.Struct()
    inner.set(1, thrift.BINARY, b"")
    value = thrift.Struct()
    value.set(1, thrift.TRUE, True)
    value.set(2, thrift.TRUE, False)
    value.set(3, thrift.BYTE, -5)
    value.set(4, thrift.I16, -300)
    value.set(5, thrift.I32, 2**31 - 1)
    value.set(6, thrift.I64, -(2**63))
    value.set(7, thrift.DOUBLE, -1.5)
    value.set(8, thrift.BINARY, bytes(range(256)) * 3)
    value.set(9, thrift.LIST, thrift.List(thrift.I32, list(range(-20, 20))))
    value.set(10, thrift.SET, thrift.List(thrift.TRUE, [True, False, True]))
    value.set(11, thrift.MAP, thrift.Map(thrift.BINARY, thrift.STRUCT, [(b"k", inner)]))
    value.set(12, thrift.MAP, thrift.Map(0, 0, []))
    value.set(40, thrift.STRUCT, inner)  # a jump of more than 15: the long field header
    value.set(41, thrift.LIST, thrift.List(thrift.STRUCT, []))
    encoded = thrift.encode(value)
    parsed = thrift.parse_all(encoded)
    assert parsed == value
    assert thrift.encode(parsed) == encoded
    assert parsed.get(99, "absent") == "absent"
    with pytest.raises(thrift.ThriftError, match="required field 99"):
        parsed[99]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x15", "ends at byte 1"),  # an i32 field with no value
        (b"\x18\x7f", "runs past the end"),  # a 127-byte binary in 0 bytes
        (b"\x19\xf5\xff\xff\xff\x0f", "runs past the end"),  # a list of 2^32-1 i32
        (b"\x1d\x00", "unknown compact type 13"),
        (b"\x16" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x15\x02\x00\x00", "ends at byte 3 of 4"),  # trailing bytes
    ],
)
def test_malformed_bytes_are_errors(data: bytes, message: str) -> None:
    with pytest.raises(thrift.ThriftError, match=message):
        thrift.parse_all(data)


def test_nesting_is_bounded() -> None:
    deep = b"\x1c" * (thrift.MAX_DEPTH + 5)
    with pytest.raises(thrift.ThriftError, match="nested deeper"):
        thrift.parse(deep)
