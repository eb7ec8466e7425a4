"""Parquet: rows read exactly once per epoch through every store, fields by Arrow type,
footers only at open, only the selected columns fetched.

Every expectation comes from the values the test wrote with pyarrow: row ``i`` of the
dataset holds ``id == i`` and columns computed from ``i`` by :func:`make_table`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BUCKET, s3_options
from faults import fault_server
from servers import RangeHTTPServer

import asyncbatch as ab
from asyncbatch._batch import FieldSchema, Jagged, Strings
from asyncbatch._errors import FormatError, ResumeStateError
from asyncbatch.formats._npy import read_range
from asyncbatch.formats._parquet import FOOTER_PROBE, read_footer
from asyncbatch.stores import open_store
from asyncbatch.stores._base import ObjectInfo, ReadsTail, Store, Versioned

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

_names = itertools.count()
#: Rows per file and the row-group size each file is written with: unequal row groups.
FILES = [(37, 10), (0, 10), (55, 16), (8, 8)]


def make_table(first: int, count: int) -> Any:
    """Rows ``first .. first + count - 1``: every column a function of the row's id."""
    ids = np.arange(first, first + count, dtype=np.int64)
    lengths = ids % 7
    tokens = [list(range(int(i), int(i) + int(n))) for i, n in zip(ids, lengths, strict=True)]
    return pa.table(
        {
            "id": pa.array(ids),
            "tokens": pa.array(tokens, type=pa.list_(pa.int32())),
            "text": pa.array([f"row {i} " + "é" * int(i % 3) for i in ids.tolist()], pa.string()),
            "vec": pa.array(
                [[float(i), float(i) / 2, -float(i)] for i in ids.tolist()],
                type=pa.list_(pa.float32(), 3),
            ),
            "score": pa.array((ids * 0.25).tolist(), type=pa.float64()),
        }
    )


#: ``write(relative path, table, row group size, **pyarrow.parquet.write_table options)``.
Write = Callable[..., None]


def writer_for(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, Write, dict[str, Any]]:
    """``(root URL, write(relative path, table, row group size, **options), storage
    options)``."""
    name = f"pq-{next(_names)}"
    if store == "s3":
        import s3fs

        options = s3_options(request.getfixturevalue("s3_endpoint"))
        fs = s3fs.S3FileSystem(**options)
        root = f"s3://{BUCKET}/{name}"

        def write_s3(path: str, table: Any, group: int, **kwargs: Any) -> None:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, row_group_size=group, **kwargs)
            fs.pipe(f"{root}/{path}", sink.getvalue().to_pybytes())

        return root, write_s3, options
    if store == "http":
        base, server = request.getfixturevalue("http_root")
        folder, root = base / name, f"{server.url}/{name}"
    else:
        folder = tmp_path / name
        root = str(folder)

    def write_file(path: str, table: Any, group: int, **kwargs: Any) -> None:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, folder / path, row_group_size=group, **kwargs)

    return root, write_file, {}


def write_files(write: Write, names: list[str]) -> int:
    """The files of :data:`FILES` under ``names``; returns the rows written."""
    first = 0
    for name, (rows, group) in zip(names, FILES, strict=True):
        write(name, make_table(first, rows), group)
        first += rows
    return first


def check_batch(batch: ab.Batch) -> None:
    """Every field equals what :func:`make_table` wrote for the batch's ids."""
    ids = batch["id"].numpy()
    np.testing.assert_array_equal(ids, batch.global_indexes)
    tokens = batch["tokens"]
    assert isinstance(tokens, Jagged)
    assert tokens.values.dtype == torch.int32
    for k, i in enumerate(ids.tolist()):
        assert tokens[k].tolist() == list(range(i, i + i % 7))
    text = batch["text"]
    assert isinstance(text, Strings)
    assert text.to_pylist() == [f"row {i} " + "é" * (i % 3) for i in ids.tolist()]
    assert batch["vec"].shape == (ids.size, 3)
    np.testing.assert_array_equal(batch["vec"][:, 0].numpy(), ids.astype(np.float32))
    np.testing.assert_array_equal(batch["score"].numpy(), ids * 0.25)


