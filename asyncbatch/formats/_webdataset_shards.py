"""Which tar shards a WebDataset URL names: a ``.tar``, a folder or prefix of them (at any
depth, in natural order), a glob, a list, or a brace pattern (``s3://b/laion/{000000..000123}.tar``,
expanded as webdataset's ``braceexpand`` does); and whether each has a sidecar index beside
it, where a listing tells. Gzip-compressed shards are refused here, saying why and what to do.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError, NotFoundError
from ..stores._base import ObjectInfo, Store
from ._npy import may_list
from ._parquet import common_root, parquet_files
from ._webdataset_index import FORMAT, SIDECAR_SUFFIX, sidecar_url

TAR_SUFFIX = ".tar"
GZIP_SUFFIXES = (".tar.gz", ".tgz")
#: Shards whose index is read, scanned or written at once.
CONCURRENT_SHARDS = 16


# ---------------------------------------------------------------------------------------------
# Brace patterns


_SEQUENCE = re.compile(r"^(-?\d+|[^\d{},.])\.\.(-?\d+|[^\d{},.])(?:\.\.(-?\d+))?$")


def expand_braces(pattern: str) -> list[str]:
    """Every string ``pattern`` stands for, as the ``braceexpand`` package (webdataset's)
    expands it: ``{a,b}`` alternatives, ``{000..123}`` zero-padded and ``{1..9..2}`` stepped
    ranges, ``{a..e}`` letters, nested, left to right; ``\\{`` is a literal brace."""
    start = _unescaped(pattern, "{")
    if start < 0:
        return [_unescape(pattern)]
    depth, end = 0, -1
    for i in range(start, len(pattern)):
        if pattern[i] == "\\":
            continue
        if i and pattern[i - 1] == "\\":
            continue
        if pattern[i] == "{":
            depth += 1
        elif pattern[i] == "}":
            depth -= 1
            if depth == 0:
                end = i
                break
    if end < 0:
        return [_unescape(pattern)]
    prefix, inner, rest = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    items = _split_commas(inner)
    sequence = _SEQUENCE.match(inner)
    if len(items) > 1:
        choices = [x for item in items for x in expand_braces(item)]
    elif sequence is not None:
        choices = _sequence(*sequence.groups())
    else:
        choices = ["{" + x + "}" for x in expand_braces(inner)]
    head = _unescape(prefix)
    return [head + choice + tail for choice in choices for tail in expand_braces(rest)]


def _unescaped(text: str, char: str) -> int:
    i = text.find(char)
    while i > 0 and text[i - 1] == "\\":
        i = text.find(char, i + 1)
    return i


def _unescape(text: str) -> str:
    return text.replace("\\{", "{").replace("\\}", "}").replace("\\,", ",")


def _split_commas(text: str) -> list[str]:
    """``text`` split at its commas outside nested braces."""
    parts, depth, last = [], 0, 0
    for i, char in enumerate(text):
        if i and text[i - 1] == "\\":
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return parts


def _sequence(left: str, right: str, step: str | None) -> list[str]:
    """braceexpand's ranges: integers padded to the longer end when either has a leading
    zero, or single characters."""
    incr = abs(int(step)) if step else 1
    incr = incr or 1
    if left.lstrip("-").isdigit() and right.lstrip("-").isdigit():
        a, b = int(left), int(right)
        padded = any(s.startswith(("0", "-0")) for s in (left, right) if s not in ("0", "-0"))
        width = max(len(left), len(right)) if padded else 0
        direction = 1 if a <= b else -1
        values = range(a, b + direction, direction * incr)
        return [f"{v:0{width}d}" for v in values]
    if left.lstrip("-").isdigit() or right.lstrip("-").isdigit():
        return ["{" + f"{left}..{right}" + (f"..{step}" if step else "") + "}"]
    a, b = ord(left), ord(right)
    direction = 1 if a <= b else -1
    return [chr(c) for c in range(a, b + direction, direction * incr)]


# ---------------------------------------------------------------------------------------------
# Finding the shards


def _path(url: str) -> str:
    return url.split("?", 1)[0].rstrip("/")


def claims(url: str) -> bool:
    """A ``.tar`` URL, a glob or brace pattern of them (``.tar.gz`` and ``.tgz`` too: opening
    them says why they cannot be read in place)."""
    return _path(url).endswith((TAR_SUFFIX, *GZIP_SUFFIXES))


def refuse_gzip(urls: Sequence[str]) -> None:
    """A ConfigError for the first gzip-compressed shard of ``urls``."""
    for url in urls:
        if _path(url).endswith(GZIP_SUFFIXES):
            raise ConfigError(
                f"{url}: a gzip-compressed tar cannot be read in place: gzip has no random"
                " access, so one sample cannot be fetched by a byte range without"
                " decompressing its shard from the start (no exact shuffle, no rank's share"
                " of a shard). Write the shards as uncompressed .tar (gunzip each one, or"
                " write them again with webdataset.ShardWriter to .tar names); images, audio"
                " and video are compressed already, so the shards grow little"
            )


async def probe_webdataset(url: str, store: Store) -> bool:
    """Whether ``url`` is a folder or prefix holding ``.tar`` shards (at any depth)."""
    if not may_list(url):
        return False
    try:
        await parquet_files(url, store, None, (TAR_SUFFIX, *GZIP_SUFFIXES), FORMAT)
    except NotFoundError:
        return False
    return True


async def find_shards(
    url: str | Sequence[str], store: Store
) -> tuple[str, list[str], dict[str, ObjectInfo], dict[str, bool | None]]:
    """The dataset root, its shards in order, what a listing told of the shards and their
    sidecars (size, version), and whether each shard has a sidecar (None: not known without
    trying to read it)."""
    known: dict[str, ObjectInfo] = {}
    if not isinstance(url, str) or "{" in _path(url):
        urls = list(url) if not isinstance(url, str) else expand_braces(url)
        if not urls or not all(isinstance(u, str) for u in urls):
            raise ConfigError(f"a list of shard URLs must hold at least one URL, got {urls!r}")
        refuse_gzip(urls)
        return common_root(urls), urls, known, {u: None for u in urls}
    refuse_gzip([url])
    suffixes = (TAR_SUFFIX, *GZIP_SUFFIXES, TAR_SUFFIX + SIDECAR_SUFFIX)
    root, found = await parquet_files(url, store, known, suffixes, FORMAT)
    listed = set(found) | set(known)
    shards = [u for u in found if not u.endswith(SIDECAR_SUFFIX)]
    refuse_gzip(shards)
    if not shards:
        raise NotFoundError(f"no .tar shards at {url}", url)
    folder = not _path(url).endswith(TAR_SUFFIX)  # a listing of the folder: it tells all
    has: dict[str, bool | None] = {}
    for shard in shards:
        there = sidecar_url(shard) in listed
        has[shard] = True if there else (False if folder else None)
    return root, shards, known, has


async def limited(jobs: Sequence[Any], limit: int = CONCURRENT_SHARDS) -> list[Any]:
    """Results of the coroutines ``jobs``, at most ``limit`` running at once; the first error
    cancels the rest."""
    gate = asyncio.Semaphore(limit)

    async def run(job: Any) -> Any:
        async with gate:
            return await job

    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
