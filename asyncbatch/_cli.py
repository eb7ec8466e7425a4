"""The ``asyncbatch`` command: ``demo`` streams a dataset, ``inspect`` summarises one,
``verify`` checks one against its manifest's sizes and checksums, ``cache info`` and
``cache clear`` show and empty a node-local cache, ``prepare`` tokenizes a raw corpus into a
documents dataset, ``index`` writes the sidecar index of WebDataset tar shards."""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._defaults import CACHE_BLOCK_SIZE, MAX_INFLIGHT, PREFETCH_BYTES
from ._errors import AsyncBatchError, NotFoundError
from ._plan_cli import add_plan_command, key_value_pairs
from ._progress import Progress

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# numpy, torch and the modules that import them load inside the commands, so that
# `asyncbatch --help` and argument errors answer at once.

DEMO_TOKENS = 150_000_000  # 300 MB of uint16
DEMO_VOCAB = 50_257


def cache_dir() -> Path:
    base = os.environ.get("ASYNCBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "asyncbatch"
    )
    return Path(base)


def _demo_chunks(total: int, seed: int = 0) -> Iterator[npt.NDArray[np.uint16]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    step = 8_000_000
    for start in range(0, total, step):
        yield rng.integers(0, DEMO_VOCAB, min(step, total - start), dtype=np.uint16)


def ensure_demo_dataset(tokens: int = DEMO_TOKENS) -> str:
    """The local demo dataset's path; written on first use (``tokens`` uint16 tokens)."""
    import numpy as np

    from ._writer import write_tokens

    root = cache_dir() / f"demo-tokens-{tokens}"
    if not (root / "manifest.json").exists():
        print(f"creating the demo dataset ({tokens * 2 / 1e6:.0f} MB) in {root}", file=sys.stderr)
        bar = Progress(tokens * 2, "writing", "B")
        chunks = _demo_chunks(tokens)

        def counted() -> Iterator[npt.NDArray[np.uint16]]:
            for chunk in chunks:
                yield chunk
                bar.update(chunk.nbytes)

        write_tokens(str(root), counted(), dtype=np.uint16, shard_size=64 * 2**20)
        bar.close()
    return str(root)


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    return key_value_pairs(pairs, "option")


def demo(args: argparse.Namespace) -> int:
    from ._loader import Loader

    url = args.url or ensure_demo_dataset(args.tokens)
    started = time.perf_counter()
    loader = Loader(
        url,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        shuffle=not args.no_shuffle,
        seed=args.seed,
        prefetch=args.prefetch,
        max_inflight=args.max_inflight,
        storage_options=_options(args.option),
        cache=args.cache,
    )
    with loader:
        steps = min(len(loader), args.steps) if args.steps else len(loader)
        first_batch = 0.0
        tokens = 0
        bar = Progress(steps, "streaming", " batches")
        for step, batch in enumerate(loader):
            if step == 0:
                first_batch = time.perf_counter() - started
            tokens += batch["tokens"].numel()
            bar.update(1)
            if step + 1 >= steps:
                break
        bar.close()
        elapsed = time.perf_counter() - started
    order = "sequential" if args.no_shuffle else "global shuffle"
    print(f"dataset         {url}")
    print(f"batches         {steps} x {args.batch_size} x {args.seq_len} tokens ({order})")
    inflight = loader.config.max_inflight
    print(f"read ahead      {loader.prefetch} batches, {inflight} requests in flight")
    print(f"time to first   {first_batch * 1e3:.1f} ms (including opening the dataset)")
    print(f"throughput      {tokens / elapsed / 1e6:.1f} M tokens/s ({elapsed:.2f} s)")
    return 0


def human_bytes(nbytes: int) -> str:
    """``nbytes`` in binary units, then exactly: ``1.2 GiB (1,288,490,188 bytes)``."""
    exact = f"{nbytes:,} byte{'' if nbytes == 1 else 's'}"
    if nbytes < 1024:
        return exact
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit} ({exact})"


