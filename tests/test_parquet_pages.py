"""Parquet under an exact shuffle reads, where files have an offset index, only the pages
holding the rows (and dictionary pages), decoded exactly; other files and orders read whole
column chunks. Expectations come from :func:`test_parquet.make_table`'s values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_parquet import check_batch, make_table, writer_for

import asyncbatch as ab
from asyncbatch._errors import FormatError
from asyncbatch.formats import _thrift as thrift

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: Small pages, so that a row group holds many: rows per write batch and bytes per page.
SMALL_PAGES = {"write_batch_size": 16, "data_page_size": 256}


def epoch_ids(dataset: ab.Dataset, **kwargs: Any) -> tuple[list[int], ab.LoaderStatistics]:
    """Every batch of one exact-shuffle epoch checked; the ids delivered and the counts."""
    ids: list[int] = []
    with ab.Loader(dataset, batch_size=8, shuffle=True, drop_last=False, **kwargs) as loader:
        for batch in loader:
            check_batch(batch)
            ids.extend(batch.global_indexes.tolist())
        return ids, loader.statistics()


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "snappy", **SMALL_PAGES},
        {"compression": "zstd", "data_page_version": "2.0", **SMALL_PAGES},
        {"compression": "zstd", "use_dictionary": False, "write_batch_size": 64},
        {"compression": "none", "data_page_version": "2.0", "use_dictionary": False},
        {"compression": "snappy", "data_page_size": 1 << 20},  # one page per chunk
    ],
    ids=["snappy-dict-v1", "zstd-dict-v2", "zstd-plain-v1", "plain-v2", "one-page"],
)
def test_pages_decode_exactly(options: dict[str, Any], tmp_path: Path, request: Any) -> None:
    root, write, _ = writer_for("local", request, tmp_path)
    # Unequal row groups, and a file without an offset index between two with one.
    write("a.parquet", make_table(0, 300), 130, write_page_index=True, **options)
    write("b.parquet", make_table(300, 70), 40, **options)
    write("c.parquet", make_table(370, 150), 150, write_page_index=True, **options)
    ids, stats = epoch_ids(ab.open_dataset(root), coalesce_gap=0)
    assert sorted(ids) == list(range(520))
    assert stats.bytes_fetched > 0


def test_columns_in_another_order_than_the_files(tmp_path: Path, request: Any) -> None:
    # Each page is decoded as the column whose leaf it is (fields were once named in the
    # order asked for while pages came in the files' order: a page read as another column).
    root, write, _ = writer_for("local", request, tmp_path)
    write("a.parquet", make_table(0, 120), 50, write_page_index=True, **SMALL_PAGES)
    dataset = ab.open_dataset(root, options={"columns": ["vec", "score", "text", "tokens", "id"]})
    ids, _ = epoch_ids(dataset)
    assert sorted(ids) == list(range(120))


def test_nullable_columns_filled_or_refused(tmp_path: Path, request: Any) -> None:
    root, write, _ = writer_for("local", request, tmp_path)
    n = 200
    values = [None if i % 9 == 0 else i for i in range(n)]
    table = pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "maybe": pa.array(values, pa.int32()),
            "words": pa.array([None if i % 4 == 0 else f"w{i}" for i in range(n)]),
            "items": pa.array(
                [None if i % 5 == 0 else [i, None] for i in range(n)], pa.list_(pa.int64())
            ),
        }
    )
    write("n.parquet", table, 100, write_page_index=True, **SMALL_PAGES)
    filled = ab.open_dataset(root, options={"nulls": "fill"})
    with ab.Loader(filled, batch_size=10, shuffle=True) as loader:
        seen = 0
        for batch in loader:
            i = batch["id"].numpy()
            expected = np.where(i % 9 == 0, 0, i)
            np.testing.assert_array_equal(batch["maybe"].numpy(), expected)
            assert batch["words"].to_pylist() == [f"w{k}" if k % 4 else "" for k in i.tolist()]
            items = batch["items"]
            for row, k in enumerate(i.tolist()):
                assert items[row].tolist() == ([] if k % 5 == 0 else [k, 0])
            seen += len(i)
        assert seen == n
    refused = ab.open_dataset(root, options={"columns": ["id", "maybe"]})
    with (
        ab.Loader(refused, batch_size=10, shuffle=True) as loader,
        pytest.raises(FormatError, match=r"n\.parquet: row group \d, column 'maybe' holds nulls"),
    ):
        list(loader)


def whole_chunks(dataset: ab.Dataset, ids: np.ndarray) -> int:
    """Bytes of the column chunks of the row groups rows ``ids`` lie in, from the footers."""
    ranges = dataset.arrays["rg_ranges"]
    per_group = (ranges[..., 1] - ranges[..., 0]).sum(axis=1)
    ends = np.cumsum(dataset.arrays["rg_rows"])
    return int(per_group[np.unique(np.searchsorted(ends, ids, side="right"))].sum())


def paged_epoch(
    dataset: ab.Dataset, check: Callable[[ab.Batch], None]
) -> tuple[int, int, list[int]]:
    """One exact-shuffle epoch, one batch per read, each batch checked: bytes fetched, the
    bytes of the whole column chunks its batches' rows lie in (what reading whole chunks
    costs), and the rows delivered."""
    whole, ids = 0, []
    with ab.Loader(dataset, batch_size=8, shuffle=True, prefetch=2, coalesce_gap=0) as loader:
        for batch in loader:
            check(batch)
            whole += whole_chunks(dataset, batch.global_indexes)
            ids.extend(batch.global_indexes.tolist())
        return loader.statistics().bytes_fetched, whole, sorted(ids)


def test_bytes_per_batch_far_below_whole_chunks(tmp_path: Path, request: Any) -> None:
    """With an offset index a batch fetches its rows' pages; without, every column chunk
    of every row group its rows lie in. (No dictionaries: a dictionary page of values that
    are all distinct is as large as its chunk.)"""
    fetched = {}
    for indexed in (True, False):
        root, write, _ = writer_for("local", request, tmp_path)
        options = {"write_page_index": indexed, "use_dictionary": False, **SMALL_PAGES}
        write("f.parquet", make_table(0, 2000), 500, **options)
        fetched[indexed], whole, ids = paged_epoch(ab.open_dataset(root), check_batch)
        assert ids == list(range(2000))
        if not indexed:
            assert fetched[indexed] == whole  # the chunk-level figure, exactly
    assert fetched[True] < 0.15 * fetched[False]


def test_over_s3(request: Any, tmp_path: Path) -> None:
    root, write, options = writer_for("s3", request, tmp_path)
    written = {"write_page_index": True, "use_dictionary": False, **SMALL_PAGES}
    write("a.parquet", make_table(0, 100), 50, **written)
    write("b.parquet", make_table(100, 60), 60, **written)
    dataset = ab.open_dataset(root, options, options={"columns": ["id", "tokens"]})

    def check(batch: ab.Batch) -> None:
        i = batch["id"].numpy()
        assert [batch["tokens"][k].tolist() for k in range(i.size)] == [
            list(range(k, k + k % 7)) for k in i.tolist()
        ]

    fetched, whole, ids = paged_epoch(dataset, check)
    assert ids == list(range(160))
    assert fetched < 0.5 * whole


def garbage(index: thrift.Struct, length: int) -> bytes:
    return b"\xff" * length


def first_row_moved(index: thrift.Struct, length: int) -> bytes:
    index[1].items[0].set(3, thrift.I64, 1)  # the first page starts at row 1
    return thrift.encode(index)


def page_moved(index: thrift.Struct, length: int) -> bytes:
    """The second page 1 byte later and shorter: still inside the chunk, but not a page."""
    page = index[1].items[1]
    page.set(1, thrift.I64, page[1] + 1)
    page.set(2, thrift.I32, page[2] - 1)
    return thrift.encode(index)


Edit = Callable[[thrift.Struct, int], bytes]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (garbage, "offset index at bytes .* is corrupt"),
        (first_row_moved, "offset index at bytes .* is corrupt: its pages"),
        (page_moved, "page at bytes .* does not decode"),
    ],
)
def test_corrupt_offset_index_names_file_and_column(
    edit: Edit, message: str, tmp_path: Path, request: Any
) -> None:
    root, write, _ = writer_for("local", request, tmp_path)
    write("bad.parquet", make_table(0, 100), 100, write_page_index=True, **SMALL_PAGES)
    path = Path(root) / "bad.parquet"
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[-8:-4], "little")
    chunk = thrift.parse_all(bytes(raw[-8 - length : -8]))[4].items[0][1].items[2]  # "text"
    at, size = chunk[4], chunk[5]
    edited = edit(thrift.parse_all(bytes(raw[at : at + size])), size)
    assert len(edited) == size
    raw[at : at + size] = edited
    path.write_bytes(bytes(raw))
    dataset = ab.open_dataset(root)
    with (
        ab.Loader(dataset, batch_size=8, shuffle=True) as loader,
        pytest.raises(FormatError, match=r"bad\.parquet: row group 0, column 'text'.*" + message),
    ):
        list(loader)
    # Block shuffle and sequential order read whole row groups: no offset index is read.
    for shuffle in ("block", False):
        with ab.Loader(dataset, batch_size=8, shuffle=shuffle, drop_last=False) as loader:
            assert sorted(i for b in loader for i in b.global_indexes.tolist()) == list(range(100))


def test_a_small_offset_index_cache_rereads_and_stays_exact(
    tmp_path: Path, request: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offset indexes evicted from a bounded cache are read again when needed: more bytes,
    the same rows."""
    from asyncbatch.formats import _parquet_pages as parquet_pages

    root, write, _ = writer_for("local", request, tmp_path)
    write("f.parquet", make_table(0, 400), 100, write_page_index=True, **SMALL_PAGES)
    dataset = ab.open_dataset(root)
    fetched = {}
    for bound in (1000, 1):
        monkeypatch.setattr(parquet_pages, "OFFSET_INDEX_CACHE", bound)
        monkeypatch.setattr(parquet_pages, "FOOTER_CACHE", bound)
        fetched[bound], _, ids = paged_epoch(dataset, check_batch)
        assert ids == list(range(400))
    assert fetched[1] > fetched[1000]
