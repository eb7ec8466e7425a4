"""Verification on the read path: what the manifests of a loader's datasets record about
each shard, and the checks the engine runs as it reads them.

Verification levels (``verify=`` of the loaders, docs/reliability.md)::

    off     the stores' length checks only
    size    each shard's size is compared with the store's the first time it is touched
    block   size, then every read is widened to whole checksum blocks, each block checked
    full    size, then each shard is read and checked whole before its first use

A shard that passed stays passed for the loader's life (across epochs), so ``size`` costs
one ``size()`` call per shard and ``full`` one extra read of each shard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

import numpy as np
import numpy.typing as npt
import xxhash

from .checksums import ALGORITHM, block_digests, format_digest, num_blocks
from .errors import ChecksumError, ConfigError, ManifestError, StoreError

if TYPE_CHECKING:
    from .dataset import Dataset
    from .stores.base import Store

Verify: TypeAlias = Literal["off", "size", "block", "full"]
VERIFY_LEVELS: tuple[Verify, ...] = get_args(Verify)
DEFAULT_VERIFY: Verify = "size"
#: Bytes read per request when a shard is read whole (``full``, ``asyncbatch verify``).
SCAN_CHUNK = 8 * 2**20
#: Shards read whole at once by one loader (``full``): bounds its memory to a few chunks.
SCAN_CONCURRENCY = 4
#: With ``block``: the most scratch bytes one group's widened reads fill before their bytes
#: are checked and copied out (a group of 64 shuffled batches may touch a GiB of blocks).
BLOCK_SCRATCH_BYTES = 64 * 2**20

Int64Array = npt.NDArray[np.int64]
DigestArray = npt.NDArray[np.uint64]


def check_level(verify: Any) -> str:
    """``verify`` if it names a level, else a ConfigError naming the value."""
    if not isinstance(verify, str) or verify not in VERIFY_LEVELS:
        raise ConfigError(f"verify={verify!r}: expected one of {VERIFY_LEVELS}")
    return verify


class ShardChecks:
    """What the manifests of a loader's datasets record about each shard (numbered as the
    engine numbers them: dataset after dataset), and which shards passed already.

    ``urls``: every file the source's plans name, if more than the manifests' shards (a
    format's index or metadata files follow the shards); those extra files are checked only
    where ``files`` gives their size and checksum (``{url: (bytes, checksum or None)}``),
    and never by blocks.
    Refuses (ConfigError) a level that needs checksums a dataset does not record. Block
    digests are gathered only for ``block`` and ``full`` (or ``blocks=True``): a big
    manifest holds millions of them.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        level: str,
        *,
        blocks: bool | None = None,
        urls: Sequence[str] | None = None,
        files: Mapping[str, tuple[int, int | None]] | None = None,
    ) -> None:
        self.level = check_level(level)
        for dataset in datasets:
            manifest = dataset.manifest
            if level in ("block", "full") and manifest.checksum is None:
                raise ConfigError(
                    f"verify={level!r} needs checksums, and {dataset.url} records none"
                    " (written without them): use verify='size' or rewrite the dataset"
                )
            if level == "block" and manifest.checksum_block is None:
                raise ConfigError(
                    f"verify='block' needs block checksums, and {dataset.url} records only"
                    " whole-shard ones (written with checksum_block=None): use verify='full'"
                )
        shards = [(d, s) for d in datasets for s in d.manifest.shards]
        self.urls = [url for d in datasets for url in d.shard_urls]
        #: Object sizes: a header before the elements (``offset``) is part of the object, and
        #: the checksums cover the whole object.
        self.sizes = np.array([s.object_size for _, s in shards], dtype=np.int64)
        self.checksums = [s.checksum for _, s in shards]
        self.block_size = np.array([d.manifest.checksum_block or 0 for d, _ in shards], np.int64)
        if blocks is None:
            blocks = level in ("block", "full")
        #: Whether ``digests`` holds the block digests the manifests record.
        self.has_block_digests = blocks
        packed = [
            np.frombuffer((s.block_checksums if blocks else None) or b"", dtype="<u8")
            for _, s in shards
        ]
        #: All block digests in one array; shard k's start at ``first_block[k]``.
        self.digests: DigestArray = (
            np.concatenate(packed).astype(np.uint64) if packed else np.zeros(0, np.uint64)
        )
        counts = np.array([b.size for b in packed], dtype=np.int64)
        self.first_block = np.cumsum(counts) - counts
        self.passed = np.zeros(len(shards), dtype=bool)
        extra = 0 if urls is None else len(urls) - len(shards)
        if extra > 0:  # files no manifest describes (not in ``files``): nothing to check
            assert urls is not None
            self.urls = list(urls)
            described = [(files or {}).get(url) for url in self.urls[len(shards) :]]
            self.sizes = np.append(
                self.sizes, np.array([-1 if d is None else d[0] for d in described], np.int64)
            )
            self.checksums += [None if d is None else d[1] for d in described]
            self.block_size = np.append(self.block_size, np.zeros(extra, dtype=np.int64))
            self.first_block = np.append(self.first_block, np.zeros(extra, dtype=np.int64))
            self.passed = np.append(self.passed, np.array([d is None for d in described]))


