"""The inputs of ``prepare`` and the units of work cut from them.

Units depend on the inputs alone (their names, sizes and Parquet footers), never on the worker
count: a whole file; a run of row groups of a large Parquet file; or a byte range of a large
uncompressed JSONL file, owning the lines that *start* in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from .._dataset import natural_key
from .._errors import ConfigError, NotFoundError, RecordError

#: Compression suffixes read as streams (fsspec's ``compression="infer"`` names).
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
#: Suffixes a folder or prefix is expanded to (a file named explicitly, or matched by a glob,
#: is read whatever its suffix: as text unless it is JSONL or Parquet).
KNOWN_SUFFIXES = JSONL_SUFFIXES + (".parquet",) + TEXT_SUFFIXES
#: The files a Hugging Face dataset folder holds beside its data, never read as records.
NOT_DATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True, slots=True)
class InputFile:
    url: str
    size: int
    kind: str  # "jsonl", "parquet" or "text"
    compression: str | None
    version: str = ""  # the store's ETag or modification time: an edited input is redone


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """One unit of work: ``kind`` records of ``url`` in bytes ``[start, end)`` (JSONL), or in
    ``row_groups`` (Parquet, whose first row is row ``first_row`` of the file)."""

    index: int
    url: str
    kind: str
    compression: str | None
    size: int
    start: int = 0
    end: int = 0
    row_groups: tuple[int, ...] = ()
    first_row: int = 0
    version: str = ""
    #: The input bytes it reads (compressed bytes of its row groups, its byte range, its
    #: file): progress is counted in them. Not part of what identifies the unit.
    weight: int = dataclasses.field(default=0, compare=False)

    def describe(self) -> dict[str, Any]:
        """What identifies the unit's input, for its fingerprint."""
        described = dataclasses.asdict(self)
        del described["weight"]
        return described


def file_kind(url: str) -> tuple[str, str | None]:
    """``(kind, compression)`` from a file name's suffixes."""
    name = url.rsplit("/", 1)[-1].lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], codec
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(".parquet"):
        if compression:
            raise ConfigError(f"{url}: a compressed Parquet file is not readable by range")
        return "parquet", None
    return "text", compression


def _known(url: str) -> bool:
    name = url.rsplit("/", 1)[-1].lower()
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    return (
        name.endswith(KNOWN_SUFFIXES) and not name.startswith((".", "_")) and name not in NOT_DATA
    )