def inspect(args: argparse.Namespace) -> int:
    from ._open import open_dataset

    dataset = open_dataset(args.url, _options(args.option))
    manifest = dataset.manifest
    print(f"dataset   {dataset.url}")
    print(f"format    {manifest.format}")
    print(f"dtype     {manifest.dtype}")
    print(f"shards    {len(manifest.shards)}")
    print(f"elements  {manifest.total_elements:,}")
    print(f"bytes     {human_bytes(manifest.total_bytes)}")
    for shard in manifest.shards[: args.shards]:
        print(f"  {shard.path}  {human_bytes(shard.nbytes)}  {shard.elements:,} elements")
    if len(manifest.shards) > args.shards:
        print(f"  ... {len(manifest.shards) - args.shards} more")
    if manifest.format in ("parquet", "arrow"):  # read in place: their blocks and columns
        if manifest.format == "parquet":
            print(f"row groups: {manifest.metadata['row_groups']}")
        else:
            print(f"record batches: {manifest.metadata['record_batches']}")
        print("columns:")
        for name, kind in manifest.metadata["types"].items():
            chosen = "" if name in manifest.metadata["columns"] else "  (not selected)"
            print(f"  {name}: {kind}{chosen}")
    if manifest.format == "documents":
        documents = manifest.metadata.get("documents")
        if documents is not None:
            print(f"documents {int(documents):,}")
        settings = manifest.metadata.get("prepare")
        if isinstance(settings, dict):  # what `prepare` recorded: the settings and counts
            print("prepared with:")
            for name, value in settings.items():
                shown = value if isinstance(value, str | int) else json.dumps(value)
                print(f"  {name}: {shown}")
    if manifest.format == "webdataset":  # tar shards: their index and fields
        print(f"sidecar indexes: {manifest.metadata['sidecars']} of {len(manifest.shards)}")
        print("fields:")
        for name in manifest.metadata["fields"]:
            chosen = "" if name in manifest.metadata["columns"] else "  (not selected)"
            print(f"  {name}{chosen}")
    return 0


#: ``asyncbatch verify`` exit codes: clean, something bad, nothing to check checksums against.
VERIFY_CLEAN, VERIFY_BAD, VERIFY_NO_CHECKSUMS = 0, 1, 3


def verify(args: argparse.Namespace) -> int:
    from ._open import open_dataset
    from ._verify import verify_dataset

    bar: Progress | None = None

    def progress(nbytes: int) -> None:
        if bar is not None:
            bar.update(nbytes)

    dataset = open_dataset(args.url, _options(args.option))
    bar = Progress(dataset.manifest.total_bytes, f"verifying {dataset.url}", "B")
    try:
        report = verify_dataset(
            dataset,
            level=args.level,
            concurrency=args.concurrency,
            progress=progress,
        )
    finally:
        bar.close()
    files = "".join(
        f", {count:,} {kind}"
        for count, kind in (
            (report.index_files, "index files"),
            (report.metadata_files, "metadata files"),
        )
        if count
    )
    print(f"dataset   {report.url}")
    print(f"checked   {report.data_shards:,} shards{files}, level {report.level}")
    print(f"bytes     {human_bytes(report.nbytes)}")
    for note in report.notes:
        print(f"note      {note}")
    for shard in report.bad:
        for problem in shard.problems:
            print(f"BAD       {problem}")
    if report.bad:
        blocks = sum(len(shard.bad_blocks) for shard in report.bad)
        where = f", {blocks} bad blocks" if report.level == "block" else ""
        of = f"shards of {report.shards:,}" if not files else f"files of {report.shards:,}"
        print(f"result    {len(report.bad)} bad {of}{where}")
        return VERIFY_BAD
    if report.level == "size":
        print("result    sizes match; no checksums to verify the bytes against")
        return VERIFY_NO_CHECKSUMS
    print("result    clean")
    return VERIFY_CLEAN


