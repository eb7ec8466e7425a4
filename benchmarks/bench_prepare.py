"""``ab.prepare`` tokens/s beside the tokenizer's own ``encode_batch`` and HF datatrove, on a
real-text corpus, with local files, Ray and S3, all in one run.

**Corpus.** The standard library that every Python install ships (``.py`` sources and the
text, reST, HTML and test-data files beside them, under ``sysconfig.get_paths()["stdlib"]``,
site-packages left out), one document per file (``{"id": path, "text": ...}``, files that are
not UTF-8 or are empty left out), cycled until ``--mb`` MB of text, cut in file order into
``--files`` JSONL files of about equal size (``part-0000K.jsonl``) and the same as
``.jsonl.zst``. A byte-level BPE tokenizer (``tokenizers``, vocabulary ``--vocab`` < 65,536,
``<|endoftext|>`` its special token) is trained on the first 8 MB of it. Both are cached under
``--work``; nothing is downloaded.

**Lines**, each round in rotating order, ``--workers`` W (default 2) wherever there are workers:

* ``encode_batch``: ``Tokenizer.encode_batch`` on the texts already in memory, on every core
  (its rayon threads), in calls of ``--encode-batch`` documents, timed after one untimed call,
  in a fresh process (this one stays free of rayon's pool, which a fork would inherit);
  tokens counted as prepare counts them (one EOS per document). ``encode_batch_fast`` (no
  offsets: what prepare's workers call, one thread each) is measured the same way: the issue's
  0.9x target is checked against both; ``encode_batch_fast 1t`` on one thread
  (``TOKENIZERS_PARALLELISM=false``), beside ``local w1``: what reading, parsing, writing and
  checksums cost a worker, on one core (which another tenant of the machine disturbs less);
* ``local w1``, ``local w2``: ``ab.prepare(jsonl files, fresh folder, tokenizer=tokenizer.json,
  eos="<|endoftext|>", workers=1 | W, engine="local", progress=False)``; ``local zst``: the same
  on the ``.jsonl.zst`` files with W workers;
* ``ray``: the same with ``engine="ray"``, W workers, on the Ray session this script starts
  once with ``ray.init(num_cpus=W)`` before the rounds (prepare finds it initialised and uses
  it), so the cluster's start is not timed;
* ``s3``: W workers, input uploaded to and output written to moto's S3 server on 127.0.0.1
  (its own process, on the same cores);
* ``tiny w2``: W files of two short documents, W workers: a run that is all fixed costs
  (listing, checks, spawning and loading the workers, the manifest); issue #34's target is
  <= 1 s;
* ``mixed w2``, ``mixed w2 256MiB``: issue #34's shape of corpus: the first quarter of the
  JSONL files as they are, the rest of the text as one Parquet file in row groups of ~1 MB,
  W workers, with the default unit size and with the 256 MiB units that were the default
  before; each run's ``report.timeline`` gives the tail's share (the part of the run after
  the last moment all W workers were busy), and ``--figure`` draws busy workers over time;
* ``datatrove``: ``LocalPipelineExecutor([JsonlReader(jsonl folder), DocumentTokenizer(folder,
  tokenizer.json, eos_token="<|endoftext|>", shuffle_documents=False)], tasks=W, workers=W)``
  (no shuffle, as prepare does not shuffle; its log goes to a file).

Rates are tokens / wall seconds of the call (prepare's own ``report.seconds`` is printed
too); each ratio is taken between two lines of the same round, and printed as min / median /
max over the rounds. ``encode_batch_fast / same 1t`` says how much of a second core the run
really had. CPU seconds (every thread of the processes doing the work: the encoding child;
the calling process and its reaped pool workers; plus moto's server for ``s3``; not Ray's nor
datatrove's workers, which are not this process's children) are printed too, and their
paired ratios: they move less than wall time when other processes share the cores.

Every line is run once, untimed, on one JSONL file first (imports, the forkserver of
datatrove, Ray's workers). After the rounds, one more ``local w2`` run in a
fresh process measures the peak RSS (``VmHWM`` in ``/proc``, sampled every 50 ms) of that
process and of every process it starts, beside the report's ``peak_rss``.

The targets printed are issue #24's: >= 1.2x datatrove; 2 workers >= 1.7x 1; Ray >= 0.9x
local; S3 >= 0.8x local files; and issue #34's: prepare >= 0.85x ``encode_batch`` on W
threads on a 12 MB corpus (``--mb 12``), fixed costs <= 1 s.

Usage: ``.venv/bin/python benchmarks/bench_prepare.py [--mb 32] [--files 8] [--rounds 3]
[--workers 2] [--vocab 32000] [--work /tmp/asyncbatch-bench-prepare] [--only "ray,local w2"]
[--json docs/img/bench_prepare.json] [--figure docs/img/prepare_balance.png]``
(``scripts/bench-setup`` installs datatrove).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from common import git_revision, positive, write_rates
from common import moto_server as start_moto

EOS = "<|endoftext|>"
SUFFIXES = {".py", ".txt", ".rst", ".html", ".c", ".h", ".decTest"}
TRAIN_BYTES = 8 * 10**6
BUCKET = "bench-prepare"
S3_KEY = S3_SECRET = "testing"
LINES = [
    "encode_batch",
    "encode_batch_fast",
    "encode_batch_fast 1t",
    "local w1",
    "local w2",
    "local zst",
    "ray",
    "s3",
    "datatrove",
    "tiny w2",
    "mixed w2",
    "mixed w2 256MiB",
]
# Paired ratios: (name, numerator line, denominator line, target).
RATIOS = (
    ("local w2 / encode_batch", "local w2", "encode_batch", 0.85),
    ("local w2 / encode_batch_fast", "local w2", "encode_batch_fast", 0.9),
    ("local w2 / datatrove", "local w2", "datatrove", 1.2),
    ("local w1 / encode_batch_fast 1t", "local w1", "encode_batch_fast 1t", 0.9),
    ("local w2 / local w1", "local w2", "local w1", 1.7),
    ("ray / local w2", "ray", "local w2", 0.9),
    ("s3 / local w2", "s3", "local w2", 0.8),
    ("local zst / local w2", "local zst", "local w2", None),
    ("encode_batch_fast / encode_batch", "encode_batch_fast", "encode_batch", None),
    ("datatrove / encode_batch", "datatrove", "encode_batch", None),
    ("encode_batch_fast / same 1t", "encode_batch_fast", "encode_batch_fast 1t", None),
    ("mixed w2 / mixed w2 256MiB", "mixed w2", "mixed w2 256MiB", None),
    ("mixed w2 / encode_batch", "mixed w2", "encode_batch", None),
)
#: The unit size every run had by default before issue #34 (one unit per file here).
OLD_UNIT_SIZE = 256 * 2**20
# CPU seconds per run (all the same tokens), where they can be counted.
CPU_RATIOS = (
    ("local w1 / encode_batch_fast 1t", "local w1", "encode_batch_fast 1t"),
    ("local w2 / encode_batch_fast 1t", "local w2", "encode_batch_fast 1t"),
    ("local w2 / local w1", "local w2", "local w1"),
    ("local zst / local w2", "local zst", "local w2"),
    ("s3 (with moto's) / local w2", "s3", "local w2"),
)


# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer, cached under --work


@dataclasses.dataclass(frozen=True)
class Corpus:
    folder: Path  # holds jsonl/, zst/, tokenizer.json, corpus.json
    documents: int
    text_bytes: int  # UTF-8 bytes of the texts
    file_bytes: int  # bytes of the .jsonl files

    @property
    def jsonl(self) -> list[Path]:
        return self.files("jsonl")

    @property
    def zst(self) -> list[Path]:
        return self.files("zst")

    def files(self, kind: str, warm: bool = False) -> list[Path]:
        """The ``kind`` ("jsonl" or "zst") files; ``warm``: a copy of the first alone."""
        folder = self.folder / (f"warm-{kind}" if warm else kind)
        return sorted(p for p in folder.iterdir() if p.name.endswith((".jsonl", ".jsonl.zst")))

    @property
    def tokenizer(self) -> Path:
        return self.folder / "tokenizer.json"

    def mixed(self) -> list[Path]:
        """The issue #34 shape: the first quarter of the JSONL files as they are, the rest of
        the text as one Parquet file of row groups of ~1 MB (made once)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = self.folder / "mixed"
        if not folder.exists():
            files = self.jsonl
            keep = max(1, len(files) // 4)
            (folder.parent / "mixed-tmp").mkdir(exist_ok=True)
            for path in files[:keep]:
                shutil.copyfile(path, folder.parent / "mixed-tmp" / path.name)
            texts = read_texts(files[keep:])
            per_group = max(1, len(texts) * 10**6 // sum(len(t.encode()) for t in texts))
            table = pa.table({"id": [str(i) for i in range(len(texts))], "text": texts})
            pq.write_table(
                table, folder.parent / "mixed-tmp" / "rest.parquet", row_group_size=per_group
            )
            (folder.parent / "mixed-tmp").rename(folder)
        return sorted(folder.iterdir())


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """(path relative to the stdlib, text) of the standard library's text files, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if (
            path.suffix not in SUFFIXES
            or "site-packages" in relative.parts
            or "__pycache__" in relative.parts
            or not path.is_file()
        ):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            yield str(relative), text


def build_corpus(folder: Path, mb: int, files: int) -> Corpus:
    """The JSONL corpus of ``mb`` MB of text in ``files`` files (and .zst), made once."""
    summary = folder / "corpus.json"
    if summary.exists():
        cached = json.loads(summary.read_text())
        return Corpus(folder, cached["documents"], cached["text_bytes"], cached["file_bytes"])
    import zstandard

    print(f"building the corpus in {folder}", file=sys.stderr)
    documents: list[tuple[str, str, int]] = []
    total = 0
    cycle = 0
    while total < mb * 10**6:
        before = len(documents)
        for name, text in stdlib_documents():
            size = len(text.encode("utf-8"))
            documents.append((f"{cycle}/{name}", text, size))
            total += size
            if total >= mb * 10**6:
                break
        if len(documents) == before:
            raise SystemExit("no text files found in the standard library")
        cycle += 1
    for sub in ("jsonl", "zst", "warm-jsonl", "warm-zst"):
        shutil.rmtree(folder / sub, ignore_errors=True)
        (folder / sub).mkdir(parents=True)
    # Cut in order into files of about total / files bytes each.
    share = total / files
    part, written, file_bytes = 0, 0, 0
    out = (folder / "jsonl" / f"part-{part:05d}.jsonl").open("w", encoding="utf-8")
    for name, text, size in documents:
        if written >= share * (part + 1) and part < files - 1:
            out.close()
            part += 1
            out = (folder / "jsonl" / f"part-{part:05d}.jsonl").open("w", encoding="utf-8")
        out.write(json.dumps({"id": name, "text": text}, ensure_ascii=False) + "\n")
        written += size
    out.close()
    compressor = zstandard.ZstdCompressor(level=3)
    for path in sorted((folder / "jsonl").glob("*.jsonl")):
        file_bytes += path.stat().st_size
        (folder / "zst" / (path.name + ".zst")).write_bytes(compressor.compress(path.read_bytes()))
    for kind in ("jsonl", "zst"):
        first = sorted((folder / kind).iterdir())[0]
        shutil.copyfile(first, folder / f"warm-{kind}" / first.name)
    corpus = Corpus(folder, len(documents), total, file_bytes)
    summary.write_text(
        json.dumps({"documents": len(documents), "text_bytes": total, "file_bytes": file_bytes})
    )
    return corpus


def read_texts(paths: list[Path]) -> list[str]:
    texts: list[str] = []
    for path in paths:
        with path.open(encoding="utf-8") as lines:
            texts.extend(json.loads(line)["text"] for line in lines)
    return texts


def train_tokenizer(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: trains the byte-level BPE tokenizer on the corpus's first 8 MB, saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for text in read_texts([Path(p) for p in spec["files"]]):
        texts.append(text)
        size += len(text)
        if size >= TRAIN_BYTES:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab"],
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(spec["path"])
    return {"vocab": tokenizer.get_vocab_size()}


def ensure_tokenizer(corpus: Corpus, vocab: int) -> None:
    if corpus.tokenizer.exists():
        return
    print(f"training a BPE tokenizer ({vocab} ids) in a child process", file=sys.stderr)
    spec = {"files": [str(p) for p in corpus.jsonl], "vocab": vocab, "path": str(corpus.tokenizer)}
    child("train", spec, timeout=1800)


# ---------------------------------------------------------------------------------------------
# Children: one fresh interpreter per measurement that must not share this one's state


def child(mode: str, spec: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run ``mode`` in ``python bench_prepare.py --child``; its result is its last line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"child {mode} failed with status {done.returncode}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def encode_in_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: ``encode_batch`` (or ``encode_batch_fast``) over the texts already read, on every
    core, or on one (``spec["one_thread"]``: as a prepare worker calls it)."""
    if spec["one_thread"]:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(spec["tokenizer"])
    texts = read_texts([Path(p) for p in spec["files"]])
    encode = getattr(tokenizer, spec["method"])
    step = spec["batch"]
    encode(texts[:step])  # the rayon pool started, untimed
    tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(texts), step):
        tokens += sum(len(encoding) for encoding in encode(texts[first : first + step]))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    # + one EOS per document, as prepare counts them
    return {"tokens": tokens + len(texts), "seconds": seconds, "cpu": cpu}


class PeakRSS:
    """Samples ``VmHWM`` (peak resident set) of every descendant of this process."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peaks: dict[int, tuple[str, int]] = {}  # pid -> (name, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(entry.path, "stat").read_text()
                    parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        me, mine = os.getpid(), set()
        for pid in parents:
            chain, seen = pid, 0
            while chain in parents and seen < 64:
                chain, seen = parents[chain], seen + 1
                if chain == me:
                    mine.add(pid)
                    break
        for pid in mine:
            with contextlib.suppress(OSError, ValueError):
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                fields = dict(line.split(":", 1) for line in status if ":" in line)
                peak = int(fields["VmHWM"].split()[0]) * 1024
                name = fields["Name"].strip()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"spawn_main" in command:
                    name = "worker"
                elif b"resource_tracker" in command:
                    name = "multiprocessing's resource tracker"
                if peak > self.peaks.get(pid, ("", 0))[1]:
                    self.peaks[pid] = (name, peak)


def own_peak() -> int:
    """This process's peak resident set (``VmHWM``), in bytes.

    Not ``getrusage``'s ``ru_maxrss``: on Linux a process started by fork and exec keeps in it
    the high-water mark its parent had at the fork, so a fresh worker of a large driver
    reports the driver's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def prepare_rss(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: one ``local`` prepare run; the peak RSS of this process and of every descendant."""
    import asyncbatch as ab

    with PeakRSS() as sampler:
        report = ab.prepare(
            spec["inputs"],
            spec["output"],
            tokenizer=spec["tokenizer"],
            eos=EOS,
            workers=spec["workers"],
            engine="local",
            progress=False,
        )
    return {
        "units": report.units,
        "tokens": report.tokens,
        "report": report_fields(report),
        "driver_peak": own_peak(),
        "descendants": sorted(sampler.peaks.values(), key=lambda item: -item[1]),
    }


def report_fields(report: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(report):
        fields = dataclasses.asdict(report)  # type: ignore[arg-type]
    else:
        fields = {k: v for k, v in vars(report).items() if not k.startswith("_")}
    return {k: v for k, v in fields.items() if isinstance(v, int | float | str | bool | None)}


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "train": train_tokenizer,
    "encode": encode_in_memory,
    "rss": prepare_rss,
}


# ---------------------------------------------------------------------------------------------
# moto's S3 server


@contextlib.contextmanager
def running_moto() -> Iterator[tuple[str, int]]:
    """moto's S3 server in its own process on 127.0.0.1 (a free port); its URL and pid."""
    with start_moto(S3_KEY, S3_SECRET) as server:
        yield server


# ---------------------------------------------------------------------------------------------
# The lines


@dataclasses.dataclass
class Measurement:
    tokens: int
    wall: float
    reported: float | None = None  # prepare's report.seconds
    #: CPU seconds of every thread of the processes that did the work, where they can be
    #: counted (not Ray's workers nor datatrove's, which are not this process's children).
    cpu: float | None = None
    #: prepare's report.timeline: (unit, start, end) of each unit, seconds from the call.
    timeline: tuple[tuple[int, float, float], ...] = ()

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (this process's and its children's) appended to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class Bench:
    def __init__(self, corpus: Corpus, args: argparse.Namespace, scratch: Path) -> None:
        self.corpus = corpus
        self.args = args
        self.scratch = scratch
        self.s3_url: str | None = None
        self.moto_pid = 0
        self.ray_start: float | None = None  # seconds ray.init took, before the rounds
        self.s3_fs: Any = None
        self.datatrove_log = scratch / "datatrove.log"
        self.counter = 0

    def moto_cpu(self) -> float:
        """CPU seconds moto's server has used so far."""
        fields = Path(f"/proc/{self.moto_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @property
    def s3_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.s3_url, "key": S3_KEY, "secret": S3_SECRET}

    def fresh(self, name: str) -> Path:
        self.counter += 1
        return self.scratch / f"{name.replace(' ', '-')}-{self.counter}"

    def prepare(
        self,
        inputs: str | list[str],
        output: str,
        workers: int,
        engine: Literal["local", "ray"] = "local",
        storage_options: dict[str, Any] | None = None,
        unit_size: int | None = None,
    ) -> Measurement:
        import asyncbatch as ab

        server = self.moto_cpu() if storage_options else 0.0
        before = os.times()
        start = time.perf_counter()
        report = ab.prepare(
            inputs,
            output,
            tokenizer=str(self.corpus.tokenizer),
            eos=EOS,
            workers=workers,
            engine=engine,
            storage_options=storage_options,
            unit_size=unit_size,
            progress=False,
        )
        wall = time.perf_counter() - start
        after = os.times()
        cpu = None
        if engine == "local":  # the pool's workers are this process's children, reaped by now
            cpu = sum(after[:4]) - sum(before[:4])
            cpu += self.moto_cpu() - server if storage_options else 0.0
        if report.units_already_done:
            raise RuntimeError(f"{output} was not fresh: {report.units_already_done} units done")
        return Measurement(report.tokens, wall, report.seconds, cpu, report.timeline)

    def local(
        self, name: str, kind: str, workers: int, warm: bool, unit_size: int | None = None
    ) -> Measurement:
        output = self.fresh(name)
        if kind == "mixed":
            files = [
                str(p) for p in (self.corpus.files("jsonl", True) if warm else self.corpus.mixed())
            ]
        elif kind == "tiny":
            files = [str(p) for p in self.tiny()]
        else:
            files = [str(p) for p in self.corpus.files(kind, warm)]
        try:
            return self.prepare(files, str(output), workers, unit_size=unit_size)
        finally:
            shutil.rmtree(output, ignore_errors=True)

    def tiny(self) -> list[Path]:
        """One file of two short documents per worker: a run that is all fixed costs."""
        folder = self.scratch / "tiny"
        if not folder.exists():
            folder.mkdir()
            for k in range(self.args.workers):
                lines = [json.dumps({"text": f"tiny document {k} {i}"}) for i in range(2)]
                (folder / f"tiny-{k}.jsonl").write_text("\n".join(lines) + "\n")
        return sorted(folder.iterdir())

    def ray(self, warm: bool) -> Measurement:
        import ray

        output = self.fresh("ray")
        files = [str(p) for p in self.corpus.files("jsonl", warm)]
        try:
            measured = self.prepare(files, str(output), self.args.workers, "ray")
        finally:
            shutil.rmtree(output, ignore_errors=True)
        if not ray.is_initialized():  # else the next round would time a cluster's start
            raise RuntimeError("prepare(engine='ray') shut down the Ray session it was given")
        return measured

    def upload(self) -> None:
        """The JSONL files (and the warm-up copy) to ``s3://BUCKET/{jsonl,warm-jsonl}/``."""
        for warm in (False, True):
            for path in self.corpus.files("jsonl", warm):
                self.s3_fs.put_file(str(path), f"{BUCKET}/{path.parent.name}/{path.name}")

    def s3(self, warm: bool) -> Measurement:
        self.counter += 1
        output = f"s3://{BUCKET}/out/run-{self.counter}"
        inputs = [
            f"s3://{BUCKET}/{p.parent.name}/{p.name}" for p in self.corpus.files("jsonl", warm)
        ]
        try:
            return self.prepare(inputs, output, self.args.workers, "local", self.s3_options)
        finally:
            self.s3_fs.rm(output.removeprefix("s3://"), recursive=True)

    def encode(self, method: str, warm: bool, one_thread: bool = False) -> Measurement:
        spec = {
            "tokenizer": str(self.corpus.tokenizer),
            "files": [str(p) for p in self.corpus.files("jsonl", warm)],
            "method": method,
            "batch": self.args.encode_batch,
            "one_thread": one_thread,
        }
        result = child("encode", spec)
        return Measurement(result["tokens"], result["seconds"], cpu=result["cpu"])

    def datatrove(self, warm: bool) -> Measurement:
        from datatrove.executor import LocalPipelineExecutor  # type: ignore[import-untyped]
        from datatrove.pipeline.readers import JsonlReader  # type: ignore[import-untyped]
        from datatrove.pipeline.tokens import DocumentTokenizer  # type: ignore[import-untyped]

        output, logs = self.fresh("datatrove"), self.fresh("datatrove-logs")
        folder = self.corpus.folder / ("warm-jsonl" if warm else "jsonl")
        executor = LocalPipelineExecutor(
            pipeline=[
                JsonlReader(str(folder), glob_pattern="*.jsonl", text_key="text", id_key="id"),
                DocumentTokenizer(
                    str(output),
                    tokenizer_name_or_path=str(self.corpus.tokenizer),
                    eos_token=EOS,
                    shuffle_documents=False,
                ),
            ],
            tasks=self.args.workers,
            workers=self.args.workers,
            logging_dir=str(logs),
            skip_completed=False,
        )
        try:
            with stderr_to(self.datatrove_log):
                start = time.perf_counter()
                executor.run()
                wall = time.perf_counter() - start
            tokens = sum(p.stat().st_size for p in output.glob("*.ds")) // 2  # uint16
            return Measurement(tokens, wall)
        finally:
            shutil.rmtree(output, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)

    def lines(self) -> dict[str, Callable[[bool], Measurement]]:
        """Each line: a function of ``warm`` (True: the warm-up file alone)."""
        workers = self.args.workers
        lines: dict[str, Callable[[bool], Measurement]] = {
            "encode_batch": lambda warm: self.encode("encode_batch", warm),
            "encode_batch_fast": lambda warm: self.encode("encode_batch_fast", warm),
            "encode_batch_fast 1t": lambda warm: self.encode("encode_batch_fast", warm, True),
            "local w1": lambda warm: self.local("local w1", "jsonl", 1, warm),
            "local w2": lambda warm: self.local("local w2", "jsonl", workers, warm),
            "local zst": lambda warm: self.local("local zst", "zst", workers, warm),
            "ray": self.ray,
            "s3": self.s3,
            "datatrove": self.datatrove,
            "tiny w2": lambda warm: self.local("tiny w2", "tiny", workers, warm),
            "mixed w2": lambda warm: self.local("mixed w2", "mixed", workers, warm),
            "mixed w2 256MiB": lambda warm: self.local(
                "mixed w2 256MiB", "mixed", workers, warm, OLD_UNIT_SIZE
            ),
        }
        return {name: line for name, line in lines.items() if name in self.args.only}


# ---------------------------------------------------------------------------------------------
# Printing


def machine() -> str:
    model = "unknown cpu"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.machine()} {model}, {os.cpu_count()} cpus ({usable} usable),"
        f" {memory:.0f} GiB, {platform.system()} {platform.release()}"
    )


