"""Checks of objects against what is expected of them, as a store layer.

:class:`Expected` says, per URL, what an object must be: its size, and optionally its
whole checksum and its block checksums (xxh3-64, :mod:`~asyncbatch._checksums`), in plain
arrays. The code that reads manifests builds it (:func:`asyncbatch._checks.shard_checks`);
this layer knows nothing of datasets. :class:`CheckedStore`, which ``open_store(...,
expected=)`` stacks on top, then checks at one of three levels::

    size    each object's size is compared with the store's the first time it is touched
    block   size, then every read is widened to whole checksum blocks, each block checked
            before any of its bytes is copied out (no windows, no conversion in the copy)
    full    size, then each object is read and checked whole before its first use

Each object is checked once however many reads wait for it (they share one future), and
the first failure in the order of :attr:`Expected.urls` is raised. An object that passed
stays passed as long as its :class:`Expected` lives (a loader keeps it across runs). Bytes
a cache below served that fail a check are discarded from it and read once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._checksums import ALGORITHM, block_digests, format_digest, num_blocks
from .._errors import ChecksumError, ManifestError, StoreError
from ._base import Buffer, Conversion, ObjectInfo, Store
from ._copying import copy_pieces
from ._ranged import read_by_ranges

#: Bytes read per request when an object is read whole (``full``, ``asyncbatch verify``).
SCAN_CHUNK = 8 * 2**20
#: Objects read whole at once by one store (``full``): bounds its memory to a few chunks.
SCAN_CONCURRENCY = 4
#: With ``block``: the most scratch bytes one group's widened reads fill before their bytes
#: are checked and copied out (a group of 64 shuffled batches may touch a GiB of blocks).
BLOCK_SCRATCH_BYTES = 64 * 2**20

Int64Array = npt.NDArray[np.int64]
DigestArray = npt.NDArray[np.uint64]


class Expected:
    """What each of ``urls`` must be, and which passed already (kept across runs).

    ``sizes[k]``: the object's bytes (-1: unknown, nothing checked); ``checksums[k]``: its
    whole digest or None; ``block_size[k]``: its checksum block (0: none), its block digests
    ``digests[first_block[k]:]``. ``level``: ``size``, ``block`` or ``full`` (see the
    module). ``has_block_digests``: whether ``digests`` holds the block digests at all.
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Int64Array,
        *,
        level: str,
        checksums: Sequence[int | None] | None = None,
        block_size: Int64Array | None = None,
        digests: DigestArray | None = None,
        first_block: Int64Array | None = None,
    ) -> None:
        count = len(urls)
        self.urls = urls
        self.level = level
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.checksums: list[int | None] = [None] * count if checksums is None else list(checksums)
        self.block_size = (
            np.zeros(count, np.int64) if block_size is None else np.asarray(block_size, np.int64)
        )
        self.has_block_digests = digests is not None
        self.digests: DigestArray = np.zeros(0, np.uint64) if digests is None else digests
        self.first_block = (
            np.zeros(count, np.int64) if first_block is None else np.asarray(first_block, np.int64)
        )
        #: Whether each object passed (one of unknown size has nothing to check).
        self.passed = self.sizes < 0
        self._index: dict[str, int] | None = None

    def row_of(self, url: str) -> int:
        """``url``'s row, or -1 when nothing is expected of it."""
        if self._index is None:
            self._index = {url: row for row, url in enumerate(self.urls)}
        return self._index.get(url, -1)

    def fill_check(self) -> Callable[[str, int, Any], str | None] | None:
        """A check of bytes a cache is about to keep, against the block checksums:
        ``check(url, start, data)`` names the first whole checksum block in ``data`` (bytes
        from ``start`` of object ``url``) whose digest differs, or returns None. None when no
        block checksums are known."""
        if not self.has_block_digests or not (self.block_size > 0).any():
            return None

        def check(url: str, start: int, data: Any) -> str | None:
            row = self.row_of(url)
            block = 0 if row < 0 else int(self.block_size[row])
            if block <= 0:
                return None
            view = memoryview(data).cast("B")
            size, end = int(self.sizes[row]), start + len(view)
            for number in range(-(-start // block), num_blocks(size, block)):
                low, high = number * block, min(size, (number + 1) * block)
                if high > end:
                    break
                got = xxhash.xxh3_64_intdigest(view[low - start : high - start])
                if got != int(self.digests[self.first_block[row] + number]):
                    return f"block {number} (bytes [{low}, {high}))"
            return None

        return check


@dataclass
class ScanReport:
    """The problems found in one object by :func:`scan` (empty: clean)."""

    url: str
    problems: list[Exception] = field(default_factory=list)
    #: Numbers of the blocks whose checksum did not match.
    bad_blocks: list[int] = field(default_factory=list)


async def scan(
    store: Store,
    expected: Expected,
    row: int,
    *,
    blocks: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ScanReport:
    """Check object ``row`` of ``expected`` against ``store``: its size, then (when known)
    its whole checksum and, with ``blocks``, every block's. Returns every problem; raises
    nothing but cancellation."""
    url = expected.urls[row]
    report = ScanReport(url)
    expected_size = int(expected.sizes[row])
    try:
        size = await store.size(url)
    except StoreError as exc:
        report.problems.append(exc)
        return report
    if size != expected_size:
        report.problems.append(size_error(url, expected_size, size))
        return report
    whole = expected.checksums[row]
    block = int(expected.block_size[row]) if blocks and expected.has_block_digests else 0
    if whole is None and not block:
        return report
    chunk = max(block, SCAN_CHUNK // block * block) if block else SCAN_CHUNK
    buffer = np.empty(min(chunk, size), dtype=np.uint8)
    hasher = xxhash.xxh3_64()
    loop = asyncio.get_running_loop()
    first = int(expected.first_block[row])
    for start in range(0, size, chunk):
        end = min(size, start + chunk)
        view = memoryview(buffer)[: end - start]  # type: ignore[arg-type]
        try:
            await store.read_ranges(url, starts=[start], ends=[end], buffers=[view])
        except StoreError as exc:
            report.problems.append(exc)
            return report
        actual = await loop.run_in_executor(None, _hash_chunk, hasher, view, block)
        if block:
            at = first + start // block
            wanted = expected.digests[at : at + actual.size]
            for index in np.flatnonzero(actual != wanted).tolist():
                number = start // block + index
                report.bad_blocks.append(number)
                a, b = number * block, min(size, (number + 1) * block)
                report.problems.append(
                    block_error(url, number, a, b, int(wanted[index]), int(actual[index]))
                )
        if progress is not None:
            progress(end - start)
    if whole is not None and hasher.intdigest() != whole:
        report.problems.append(
            ChecksumError(
                f"checksum mismatch: {url} (whole shard, {size} bytes): {ALGORITHM}"
                f" expected {format_digest(whole)}, got {format_digest(hasher.intdigest())}",
                url,
                0,
                size,
            )
        )
    return report


def _hash_chunk(hasher: Any, view: memoryview, block: int) -> DigestArray:
    """Feed ``view`` to ``hasher``; the digests of its ``block``-byte blocks (none if 0)."""
    hasher.update(view)
    if not block:
        return np.zeros(0, dtype=np.uint64)
    return np.frombuffer(block_digests(view, block), dtype="<u8").astype(np.uint64)


def size_error(url: str, expected: int, actual: int) -> ManifestError:
    return ManifestError(
        f"size mismatch: {url} has {actual} bytes in the store, the manifest says {expected}"
    )


def block_error(
    url: str, number: int, start: int, end: int, expected: int, actual: int, note: str = ""
) -> ChecksumError:
    return ChecksumError(
        f"checksum mismatch: {url} block {number} bytes [{start}, {end}): {ALGORITHM}"
        f" expected {format_digest(expected)}, got {format_digest(actual)}{note}",
        url,
        start,
        end,
    )


@dataclass(frozen=True, slots=True)
class PerUrl:
    """What :class:`Expected` says of each URL of one call's list, by its index there."""

    rows: Int64Array
    sizes: Int64Array
    block_size: Int64Array
    first_block: Int64Array


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Whole checksum blocks covering a group of reads, and where their bytes lie in them.

    Run ``r`` reads bytes ``[run_start[r], run_end[r])`` of object ``run_object[r]`` (whole
    consecutive blocks) to ``run_at[r]`` of a scratch buffer of ``nbytes``. Block ``k`` lies
    at ``[block_at[k], block_at[k] + block_length[k])`` of the scratch buffer and is block
    ``block_number[k]`` of object ``block_object[k]``. Segment ``s`` copies
    ``seg_length[s]`` bytes from ``seg_src[s]`` of the scratch buffer to ``seg_dest[s]`` of
    the destination.
    """

    run_object: Int64Array
    run_start: Int64Array
    run_end: Int64Array
    run_at: Int64Array
    block_object: Int64Array
    block_number: Int64Array
    block_at: Int64Array
    block_length: Int64Array
    seg_src: Int64Array
    seg_dest: Int64Array
    seg_length: Int64Array
    nbytes: int


def plan_blocks(
    per: PerUrl,
    read_object: Int64Array,
    read_start: Int64Array,
    read_end: Int64Array,
    dest_offsets: Int64Array,
) -> BlockPlan:
    """Widen the reads of objects with block checksums to the whole blocks they touch (each
    block once); reads of other objects stay as they are, after the blocks, unchecked. Read
    ``r``'s bytes go to ``dest_offsets[r]`` of the destination. Vectorised."""
    seg_read = np.arange(read_object.size, dtype=np.int64)
    seg_start, seg_dest, seg_length = read_start, dest_offsets, read_end - read_start
    block_sizes, sizes = per.block_size, per.sizes
    size = block_sizes[read_object]
    checked = size > 0
    picked = np.flatnonzero(checked)
    obj, size = read_object[picked], size[picked]
    first = read_start[picked] // size
    counts = -(-read_end[picked] // size) - first
    owner = np.repeat(np.arange(picked.size), counts)
    step = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    # One key per (object, block), ordered by object then block.
    stride = int((sizes // np.maximum(block_sizes, 1)).max(initial=0)) + 2
    keys = np.unique(obj[owner] * stride + first[owner] + step)
    block_object, block_number = keys // stride, keys % stride
    block_size = block_sizes[block_object]
    block_start = block_number * block_size
    block_end = np.minimum(block_start + block_size, sizes[block_object])
    block_length = block_end - block_start
    new_run = np.ones(keys.size, dtype=bool)
    new_run[1:] = keys[1:] != keys[:-1] + 1  # the next block of the same object continues a run
    heads = np.flatnonzero(new_run)
    block_at = np.cumsum(block_length) - block_length
    tails = np.append(heads[1:], keys.size)[: heads.size] - 1
    # Unchecked reads: one run each, after the blocks.
    plain = np.flatnonzero(~checked)
    plain_length = read_end[plain] - read_start[plain]
    plain_at = int(block_length.sum()) + np.cumsum(plain_length) - plain_length
    # Each segment lies in one run: find its first block (or its read), then the offset.
    seg_src = np.empty_like(seg_start)
    in_blocks = checked[seg_read]
    at = np.flatnonzero(in_blocks)
    seg_object = read_object[seg_read[at]]
    seg_block = np.searchsorted(
        keys, seg_object * stride + seg_start[at] // block_sizes[seg_object]
    )
    seg_src[at] = block_at[seg_block] + seg_start[at] - block_start[seg_block]
    at = np.flatnonzero(~in_blocks)
    read = seg_read[at]
    rank = np.cumsum(~checked) - 1  # of each unchecked read among them
    seg_src[at] = plain_at[rank[read]] + seg_start[at] - read_start[read]
    return BlockPlan(
        run_object=np.concatenate([block_object[heads], read_object[plain]]),
        run_start=np.concatenate([block_start[heads], read_start[plain]]),
        run_end=np.concatenate([block_end[tails], read_end[plain]]),
        run_at=np.concatenate([block_at[heads], plain_at]),
        block_object=block_object,
        block_number=block_number,
        block_at=block_at,
        block_length=block_length,
        seg_src=seg_src,
        seg_dest=seg_dest,
        seg_length=seg_length,
        nbytes=int(block_length.sum() + plain_length.sum()),
    )


def check_blocks(
    expected: Expected,
    per: PerUrl,
    urls: Sequence[str],
    blocks: BlockPlan,
    scratch: npt.NDArray[np.uint8],
    first: int,
    last: int,
    base: int,
) -> None:
    """Raise a ChecksumError for the first of blocks ``[first, last)`` of ``blocks`` that does
    not match (naming the count of bad ones); ``scratch`` holds the plan's scratch bytes
    from offset ``base`` on. Runs in a worker thread (xxhash drops the GIL)."""
    view = memoryview(scratch)  # type: ignore[arg-type]
    hash_of = xxhash.xxh3_64_intdigest
    starts = (blocks.block_at[first:last] - base).tolist()
    lengths = blocks.block_length[first:last].tolist()
    actual = np.fromiter(
        (hash_of(view[at : at + n]) for at, n in zip(starts, lengths, strict=True)),
        dtype=np.uint64,
        count=len(starts),
    )
    objects, numbers = blocks.block_object[first:last], blocks.block_number[first:last]
    wanted = expected.digests[per.first_block[objects] + numbers]
    bad = np.flatnonzero(actual != wanted)
    if bad.size:
        k = int(bad[0])
        obj, number = int(objects[k]), int(numbers[k])
        start = number * int(per.block_size[obj])
        more = f" (and {bad.size - 1} more bad blocks in this read)" if bad.size > 1 else ""
        raise block_error(
            urls[obj], number, start, start + lengths[k], int(wanted[k]), int(actual[k]), more
        )


#: The arguments of one ``read_into`` call: urls, which, starts, ends, dest, dest_offsets.
_Call = tuple[Sequence[str], Int64Array, Int64Array, Int64Array, npt.NDArray[np.uint8], Int64Array]


@dataclass
class _Turn:
    """Block reads asked for in one turn of the loop, read together by one task: each call
    with the future its caller waits on."""

    entries: list[tuple[_Call, asyncio.Future[None]]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Hand a call's outcome to its caller."""
    if future.done():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
        future.exception()  # retrieved: its caller raises it, if it still waits
    else:
        future.set_result(None)


class CheckedStore:
    """Checks the objects of ``inner`` against ``expected`` as they are first used (see the
    module); can do what ``inner`` can, but convert in the copy or copy windows itself under
    ``block``, where every read is widened to whole checksum blocks. Its group reads
    (``read_into``) work over any store below (one ``read_ranges`` per object without its
    own)."""

    def __init__(self, inner: Store, expected: Expected) -> None:
        self.inner = inner
        self.expected = expected
        self.coalesce_gap = inner.coalesce_gap
        self._blocks = expected.level == "block"
        self.supports_read_into = True
        self.supports_convert = inner.supports_convert and not self._blocks
        self.supports_windows = inner.supports_windows and not self._blocks
        self.supports_discard = inner.supports_discard
        #: Checks under way or failed, by row, shared by the reads that wait for them.
        self._checking: dict[int, asyncio.Future[None]] = {}
        self._scans = asyncio.Semaphore(SCAN_CONCURRENCY)
        #: Whether every expected object passed: reads then check nothing more.
        self._done = False
        #: The last URL list a call named, and what is expected of each of its URLs.
        self._per: tuple[Sequence[str], PerUrl] | None = None
        #: Block reads asked for in this turn of the loop, read together when it ends.
        self._turn: _Turn | None = None
        if expected.passed.all():
            self._passed()

    def _passed(self) -> None:
        """Every expected object passed: reads check nothing more. Under any level but
        ``block`` (which widens every read) the group reads then go straight to the store
        below, with no frame of this layer between."""
        self._done = True
        if self._blocks:
            return
        if self.inner.supports_read_into:
            self.read_into = self.inner.read_into  # type: ignore[method-assign]
        if self.supports_windows:
            self.read_windows = self.inner.read_windows  # type: ignore[method-assign]

    def _per_url(self, urls: Sequence[str]) -> PerUrl:
        """What is expected of each of ``urls`` (computed once per list: the engine names
        the same list in every call)."""
        if self._per is not None and self._per[0] is urls:
            return self._per[1]
        expected = self.expected
        if urls is expected.urls:
            rows = np.arange(len(urls), dtype=np.int64)
        else:
            rows = np.array([expected.row_of(url) for url in urls], dtype=np.int64)
        known = rows >= 0
        safe = np.where(known, rows, 0)

        def pick(values: Int64Array, default: int) -> Int64Array:
            return np.where(known, values[safe], default) if values.size else rows * 0 + default

        per = PerUrl(
            rows,
            pick(expected.sizes, -1),
            pick(expected.block_size, 0),
            pick(expected.first_block, 0),
        )
        self._per = (urls, per)
        return per

    async def _check_indexes(self, urls: Sequence[str], indexes: Int64Array) -> None:
        """Check the objects ``urls[indexes]`` not checked yet."""
        if self._done:
            return
        rows = self._per_url(urls).rows[indexes]
        rows = rows[rows >= 0]
        todo = rows[~self.expected.passed[rows]]
        if todo.size:
            await self._check_rows(todo)
        elif self.expected.passed.all():
            self._passed()

    async def _check_rows(self, rows: Int64Array) -> None:
        """Check the objects of ``rows`` (size, or whole checksum for ``full``), each once
        however many reads wait for it; raises the first failure in row order."""
        expected = self.expected
        loop = asyncio.get_running_loop()
        mine: list[int] = []
        waiting: list[asyncio.Future[None]] = []
        for row in np.unique(rows).tolist():
            future = self._checking.get(row)
            if future is None:
                future = self._checking[row] = loop.create_future()
                mine.append(row)
            waiting.append(future)
        if mine:
            try:
                results = await asyncio.gather(
                    *(self._check_row(row) for row in mine), return_exceptions=True
                )
            except BaseException:
                for row in mine:  # cancelled: the reads waiting on these are cancelled too
                    self._checking.pop(row).cancel()
                raise
            for row, result in zip(mine, results, strict=True):
                future = self._checking[row]
                if isinstance(result, asyncio.CancelledError):
                    future.cancel()
                elif isinstance(result, BaseException):
                    future.set_exception(result)
                    future.exception()  # retrieved: it is raised below
                else:
                    expected.passed[row] = True
                    future.set_result(None)
        # Waiting never cancels them (other reads wait for them too); the first failure in
        # row order is raised.
        pending = [future for future in waiting if not future.done()]
        if pending:
            await asyncio.wait(pending)
        for future in waiting:
            future.result()

    async def _check_row(self, row: int) -> None:
        expected = self.expected
        url, size = expected.urls[row], int(expected.sizes[row])
        if expected.level == "full":
            for again in (False, True):
                async with self._scans:
                    report = await scan(self.inner, expected, row)
                if not report.problems:
                    return
                # A mismatch in bytes a cache served: drop its copies, read once more.
                problem = report.problems[0]
                if again or not isinstance(problem, ChecksumError):
                    raise problem
                if not await self._discard([url], [0], [size]):
                    raise problem
            return
        got = await self.inner.size(url)
        if got != size:
            raise size_error(url, size, got)

    async def _discard(
        self, urls: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> bool:
        """Drop cached copies of ``[starts[i], ends[i])`` of ``urls[i]``; whether a store
        below keeps copies."""
        if not self.supports_discard:
            return False
        for url, start, end in zip(urls, starts, ends, strict=True):
            await self.inner.discard(url, int(start), int(end))
        return True

    async def read_into(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
        convert: Conversion | None = None,
    ) -> None:
        if not self._done:
            await self._check_indexes(urls, np.unique(which))
        if self._blocks:
            assert convert is None, "no conversion under verify='block'"
            await self._read_blocks_together((urls, which, starts, ends, dest, dest_offsets))
        elif self.inner.supports_read_into:
            await self.inner.read_into(urls, which, starts, ends, dest, dest_offsets, convert)
        else:
            assert convert is None, "no conversion without read_into below"
            await read_by_ranges(self.inner, urls, which, starts, ends, dest, dest_offsets)

    async def _read_below(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dest: npt.NDArray[np.uint8],
        dest_offsets: Int64Array,
    ) -> None:
        if self.inner.supports_read_into:
            await self.inner.read_into(urls, which, starts, ends, dest, dest_offsets)
        else:
            await read_by_ranges(self.inner, urls, which, starts, ends, dest, dest_offsets)

    async def _read_blocks_together(self, call: _Call) -> None:
        """``call``'s block reads, joined with the others asked for in the same turn of the
        loop (a group's reads that land in place and those merged into scratch, and other
        groups'): each block read and checked once for all of them. Where the joined read
        fails, each call is read again on its own, so each gets its own outcome. A caller
        cancelled waits until nothing writes into its buffer any more."""
        loop = asyncio.get_running_loop()
        turn = self._turn
        if turn is None:
            turn = self._turn = _Turn()
            loop.call_soon(self._start_turn, turn)
        entry = (call, loop.create_future())
        turn.entries.append(entry)
        try:
            await asyncio.shield(entry[1])
        except asyncio.CancelledError:
            turn.entries = [other for other in turn.entries if other is not entry]
            task = turn.task
            if task is None:  # not started: nothing will write into this call's buffer
                raise
            if not turn.entries:  # nobody waits for it any more
                task.cancel()
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([task])
            raise

    def _start_turn(self, turn: _Turn) -> None:
        if self._turn is turn:
            self._turn = None
        if turn.entries:
            turn.task = asyncio.get_running_loop().create_task(self._read_turn(turn.entries))

    async def _read_turn(self, entries: list[tuple[_Call, asyncio.Future[None]]]) -> None:
        """The calls of one turn, those naming one URL list together; settles each call's
        future."""
        by_list: dict[int, list[tuple[_Call, asyncio.Future[None]]]] = {}
        for entry in list(entries):
            by_list.setdefault(id(entry[0][0]), []).append(entry)
        try:
            for joined in by_list.values():
                calls = [call for call, _ in joined]
                try:
                    await self._read_calls(calls)
                except Exception as exc:  # noqa: BLE001 - handed to the calls that failed
                    if len(joined) == 1:
                        _settle(joined[0][1], exc)
                        continue
                    # Which calls failed: each read on its own (a failure is rare).
                    outcomes = await asyncio.gather(
                        *(self._read_calls([call]) for call in calls), return_exceptions=True
                    )
                    for (_, future), outcome in zip(joined, outcomes, strict=True):
                        _settle(future, outcome if isinstance(outcome, BaseException) else None)
                    continue
                for _, future in joined:
                    _settle(future, None)
        finally:
            for _, future in entries:
                if not future.done():
                    future.cancel()

    async def _read_calls(self, calls: list[_Call]) -> None:
        """The block reads of ``calls`` (all naming one URL list), together."""
        sizes = [int(call[1].size) for call in calls]
        await self._read_blocks(
            calls[0][0],
            np.concatenate([call[1] for call in calls]),
            np.concatenate([call[2] for call in calls]),
            np.concatenate([call[3] for call in calls]),
            [call[4] for call in calls],
            np.concatenate([call[5] for call in calls]),
            np.repeat(np.arange(len(calls), dtype=np.int64), sizes),
        )

    async def _read_blocks(
        self,
        urls: Sequence[str],
        which: Int64Array,
        starts: Int64Array,
        ends: Int64Array,
        dests: Sequence[npt.NDArray[np.uint8]],
        dest_offsets: Int64Array,
        dest_of: Int64Array,
    ) -> None:
        """``read_into`` with every read widened to whole checksum blocks (each read once),
        checked before any of their bytes is copied out: read ``r``'s bytes go to
        ``dests[dest_of[r]][dest_offsets[r]:]``."""
        per = self._per_url(urls)
        blocks = plan_blocks(per, which, starts, ends, dest_offsets)
        run_at, run_length = blocks.run_at, blocks.run_end - blocks.run_start
        # Runs are read, checked and copied out in chunks of about BLOCK_SCRATCH_BYTES.
        chunk = run_at // BLOCK_SCRATCH_BYTES
        edges = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), int(run_at.size)]
        order = np.argsort(blocks.seg_src, kind="stable")
        seg_src = blocks.seg_src[order]
        loop = asyncio.get_running_loop()
        for r0, r1 in itertools.pairwise(edges):
            base = int(run_at[r0])
            top = int(run_at[r1 - 1] + run_length[r1 - 1])
            scratch = np.empty(top - base, dtype=np.uint8)
            b0, b1 = np.searchsorted(blocks.block_at, [base, top]).tolist()
            runs = slice(r0, r1)
            objects, lows, highs = (
                blocks.run_object[runs],
                blocks.run_start[runs],
                blocks.run_end[runs],
            )
            for again in (False, True):
                await self._read_below(urls, objects, lows, highs, scratch, run_at[runs] - base)
                try:
                    await loop.run_in_executor(
                        None, check_blocks, self.expected, per, urls, blocks, scratch, b0, b1, base
                    )
                    break
                except ChecksumError:
                    # Bytes a cache served are not trusted: drop its copies, read once more.
                    named = [urls[k] for k in objects.tolist()]
                    if again or not await self._discard(named, lows.tolist(), highs.tolist()):
                        raise
            s0, s1 = np.searchsorted(seg_src, [base, top]).tolist()
            picked = order[s0:s1]  # segment s is read s
            for number, dest in enumerate(dests):
                mine = picked[dest_of[picked] == number] if len(dests) > 1 else picked
                copy_pieces(
                    scratch,
                    blocks.seg_src[mine] - base,
                    blocks.seg_length[mine],
                    dest,
                    blocks.seg_dest[mine],
                )

    async def read_windows(
        self,
        urls: Sequence[str],
        ends: Int64Array,
        offsets: Int64Array,
        itemsize: int,
        starts: Int64Array,
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        """The windows copied by the store below, after the checks of the objects they
        touch; declined under ``block``."""
        if not self.supports_windows:
            return False
        if not self._done:
            first = np.searchsorted(ends, starts, side="right")
            last = np.searchsorted(ends, starts + max(0, window - 1), side="right")
            touched = np.unique(np.concatenate([first, last]))
            if (last - first > 1).any():
                touched = np.arange(int(first.min()), int(last.max()) + 1)
            await self._check_indexes(urls, touched[touched < len(urls)])
        return await self.inner.read_windows(
            urls, ends, offsets, itemsize, starts, window, dest, convert
        )

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        row = self.expected.row_of(url)
        if row < 0:
            await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            return
        if not self.expected.passed[row]:
            await self._check_rows(np.array([row], dtype=np.int64))
        if not (self._blocks and self.expected.block_size[row] > 0) or not buffers:
            await self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            return
        sizes = np.array([len(b) for b in buffers], dtype=np.int64)
        dest = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.cumsum(sizes) - sizes
        urls = [url]
        count = len(buffers)
        await self._read_blocks(
            urls,
            np.zeros(count, dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
            np.asarray(ends, dtype=np.int64),
            [dest],
            offsets,
            np.zeros(count, dtype=np.int64),
        )
        for buffer, offset, size in zip(buffers, offsets.tolist(), sizes.tolist(), strict=True):
            buffer[:] = memoryview(dest[offset : offset + size])  # type: ignore[arg-type]

    async def size(self, url: str) -> int:
        return await self.inner.size(url)

    async def stat(self, url: str) -> ObjectInfo:
        return await self.inner.stat(url)

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        return await self.inner.read_tail(url, length)

    async def list_info(self, url: str) -> list[tuple[str, ObjectInfo | None]]:
        return await self.inner.list_info(url)

    async def write(self, url: str, data: Buffer | bytes) -> None:
        await self.inner.write(url, data)

    async def discard(self, url: str, start: int, end: int) -> None:
        await self.inner.discard(url, start, end)

    async def close(self) -> None:
        await self.inner.close()

    # Last: within the class, ``list`` names this method from here on.
    async def list(self, url: str) -> list[str]:
        return await self.inner.list(url)