def cache_info_command(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.path):
        print(f"asyncbatch: error: no cache at {args.path}", file=sys.stderr)
        return 1
    from .stores._disk_cache import cache_info

    info = cache_info(args.path)
    limit = "none" if info.max_bytes is None else f"{info.max_bytes} bytes"
    print(f"cache       {info.path}")
    print(f"entries     {info.entries}")
    print(f"objects     {info.objects}")
    print(f"bytes used  {info.bytes_used}")
    # cache.json records the settings of the last process that opened the cache.
    print(f"max bytes   {limit if info.block_size is not None else 'unknown'}")
    print(f"block size  {info.block_size if info.block_size is not None else 'unknown'}")
    return 0


def cache_clear_command(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.path):
        print(f"asyncbatch: error: no cache at {args.path}", file=sys.stderr)
        return 1
    from .stores._disk_cache import clear_cache

    freed = clear_cache(args.path)
    print(f"cleared {os.path.abspath(args.path)}: {freed} bytes freed")
    return 0


def prepare_command(args: argparse.Namespace) -> int:
    from ._prepare.driver import prepare

    eos = _token(args.eos)
    bos = _token(args.bos)
    try:
        report = prepare(
            args.inputs,
            args.output,
            tokenizer=_tokenizer(args.tokenizer),
            text_field=args.text_field,
            token_field=args.token_field,
            metadata_fields=tuple(args.metadata_field),
            eos=eos,
            bos=bos,
            shard_size=args.shard_size,
            unit_size=args.unit_size,
            workers=args.workers,
            engine=args.engine,
            ray_address=args.ray_address,
            storage_options=_options(args.option),
            on_error=args.on_error,
            vocab_size=args.vocab_size,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        print(
            "asyncbatch: prepare interrupted; finished units are kept: run the same command"
            " again to resume",
            file=sys.stderr,
        )
        return 130
    print(report.summary())
    return 0


def index_command(args: argparse.Namespace) -> int:
    from .formats._webdataset_write import index_webdataset

    bar: Progress | None = None

    def progress(done: int, shards: int) -> None:
        nonlocal bar
        if args.no_progress:
            return
        if bar is None:  # the shards are found: their count is the total
            bar = Progress(shards, "indexing", " shards")
        bar.update(done - bar.done)

    urls = args.urls[0] if len(args.urls) == 1 else args.urls
    try:
        report = index_webdataset(
            urls,
            _options(args.option),
            progress=progress,
            workers=args.workers,
            engine=args.engine,
            address=args.ray_address,
        )
    finally:
        if bar is not None:
            bar.close()
    print(f"shards    {report.shards} ({human_bytes(report.shard_bytes)}) scanned")
    print(f"samples   {report.samples:,}")
    print(f"sidecars  {report.shards} written ({human_bytes(report.index_bytes)}), as")
    print(f"          {report.sidecars[0]}" if report.sidecars else "          (none)")
    return 0


def _tokenizer(value: str | None) -> Any:
    """``module:function`` names a callable; anything else is a tokenizer.json path or URL."""
    if value is None or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value) is None:
        return value
    module, _, name = value.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _token(value: str | None) -> int | str | None:
    """``--eos 0`` is id 0, ``--eos '<|endoftext|>'`` a token string."""
    if value is None:
        return None
    return int(value) if value.isdigit() else value


