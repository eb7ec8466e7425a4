"""Token files users already have, read in place as the ``tokens`` format: ``.npy`` files
and raw (headerless) token files such as OLMo's memmaps.

A ``.npy`` file is one shard whose elements start after its header (``offset`` = header
length); only the headers are read at open, one small range read per file, all at once.
Only 1-D arrays of a native-byte-order, non-object dtype are accepted (a 1-D array is the
same bytes in C and Fortran order). A raw file has no header: ``format="raw"`` with
``options={"dtype": ...}`` reads its whole size as elements of that dtype.

A URL is a single file or a folder (prefix) of them, in name order: for ``.npy`` every
``*.npy`` in the folder, for raw files every object in it. Listing needs a store that can
list (local, S3); over plain HTTP name each file.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .._checksums import digest, format_digest
from .._dataset import Dataset
from .._errors import ConfigError, FormatError, NotFoundError
from .._manifest import Manifest, ShardInfo
from ..stores import scheme_of
from ..stores._base import ObjectInfo, Store, Versioned
from ._base import Opener, natural_key

T = TypeVar("T")

NPY_MAGIC = b"\x93NUMPY"
NPY_SUFFIX = ".npy"
#: Bytes read first from every ``.npy``: numpy pads 1-D headers to 128 bytes (a longer one
#: takes a second read of exactly its length).
HEADER_PROBE = 128
#: Headers read at once when a folder holds many files.
CONCURRENT_READS = 32


def parent_and_name(url: str) -> tuple[str, str]:
    """``("s3://b/dir", "name.npy")`` for ``"s3://b/dir/name.npy"``."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise ConfigError(f"{url!r} does not name a file inside a folder or bucket")
    return parent, name


