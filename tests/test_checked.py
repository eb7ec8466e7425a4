"""The checks as a store layer (stores/checked.py) over a transport that reads only ranges,
and the flags each layer of the stack states for what the store below can do."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import xxhash
from plugin.abtest_adapter import DirTransport

from asyncbatch._errors import ChecksumError, ManifestError, StoreError
from asyncbatch.stores._base import ObjectInfo, Store
from asyncbatch.stores._checked import CheckedStore, Expected
from asyncbatch.stores._counting import ReadCounts
from asyncbatch.stores._local import LocalStore
from asyncbatch.stores._stack import stacked

BLOCK = 256


class CountedDir(DirTransport):
    """The example adapter (``get_ranges`` and ``stat`` only), counting stats and ranges."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.stats: Counter[str] = Counter()
        self.ranges = 0
        self.delay = delay

    async def stat(self, url: str) -> ObjectInfo:
        self.stats[url] += 1
        await asyncio.sleep(0.01)  # the groups' checks overlap
        return await super().stat(url)

    async def get_ranges(self, url: str, *, starts: object, ends: object) -> list[bytes]:
        self.ranges += 1
        await asyncio.sleep(self.delay)
        return await super().get_ranges(url, starts=starts, ends=ends)  # type: ignore[arg-type]


def _expected(urls: list[str], datas: list[bytes], level: str, sizes: list[int]) -> Expected:
    """What the objects ``datas`` are, as a manifest would record them (block digests of
    ``BLOCK`` bytes)."""
    digests = [
        [xxhash.xxh3_64_intdigest(d[a : a + BLOCK]) for a in range(0, len(d), BLOCK)] for d in datas
    ]
    counts = np.array([len(d) for d in digests], dtype=np.int64)
    return Expected(
        urls,
        np.array(sizes, dtype=np.int64),
        level=level,
        checksums=[xxhash.xxh3_64_intdigest(d) for d in datas],
        block_size=np.full(len(urls), BLOCK, dtype=np.int64),
        digests=np.array([x for d in digests for x in d], dtype=np.uint64),
        first_block=np.cumsum(counts) - counts,
    )


def _objects(tmp_path: Path) -> tuple[list[str], list[bytes]]:
    rng = np.random.default_rng(0)
    datas = [rng.bytes(1000), rng.bytes(700)]
    urls = []
    for index, data in enumerate(datas):
        path = tmp_path / f"obj-{index}"
        path.write_bytes(data)
        urls.append(f"dirplug://{path}")
    return urls, datas