def filesystem(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """fsspec's filesystem of ``url`` and the path in it."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(options))
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read inputs at {url}: {exc}") from exc
    return fs, path


def expand_inputs(inputs: str | Sequence[str], options: Mapping[str, Any]) -> list[InputFile]:
    """Every input file, in order: each argument in the order given, its files by name."""
    given = [inputs] if isinstance(inputs, str) else list(inputs)
    if not given:
        raise ConfigError("prepare needs at least one input URL, glob, folder or prefix")
    seen: set[str] = set()
    files: list[InputFile] = []
    for item in given:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"inputs must be URLs or paths, got {item!r}")
        fs, path = filesystem(item, options)
        found = _expand_one(fs, path, item)
        if not found:
            raise NotFoundError(f"no input files at {item}", item)
        for name, size, version in sorted(found, key=lambda found: natural_key(found[0])):
            url = _url(fs, item, name)
            if url in seen:
                continue
            seen.add(url)
            kind, compression = file_kind(url)
            files.append(InputFile(url, size, kind, compression, version))
    return files


def _expand_one(fs: Any, path: str, item: str) -> list[tuple[str, int, str]]:
    """``(path, size, version)`` of each file at one input argument."""
    try:
        if any(char in path for char in GLOB_CHARS):
            infos = fs.glob(path, detail=True)
            chosen = [(n, i) for n, i in infos.items() if i["type"] == "file"]
        elif fs.isdir(path):
            infos = fs.find(path, detail=True)
            chosen = [(n, i) for n, i in infos.items() if _known(n)]
        else:
            chosen = [(fs.info(path)["name"], fs.info(path))]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NotFoundError(f"cannot list inputs at {item}: {exc}", item) from exc
    return [(name, int(info.get("size") or 0), _version(info)) for name, info in chosen]


def _version(info: Mapping[str, Any]) -> str:
    """What changes when a file is rewritten: its ETag, version id or modification time."""
    for key in ("ETag", "etag", "VersionId", "generation", "mtime", "LastModified", "created"):
        value = info.get(key)
        if value:
            return f"{key}={value}"
    return ""


def _url(fs: Any, given: str, name: str) -> str:
    """A full URL for fsspec path ``name`` found under the argument ``given``."""
    if "://" not in given:
        return str(name)
    unstrip = getattr(fs, "unstrip_protocol", None)
    return str(unstrip(name)) if unstrip is not None else str(name)


def plan_units(
    files: Sequence[InputFile], unit_size: int, options: Mapping[str, Any], skip: bool = False
) -> list[Unit]:
    """The units of ``files``, numbered in input order. Parquet footers are read 16 at a time
    (a few requests each): planning a corpus of many files is not one round trip per file."""
    parquet = [file for file in files if file.kind == "parquet"]
    with ThreadPoolExecutor(16, thread_name_prefix="asyncbatch-footers") as pool:
        runs = dict(
            zip(
                (file.url for file in parquet),
                pool.map(lambda file: _row_group_runs(file, unit_size, options, skip), parquet),
                strict=True,
            )
        )
    units: list[Unit] = []
    for file in files:
        if file.kind == "jsonl" and file.compression is None and file.size > unit_size:
            for start in range(0, file.size, unit_size):
                end = min(start + unit_size, file.size)
                units.append(
                    Unit(
                        len(units),
                        file.url,
                        "jsonl",
                        None,
                        file.size,
                        start,
                        end,
                        version=file.version,
                        weight=end - start,
                    )  # fmt: skip
                )
        elif file.kind == "parquet":
            for groups, first_row, nbytes in runs[file.url]:
                units.append(
                    Unit(
                        len(units),
                        file.url,
                        "parquet",
                        None,
                        file.size,
                        row_groups=groups,
                        first_row=first_row,
                        version=file.version,
                        weight=nbytes,
                    )
                )
        else:
            units.append(
                Unit(
                    len(units),
                    file.url,
                    file.kind,
                    file.compression,
                    file.size,
                    version=file.version,
                    weight=file.size,
                )  # fmt: skip
            )
    return units


def _row_group_runs(
    file: InputFile, unit_size: int, options: Mapping[str, Any], skip: bool
) -> list[tuple[tuple[int, ...], int, int]]:
    """Runs of consecutive row groups of at most ``unit_size`` compressed bytes (at least one
    group each), with the file row each run starts at and its compressed bytes. A footer that
    cannot be read is an error, or with ``skip`` one unit of no row group, which counts the
    file as skipped."""
    import pyarrow.parquet as pq

    fs, path = filesystem(file.url, options)
    try:
        with fs.open(path, "rb") as handle:
            metadata = pq.ParquetFile(handle).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        if skip:
            return [((), 0, file.size)]
        raise RecordError(
            f"{file.url}: cannot read the Parquet footer: {exc}", file.url, "footer"
        ) from exc
    runs: list[tuple[tuple[int, ...], int, int]] = []
    current: list[int] = []
    current_bytes = 0
    row = first = 0
    for group in range(metadata.num_row_groups):
        meta = metadata.row_group(group)
        size = sum(meta.column(c).total_compressed_size for c in range(meta.num_columns))
        if current and current_bytes + size > unit_size:
            runs.append((tuple(current), first, current_bytes))
            current, current_bytes, first = [], 0, row
        current.append(group)
        current_bytes += size
        row += meta.num_rows
    if current:
        runs.append((tuple(current), first, current_bytes))
    return runs