#: Every option's help says its default (``%(default)s``, or in words where it is computed).
_OPTION_HELP = "storage option (JSON values allowed), repeatable (default: none)"


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog="asyncbatch", description=(__doc__ or "").replace("``", ""))
    commands = root.add_subparsers(dest="command", required=True)

    run = commands.add_parser("demo", help="stream a dataset (by default a local demo one)")
    run.add_argument(
        "--url", help="dataset URL (default: a local demo dataset, created on first run)"
    )
    run.add_argument(
        "--batch-size", type=int, default=16, help="samples per batch (default: %(default)s)"
    )
    run.add_argument(
        "--seq-len", type=int, default=2048, help="tokens per sample (default: %(default)s)"
    )
    run.add_argument(
        "--steps", type=int, default=0, help="stop after N batches (default: 0, one epoch)"
    )
    run.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    run.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="batches read ahead (default: the loader's, as many as fit in"
        f" {PREFETCH_BYTES >> 20} MiB, 2 to 128; 1024 for local files)",
    )
    run.add_argument(
        "--max-inflight",
        type=int,
        default=MAX_INFLIGHT,
        help="requests in flight (default: the loader's, %(default)s)",
    )
    run.add_argument("--no-shuffle", action="store_true", help="sequential order (default: off)")
    run.add_argument(
        "--tokens",
        type=int,
        default=DEMO_TOKENS,
        help="tokens in the demo dataset (default: %(default)s)",
    )
    run.add_argument(
        "--cache", metavar="PATH", help="read through a node-local cache at PATH (default: none)"
    )
    run.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help=_OPTION_HELP
    )
    run.set_defaults(func=demo)

    look = commands.add_parser("inspect", help="print a dataset's manifest summary")
    look.add_argument("url", help="dataset URL or path")
    look.add_argument("--shards", type=int, default=5, help="shards to list (default: %(default)s)")
    look.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help=_OPTION_HELP
    )
    look.set_defaults(func=inspect)

    check = commands.add_parser(
        "verify",
        help="check every shard's size and checksums; exit 0 clean, 1 bad, 3 no checksums",
    )
    check.add_argument("url", help="dataset URL or path")
    check.add_argument(
        "--level",
        choices=("block", "full"),
        default=None,
        help="block: every block and whole shard; full: whole shards only (default: block"
        " when the manifest records blocks, else full)",
    )
    check.add_argument(
        "--concurrency", type=int, default=8, help="shards read at once (default: %(default)s)"
    )
    check.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help=_OPTION_HELP
    )
    check.set_defaults(func=verify)

    defaults = argparse.ArgumentDefaultsHelpFormatter
    cache = commands.add_parser(
        "cache",
        help="show or empty a node-local cache",
        description="A node-local cache made with cache=PATH holds blocks of"
        f" {CACHE_BLOCK_SIZE} bytes (4 MiB) with no size limit; asyncbatch.DiskCache(PATH,"
        " max_bytes=..., block_size=...) sets both.",
        formatter_class=defaults,
    )
    actions = cache.add_subparsers(dest="action", required=True)
    show = actions.add_parser(
        "info",
        help="entries, objects, bytes used and the limit of the cache at PATH",
        formatter_class=defaults,
    )
    show.add_argument("path", metavar="PATH", help="the cache's directory")
    show.set_defaults(func=cache_info_command)
    empty = actions.add_parser(
        "clear",
        help="delete every entry of the cache at PATH (running loaders warn and go on)",
        formatter_class=defaults,
    )
    empty.add_argument("path", metavar="PATH", help="the cache's directory")
    empty.set_defaults(func=cache_clear_command)

    make = commands.add_parser(
        "prepare",
        help="tokenize JSONL, Parquet or text files into a documents dataset",
        description="Tokenize a raw corpus (JSONL plain, .gz or .zst; Parquet; text files, one"
        " document per file; on any store) into a documents dataset at --output. The work is"
        " cut into units from the inputs alone; the output is byte-identical for any worker"
        " count and engine, and the same command run again after a crash or Ctrl-C redoes"
        " only the unfinished units. See docs/prepare.md.",
    )
    make.add_argument("inputs", nargs="+", metavar="INPUT", help="URLs, globs, folders, prefixes")
    make.add_argument(
        "--output", required=True, metavar="URL", help="the dataset to write (required: no default)"
    )
    make.add_argument(
        "--tokenizer",
        metavar="PATH_URL_OR_CALLABLE",
        help="a Hugging Face tokenizer.json path or URL, or module:function of a callable"
        " list[str] -> list[list[int]] (default: none; give --token-field instead)",
    )
    make.add_argument(
        "--text-field", default="text", help="the field or column of the text (default: text)"
    )
    make.add_argument(
        "--token-field",
        default=None,
        help="take token ids as they are from this list-of-integers field, with no tokenizer"
        " (default: none)",
    )
    make.add_argument(
        "--metadata-field",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this field or column of every record as the document's metadata (repeat"
        " for several: --metadata-field id --metadata-field url; a missing field is null;"
        " default: none)",
    )
    make.add_argument("--eos", help="token id or string added after every document (default: none)")
    make.add_argument(
        "--bos", help="token id or string added before every document (default: none)"
    )
    make.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="ids are below this (default: the tokenizer's; with --token-field: none, uint32"
        " output)",
    )
    make.add_argument(
        "--shard-size",
        type=int,
        default=256 * 2**20,
        help="bytes of tokens per shard (default: %(default)s)",
    )
    make.add_argument(
        "--unit-size",
        type=int,
        default=None,
        help="input bytes per unit of work: large uncompressed JSONL files are cut into byte"
        " ranges, Parquet files into runs of row groups (default: from the inputs alone, their"
        " total bytes / 1024 within 1 MiB to 256 MiB, so that every core stays busy to the"
        " end)",
    )
    make.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes or Ray tasks at once (default: the CPUs this process may use)",
    )
    make.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="a local process pool, or Ray tasks (default: %(default)s)",
    )
    make.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster: auto, ray://host:10001 (default: start a local one)",
    )
    make.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a bad record stops the run naming it, or is skipped and counted (default:"
        " %(default)s)",
    )
    make.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar or lines (default: shown on stderr)",
    )
    make.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help=_OPTION_HELP
    )
    make.set_defaults(func=prepare_command)

    index = commands.add_parser(
        "index",
        help="write the sidecar index of WebDataset tar shards beside them",
        description="Scan every WebDataset .tar shard once (large sequential reads, all"
        " shards at once) and write its member index beside it as <shard>.tar.abidx;"
        " opening the shards then reads only these small files. A sidecar already there is"
        " written again. See docs/format.md.",
    )
    index.add_argument(
        "urls",
        nargs="+",
        metavar="URL",
        help="a .tar shard, a folder or prefix of them, a glob, a brace pattern"
        " ('s3://b/laion/{000000..000123}.tar'), or several shard URLs",
    )
    index.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes or Ray tasks at once; 1: this process, 16 shards at once on"
        " its event loop (default: %(default)s)",
    )
    index.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="with --workers: a local process pool, or Ray tasks (default: %(default)s)",
    )
    index.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster: auto, ray://host:10001 (default: start a local one)",
    )
    index.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar or lines (default: shown on stderr)",
    )
    index.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help=_OPTION_HELP
    )
    index.set_defaults(func=index_command)
    add_plan_command(commands)
    return root


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` (its subcommands' too) that keeps its long options' names, and
    names itself in what it parsed when it is the innermost command that parsed it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.long_options: list[str] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        self.long_options += [n for n in names if isinstance(n, str) and n.startswith("--")]
        return super().add_argument(*names, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "parsed_by", None) is None:  # a subcommand's parser was first
            parsed.parsed_by = self
        return parsed, rest


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; an unknown option is reported by the subcommand's own parser (its
    usage), with the closest option it has (``--tokeniser``: did you mean --tokenizer?)."""
    root = parser()
    args, unknown = root.parse_known_args(argv)
    if not unknown:
        return args
    command: _Parser = args.parsed_by  # `prepare`, or `cache info`: the innermost
    known = command.long_options
    hints = []
    for item in unknown:
        name = item.partition("=")[0]
        close = difflib.get_close_matches(name, known, n=1) if name.startswith("--") else []
        if close:
            hints.append(f"did you mean {close[0]} (not {name})?")
    hint = f"; {' '.join(hints)}" if hints else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except (AsyncBatchError, NotFoundError) as exc:
        print(f"asyncbatch: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`asyncbatch inspect URL | head`): stop quietly, as other
        # command-line tools do. stdout is pointed at /dev/null so that the interpreter's
        # own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe ended
    return code


if __name__ == "__main__":
    sys.exit(main())
