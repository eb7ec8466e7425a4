"""Slot tables of paged per-shard document indexes: packed windows read where documents start
in the blocks they overlap, and get exactly the batches the pages give; slots that fail their
checks are refused; no slot is fetched twice while the cache holds it."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from faults import fault_server
from test_documents_paged import write_paged

import asyncbatch as ab
from asyncbatch.formats._documents_index import index_file_bytes
from asyncbatch.formats._documents_slots import (
    SLOT_HEADER_BYTES,
    SLOT_MAGIC,
    SlotTable,
    slot_checksum,
)

FIELDS = ("tokens", "document_ids", "position_ids")


def lengths_with_edges(count: int, seed: int) -> npt.NDArray[np.int64]:
    """Documents of 0 to 39 tokens, a tenth empty, runs of empty ones, and a few of 150 to
    300 (several blocks of 16 and several windows long)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, count)
    lengths[rng.random(count) < 0.1] = 0
    lengths[rng.choice(count, 8, replace=False)] = rng.integers(150, 300, 8)
    lengths[50:57] = 0
    return lengths


def batches(url: str, **kwargs: Any) -> list[dict[str, Any]]:
    with ab.Loader(url, **kwargs) as loader:
        return [as_arrays(batch) for batch in loader]


def as_arrays(batch: ab.Batch) -> dict[str, Any]:
    got = {name: batch[name].numpy() for name in FIELDS}
    got["cu_seqlens"] = [row.numpy() for row in batch["cu_seqlens"]]
    got["ids"] = batch.global_indexes.tolist()
    return got


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a["ids"] == b["ids"]
        for name in FIELDS:
            np.testing.assert_array_equal(a[name], b[name])
        assert len(a["cu_seqlens"]) == len(b["cu_seqlens"])
        for x, y in zip(a["cu_seqlens"], b["cu_seqlens"], strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The same documents twice, in shards of 150 documents: pages only, and pages plus
    slots of blocks of 16 tokens holding 2 starts (documents of ~20 tokens: many blocks
    overflow)."""
    root = tmp_path_factory.mktemp("slots")
    lengths = lengths_with_edges(900, 4)
    write_paged(root / "pages", lengths, 150, 8)
    write_paged(root / "slots", lengths, 150, 8, slots=True, block_tokens=16, slot_starts=2)
    manifest = json.loads((root / "slots" / "manifest.json").read_text())
    tables = [e["slots"] for e in manifest["metadata"]["shard_indexes"]]
    assert len(tables) == 6 and all(t["block_tokens"] == 16 for t in tables)
    assert all(t["overflow"] > 0 for t in tables)
    return str(root / "pages"), str(root / "slots")


@pytest.mark.parametrize("next_token", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_slots_give_the_batches_pages_give(
    pair: tuple[str, str], next_token: bool, world_size: int
) -> None:
    """Batch for batch (tokens, cu_seqlens, document_ids, position_ids): windows of 24 and
    25 tokens over blocks of 16, crossing shard ends, empty and long documents, each rank of
    an exact shuffle, and the cache at 0 (every slot fetched again) for rank 0."""
    pages, slots = pair
    for rank in range(world_size):
        kwargs: dict[str, Any] = {
            "batch_size": 7,
            "seq_len": 24,
            "next_token": next_token,
            "shuffle": True,
            "seed": 2,
            "rank": rank,
            "world_size": world_size,
            "drop_last": False,
        }
        want = batches(pages, **kwargs)
        assert_same(batches(slots, **kwargs), want)
        if rank == 0:
            tight = {**kwargs, "format_options": {"index_cache_bytes": 0}}
            assert_same(batches(slots, **tight), want)
    with ab.Loader(slots, batch_size=2, seq_len=24) as loader:
        index = loader._engine.source.index
        assert index is not None and (index.slot_at >= 0).all()  # the slot path was read


def test_slots_resume_as_pages_do(pair: tuple[str, str]) -> None:
    pages, slots = pair
    kwargs: dict[str, Any] = {"batch_size": 5, "seq_len": 32, "shuffle": True, "seed": 9}
    want = batches(pages, **kwargs)
    with ab.Loader(slots, **kwargs) as loader:
        first = [as_arrays(b) for _, b in zip(range(4), loader, strict=False)]
        state = loader.state_dict()
    with ab.Loader(slots, **kwargs) as loader:
        loader.load_state_dict(state)
        rest = [as_arrays(b) for b in loader]
    assert_same(first + rest, want)


def test_the_writers_choose_a_slot_table(tmp_path: Path) -> None:
    """``write_documents`` writes a slot table after the top level (its header and entry as
    format.md says); documents of ~200 tokens get blocks whose slots cost under 2 % of a
    2,048-token window; ``slots=False`` writes none, and a table not smaller than the
    offsets is not written."""
    rng = np.random.default_rng(0)
    docs = [np.full(int(n), 7, dtype=np.uint16) for n in rng.integers(100, 300, 3000)]
    dataset = ab.write_documents(str(tmp_path / "ds"), docs)
    entry = dataset.manifest.metadata["shard_indexes"][0]
    table = SlotTable.of_entry(entry["slots"], dataset.manifest.shards[0].elements)
    raw = (tmp_path / "ds" / entry["path"]).read_bytes()
    at = index_file_bytes(3000, 512)
    assert raw[at : at + 8] == SLOT_MAGIC and len(raw) == at + table.file_bytes
    assert struct.unpack_from("<II", raw, at + 8) == (table.block, table.starts)
    per_window = (1 + 2047 / table.block) * table.slot_bytes
    assert per_window < 0.02 * 4096, (table, per_window)
    plain = ab.write_documents(str(tmp_path / "plain"), docs, slots=False)
    assert "slots" not in plain.manifest.metadata["shard_indexes"][0]
    # Three long documents: slots of blocks would outweigh four offsets.
    few = ab.write_documents(str(tmp_path / "few"), [np.ones(5000, np.uint16)] * 3)
    assert "slots" not in few.manifest.metadata["shard_indexes"][0]
    with pytest.raises(ab.ConfigError, match="block_tokens"):
        write_paged(tmp_path / "bad", np.array([3, 4]), 2, 8, slots=True, block_tokens=24)


def corrupt_setup(tmp_path: Path) -> tuple[Path, bytes, str, SlotTable, int]:
    """One shard of 8-token documents in blocks of 16 holding 2 starts (block 2: 4 starts,
    overflowing); its index, bytes, table and where its slots begin."""
    lengths = np.array([8, 8, 8, 8, 3, 3, 2, 8, 8, 8, 8])  # block 2 (32..47): 32, 35, 38, 40
    write_paged(tmp_path / "ds", lengths, 20, 4, slots=True, block_tokens=16, slot_starts=2)
    index = tmp_path / "ds" / "shard-00000.idx"
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    table = SlotTable.of_entry(manifest["metadata"]["shard_indexes"][0]["slots"], 72)
    assert (table.blocks, table.overflow) == (5, 4)
    return index, index.read_bytes(), str(index), table, index_file_bytes(11, 4) + SLOT_HEADER_BYTES


def resum(raw: bytearray, table: SlotTable, start: int, block: int) -> None:
    """Slot ``block``'s checksum redone in place (what the content checks must catch)."""
    a = start + block * table.slot_bytes
    body = table.slot_bytes - 4
    raw[a + body : a + table.slot_bytes] = slot_checksum(bytes(raw[a : a + body]), block).to_bytes(
        4, "little"
    )


def read_packed(root: Path) -> None:
    with ab.Loader(str(root), batch_size=2, seq_len=16, shuffle=False) as loader:
        for _ in loader:
            pass


def test_a_slot_that_fails_its_checks_is_refused(tmp_path: Path) -> None:
    """A slot or overflow whose checksum fails is a ChecksumError naming the index, the
    bytes, the block and the shard; a slot that disagrees with its shard or its neighbour
    (checksum redone) a FormatError naming the same."""
    index, good, url, table, start = corrupt_setup(tmp_path)
    shard = str(tmp_path / "ds" / "shard-00000.bin")
    size, head = table.slot_bytes, table.before_bytes + table.count_bytes
    read_packed(tmp_path / "ds")

    def where(block: int) -> str:
        a = start + block * size
        end = min(16 * (block + 1), 72)
        return (
            rf"{url}: bytes \[{a}, {a + size}\): the slot of block {block} \(elements"
            rf" \[{16 * block}, {end}\)\) of shard {shard}"
        )

    raw = bytearray(good)
    raw[start + size + head] ^= 1
    index.write_bytes(bytes(raw))
    with pytest.raises(ab.ChecksumError, match=f"{where(1)}: checksum") as caught:
        read_packed(tmp_path / "ds")
    assert (caught.value.url, caught.value.start, caught.value.end) == (
        url,
        start + size,
        start + 2 * size,
    )
    overflow_at = start + table.blocks * size
    raw = bytearray(good)
    raw[overflow_at + 1] ^= 1
    index.write_bytes(bytes(raw))
    spilled = rf"bytes \[{overflow_at}, {overflow_at + 8}\): the overflow starts of block 2"
    with pytest.raises(ab.ChecksumError, match=f"{spilled} of shard {shard}: checksum"):
        read_packed(tmp_path / "ds")

    def broken(block: int, edit: dict[int, int]) -> None:
        raw = bytearray(good)
        for offset, value in edit.items():
            raw[start + block * size + offset] = value
        resum(raw, table, start, block)
        index.write_bytes(bytes(raw))

    # Block 1 (16..31) holds starts 0 and 8: one moved beyond the block, then before the
    # other; its documents-before count off by one (its neighbours disagree); a count
    # beyond the slot's 2 starts.
    cases = [
        (1, {head + 2: 16}, "a document starts at 16 from the block's start, beyond its 16"),
        (1, {head: 9}, r"document starts decrease \(9 then 8\)"),
        (1, {0: 3}, "3 documents before the block, but block 0's slot has 0 before it and 2"),
        (1, {table.before_bytes: 2 + 1}, "3 starts, more than the 2 a slot holds"),
        (0, {head: 1}, "the shard's first document must start at element 0"),
    ]
    for block, edit, message in cases:
        broken(block, edit)
        with pytest.raises(ab.FormatError, match=f"{where(block)}: {message}"):
            read_packed(tmp_path / "ds")
    index.write_bytes(good)
    read_packed(tmp_path / "ds")


def test_an_exact_shuffle_fetches_no_slot_twice(tmp_path: Path) -> None:
    """Ranks of an exact shuffle counted at an HTTP server: no byte of a slot table is
    fetched twice by a rank while the cache holds it, no top level or page is fetched for
    packed windows, and a small cache stays near its bound."""
    lengths = np.random.default_rng(5).integers(20, 60, 3000)
    write_paged(tmp_path / "ds", lengths, 1000, 64, slots=True)
    with fault_server(tmp_path) as server:
        url = f"{server.url}/ds"
        for rank in range(3):
            server.reset()
            args: dict[str, Any] = {"rank": rank, "world_size": 3, "seed": 3, "shuffle": True}
            with ab.Loader(url, batch_size=8, seq_len=128, **args) as loader:
                for _ in loader:
                    pass
            ranges: dict[str, list[tuple[int, int]]] = {}
            for method, path, header in server.log:
                if method == "GET" and path.endswith(".idx"):
                    first, last = (int(x) for x in header.removeprefix("bytes=").split("-"))
                    ranges.setdefault(path, []).append((first, last + 1))
            assert len(ranges) == 3
            for path, got in ranges.items():
                got.sort()
                slots_at = index_file_bytes(1000, 64) + SLOT_HEADER_BYTES
                assert got[0][0] >= slots_at, (path, got[0])  # slots only
                assert all(a[1] <= b[0] for a, b in zip(got, got[1:], strict=False)), path
        budget = 4096
        with ab.Loader(
            url,
            batch_size=8,
            seq_len=128,
            shuffle=True,
            prefetch=1,
            format_options={"index_cache_bytes": budget},
        ) as loader:
            index = loader._engine.source.index
            peak = 0
            for _ in itertools.islice(loader, 30):
                peak = max(peak, index.cached_bytes)
    assert 0 < peak <= budget + 8 * 3 * (320 + 8 * 16), peak


def test_a_slots_entry_that_does_not_fit_its_shard_is_refused_at_open(tmp_path: Path) -> None:
    """A manifest whose slots entry does not fit the shard or the file is a ManifestError
    at open."""
    index, good, url, table, start = corrupt_setup(tmp_path)
    manifest_path = tmp_path / "ds" / "manifest.json"
    saved = manifest_path.read_text()
    for key, value, message in [
        ("blocks", 4, "slots: 4 blocks of 16 and 4 overflow entries for a shard of 72 elements"),
        ("block_tokens", 24, "slots: block_tokens 24 is not a power of two"),
        ("overflow", 5, "cannot hold the 12 paged index .* and slot table"),
    ]:
        manifest = json.loads(saved)
        manifest["metadata"]["shard_indexes"][0]["slots"][key] = value
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(ab.ManifestError, match=message):
            ab.open_dataset(str(tmp_path / "ds"))
    manifest_path.write_text(saved)
    ab.open_dataset(str(tmp_path / "ds"))


def test_wide_slot_counts_and_tiny_documents(tmp_path: Path) -> None:
    """Documents of 0 to 2 tokens in blocks of 1,024 holding 300 starts (uint16 counts; the
    ~1,000 starts of a block overflow): the batches pages give."""
    lengths = np.random.default_rng(7).integers(0, 3, 6000)
    write_paged(tmp_path / "pages", lengths, 2500, 64)
    write_paged(
        tmp_path / "slots", lengths, 2500, 64, slots=True, block_tokens=1024, slot_starts=300
    )
    entry = json.loads((tmp_path / "slots" / "manifest.json").read_text())["metadata"]
    assert entry["shard_indexes"][0]["slots"]["count_bytes"] == 2
    kwargs: dict[str, Any] = {"batch_size": 3, "seq_len": 100, "next_token": True, "shuffle": True}
    assert_same(
        batches(str(tmp_path / "slots"), **kwargs), batches(str(tmp_path / "pages"), **kwargs)
    )