@pytest.mark.parametrize("shuffle", ["block", True, False])
def test_every_row_once_per_epoch_every_store(
    store: str, shuffle: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if store != "local" and shuffle is not True:
        pytest.skip("the orders are store-independent: one order per remote store")
    root, write, options = writer_for(store, request, tmp_path)
    names = [f"part-{n}.parquet" for n in (2, 10, 11, 100)]
    total = write_files(write, names)
    if store == "http":  # no listing over plain HTTP: a list of files
        dataset = ab.open_dataset([f"{root}/{n}" for n in names], options)
    else:
        dataset = ab.open_dataset(root, options)
    assert [s.path for s in dataset.manifest.shards] == names  # natural order
    assert dataset.manifest.total_elements == total
    extra = {"window": 2} if shuffle == "block" else {}
    with ab.Loader(dataset, batch_size=6, shuffle=shuffle, drop_last=False, **extra) as loader:
        seen = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = []
            for batch in loader:
                check_batch(batch)
                ids.extend(batch.global_indexes.tolist())
            assert sorted(ids) == list(range(total))
            seen.append(ids)
    if shuffle is False:
        assert seen[0] == list(range(total))
    else:
        assert seen[0] != seen[1]


class CallCounter:
    """A real store with every call that reaches it logged: each is one request."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.coalesce_gap = inner.coalesce_gap
        self.log: list[str] = []

    async def size(self, url: str) -> int:
        self.log.append("size")
        return await self.inner.size(url)

    async def stat(self, url: str) -> ObjectInfo:
        self.log.append("stat")
        assert isinstance(self.inner, Versioned)
        return await self.inner.stat(url)

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        self.log.append(f"read_tail {length}")
        assert isinstance(self.inner, ReadsTail)
        return await self.inner.read_tail(url, length)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Any]
    ) -> None:
        self.log.extend(f"read_ranges {a}-{b}" for a, b in zip(starts, ends, strict=True))
        await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)

    async def list(self, url: str) -> list[str]:
        raise AssertionError("opening a list of files lists nothing")

    async def write(self, url: str, data: Any) -> None:
        raise AssertionError("opening writes nothing")

    async def close(self) -> None:
        await self.inner.close()


async def footer_calls(url: str, options: dict[str, Any]) -> list[str]:
    """The calls :func:`read_footer` makes of ``url``'s store; checks the footer it returns."""
    calls = CallCounter(open_store(url, options))
    try:
        footer = await read_footer(calls, url)
        log = list(calls.log)
        size = await calls.size(url)
        data = await read_range(calls, url, 0, size)
    finally:
        await calls.close()
    length = int.from_bytes(data[-8:-4], "little")
    assert footer == data[-8 - length : -8] + size.to_bytes(8, "little")
    return log


@pytest.mark.parametrize("store", ["local", "s3", "http"])
def test_open_costs_one_request_per_file_two_for_a_large_footer(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    root, write, options = writer_for(store, request, tmp_path)
    names = ["a.parquet", "empty.parquet", "b.parquet", "c.parquet", "large.parquet"]
    total = write_files(write, names[:4])
    # One row group per row: a footer larger than the probe (two reads, checked below).
    write(names[4], make_table(total, 300), 1)
    total += 300
    urls = [f"{root}/{name}" for name in names]
    probe = f"read_tail {FOOTER_PROBE}"
    with contextlib.ExitStack() as stack:
        if store == "s3":  # S3 requests counted by a proxy in front of moto
            proxy = stack.enter_context(
                fault_server(upstream=request.getfixturevalue("s3_endpoint"))
            )
            options = s3_options(proxy.url)

            def served() -> int:  # by the Parquet files (not the manifest looked for)
                folder = f"/{root.rpartition('/')[2]}/"
                return sum(folder in p and p.endswith(".parquet") for _, p, _ in proxy.log)
        elif store == "http":
            server = request.getfixturevalue("http_root")[1]

            def served() -> int:
                return server.requests + server.heads
        else:

            def served() -> int:
                return 0

        for url in urls:
            log = asyncio.run(footer_calls(url, options))
            assert log[0] == probe
            assert len(log) == (2 if url.endswith("large.parquet") else 1), log
        before = served()
        dataset = ab.open_dataset(urls, options)
        if store != "local":
            assert served() - before == 6  # one request per file, two for the large footer
        if store == "s3":  # the listing tells sizes and ETags: one range per file, no HEAD
            before, heads, logged = served(), proxy.count("HEAD", ".parquet"), len(proxy.log)
            listed = ab.open_dataset(root, options).manifest.shards  # in natural order
            assert set(listed) == set(dataset.manifest.shards)
            assert served() - before == 6
            assert proxy.count("HEAD", ".parquet") == heads
            ranges = [r for _, p, r in proxy.log[logged:] if p.endswith(".parquet")]
            assert len(ranges) == 6 and not any(r.startswith("bytes=-") for r in ranges)
            # The same through a node cache: the listing's sizes and ETags still reach the
            # open (the cache and the request counter pass listings on), so still no HEAD.
            # The cache fetches whole blocks: each of these small files is one block, so the
            # large footer's second read is a hit.
            before, heads = served(), proxy.count("HEAD", ".parquet")
            cached = ab.open_dataset(root, options, cache=tmp_path / "cache").manifest.shards
            assert set(cached) == set(dataset.manifest.shards)
            assert served() - before == 5
            assert proxy.count("HEAD", ".parquet") == heads
        with ab.Loader(dataset, batch_size=16, shuffle=False, drop_last=False) as loader:
            ids = [i for b in loader for i in b["id"].tolist()]
    assert ids == list(range(total))


@pytest.mark.parametrize("server_kind", ["nosuffix", "misreadsuffix"])
def test_a_server_without_suffix_ranges_costs_one_more_request(
    http_root: tuple[Path, RangeHTTPServer], server_kind: str
) -> None:
    base, server = http_root
    folder = base / f"pq-{next(_names)}"
    folder.mkdir()
    sizes = {"small.parquet": 20, "big.parquet": 4000}
    for name, rows in sizes.items():
        pq.write_table(make_table(0, rows), folder / name, row_group_size=1000)
        (folder / f"{name}.{server_kind}").touch()  # how the test server answers bytes=-N
    assert (folder / "small.parquet").stat().st_size < FOOTER_PROBE
    assert (folder / "big.parquet").stat().st_size > FOOTER_PROBE
    urls = [f"{server.url}/{folder.name}/{name}" for name in sizes]
    # (GETs, HEADs). A whole file or a first part holding the tail is read and cut; other
    # bytes are dropped, and their headers' size serves a ranged read of the tail.
    for url, rows, expected in zip(urls, sizes.values(), [(1, 0), (2, 0)], strict=True):
        before = server.requests, server.heads
        dataset = ab.open_dataset([url])
        assert (server.requests - before[0], server.heads - before[1]) == expected
        with ab.Loader(dataset, batch_size=500, shuffle=False, drop_last=False) as loader:
            assert [i for b in loader for i in b["id"].tolist()] == list(range(rows))

    async def big_then_small() -> list[tuple[int, int]]:
        store, counts = open_store(urls[0]), []
        try:
            for url in urls[::-1]:
                before = server.requests, server.heads
                await read_footer(store, url)
                counts.append((server.requests - before[0], server.heads - before[1]))
        finally:
            await store.close()
        return counts

    # The store remembers the server: after the big file, a tail is a HEAD and a range.
    assert asyncio.run(big_then_small()) == [(2, 0), (1, 1)]


def test_open_through_the_cache_is_one_request_per_file(
    http_root: tuple[Path, RangeHTTPServer], tmp_path: Path
) -> None:
    base, server = http_root
    folder = base / f"pq-{next(_names)}"
    folder.mkdir()
    names = [f"{n}.parquet" for n in "abcd"]
    total = write_files(lambda p, t, g: pq.write_table(t, folder / p, row_group_size=g), names)
    urls = [f"{server.url}/{folder.name}/{name}" for name in names]
    cache = tmp_path / "cache"
    before = server.requests + server.heads
    dataset = ab.open_dataset(urls, cache=cache)  # the tails pass the cache by
    assert server.requests + server.heads - before == len(names)
    with ab.Loader(dataset, batch_size=16, shuffle=False, drop_last=False, cache=cache) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            before = server.requests
            assert [i for b in loader for i in b["id"].tolist()] == list(range(total))
            if epoch:
                assert server.requests == before  # every block from the cache


def test_huggingface_layout_by_glob_and_folder(tmp_path: Path) -> None:
    root = tmp_path / "hub"
    names = [f"train-{n:05d}-of-00003.parquet" for n in range(3)]
    first = 0
    for name, rows in zip(names, [9, 4, 12], strict=True):
        (root / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(make_table(first, rows), root / "data" / name, row_group_size=5)
        first += rows
    pq.write_table(make_table(0, 3), root / "data" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text("card")
    train = ab.open_dataset(f"{root}/data/train-*.parquet")
    assert [s.path for s in train.manifest.shards] == names
    everything = ab.open_dataset(str(root))  # a folder: .parquet at any depth
    assert len(everything.manifest.shards) == 4
    assert everything.manifest.shards[0].path == "data/test-00000-of-00001.parquet"
    with ab.Loader(train, batch_size=25, shuffle=False) as loader:
        (batch,) = list(loader)
    check_batch(batch)


def test_empty_file_and_empty_row_group(tmp_path: Path) -> None:
    table = make_table(0, 12)
    with pq.ParquetWriter(tmp_path / "a.parquet", table.schema) as out:
        out.write_table(table.slice(0, 5))
        out.write_table(table.slice(5, 0))  # an empty row group
        out.write_table(table.slice(5, 7))
    pq.write_table(table.slice(0, 0), tmp_path / "b.parquet")  # no rows at all
    pq.write_table(make_table(12, 3), tmp_path / "c.parquet")
    dataset = ab.open_dataset(str(tmp_path))
    assert dataset.manifest.total_elements == 15
    with ab.Loader(dataset, batch_size=4, shuffle="block", drop_last=False) as loader:
        ids = []
        for batch in loader:
            check_batch(batch)
            ids += batch.global_indexes.tolist()
    assert sorted(ids) == list(range(15))


@pytest.mark.parametrize("damage", ["truncated", "footer", "magic", "tiny"])
def test_corrupt_files_name_the_file(tmp_path: Path, damage: str) -> None:
    pq.write_table(make_table(0, 20), tmp_path / "good.parquet", row_group_size=5)
    bad = tmp_path / "bad.parquet"
    pq.write_table(make_table(20, 20), bad, row_group_size=5)
    data = bytearray(bad.read_bytes())
    if damage == "truncated":  # cut inside the data: the footer survives a rewrite elsewhere
        data = data[:100] + data[-(int.from_bytes(data[-8:-4], "little") + 8) :]
    elif damage == "footer":
        length = int.from_bytes(data[-8:-4], "little")
        data[-8 - length : -8 - length + 40] = b"\xff" * 40
    elif damage == "magic":
        data = data[:-3]
    else:
        data = data[:7]
    bad.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="bad.parquet"):
        ab.open_dataset(str(tmp_path))


def test_projection_fetches_only_its_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    columns = {f"c{k}": rng.integers(0, 2**62, 4000) for k in range(5)}
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=1000, compression="none")
    dataset = ab.open_dataset(str(path), options={"columns": ["c3"]})
    with ab.Loader(dataset, batch_size=100, shuffle="block", drop_last=False) as loader:
        got = np.concatenate([b["c3"].numpy()[np.argsort(b.global_indexes)] for b in loader])
        stats = loader.statistics()
    assert sorted(got.tolist()) == sorted(columns["c3"].tolist())
    assert list(batch_fields(dataset)) == ["c3"]
    assert 0 < stats.bytes_fetched <= 0.3 * path.stat().st_size


def batch_fields(dataset: ab.Dataset) -> list[str]:
    with ab.Loader(dataset, batch_size=1, shuffle=False) as loader:
        return list(next(iter(loader)))


def test_nulls_are_an_error_unless_filled(tmp_path: Path) -> None:
    table = pa.table(
        {
            "x": pa.array([1, 2, None, 4, 5, 6], type=pa.int32()),
            "t": pa.array([[1], None, [2, 3], [], [4], [5]], type=pa.list_(pa.int64())),
            "s": pa.array(["a", "b", "c", None, "e", "f"]),
        }
    )
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=2)
    dataset = ab.open_dataset(str(tmp_path / "n.parquet"))
    with (
        ab.Loader(dataset, batch_size=6, shuffle=False) as loader,
        pytest.raises(FormatError, match=r"n\.parquet: row group [01], column 'x'"),
    ):
        next(iter(loader))
    filled = ab.open_dataset(str(tmp_path / "n.parquet"), options={"nulls": "fill"})
    with ab.Loader(filled, batch_size=6, shuffle=False) as loader:
        (batch,) = list(loader)
    assert batch["x"].tolist() == [1, 2, 0, 4, 5, 6]
    assert [batch["t"][i].tolist() for i in range(6)] == [[1], [], [2, 3], [], [4], [5]]
    assert batch["s"].to_pylist() == ["a", "b", "c", "", "e", "f"]


def test_resume_and_another_datasets_state(tmp_path: Path) -> None:
    for name, first in (("one", 0), ("two", 1000)):
        (tmp_path / name).mkdir()
        pq.write_table(make_table(first, 50), tmp_path / name / "p.parquet", row_group_size=9)
    one = ab.open_dataset(str(tmp_path / "one"))
    args: dict[str, Any] = dict(batch_size=4, shuffle="block", window=2, seed=3, prefetch=3)
    with ab.Loader(one, **args) as loader:
        full = [b.global_indexes.tolist() for b in loader]
    with ab.Loader(one, **args) as loader:
        it = iter(loader)
        head = [next(it).global_indexes.tolist() for _ in range(3)]
        state = loader.state_dict()
    with ab.Loader(one, **args) as loader:
        loader.load_state_dict(state)
        assert head + [b.global_indexes.tolist() for b in loader] == full
    two = ab.open_dataset(str(tmp_path / "two"))  # same shape, other rows
    with ab.Loader(two, **args) as loader, pytest.raises(ResumeStateError, match="dataset"):
        loader.load_state_dict(state)


def test_strings_pickle_and_slice() -> None:
    data = torch.tensor(list(b"abcdef"), dtype=torch.uint8)
    column = Strings(data, torch.tensor([0, 1, 1, 6]))
    assert column.to_pylist() == ["a", "", "bcdef"]
    assert column[1:].to_pylist() == ["", "bcdef"]
    assert column[-1] == "bcdef"
    schema = {"s": FieldSchema(dtype="str", shape=(-1,), nested=True, tensor=False)}
    batch = ab.Batch(np.arange(3), {"s": column}, schema)
    header, buffers = batch.to_buffers()
    again = ab.Batch.from_buffers(header, buffers)
    assert isinstance(again["s"], Strings)
    assert again["s"].to_pylist() == ["a", "", "bcdef"]


def test_inspect_lists_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(make_table(0, 30), tmp_path / "p.parquet", row_group_size=7)
    from asyncbatch._cli import main

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "row groups: 5" in out
    assert "tokens: list<element: int32>" in out


def test_ranks_read_only_their_own_row_groups(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for k in range(4):
        columns = {f"c{j}": rng.integers(0, 2**62, 600) for j in range(2)}
        pq.write_table(pa.table(columns), tmp_path / f"f{k}.parquet", row_group_size=100)
    dataset = ab.open_dataset(str(tmp_path), options={"columns": ["c0"]})
    # No coalescing across the other column: bytes fetched are exactly the chunks read.
    args: dict[str, Any] = dict(batch_size=50, shuffle="block", window=2, seed=5, coalesce_gap=0)
    with ab.Loader(dataset, **args) as loader:
        list(loader)
        alone = loader.statistics().bytes_fetched
    ids: list[int] = []
    fetched = 0
    for rank in range(2):
        with ab.Loader(dataset, rank=rank, world_size=2, **args) as loader:
            ids += [i for b in loader for i in b.global_indexes.tolist()]
            fetched += loader.statistics().bytes_fetched
    assert sorted(ids) == list(range(2400))
    chunks = 0
    for k in range(4):
        meta = pq.read_metadata(tmp_path / f"f{k}.parquet")
        chunks += sum(meta.row_group(g).column(0).total_compressed_size for g in range(6))
    assert alone == chunks  # row groups are the blocks: each read once, whole
    assert fetched == chunks  # and by one rank only


@pytest.mark.parametrize("shuffle", ["block", True])
def test_elastic_resume_two_ranks_to_three(tmp_path: Path, shuffle: Any) -> None:
    for k in range(3):
        pq.write_table(make_table(40 * k, 40), tmp_path / f"p{k}.parquet", row_group_size=8)
    dataset = ab.open_dataset(str(tmp_path))
    extra = {"window": 2} if shuffle == "block" else {}

    def loader(rank: int, world: int) -> ab.Loader:
        return ab.Loader(
            dataset, batch_size=12 // world, rank=rank, world_size=world, shuffle=shuffle, **extra
        )

    delivered: list[int] = []
    states = []
    for rank in range(2):
        with loader(rank, 2) as first:
            it = iter(first)
            delivered += [i for _ in range(3) for i in next(it).global_indexes.tolist()]
            states.append(first.state_dict())
    for rank in range(3):
        with loader(rank, 3) as rest:
            rest.load_state_dict(states[0])
            delivered += [i for b in rest for i in b.global_indexes.tolist()]
    assert sorted(delivered) == list(range(120))


def test_without_pyarrow_a_config_error_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pq.write_table(make_table(0, 3), tmp_path / "p.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ab.ConfigError, match=r"asyncbatch\[parquet\]"):
        ab.open_dataset(str(tmp_path / "p.parquet"))


def test_list_of_s3_urls(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    root, write, options = writer_for("s3", request, tmp_path)
    names = [f"d/x-{n}.parquet" for n in range(4)]
    total = write_files(write, names)
    dataset = ab.open_dataset([f"{root}/{n}" for n in reversed(names)], options)
    # In the order given, relative to the folder they share.
    assert [s.path for s in dataset.manifest.shards] == [n[2:] for n in reversed(names)]
    assert dataset.url == f"{root}/d"
    with ab.Loader(dataset, batch_size=8, shuffle=False, drop_last=False) as loader:
        ids = [i for b in loader for i in b["id"].tolist()]
    assert sorted(ids) == list(range(total))


def test_a_null_item_inside_a_list_names_the_row_groups(tmp_path: Path) -> None:
    lists = pa.array([[1, 2], [3, None], [4]], type=pa.list_(pa.int64()))
    pq.write_table(pa.table({"t": lists}), tmp_path / "i.parquet", row_group_size=2)
    dataset = ab.open_dataset(str(tmp_path / "i.parquet"))
    with (
        ab.Loader(dataset, batch_size=3, shuffle=False) as loader,
        pytest.raises(FormatError, match=r"i\.parquet: row groups \[0, 1\], items of column 't'"),
    ):
        next(iter(loader))


def test_a_mixture_of_two_parquet_datasets(tmp_path: Path) -> None:
    for name, first in (("a", 0), ("b", 100)):
        (tmp_path / name).mkdir()
        pq.write_table(make_table(first, 30), tmp_path / name / "p.parquet", row_group_size=7)
    blend = ab.mix([str(tmp_path / "a"), str(tmp_path / "b")], [0.5, 0.5], samples=40)
    with ab.Loader(blend, batch_size=8, shuffle="block", window=2) as loader:
        ids = [i for b in loader for i in b["id"].tolist()]
    assert len(ids) == 40
    assert {i // 100 for i in ids} == {0, 1}  # rows of both
    assert all(i % 100 < 30 for i in ids)


def write_documents_files(
    folder: Path, lengths: list[list[int | None]], group: int, *, write_statistics: bool = True
) -> list[list[int]]:
    """Files of one ``input_ids`` list column (document ``d`` of file ``f``: ``lengths[f][d]``
    tokens, values numbered through the stream; ``None``: a null document); returns every
    document's tokens (a null one's: none)."""
    documents: list[list[int]] = []
    at = 0
    for number, file_lengths in enumerate(lengths):
        docs: list[list[int] | None] = []
        for n in file_lengths:
            docs.append(None if n is None else list(range(at, at + n)))
            at += n or 0
        table = pa.table(
            {
                "input_ids": pa.array(docs, type=pa.list_(pa.int32())),
                "id": pa.array(range(len(documents), len(documents) + len(docs)), type=pa.int64()),
            }
        )
        pq.write_table(
            table,
            folder / f"p-{number}.parquet",
            row_group_size=group,
            write_statistics=write_statistics,
        )
        documents += [d or [] for d in docs]
    return documents


PACKED = ("tokens", "document_ids", "position_ids", "cu_seqlens")


def windows_of(batches: Any) -> Iterator[tuple[int, dict[str, list[int]]]]:
    """``(window id, its packed fields)`` of every window of ``batches``."""
    for batch in batches:
        for k, i in enumerate(batch.global_indexes.tolist()):
            yield i, {name: batch[name][k].tolist() for name in PACKED}


def check_packed(
    windows: Iterable[tuple[int, dict[str, list[int]]]],
    documents: list[list[int]],
    seq_len: int,
    next_token: bool,
) -> list[int]:
    """Every window holds the stream's tokens at its id, the documents (rows) they come from
    and the boundaries of the documents inside it (an empty one has none); returns the window
    ids seen."""
    window = seq_len + int(next_token)
    lengths = [len(d) for d in documents]
    stream = np.array([t for d in documents for t in d], dtype=np.int64)
    doc_of = np.repeat(np.arange(len(documents)), lengths)
    starts = np.cumsum([0, *lengths])
    seen = []
    for i, fields in windows:
        lo = i * seq_len
        assert fields["tokens"] == stream[lo : lo + window].tolist()
        assert fields["document_ids"] == doc_of[lo : lo + window].tolist()
        position = np.arange(lo, lo + window) - np.maximum(starts[doc_of[lo : lo + window]], lo)
        assert fields["position_ids"] == position.tolist()
        inner = sorted({int(s) - lo for s in starts if lo < s < lo + seq_len})
        assert fields["cu_seqlens"] == [0, *inner, seq_len]
        seen.append(i)
    return seen


@pytest.mark.parametrize("next_token", [False, True])
def test_packing_is_token_windows_plus_boundaries(tmp_path: Path, next_token: bool) -> None:
    rng = np.random.default_rng(2)
    lengths: list[list[int | None]] = [(1 + rng.geometric(1 / 9, n)).tolist() for n in (30, 1, 45)]
    documents = write_documents_files(tmp_path, lengths, group=7)
    seq_len = 16
    dataset = ab.open_dataset(str(tmp_path))
    with ab.Loader(
        dataset,
        batch_size=5,
        seq_len=seq_len,
        next_token=next_token,
        shuffle="block",
        drop_last=False,
    ) as loader:
        seen = check_packed(windows_of(loader), documents, seq_len, next_token)
    tokens = sum(len(d) for d in documents)
    assert sorted(seen) == list(range((tokens - int(next_token)) // seq_len))


def gappy_lengths(seed: int) -> list[list[int | None]]:
    """Documents of a few files, a quarter of them empty and a tenth null; one file's first
    row group holds no token, another file holds no row."""
    rng = np.random.default_rng(seed)
    files: list[list[int | None]] = [[0, None, 0, None, 0, 0, 0]]
    for n in (40, 0, 33):
        lengths: list[int | None] = (1 + rng.geometric(1 / 6, n)).tolist()
        for d in np.flatnonzero(rng.random(n) < 0.25).tolist():
            lengths[d] = 0
        for d in np.flatnonzero(rng.random(n) < 0.1).tolist():
            lengths[d] = None
        files.append(lengths)
    return files


@pytest.mark.parametrize(("shuffle", "next_token"), [("block", True), (True, False), (False, True)])
def test_packing_passes_over_empty_and_null_documents(
    tmp_path: Path, shuffle: Any, next_token: bool
) -> None:
    documents = write_documents_files(tmp_path, gappy_lengths(4), group=6)
    assert any(not d for d in documents[7:])
    dataset = ab.open_dataset(str(tmp_path), options={"nulls": "fill"})
    seq_len = 8
    with ab.Loader(
        dataset,
        batch_size=4,
        seq_len=seq_len,
        next_token=next_token,
        shuffle=shuffle,
        drop_last=False,
        **({"window": 2} if shuffle == "block" else {}),
    ) as loader:
        seen = check_packed(windows_of(loader), documents, seq_len, next_token)
    tokens = sum(len(d) for d in documents)
    # Every window once: together they cover every token of the stream but the tail.
    assert sorted(seen) == list(range((tokens - int(next_token)) // seq_len))


def test_packing_null_documents_are_an_error_unless_filled(tmp_path: Path) -> None:
    write_documents_files(tmp_path, [[3, None, 4, 5]], group=2)
    dataset = ab.open_dataset(str(tmp_path))
    with (
        ab.Loader(dataset, batch_size=1, seq_len=4, shuffle=False) as loader,
        pytest.raises(FormatError, match=r"row group 0, column 'input_ids' holds nulls"),
    ):
        list(loader)


def test_packing_without_statistics_refuses_empty_documents(tmp_path: Path) -> None:
    write_documents_files(tmp_path, [[3, 0, 4, 5]], group=2, write_statistics=False)
    dataset = ab.open_dataset(str(tmp_path))
    with (
        ab.Loader(dataset, batch_size=1, seq_len=4, shuffle=False) as loader,
        pytest.raises(FormatError, match=r"row group 0, column 'input_ids'.*no null count"),
    ):
        list(loader)


def test_packing_refuses_null_tokens_inside_a_document(tmp_path: Path) -> None:
    lists = pa.array([[1, 2, 3], [4, None, 6], [7, 8]], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"t": lists}), tmp_path / "i.parquet", row_group_size=2)
    dataset = ab.open_dataset(str(tmp_path / "i.parquet"), options={"nulls": "fill"})
    with (
        ab.Loader(dataset, batch_size=1, seq_len=2, shuffle=False) as loader,
        pytest.raises(FormatError, match=r"i\.parquet: row group 0, column 't': null tokens"),
    ):
        list(loader)


def test_packing_resumes_over_empty_and_null_documents(tmp_path: Path) -> None:
    documents = write_documents_files(tmp_path, gappy_lengths(5), group=5)
    dataset = ab.open_dataset(str(tmp_path), options={"nulls": "fill"})
    args: dict[str, Any] = dict(batch_size=3, seq_len=6, shuffle="block", window=2, seed=7)
    with ab.Loader(dataset, prefetch=4, **args) as loader:
        full = [b.global_indexes.tolist() for b in loader]
    for stop in (1, 4):
        with ab.Loader(dataset, prefetch=4, **args) as loader:
            it = iter(loader)
            head = [next(it).global_indexes.tolist() for _ in range(stop)]
            state = loader.state_dict()
        with ab.Loader(dataset, prefetch=2, **args) as loader:
            loader.load_state_dict(state)
            rest = list(loader)
            check_packed(windows_of(rest), documents, 6, False)
            assert head + [b.global_indexes.tolist() for b in rest] == full
    # Elastic: two ranks stop after 2 batches each, three ranks read the rest of the epoch
    # (the global batch stays 6 windows).
    del args["batch_size"]
    delivered: list[int] = []
    states = []
    for rank in range(2):
        with ab.Loader(dataset, batch_size=3, rank=rank, world_size=2, **args) as loader:
            it = iter(loader)
            delivered += [i for _ in range(2) for i in next(it).global_indexes.tolist()]
            states.append(loader.state_dict())
    for rank in range(3):
        with ab.Loader(dataset, batch_size=2, rank=rank, world_size=3, **args) as loader:
            loader.load_state_dict(states[0])
            delivered += [i for b in loader for i in b.global_indexes.tolist()]
    windows = sum(len(d) for d in documents) // 6
    assert len(delivered) == len(set(delivered))
    assert windows - 6 < len(delivered) <= windows  # all but the tail short of a global batch


def test_a_mixture_of_two_packed_parquet_datasets(tmp_path: Path) -> None:
    """Each dataset packs on its own: every window of each once per mixture epoch (default
    weights), holding that dataset's tokens; document ids number rows through the mixture."""
    parts = []
    for name, seed in (("a", 6), ("b", 7)):
        (tmp_path / name).mkdir()
        parts.append(write_documents_files(tmp_path / name, gappy_lengths(seed), group=6))
    datasets = [ab.open_dataset(str(tmp_path / n), options={"nulls": "fill"}) for n in "ab"]
    blend = ab.mix(datasets)
    seq_len = 8
    sizes = [sum(len(d) for d in docs) // seq_len for docs in parts]
    seen: list[list[int]] = [[], []]
    rows_a = len(parts[0])
    with ab.Loader(
        blend, batch_size=4, seq_len=seq_len, shuffle="block", window=2, drop_last=False
    ) as loader:
        for batch in loader:
            which, samples = blend.locate(batch.global_indexes, seq_len)
            for (_, fields), d, i in zip(windows_of([batch]), which, samples, strict=True):
                # Rows are numbered through the mixture: b's after a's.
                fields["document_ids"] = [r - d * rows_a for r in fields["document_ids"]]
                seen[d] += check_packed([(i, fields)], parts[d], seq_len, False)
    assert [sorted(s) for s in seen] == [list(range(n)) for n in sizes]


def test_a_mixture_of_parquet_and_tokens_is_refused(tmp_path: Path) -> None:
    write_documents_files(tmp_path, [[3, 4, 5]], group=2)
    tokens = ab.write_tokens(str(tmp_path / "tokens"), np.arange(100, dtype=np.uint16))
    with pytest.raises(ab.ConfigError, match=r"one format.*\(parquet\).*\(tokens\)"):
        ab.mix([ab.open_dataset(str(tmp_path / "p-0.parquet")), tokens])


@pytest.mark.parametrize("shuffle", ["block", True])
def test_local_reads_of_fewer_ranges_than_jobs(
    shuffle: Any, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copy jobs of 64 bytes, no reads made on the loop: a group's few pages are fewer than
    # the jobs their bytes make (at the defaults, the same with pages of megabytes).
    from asyncbatch.stores import _local

    monkeypatch.setattr(_local, "GATHER_JOB_BYTES", 64)
    monkeypatch.setattr(_local, "INLINE_BYTES", 0)
    root, write, _ = writer_for("local", request, tmp_path)
    names = [f"part-{n}.parquet" for n in range(len(FILES))]
    total = write_files(write, names)
    extra = {"window": 2} if shuffle == "block" else {}
    with ab.Loader(root, batch_size=6, shuffle=shuffle, drop_last=False, **extra) as loader:
        seen = []
        for batch in loader:
            check_batch(batch)
            seen.extend(batch.global_indexes.tolist())
    assert sorted(seen) == list(range(total))
