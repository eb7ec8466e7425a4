"""Paged per-shard document indexes: the file the writers write, reads that fetch a shard's
top level and then only the pages a batch needs (counted at the server), the cache's bound,
and pages that fail their checks."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import BUCKET, s3_options
from faults import fault_server
from test_documents import (
    Documents,
    check_jagged,
    check_packed,
    make_documents,
    stream_of,
)

import asyncbatch as ab
from asyncbatch._checksums import DEFAULT_CHECKSUM_BLOCK, block_digests, digest, format_digest
from asyncbatch._manifest import Manifest, ShardInfo
from asyncbatch.formats._documents_index import (
    HEADER_BYTES,
    PAGE_DOCUMENTS,
    PAGED_MAGIC,
    index_path,
    per_shard_metadata,
    shard_index_bytes,
    shard_index_info,
)


@pytest.fixture(scope="module")
def documents() -> Documents:
    return make_documents(4, 300)


def write_paged(
    root: Path,
    lengths: npt.NDArray[np.int64],
    per_shard: int,
    page: int | None,
    *,
    slots: bool = False,
    **slot_args: int,
) -> npt.NDArray[np.uint16]:
    """A per-shard dataset of documents of ``lengths`` (each token its document's number
    modulo 60,000), ``per_shard`` documents a shard, written with numpy and the writers'
    helpers as ``prepare`` writes one (fast for many documents); its tokens. No slot table
    unless ``slots`` (``slot_args``: ``block_tokens``, ``slot_starts``), so that packed
    windows read pages."""
    count = lengths.size
    tokens = np.repeat(np.arange(count) % 60_000, lengths).astype(np.uint16)
    ends = np.cumsum(lengths)
    root.mkdir(parents=True)
    shards, infos, counts = [], [], []
    for k, first in enumerate(range(0, count, per_shard)):
        last = min(count, first + per_shard)
        start = int(ends[first - 1]) if first else 0
        data = tokens[start : int(ends[last - 1])].tobytes()
        name = f"shard-{k:05d}.bin"
        (root / name).write_bytes(data)
        blocks = block_digests(data, DEFAULT_CHECKSUM_BLOCK)
        shards.append(ShardInfo(name, len(data), len(data) // 2, 0, digest(data), blocks))
        raw = shard_index_bytes(
            np.concatenate([[0], ends[first:last] - start]),
            page_documents=page,
            slots=slots,
            **slot_args,
        )
        (root / index_path(name)).write_bytes(raw)
        infos.append(shard_index_info(index_path(name), raw))
        counts.append(last - first)
    manifest = Manifest(
        "documents",
        np.dtype(np.uint16),
        tuple(shards),
        per_shard_metadata(counts, infos),
        checksum="xxh3_64",
        checksum_block=DEFAULT_CHECKSUM_BLOCK,
    )
    (root / "manifest.json").write_text(manifest.to_json())
    return tokens


def test_the_paged_index_file(tmp_path: Path) -> None:
    docs = [[1, 2], [3], [], [4, 5, 6], [7], [], [], [8, 9]]
    dataset = ab.write_documents(
        str(tmp_path / "ds"), docs, dtype=np.uint16, page_documents=3, slots=False
    )
    entry = dataset.manifest.metadata["shard_indexes"][0]
    raw = (tmp_path / "ds" / entry["path"]).read_bytes()
    assert raw[:8] == PAGED_MAGIC and struct.unpack_from("<qq", raw, 8) == (3, 8)
    offsets = np.frombuffer(raw, "<i8", 9, HEADER_BYTES)
    assert offsets.tolist() == [0, 2, 3, 3, 6, 7, 7, 7, 9]
    top = raw[HEADER_BYTES + 72 :]
    assert np.frombuffer(top, "<i8", 3).tolist() == [0, 3, 7]  # offsets 0, 3 and 6
    page_bytes = [
        raw[HEADER_BYTES + 8 * a : HEADER_BYTES + 8 * b] for a, b in [(0, 4), (3, 7), (6, 9)]
    ]
    assert np.frombuffer(top, "<u8", 3, 24).tolist() == [digest(p) for p in page_bytes]
    assert entry == {
        "path": "shard-00000.idx",
        "bytes": len(raw),
        "checksum": format_digest(digest(raw)),
        "page_documents": 3,
        "top_checksum": format_digest(digest(top)),
    }
    assert shard_index_info(entry["path"], raw) == entry
    assert PAGE_DOCUMENTS == 512  # the writers' default, as docs/format.md says
    with ab.Loader(dataset, batch_size=8, shuffle=False) as loader:
        column = next(iter(loader))["tokens"]
    assert column.lengths.tolist() == [len(d) for d in docs]
    with pytest.raises(ab.ConfigError, match="page_documents"):
        ab.write_documents(str(tmp_path / "bad"), docs, dtype=np.uint16, page_documents=0)


@pytest.mark.parametrize("budget", [None, 0])
@pytest.mark.parametrize("kind", ["samples", "packed"])
def test_paged_reads_back_exactly(
    tmp_path: Path, documents: Documents, kind: str, budget: int | None
) -> None:
    """Pages of 3 documents, shards of ~500 tokens, empty documents and documents longer
    than a window: every document and window as written, with the index cache at its
    default and at 0 (every page fetched again when needed)."""
    dataset = ab.write_documents(
        str(tmp_path / "ds"), documents, shard_size=1000, page_documents=3, slots=False
    )
    assert len(dataset.manifest.shards) > 4
    tokens, owner = stream_of(documents)
    args: dict[str, Any] = {"batch_size": 8, "shuffle": True, "seed": 5, "drop_last": False}
    if budget is not None:
        args["format_options"] = {"index_cache_bytes": budget}
    if kind == "packed":
        args["seq_len"] = 40
        args["next_token"] = True
    seen = []
    with ab.Loader(dataset, **args) as loader:
        for batch in loader:
            if kind == "packed":
                check_packed(batch, tokens, owner, 40, next_token=True)
            else:
                check_jagged(batch, documents)
            seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(len(seen)))


def test_whole_and_paged_indexes_in_one_dataset(tmp_path: Path, documents: Documents) -> None:
    """Every other shard's index rewritten whole (as an earlier writer wrote it): documents
    and windows read across both kinds (packed windows: slots and whole indexes)."""
    root = tmp_path / "ds"
    dataset = ab.write_documents(str(root), documents, shard_size=800, page_documents=4)
    manifest = json.loads((root / "manifest.json").read_text())
    entries = manifest["metadata"]["shard_indexes"]
    for entry in entries[::2]:
        raw = (root / entry["path"]).read_bytes()
        n = struct.unpack_from("<qq", raw, 8)[1]
        whole = raw[HEADER_BYTES : HEADER_BYTES + 8 * (n + 1)]
        (root / entry["path"]).write_bytes(whole)
        entry.clear()
        entry.update(shard_index_info(index_path(dataset.manifest.shards[0].path), whole))
    for k, entry in enumerate(entries):
        entry["path"] = index_path(dataset.manifest.shards[k].path)
    (root / "manifest.json").write_text(json.dumps(manifest))
    tokens, owner = stream_of(documents)
    for args in ({}, {"seq_len": 64}):
        with ab.Loader(str(root), batch_size=8, shuffle=True, seed=1, **args) as loader:
            for batch in loader:
                if args:
                    check_packed(batch, tokens, owner, 64)
                else:
                    check_jagged(batch, documents)


def index_pieces(
    log: list[tuple[str, str, str]], documents: int, page: int
) -> dict[str, list[int]]:
    """Per index file, the pieces its GETs fetched, from a server's log: each page a range
    covered, ``-1`` for its top level (every index of ``documents`` in pages of ``page``)."""
    top = HEADER_BYTES + 8 * (documents + 1)
    pieces: dict[str, list[int]] = {}
    for method, path, header in log:
        if method != "GET" or not path.endswith(".idx"):
            continue
        first, last = (int(x) for x in header.removeprefix("bytes=").split("-"))
        got = pieces.setdefault(path, [])
        if first >= top:
            got.append(-1)
            continue
        entries = (last + 1 - HEADER_BYTES) // 8  # a run of pages ends one offset past them
        got += range((first - HEADER_BYTES) // (8 * page), -(-(entries - 1) // page))
    return pieces


@pytest.mark.parametrize("slots", [False, True])
def test_first_shuffled_batch_reads_pages_not_the_index_over_s3(
    tmp_path: Path, s3_endpoint: str, slots: bool
) -> None:
    """The issue's 5×10^6 documents in one shard, scaled to 4×10^5 (the page arithmetic is
    the same): counted at a proxy in front of moto, opening plus the first exact-shuffle
    batch of 16 windows of 2048 reads at most 1 MiB plus 64 KiB for the one shard; the whole
    index alone is 3.2 MB. With the slot table the writers choose (blocks of 256 tokens),
    slots only: no top level, no page."""
    import s3fs

    count = 400_000
    lengths = np.random.default_rng(1).integers(0, 6, count)
    write_paged(tmp_path / "ds", lengths, count, PAGE_DOCUMENTS, slots=slots)
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    fs.put(str(tmp_path / "ds"), f"{BUCKET}/paged-{slots}", recursive=True)
    with fault_server(upstream=s3_endpoint) as proxy:
        options = s3_options(proxy.url)
        with ab.Loader(
            f"s3://{BUCKET}/paged-{slots}",
            batch_size=16,
            seq_len=2048,
            shuffle=True,
            prefetch=1,
            storage_options=options,
        ) as loader:
            next(iter(loader))
            sent = proxy.sent("GET")
            index_sent = proxy.sent("GET", ".idx")
            index_gets = proxy.count("GET", ".idx")
            fetched = loader.statistics().bytes_fetched
            firsts = [
                int(header.removeprefix("bytes=").split("-")[0])
                for method, path, header in proxy.log
                if method == "GET" and path.endswith(".idx")
            ]
    assert sent <= 2**20 + 2**16
    # What the loader counts as fetched includes the next group's reads once planned, which
    # may not have reached the proxy yet when it was read: bounded the same, not by ``sent``.
    assert 0 < fetched <= 2**20 + 2**16
    if slots:
        manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
        table = manifest["metadata"]["shard_indexes"][0]["slots"]
        assert table["block_tokens"] == 256
        # Slots only (no top level, no page): 16 windows of 9 or 10 slots of 261 bytes, one
        # range a window (and a rare overflow), a batch; the loader reads a few ahead.
        slots_at = HEADER_BYTES + 8 * (count + 1) + 16 * -(-count // PAGE_DOCUMENTS) + 36
        assert all(first >= slots_at for first in firsts), (min(firsts), slots_at)
        assert 0 < index_sent <= 8 * 16 * 10 * 261
        assert index_gets <= 8 * 2 * 16
        return
    # The top level (782 pages: 12.5 KiB), then the pages of 16 windows (one or two each).
    assert 12_512 < index_sent <= 12_512 + 16 * 3 * (8 * PAGE_DOCUMENTS + 8)
    assert index_gets <= 1 + 16 * 2  # the top level, then one range per run of pages


def test_an_exact_shuffle_fetches_no_page_twice_and_the_cache_stays_bounded(
    tmp_path: Path,
) -> None:
    """Simulated ranks of an exact global shuffle over one epoch of packed windows, counted
    at an HTTP server: with the cache at its default, no rank fetches a page or a top level
    twice; with a cache of 8 pages, it never holds more than that plus one fetch's pieces,
    and the windows stay exact."""
    count, per_shard, page = 20_000, 5_000, 64
    lengths = np.random.default_rng(2).integers(20, 60, count)
    tokens = write_paged(tmp_path / "ds", lengths, per_shard, page)
    owner = np.repeat(np.arange(count), lengths)
    with fault_server(tmp_path) as server:
        url = f"{server.url}/ds"
        for rank in range(4):
            server.reset()
            args: dict[str, Any] = {"rank": rank, "world_size": 4, "seed": 3, "shuffle": True}
            with ab.Loader(url, batch_size=8, seq_len=512, **args) as loader:
                for _ in loader:
                    pass
            pieces = index_pieces(server.log, per_shard, page)
            assert len(pieces) == count // per_shard  # every shard touched
            for got in pieces.values():
                assert got.count(-1) == 1 and len(got) == len(set(got)), got
        budget = 8 * 8 * (page + 1)
        with ab.Loader(
            url,
            batch_size=8,
            seq_len=512,
            shuffle=True,
            prefetch=1,
            format_options={"index_cache_bytes": budget},
        ) as loader:
            index = loader._engine.source.index
            peak = 0
            for number, batch in enumerate(itertools.islice(loader, 40)):
                peak = max(peak, index.cached_bytes)
                if number < 10:
                    check_packed(batch, tokens, owner, 512)
    one_fetch = 8 * 3 * 8 * (page + 1) + 4 * 16 * (per_shard // page + 1)
    assert 0 < peak <= budget + one_fetch, peak


def test_a_page_that_fails_its_checks_is_refused(tmp_path: Path) -> None:
    """A page or top level whose checksum fails is a ChecksumError; one that disagrees with
    the top level or the shard a FormatError; both name the index, the bytes, the page and
    the shard, for documents as samples and packed windows alike."""
    docs = [[1, 2, 3], [4], [5, 6], [7, 8], [], [9], [10, 11, 12], [13], [14, 15]]
    root = tmp_path / "ds"
    ab.write_documents(str(root), docs, dtype=np.uint16, page_documents=3, slots=False)
    index = root / "shard-00000.idx"
    good, saved = index.read_bytes(), (root / "manifest.json").read_text()
    url, shard = str(index), str(root / "shard-00000.bin")
    n = len(docs)
    top_at = HEADER_BYTES + 8 * (n + 1)

    def rewrite(offsets: list[int] | None = None, firsts: list[int] | None = None) -> None:
        """The index with other ``offsets`` or top-level ``firsts``, every checksum redone
        (what the pages' checks must catch on their own)."""
        raw = bytearray(good)
        if offsets is not None:
            raw[HEADER_BYTES:top_at] = np.array(offsets, "<i8").tobytes()
        pages = [
            raw[HEADER_BYTES + 8 * a : HEADER_BYTES + 8 * b] for a, b in [(0, 4), (3, 7), (6, 10)]
        ]
        top = np.frombuffer(bytes(raw[top_at:]), "<i8").copy()
        if firsts is not None:
            top[:3] = firsts
        top[3:] = np.array([digest(bytes(p)) for p in pages], "<u8").view("<i8")
        raw[top_at:] = top.tobytes()
        index.write_bytes(bytes(raw))
        manifest = json.loads(saved)
        entry = manifest["metadata"]["shard_indexes"][0]
        entry["top_checksum"] = format_digest(digest(top.tobytes()))
        entry.pop("checksum")
        (root / "manifest.json").write_text(json.dumps(manifest))

    def read_all(**kwargs: Any) -> None:
        with ab.Loader(str(root), batch_size=3, shuffle=False, **kwargs) as loader:
            for _ in loader:
                pass

    offsets = np.frombuffer(good, "<i8", n + 1, HEADER_BYTES).tolist()
    assert offsets == [0, 3, 4, 6, 8, 8, 9, 12, 13, 15]
    at = rf"{url}: bytes \[{HEADER_BYTES + 24}, {HEADER_BYTES + 56}\)"
    page1 = f"{at}: page 1 of the index of shard {shard}"
    for kwargs in ({}, {"seq_len": 4}):
        # A byte of page 1 flipped: its checksum.
        raw = bytearray(good)
        raw[HEADER_BYTES + 8 * 4] ^= 1
        index.write_bytes(bytes(raw))
        with pytest.raises(ab.ChecksumError, match=f"{page1}: checksum") as caught:
            read_all(**kwargs)
        assert (caught.value.url, caught.value.start) == (url, HEADER_BYTES + 24)
        # The top level flipped: its checksum, from the manifest.
        raw = bytearray(good)
        raw[top_at + 8] ^= 1
        index.write_bytes(bytes(raw))
        top = rf"{url}: bytes \[{top_at}, {top_at + 48}\): the top level of the paged index"
        with pytest.raises(ab.ChecksumError, match=f"{top} of shard {shard}: checksum"):
            read_all(**kwargs)
        # Checksums redone, offsets wrong: a page that decreases, a page at another place
        # than its top-level entry, a top level beyond the shard.
        rewrite(offsets=[0, 3, 4, 6, 5, 8, 9, 12, 13, 15])
        falling = "document offsets decrease at document 3"
        with pytest.raises(ab.FormatError, match=f"{page1}: {falling}"):
            read_all(**kwargs)
        rewrite(firsts=[0, 5, 9])
        wrong = "offsets 0 .. 6, but the top level puts the page at elements 0 .. 5"
        with pytest.raises(ab.FormatError, match=f"page 0 of the index of shard {shard}: {wrong}"):
            read_all(**kwargs)
        rewrite(firsts=[0, 6, 16])
        beyond = "starts at element 16, out of order in the 15 elements"
        with pytest.raises(ab.FormatError, match=f"page 2 of the index of shard {shard} {beyond}"):
            read_all(**kwargs)
        index.write_bytes(good)
        (root / "manifest.json").write_text(saved)
        read_all(**kwargs)


def test_prepare_writes_paged_indexes(tmp_path: Path) -> None:
    """``prepare`` writes its indexes through the same helpers: paged, read back exactly."""
    rows = [[int(i), int(i) + 1][: i % 3] for i in range(1, 1200)]
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    ab.prepare(str(tmp_path / "in"), str(tmp_path / "out"), token_field="input_ids", progress=False)
    dataset = ab.open_dataset(str(tmp_path / "out"))
    entries = dataset.manifest.metadata["shard_indexes"]
    assert entries and all(e["page_documents"] == PAGE_DOCUMENTS for e in entries)
    assert all("top_checksum" in e for e in entries)
    with ab.Loader(dataset, batch_size=100, shuffle=True, drop_last=False) as loader:
        got = {
            i: batch["tokens"][row].tolist()
            for batch in loader
            for row, i in enumerate(batch.global_indexes.tolist())
        }
    assert [got[i] for i in range(len(rows))] == rows


def test_index_bytes_and_memory_grow_with_what_a_batch_reads(tmp_path: Path) -> None:
    """Ten times the documents in one shard: the first batch's index bytes (counted at the
    server) and the cache's bytes grow by the top level alone (16 bytes a page), not with
    the whole index (8 bytes a document)."""
    got = []
    with fault_server(tmp_path) as server:
        for count in (20_000, 200_000):
            lengths = np.random.default_rng(3).integers(0, 6, count)
            write_paged(tmp_path / f"d{count}", lengths, count, PAGE_DOCUMENTS)
            for args in ({"seq_len": 256}, {}):
                server.reset()
                url = f"{server.url}/d{count}"
                with ab.Loader(url, batch_size=4, shuffle=True, prefetch=1, **args) as loader:
                    next(iter(loader))
                    cached = loader._engine.source.index.cached_bytes
                    sent = server.sent("GET", ".idx")
                top = 16 * -(-count // PAGE_DOCUMENTS)
                pages = 4 * 2 * (8 * PAGE_DOCUMENTS + 8)
                assert top < sent <= top + 4 * pages  # a few batches read ahead at most
                assert cached <= sent + 8 * 8  # neighbouring pages share an offset
                got.append(sent)
    assert got[2] - got[0] < 2 * (16 * 180_000 // PAGE_DOCUMENTS + 4 * 2 * 4104)


def test_documents_as_samples_read_a_top_level_and_its_pages_in_one_round(
    tmp_path: Path,
) -> None:
    """A document's page is known without the top level: the first batch that touches a
    shard reads both at once (both in flight at the server, each held back 0.3 s), and
    checks the page against the top level after."""
    from faults import Fault

    ab.write_documents(str(tmp_path / "ds"), make_documents(1, 50), page_documents=8)
    with fault_server(tmp_path) as server:
        dataset = ab.open_dataset(f"{server.url}/ds")
        server.reset()
        server.inject(default=Fault(delay=0.3), path=".idx")
        with ab.Loader(dataset, batch_size=4, shuffle=False, prefetch=1) as loader:
            next(iter(loader))
        assert server.count("GET", ".idx") == 2 and server.peak == 2
