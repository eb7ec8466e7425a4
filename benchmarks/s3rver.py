"""A local S3 server for the benchmarks: s3rver (Node), installed with npm on first use.

``running_s3rver(ensure_s3rver(default_s3rver_dir()))`` starts one s3rver process on
127.0.0.1 (a free port, a temporary data directory, one bucket) and stops it on exit, error
or not; it yields the endpoint URL. s3rver accepts any request signed with its built-in
credentials ``KEY`` / ``SECRET``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
from common import stop_process

BUCKET = "bench"
# s3rver's built-in credentials.
KEY = SECRET = "S3RVER"
VOCAB = 50_257


def default_s3rver_dir() -> Path:
    """``~/.cache/asyncbatch/s3rver`` (``$XDG_CACHE_HOME`` respected)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "asyncbatch" / "s3rver"


def ensure_s3rver(prefix: Path) -> Path:
    """The s3rver CLI script under ``prefix``, installed with npm if missing."""
    script = prefix / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    if not script.exists():
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit("npm is needed to install s3rver (apt-get install nodejs npm)")
        print(f"installing s3rver into {prefix}", file=sys.stderr)
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "s3rver"],
            check=True,
            stdout=sys.stderr,
        )
    if not script.exists():
        raise SystemExit(f"npm install finished but {script} is missing")
    return script


def s3rver_version(script: Path) -> str:
    """The installed s3rver's version, from its package.json."""
    package = script.parent.parent / "package.json"
    try:
        return str(json.loads(package.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until_answering(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll ``url`` until any HTTP answer; raise if the process exits or time runs out."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"s3rver exited with status {process.returncode}")
        try:
            with opener.open(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # an S3 error document is an answer
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"s3rver did not answer at {url} within {timeout} s") from None
            time.sleep(0.1)


@contextlib.contextmanager
def running_s3rver(script: Path, bucket: str = BUCKET) -> Iterator[str]:
    """Run s3rver on 127.0.0.1 with a temporary directory and bucket; yields its endpoint."""
    node = shutil.which("node")
    if node is None:
        raise SystemExit("node is needed to run s3rver")
    with tempfile.TemporaryDirectory(prefix="asyncbatch-s3rver-") as data:
        port = free_port()
        log_path = Path(data) / "s3rver.log"
        command = [
            node,
            str(script),
            "--directory",
            str(Path(data) / "store"),
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
            "--silent",
            "--configure-bucket",
            bucket,
        ]
        (Path(data) / "store").mkdir()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            endpoint = f"http://127.0.0.1:{port}"
            try:
                wait_until_answering(endpoint + "/", process, timeout=30)
            except RuntimeError:
                sys.stderr.write(log_path.read_text(errors="replace"))
                raise
            yield endpoint
        finally:
            stop_process(process)


def token_chunks(total: int, seed: int = 0) -> Iterator[npt.NDArray[np.uint16]]:
    """``total`` random uint16 tokens below ``VOCAB``, in chunks."""
    rng = np.random.default_rng(seed)
    step = 16 * 2**20
    for start in range(0, total, step):
        yield rng.integers(0, VOCAB, min(step, total - start), dtype=np.uint16)


def upload_folder(endpoint: str, folder: str, url: str) -> None:
    """Upload every file of ``folder`` (not its subfolders) under ``url`` (``s3://bucket/prefix``)."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=KEY, secret=SECRET, skip_instance_cache=True)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fs.put_file(path, f"{url}/{name}")
