"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import compileall
import contextlib
import datetime
import functools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def git_revision() -> str:
    """Short HEAD of the repository, with a note when ``asyncbatch/`` has local changes.

    Cached: the revision a script prints at its start is the one its figures name at the end,
    even if a commit lands while it runs."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "asyncbatch"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} (asyncbatch/ modified in the working tree)" if dirty else head


def compile_package() -> None:
    """Bytecode for asyncbatch's modules, as ``pip install`` writes it for an installed
    package: a checkout has none where ``PYTHONDONTWRITEBYTECODE`` is set, and every child
    process of a benchmark would compile the modules it imports again (0.13 s of a loader's
    construction, timed)."""
    import asyncbatch

    compileall.compile_dir(Path(asyncbatch.__file__).parent, quiet=1)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median over rounds of the ratio of two measurements taken in the same round."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def rotated(lines: int, round_: int) -> list[int]:
    """The order in which round ``round_`` measures ``lines`` lines: each round starts one
    line later, so no line is always measured first (or right after the same other)."""
    turn = round_ % lines
    return [*range(turn, lines), *range(turn)]


def cache_folder(name: str) -> Path:
    """``~/.cache/asyncbatch/<name>`` (``$XDG_CACHE_HOME`` respected): where a benchmark keeps
    the data it writes once and reuses."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "asyncbatch" / name


def machine() -> str:
    """The machine a benchmark ran on, for its header: ``x86_64 Python 3.11.7, 2 cpus``."""
    return f"{platform.machine()} Python {platform.python_version()}, {os.cpu_count()} cpus"


def read_plan_files(plan: Any, files: list[str]) -> Any:
    """The bytes a byte-range ``ReadPlan`` asks for, read from local ``files`` (a source's
    index reads served without an engine)."""
    import numpy as np

    buffer = np.empty(plan.nbytes, dtype=np.uint8)
    for f, a, b, d in zip(
        plan.read_shard.tolist(),
        plan.read_start.tolist(),
        plan.read_end.tolist(),
        plan.read_dest.tolist(),
        strict=True,
    ):
        with open(files[f], "rb") as handle:
            handle.seek(a)
            buffer[d : d + b - a] = np.frombuffer(handle.read(b - a), dtype=np.uint8)
    return buffer


def settle(proxy: Any) -> None:
    """Wait until a counting proxy (``delayproxy.running_proxy``) has passed on the last bytes
    of earlier reads (a closed loader's cancelled ones), so that they count for none of the
    next steps."""
    last = proxy.counts()
    while True:
        time.sleep(0.1)
        now = proxy.counts()
        if now == last:
            return
        last = now


def stop_process(process: subprocess.Popen[Any]) -> None:
    """Terminate ``process`` and wait for it; kill it if it has not ended after 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def moto_server(key: str = "testing", secret: str = "testing") -> Iterator[tuple[str, int]]:
    """moto's S3 server in its own process on 127.0.0.1 (a free port): its URL and pid."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield url, process.pid
    finally:
        stop_process(process)


def run_child(script: Path, spec: dict[str, Any], folder: str, timeout: float) -> dict[str, Any]:
    """Run ``script --child <spec as JSON>`` in a fresh Python process; its result is the last
    line it prints.

    ``folder`` (the spec key of its scratch folder: a chunk cache, an output folder) is made
    and removed here, so nothing is left behind when the child is killed.
    """
    with tempfile.TemporaryDirectory(prefix="bench-child-") as scratch:
        spec = {**spec, folder: scratch}
        command = [sys.executable, str(script), "--child", json.dumps(spec)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"child {spec['mode']} failed with status {done.returncode}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def write_rates(
    path: Path,
    script: str,
    rates: dict[str, list[float]],
    *,
    unit: str,
    baseline: str,
    title: str,
    baselines: dict[str, str] | None = None,
) -> None:
    """Write one benchmark's per-round figures as JSON for benchmarks/plot.py (and the docs).

    ``rates`` maps each line to its figure in every round, in round order, so a reader can
    take medians or the paired ratio to ``baseline`` (one of the lines), as the script does;
    ``baselines`` gives some lines another line to be compared with.
    """
    figures = {
        "header": [
            f"asyncbatch {script}  {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"  git {git_revision()}  python {platform.python_version()}  cpus {os.cpu_count()}",
            "  command: " + " ".join(["benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
        ],
        "title": title,
        "unit": unit,
        "baseline": baseline,
        "baselines": baselines or {},
        "rates": rates,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures: {path}")
