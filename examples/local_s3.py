"""moto's S3 server on 127.0.0.1, a stand-in for S3 that the examples start for themselves.

Needs ``pip install 'moto[server]'``. On real S3 the examples take a bucket URL instead and
credentials from the usual AWS variables.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

# moto accepts any key; real S3 takes credentials from the environment instead.
MOTO_OPTIONS = {"key": "testing", "secret": "testing"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in its own process on 127.0.0.1; yields its URL, stops it after."""
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", url.rsplit(":", 1)[1]]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
