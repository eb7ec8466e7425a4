"""Real servers for the tests, on 127.0.0.1: a Range-honouring HTTP server and moto's S3."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(BaseHTTPRequestHandler):
    """Serves files under ``server.root`` with HEAD, GET and single byte ranges."""

    server: RangeHTTPServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's algorithm and the
    # client's delayed ACK hold the body back ~40 ms on every kept-alive request.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _file(self) -> Path | None:
        path = (self.server.root / self.path.split("?")[0].lstrip("/")).resolve()
        if self.server.root not in path.parents or not path.is_file():
            self.send_error(404)
            return None
        return path

    def _etag(self, path: Path) -> None:
        """An ETag as nginx makes one (mtime and size): a rewritten file gets another."""
        stat = path.stat()
        self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"')

    def do_HEAD(self) -> None:
        path = self._file()
        if path is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self._etag(path)
        self.end_headers()

    def do_GET(self) -> None:
        path = self._file()
        if path is None:
            return
        data = path.read_bytes()
        with self.server.lock:
            self.server.requests += 1
        match = _RANGE.match(self.headers.get("Range", ""))
        if match is None:
            self.send_response(200)
            body = data
        else:
            start = int(match.group(1))
            end = int(match.group(2)) + 1 if match.group(2) else len(data)
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[start:end]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self._etag(path)
        self.end_headers()
        self.wfile.write(body)


class RangeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops connections when a loader opens dozens at
    # once, and each dropped SYN costs a retransmission timeout.
    request_queue_size = 256

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root = root.resolve()
        self.requests = 0  # GET requests served
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A loader closed mid-epoch drops its connections: not an error of the server's.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@contextlib.contextmanager
def http_server(root: Path) -> Iterator[RangeHTTPServer]:
    server = RangeHTTPServer(root)
    thread = threading.Thread(target=server.serve_forever, name="test-http-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in its own process (server mode, as s3fs's tests use); its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
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
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