def fill_check(checks: ShardChecks) -> Callable[[str, int, Any], str | None] | None:
    """A check of bytes a cache is about to keep, against the manifests' block checksums:
    ``check(url, start, data)`` names the first whole checksum block in ``data`` (bytes from
    ``start`` of object ``url``) whose digest differs, or returns None. None when no
    manifest records block checksums."""
    if not checks.has_block_digests or not (checks.block_size > 0).any():
        return None
    shard_of = {url: shard for shard, url in enumerate(checks.urls)}

    def check(url: str, start: int, data: Any) -> str | None:
        shard = shard_of.get(url)
        block = 0 if shard is None else int(checks.block_size[shard])
        if shard is None or block <= 0:
            return None
        view = memoryview(data).cast("B")
        size, end = int(checks.sizes[shard]), start + len(view)
        for number in range(-(-start // block), num_blocks(size, block)):
            low, high = number * block, min(size, (number + 1) * block)
            if high > end:
                break
            got = xxhash.xxh3_64_intdigest(view[low - start : high - start])
            if got != int(checks.digests[checks.first_block[shard] + number]):
                return f"block {number} (bytes [{low}, {high}))"
        return None

    return check


@dataclass
class ShardReport:
    """The problems found in one shard by :func:`scan_shard` (empty: clean)."""

    url: str
    problems: list[Exception] = field(default_factory=list)
    #: Numbers of the blocks whose checksum did not match.
    bad_blocks: list[int] = field(default_factory=list)


async def scan_shard(
    store: Store,
    checks: ShardChecks,
    shard: int,
    *,
    blocks: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ShardReport:
    """Check shard ``shard`` against the store: its size, then (when recorded) its whole
    checksum and, with ``blocks``, every block's. Returns every problem; raises nothing but
    cancellation."""
    url = checks.urls[shard]
    report = ShardReport(url)
    expected_size = int(checks.sizes[shard])
    try:
        size = await store.size(url)
    except StoreError as exc:
        report.problems.append(exc)
        return report
    if size != expected_size:
        report.problems.append(size_error(url, expected_size, size))
        return report
    whole = checks.checksums[shard]
    block = int(checks.block_size[shard]) if blocks and checks.has_block_digests else 0
    if whole is None and not block:
        return report
    chunk = max(block, SCAN_CHUNK // block * block) if block else SCAN_CHUNK
    buffer = np.empty(min(chunk, size), dtype=np.uint8)
    hasher = xxhash.xxh3_64()
    loop = asyncio.get_running_loop()
    first = int(checks.first_block[shard])
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
            expected = checks.digests[at : at + actual.size]
            for index in np.flatnonzero(actual != expected).tolist():
                number = start // block + index
                report.bad_blocks.append(number)
                a, b = number * block, min(size, (number + 1) * block)
                report.problems.append(
                    block_error(url, number, a, b, int(expected[index]), int(actual[index]))
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
class BlockPlan:
    """Whole checksum blocks covering a read plan, and where the plan's bytes lie in them.

    Run ``r`` reads bytes ``[run_start[r], run_end[r])`` of shard ``run_shard[r]`` (whole
    consecutive blocks) to ``run_at[r]`` of a scratch buffer of ``nbytes``. Block ``k`` of
    the plan lies at ``[block_at[k], block_at[k] + block_length[k])`` of the scratch buffer
    and is block ``block_number[k]`` of shard ``block_shard[k]``. Segment ``s`` copies
    ``seg_length[s]`` bytes from ``seg_src[s]`` of the scratch buffer to ``seg_dest[s]`` of
    the batch buffer.
    """

    run_shard: Int64Array
    run_start: Int64Array
    run_end: Int64Array
    run_at: Int64Array
    block_shard: Int64Array
    block_number: Int64Array
    block_at: Int64Array
    block_length: Int64Array
    seg_src: Int64Array
    seg_dest: Int64Array
    seg_length: Int64Array
    nbytes: int


def plan_blocks(
    checks: ShardChecks,
    read_shard: Int64Array,
    read_start: Int64Array,
    read_end: Int64Array,
    seg_read: Int64Array,
    seg_start: Int64Array,
    seg_dest: Int64Array,
    seg_length: Int64Array,
) -> BlockPlan:
    """Widen the reads of shards with block checksums to the whole blocks they touch (each
    block once); reads of files no manifest describes (a format's index or metadata files)
    stay as they are, after the blocks, unchecked. Segment ``s`` lies in read
    ``seg_read[s]``, from byte ``seg_start[s]`` of its shard. Vectorised."""
    size = checks.block_size[read_shard]
    checked = size > 0
    picked = np.flatnonzero(checked)
    shard, size = read_shard[picked], size[picked]
    first = read_start[picked] // size
    counts = -(-read_end[picked] // size) - first
    owner = np.repeat(np.arange(picked.size), counts)
    step = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    # One key per (shard, block), ordered by shard then block.
    stride = int((checks.sizes // np.maximum(checks.block_size, 1)).max(initial=0)) + 2
    keys = np.unique(shard[owner] * stride + first[owner] + step)
    block_shard, block_number = keys // stride, keys % stride
    block_size = checks.block_size[block_shard]
    block_start = block_number * block_size
    block_end = np.minimum(block_start + block_size, checks.sizes[block_shard])
    block_length = block_end - block_start
    new_run = np.ones(keys.size, dtype=bool)
    new_run[1:] = keys[1:] != keys[:-1] + 1  # the next block of the same shard continues a run
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
    seg_shard = read_shard[seg_read[at]]
    seg_block = np.searchsorted(
        keys, seg_shard * stride + seg_start[at] // checks.block_size[seg_shard]
    )
    seg_src[at] = block_at[seg_block] + seg_start[at] - block_start[seg_block]
    at = np.flatnonzero(~in_blocks)
    read = seg_read[at]
    rank = np.cumsum(~checked) - 1  # of each unchecked read among them
    seg_src[at] = plain_at[rank[read]] + seg_start[at] - read_start[read]
    return BlockPlan(
        run_shard=np.concatenate([block_shard[heads], read_shard[plain]]),
        run_start=np.concatenate([block_start[heads], read_start[plain]]),
        run_end=np.concatenate([block_end[tails], read_end[plain]]),
        run_at=np.concatenate([block_at[heads], plain_at]),
        block_shard=block_shard,
        block_number=block_number,
        block_at=block_at,
        block_length=block_length,
        seg_src=seg_src,
        seg_dest=seg_dest,
        seg_length=seg_length,
        nbytes=int(block_length.sum() + plain_length.sum()),
    )


def check_blocks(
    checks: ShardChecks,
    blocks: BlockPlan,
    scratch: npt.NDArray[np.uint8],
    first: int,
    last: int,
    base: int,
) -> None:
    """Raise a ChecksumError for the first of blocks ``[first, last)`` of ``blocks`` that does
    not match the manifest (naming the count of bad ones); ``scratch`` holds the plan's
    scratch bytes from offset ``base`` on. Runs in a worker thread (xxhash drops the GIL)."""
    view = memoryview(scratch)  # type: ignore[arg-type]
    hash_of = xxhash.xxh3_64_intdigest
    starts = (blocks.block_at[first:last] - base).tolist()
    lengths = blocks.block_length[first:last].tolist()
    actual = np.fromiter(
        (hash_of(view[at : at + n]) for at, n in zip(starts, lengths, strict=True)),
        dtype=np.uint64,
        count=len(starts),
    )
    shards, numbers = blocks.block_shard[first:last], blocks.block_number[first:last]
    expected = checks.digests[checks.first_block[shards] + numbers]
    bad = np.flatnonzero(actual != expected)
    if bad.size:
        k = int(bad[0])
        shard, number = int(shards[k]), int(numbers[k])
        start = number * int(checks.block_size[shard])
        more = f" (and {bad.size - 1} more bad blocks in this read)" if bad.size > 1 else ""
        raise block_error(
            checks.urls[shard],
            number,
            start,
            start + lengths[k],
            int(expected[k]),
            int(actual[k]),
            more,
        )