def versions() -> str:
    import importlib.metadata

    names = ["tokenizers", "ray", "datatrove", "moto", "s3fs"]
    found = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid * scale:>8.{digits}f}{low * scale:>8.{digits}f}{high * scale:>8.{digits}f}"


def print_results(
    results: dict[str, list[Measurement]],
    corpus: Corpus,
    args: argparse.Namespace,
    load: tuple[float, float],
    ray_start: float | None,
) -> None:
    zst = sum(p.stat().st_size for p in corpus.zst)
    print(f"# bench_prepare {datetime.date.today()} commit {git_revision()}")
    print(f"# {machine()}")
    print(f"# Python {platform.python_version()}, {versions()}")
    print(
        f"# load average (1 min) {load[0]:.2f} when the run started, {load[1]:.2f} at its end:"
        " other processes share these cores"
    )
    print(
        f"# corpus: the standard library's text files, {corpus.documents} documents,"
        f" {corpus.text_bytes / 1e6:.1f} MB of text in {len(corpus.jsonl)} JSONL files"
        f" ({corpus.file_bytes / 1e6:.1f} MB; .zst {zst / 1e6:.1f} MB);"
        f" byte-level BPE, {args.vocab} ids; {args.workers} workers; {args.rounds} rounds"
    )
    tokens = {name: sorted({m.tokens for m in runs}) for name, runs in results.items()}
    if len({tuple(t) for t in tokens.values()}) == 1:
        print(f"# every line and round made {next(iter(tokens.values()))[0]:,} tokens")
    else:
        print("# tokens per run differ: " + ", ".join(f"{n} {t}" for n, t in tokens.items()))
    if ray_start is not None:
        print(
            f"# ray: ray.init(num_cpus={args.workers}) once before the rounds, {ray_start:.1f} s,"
            " not timed; prepare(engine='ray') runs on that session"
        )
    print()
    print(
        f"{'line':<20}{'M tokens/s':>10}{'min':>8}{'max':>8}   {'wall s':>8}{'report s':>9}"
        f"{'CPU s':>8}"
    )
    for name, runs in results.items():
        rates = [m.rate for m in runs]
        reported = [m.reported for m in runs if m.reported is not None]
        cpu = [m.cpu for m in runs if m.cpu is not None]
        print(
            f"{name:<20}{spread(rates, 1e-6)}   {statistics.median(m.wall for m in runs):>8.2f}"
            + (f"{statistics.median(reported):>9.2f}" if reported else f"{'-':>9}")
            + (f"{statistics.median(cpu):>8.2f}" if cpu else f"{'-':>8}")
        )
    print()
    print(f"{'paired ratio':<34}{'median':>8}{'min':>8}{'max':>8}{'target':>9}")
    for label, top, bottom, target in RATIOS:
        if top not in results or bottom not in results:
            continue
        ratios = [a.rate / b.rate for a, b in zip(results[top], results[bottom], strict=True)]
        verdict = ""
        if target is not None:
            verdict = (
                f"  >= {target:<4} {'met' if statistics.median(ratios) >= target else 'NOT met'}"
            )
        print(f"{label:<34}{spread(ratios)}{verdict}")
    if "tiny w2" in results:
        walls = [m.wall for m in results["tiny w2"]]
        print(
            f"\nfixed costs: prepare of {args.workers} files of 2 documents, {args.workers}"
            f" workers: wall s {spread(walls)} (median min max)  <= 1.0 s"
            f" {'met' if statistics.median(walls) <= 1.0 else 'NOT met'}"
        )
    for name in ("mixed w2", "mixed w2 256MiB", "local w2"):
        if name in results:
            shares = [tail_share(m.timeline, args.workers) for m in results[name]]
            units = len(results[name][-1].timeline)
            print(
                f"tail share of {name!r} ({units} units): {spread(shares, 100, 1)} % of the run"
                f" with fewer than {args.workers} workers busy (median min max)"
            )
    print()
    print(f"{'CPU seconds, paired ratio':<34}{'median':>8}{'min':>8}{'max':>8}")
    for label, top, bottom in CPU_RATIOS:
        if top not in results or bottom not in results:
            continue
        pairs = zip(results[top], results[bottom], strict=True)
        ratios = [a.cpu / b.cpu for a, b in pairs if a.cpu and b.cpu]
        print(f"{label:<34}{spread(ratios)}")