async def read_range(store: Store, url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``url``."""
    buffer = bytearray(end - start)
    await store.read_ranges(url, starts=[start], ends=[end], buffers=[memoryview(buffer)])
    return bytes(buffer)


async def gather_limited(jobs: Iterable[Awaitable[T]]) -> list[T]:
    """Results of ``jobs`` (not yet started), in order, at most :data:`CONCURRENT_READS`
    under way at once."""
    gate = asyncio.Semaphore(CONCURRENT_READS)

    async def run(job: Awaitable[T]) -> T:
        async with gate:
            return await job

    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # the first error wins; the rest must not outlive the store
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_token_dtype(dtype: np.dtype[Any], where: str) -> None:
    """Refuse dtypes a token stream cannot hand to torch as they are stored."""
    if dtype.hasobject or dtype.itemsize == 0:
        raise FormatError(f"{where}: dtype {dtype} holds no fixed-size values")
    fields = [dtype[name] for name in dtype.names] if dtype.names else [dtype]
    if any(not f.isnative for f in fields):
        raise FormatError(f"{where}: dtype {dtype.str} is not in this machine's byte order")


def parse_npy_header(head: bytes, url: str) -> tuple[int, np.dtype[Any], int] | int:
    """``(header length, dtype, elements)`` of a ``.npy`` file from its first bytes, or
    the header length when ``head`` does not hold the whole header yet."""
    if not head.startswith(NPY_MAGIC):
        raise FormatError(
            f"{url} is not a .npy file (no \\x93NUMPY magic at byte 0); for a raw token file"
            ' without header open it with format="raw", options={"dtype": ...}'
        )
    if len(head) < 10:
        raise FormatError(f"{url}: .npy file truncated inside its header ({len(head)} bytes)")
    major = head[6]
    if major == 1:
        length, start = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3):
        if len(head) < 12:
            raise FormatError(f"{url}: .npy file truncated inside its header ({len(head)} bytes)")
        length, start = int.from_bytes(head[8:12], "little"), 12
    else:
        raise FormatError(f"{url}: .npy format version {major}.{head[7]} unknown (1, 2 or 3)")
    if len(head) < start + length:
        return start + length
    encoding = "utf8" if major == 3 else "latin1"
    try:
        header = ast.literal_eval(head[start : start + length].decode(encoding))
        descr, shape, fortran = header["descr"], header["shape"], header["fortran_order"]
        dtype = np.lib.format.descr_to_dtype(descr)
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{url}: .npy header is not a valid header dict: {exc!r}") from exc
    if not isinstance(shape, tuple) or len(shape) != 1 or not isinstance(shape[0], int):
        raise FormatError(
            f"{url}: .npy array has shape {shape!r}; only 1-D token arrays are read in place"
        )
    del fortran  # 1-D: the same bytes in either order
    check_token_dtype(dtype, url)
    return start + length, dtype, shape[0]


async def npy_shard(store: Store, url: str, size: int) -> tuple[np.dtype[Any], ShardInfo]:
    """The dtype and shard of one ``.npy`` file of ``size`` bytes (reads only its header)."""
    head = await read_range(store, url, 0, min(size, HEADER_PROBE))
    parsed = parse_npy_header(head, url)
    if isinstance(parsed, int):  # a header longer than the probe
        if parsed > size:
            raise FormatError(f"{url}: .npy file of {size} bytes ends inside its header")
        parsed = parse_npy_header(await read_range(store, url, 0, parsed), url)
        assert not isinstance(parsed, int)
    offset, dtype, elements = parsed
    nbytes = elements * dtype.itemsize
    if size != offset + nbytes:
        raise FormatError(
            f"{url}: .npy file has {size} bytes, but its header says {offset} + {elements}"
            f" elements of {dtype} = {offset + nbytes} bytes (truncated or corrupt)"
        )
    _, name = parent_and_name(url)
    return dtype, ShardInfo(name, nbytes, elements, offset)


#: Bytes read from each end of a local file to tell its contents from others' (resume states).
SAMPLE_BYTES = 64 * 1024


async def object_infos(store: Store, urls: Iterable[str]) -> list[ObjectInfo]:
    """Size and version of each of ``urls`` (version None where the store tells none): data
    read in place has no checksums, so its versions identify its bytes (resume states).

    A local file's version is a digest of its size and first and last 64 KiB rather than its
    inode and mtime, so each node's own copy of a dataset is the same dataset to a resume
    state (two reads per file at open)."""
    urls = list(urls)
    if isinstance(store, Versioned):
        infos = await gather_limited(store.stat(u) for u in urls)
    else:
        infos = [ObjectInfo(n, None) for n in await gather_limited(store.size(u) for u in urls)]
    local = [i for i, url in enumerate(urls) if scheme_of(url) == "file"]
    sampled = await gather_limited(_sample_version(store, urls[i], infos[i].size) for i in local)
    for i, version in zip(local, sampled, strict=True):
        infos[i] = ObjectInfo(infos[i].size, version)
    return infos


async def _sample_version(store: Store, url: str, size: int) -> str:
    head = min(size, SAMPLE_BYTES)
    tail_start = max(head, size - SAMPLE_BYTES)
    buffers = [memoryview(bytearray(head)), memoryview(bytearray(size - tail_start))]
    await store.read_ranges(url, starts=[0, tail_start], ends=[head, size], buffers=buffers)
    sample = size.to_bytes(8, "little") + bytes(buffers[0]) + bytes(buffers[1])
    return "sample-" + format_digest(digest(sample))


def may_list(url: str) -> bool:
    """Whether listing ``url`` is safe: over HTTP a listing GETs the whole object, so only
    URLs ending in ``/`` are listed there."""
    return scheme_of(url) not in ("http", "https") or url.endswith("/")


async def _files(
    url: str, store: Store, keep: Callable[[str], bool], *, file: bool = False
) -> tuple[str, list[str]]:
    """The dataset root and the file URLs: ``url`` itself if it is a file (or ``file``), else
    the files under it that ``keep`` accepts, in natural order."""
    if not file and may_list(url):
        try:
            listed = await store.list(url.rstrip("/"))
        except (NotFoundError, NotADirectoryError):
            listed = []
        children = [u for u in listed if u.rstrip("/") != url.rstrip("/") and keep(u)]
        if children:
            return url.rstrip("/"), sorted(children, key=natural_key)
    url = url.rstrip("/")
    parent, _ = parent_and_name(url)
    return parent, [url]


def _relative(root: str, url: str) -> str:
    prefix = root.rstrip("/") + "/"
    return url[len(prefix) :] if url.startswith(prefix) else parent_and_name(url)[1]


def _dataset(
    root: str,
    dtype: np.dtype[Any],
    shards: list[ShardInfo],
    options: Mapping[str, Any],
    kind: str,
    infos: Sequence[ObjectInfo],
) -> Dataset:
    manifest = Manifest("tokens", dtype, tuple(shards), {"read_in_place": kind})
    return Dataset(root, manifest, options, versions=tuple(i.version for i in infos))


def _one_dtype(urls: Sequence[str], dtypes: Sequence[np.dtype[Any]]) -> np.dtype[Any]:
    for url, dtype in zip(urls, dtypes, strict=True):
        if dtype != dtypes[0]:
            raise FormatError(f"{url} holds {dtype}, not {dtypes[0]} as {urls[0]}")
    return dtypes[0]


async def open_npy(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """A ``.npy`` file, or a folder of them, as a token dataset (reads only headers)."""
    if options:
        raise ConfigError(f".npy files take no options, got {sorted(options)}")
    is_file = url.rstrip("/").endswith(NPY_SUFFIX)
    root, urls = await _files(url, store, lambda u: u.endswith(NPY_SUFFIX), file=is_file)
    infos = await object_infos(store, urls)
    parsed = await gather_limited(
        npy_shard(store, u, i.size) for u, i in zip(urls, infos, strict=True)
    )
    dtype = _one_dtype(urls, [d for d, _ in parsed])
    shards = [
        ShardInfo(_relative(root, u), s.nbytes, s.elements, s.offset)
        for u, (_, s) in zip(urls, parsed, strict=True)
    ]
    return _dataset(root, dtype, shards, storage_options, "npy", infos)


async def probe_npy(url: str, store: Store) -> bool:
    """Whether ``url`` is a folder holding ``.npy`` files."""
    if not may_list(url):
        return False
    try:
        listed = await store.list(url.rstrip("/"))
    except (NotFoundError, NotADirectoryError):
        return False
    return any(u.endswith(NPY_SUFFIX) for u in listed)


async def open_raw(
    url: str, store: Store, storage_options: Mapping[str, Any], options: Mapping[str, Any]
) -> Dataset:
    """A raw token file, or a folder of them, as a token dataset of ``options["dtype"]``."""
    extra = sorted(set(options) - {"dtype"})
    if extra:
        raise ConfigError(f'format="raw" takes only options={{"dtype": ...}}, got {extra}')
    if "dtype" not in options:
        raise ConfigError(
            f'{url}: raw token files have no header: give options={{"dtype": "uint16"}} (or'
            " the dtype they were written with)"
        )
    try:
        dtype = np.dtype(options["dtype"])
    except TypeError as exc:
        raise ConfigError(f"options dtype={options['dtype']!r} is not a numpy dtype") from exc
    check_token_dtype(dtype, f"{url}: options dtype")
    root, urls = await _files(url, store, lambda u: not parent_and_name(u)[1].startswith("."))
    infos = await object_infos(store, urls)
    shards = []
    for file_url, size in zip(urls, (i.size for i in infos), strict=True):
        if size % dtype.itemsize:
            raise FormatError(
                f"{file_url}: {size} bytes is not a whole number of {dtype} elements"
                f" ({dtype.itemsize} bytes each): wrong dtype or truncated file"
            )
        shards.append(ShardInfo(_relative(root, file_url), size, size // dtype.itemsize))
    return _dataset(root, dtype, shards, storage_options, "raw", infos)


NPY_OPENER = Opener(
    "npy",
    open_npy,
    claims=lambda url: url.rstrip("/").endswith(NPY_SUFFIX),
    probe=probe_npy,
    probes_for="no .npy files listed in it",
)
RAW_OPENER = Opener("raw", open_raw)