def _flip(path: Path, offset: int) -> None:
    """Change the byte at ``offset`` of ``path`` in place."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


async def _read_into(store: Store, urls: list[str], ranges: list[tuple[int, int, int]]) -> bytes:
    which = np.array([r[0] for r in ranges], dtype=np.int64)
    starts = np.array([r[1] for r in ranges], dtype=np.int64)
    ends = np.array([r[2] for r in ranges], dtype=np.int64)
    offsets = np.cumsum(ends - starts) - (ends - starts)
    dest = np.zeros(int((ends - starts).sum()), dtype=np.uint8)
    await store.read_into(urls, which, starts, ends, dest, offsets)
    return dest.tobytes()


@pytest.mark.parametrize("level", ["size", "block", "full"])
def test_checks_over_a_transport_that_reads_only_ranges(tmp_path: Path, level: str) -> None:
    """Over the two-method adapter, the checks read groups into one buffer (one read per
    object), check each object once however many reads wait for it, and widen reads to
    whole blocks under ``block``; a corrupt block is a ChecksumError naming it, a wrong size
    a ManifestError, the first in URL order."""
    urls, datas = _objects(tmp_path)
    ranges = [(0, 10, 20), (0, 300, 310), (1, 5, 600)]
    wanted = b"".join(datas[w][a:b] for w, a, b in ranges)

    async def main() -> None:
        transport = CountedDir()
        expected = _expected(urls, datas, level, [len(d) for d in datas])
        store = CheckedStore(stacked(transport), expected)
        try:
            assert store.supports_read_into and not store.supports_convert
            assert not store.supports_windows
            got = await asyncio.gather(*(_read_into(store, urls, ranges) for _ in range(4)))
            assert got == [wanted] * 4
            assert transport.stats == Counter(urls)  # one check per object for all four
            transport.ranges = 0
            got = await asyncio.gather(*(_read_into(store, urls, ranges) for _ in range(4)))
            assert got == [wanted] * 4
            if level == "block":  # read together: each block once, one request per object
                assert transport.ranges == 2
            assert expected.passed.all()
            # Corrupt byte 300 (block 1) of object 0: "block" reads see it; the others
            # checked the object already.
            _flip(Path(urls[0].removeprefix("dirplug://")), 300)
            if level == "block":
                with pytest.raises(ChecksumError, match=r"obj-0 block 1 bytes \[256, 512\)"):
                    await _read_into(store, urls, ranges)
            else:
                await _read_into(store, urls, ranges)
        finally:
            await store.close()
        # Wrong sizes on both objects: the first one's error is raised.
        wrong = _expected(urls, datas, level, [len(d) + 1 for d in datas])
        store = CheckedStore(stacked(CountedDir()), wrong)
        try:
            with pytest.raises(ManifestError, match=f"size mismatch: {urls[0]}"):
                await _read_into(store, urls, [(1, 0, 10), (0, 0, 10)])
        finally:
            await store.close()

    asyncio.run(main())


def test_each_layer_states_what_the_store_below_can_do(tmp_path: Path) -> None:
    """The flags: the local transport reads groups, converts and copies windows through
    every layer; the two-method adapter does none of it (and refuses a group read rather
    than fake one); a stacked store stacked again keeps its own flags."""

    async def main() -> None:
        local = stacked(LocalStore(), counts=ReadCounts())
        plain = stacked(DirTransport(), counts=ReadCounts())
        again = stacked(stacked(DirTransport()))
        try:
            flags = ("read_into", "convert", "windows", "discard")
            assert [getattr(local, f"supports_{f}") for f in flags] == [True, True, True, False]
            for store in (plain, again):
                assert [getattr(store, f"supports_{f}") for f in flags] == [False] * 4
            zero = np.zeros(1, dtype=np.int64)
            with pytest.raises(StoreError, match="cannot read into one buffer"):
                await plain.read_into(
                    [str(tmp_path)], zero, zero, zero + 1, np.zeros(1, np.uint8), zero
                )
            assert not await plain.read_windows([], zero, zero, 1, zero, 1, np.zeros(0, np.uint8))
        finally:
            for store in (local, plain, again):
                await store.close()

    asyncio.run(main())


def test_a_block_read_cancelled_leaves_the_others_whole(tmp_path: Path) -> None:
    """Of block reads asked for together, one cancelled (before or while they are read)
    leaves the others' bytes whole, and nothing reads on after the last is cancelled."""
    urls, datas = _objects(tmp_path)
    ranges = [(0, 10, 20), (1, 5, 600)]
    wanted = b"".join(datas[w][a:b] for w, a, b in ranges)

    async def main() -> None:
        expected = _expected(urls, datas, "block", [len(d) for d in datas])
        expected.passed[:] = True
        transport = CountedDir(delay=0.05)
        store = CheckedStore(stacked(transport), expected)
        try:
            for delay in (0.0, 0.01):
                tasks = [asyncio.ensure_future(_read_into(store, urls, ranges)) for _ in range(3)]
                await asyncio.sleep(delay)
                tasks[1].cancel()
                got = await asyncio.gather(*tasks, return_exceptions=True)
                assert got[0] == got[2] == wanted and isinstance(got[1], asyncio.CancelledError)
            tasks = [asyncio.ensure_future(_read_into(store, urls, ranges)) for _ in range(2)]
            await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(g, asyncio.CancelledError) for g in got)
            reads = transport.ranges
            await asyncio.sleep(0.1)
            assert transport.ranges == reads  # the joined read was stopped, not left running
            assert await _read_into(store, urls, ranges) == wanted  # still reads
        finally:
            await store.close()

    asyncio.run(main())