def busy(timeline: tuple[tuple[int, float, float], ...]) -> list[tuple[float, int]]:
    """``(time, units running from then on)`` at every unit's start and end."""
    events = sorted(
        [(start, 1) for _, start, _ in timeline] + [(end, -1) for _, _, end in timeline]
    )
    running, steps = 0, []
    for moment, change in events:
        running += change
        steps.append((moment, running))
    return steps


def tail_share(timeline: tuple[tuple[int, float, float], ...], workers: int) -> float:
    """The share of the run (first unit's start to last unit's end) after the last moment
    all ``workers`` were busy: the tail that leaves cores idle."""
    if not timeline:
        return 0.0
    steps = busy(timeline)
    first, last = steps[0][0], steps[-1][0]
    full = [moment for moment, running in steps if running >= workers]
    if not full:
        return 1.0
    # the end of the last stretch at full occupancy
    ends = [steps[k + 1][0] for k, (_, running) in enumerate(steps[:-1]) if running >= workers]
    return (last - max(ends)) / max(last - first, 1e-9)


def plot_balance(results: dict[str, list[Measurement]], workers: int, path: Path) -> None:
    """Units running over time (the workers', and the driver's own while its workers start)
    in the last round of the mixed corpus, at both unit sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.2))
    for name, label in (
        ("mixed w2 256MiB", "256 MiB units (the default before)"),
        ("mixed w2", "default units (inputs / 1024, >= 1 MiB)"),
    ):
        if name not in results:
            continue
        measured = results[name][-1]
        steps = busy(measured.timeline)
        times = [0.0] + [moment for moment, _ in steps]
        counts = [0] + [running for _, running in steps]
        share = tail_share(measured.timeline, workers)
        axis.step(
            times,
            counts,
            where="post",
            label=f"{label}: {len(measured.timeline)} units, {measured.wall:.1f} s,"
            f" tail {share:.0%}",
        )
    axis.set_xlabel("seconds from the start of prepare()")
    axis.set_ylabel("units running")
    top = workers + 1  # the driver runs units too while its workers start
    axis.set_yticks(range(top + 1))
    axis.legend(loc="lower center", fontsize=8)
    axis.set_title(
        f"prepare, {workers} workers: one Parquet file of 75% of the text + JSONL files", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"(figure {path})")


def print_rss(result: dict[str, Any], corpus: Corpus, workers: int) -> None:
    unit = corpus.file_bytes / max(1, result["units"])
    print()
    print(
        f"peak RSS (VmHWM), one local run with {workers} workers started from a fresh process:"
        f" {result['units']} units of {unit / 1e6:.1f} MB of JSONL on average, the corpus"
        f" {corpus.file_bytes / unit:.1f}x a unit"
    )
    print(f"  driver (the process calling prepare): {result['driver_peak'] / 2**20:.0f} MiB")
    for name, peak in result["descendants"]:
        print(f"  process started by it, {name}: {peak / 2**20:.0f} MiB")
    reported = result["report"].get("peak_rss")
    if reported is not None:
        print(
            f"  report.peak_rss: {reported / 2**20:.0f} MiB (ru_maxrss in the workers: on Linux"
            " it also counts the spawning process's resident set at the fork)"
        )


# ---------------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=positive, default=32, help="MB of text in the corpus")
    parser.add_argument("--files", type=positive, default=8, help="JSONL files")
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--workers", type=positive, default=2)
    parser.add_argument("--vocab", type=positive, default=32000, help="BPE ids, < 65536")
    parser.add_argument(
        "--encode-batch", type=positive, default=256, help="documents per encode_batch call"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncbatch-bench-prepare"))
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=LINES,
        help=f"comma-separated lines to run (default: all of {','.join(LINES)})",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the per-round rates")
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        help="draw busy workers over time of the mixed lines (last round) to this PNG",
    )
    args = parser.parse_args()
    if args.vocab >= 65536:
        parser.error("--vocab must be < 65536 (uint16 tokens)")
    if unknown := set(args.only) - set(LINES):
        parser.error(f"unknown lines {sorted(unknown)}: choose from {','.join(LINES)}")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    corpus = build_corpus(args.work / f"corpus-{args.mb}mb-{args.files}", args.mb, args.files)
    ensure_tokenizer(corpus, args.vocab)
    scratch = args.work / "runs"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    bench = Bench(corpus, args, scratch)
    with contextlib.ExitStack() as stack:
        if "s3" in args.only:
            import s3fs

            bench.s3_url, bench.moto_pid = stack.enter_context(running_moto())
            bench.s3_fs = s3fs.S3FileSystem(endpoint_url=bench.s3_url, key=S3_KEY, secret=S3_SECRET)
            bench.s3_fs.mkdir(BUCKET)
            bench.upload()
        if "ray" in args.only:
            import ray

            start = time.perf_counter()
            ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
            bench.ray_start = time.perf_counter() - start
        lines = bench.lines()
        for name, line in lines.items():  # warm: one file each, untimed
            print(f"warming {name}", file=sys.stderr)
            line(True)
        results: dict[str, list[Measurement]] = {name: [] for name in lines}
        names = list(lines)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                measured = lines[name](False)
                results[name].append(measured)
                print(
                    f"round {round_ + 1} {name}: {measured.rate / 1e6:.2f} M tokens/s"
                    f" ({measured.tokens} tokens, {measured.wall:.2f} s)",
                    file=sys.stderr,
                )
    rss = None
    if "local w2" in args.only:
        output = scratch / "rss"
        spec = {
            "inputs": [str(p) for p in corpus.jsonl],
            "output": str(output),
            "tokenizer": str(corpus.tokenizer),
            "workers": args.workers,
        }
        rss = child("rss", spec)
        shutil.rmtree(output, ignore_errors=True)
    print_results(results, corpus, args, (load_before, os.getloadavg()[0]), bench.ray_start)
    if rss is not None:
        print_rss(rss, corpus, args.workers)
    if args.figure is not None:
        plot_balance(results, args.workers, args.figure)
    print(f"(run time {time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        write_rates(
            args.json,
            "bench_prepare",
            {name: [m.rate for m in runs] for name, runs in results.items()},
            unit="tokens/s",
            baseline="encode_batch",
            title="ab.prepare tokens/s beside encode_batch and datatrove",
            baselines={"local w1": "local w2", "ray": "local w2", "s3": "local w2"},
        )


if __name__ == "__main__":
    main()
