"""GCS misconfiguration fails fast, once, with the fix named; credentials are found where
Google's own tools find them (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application
default credentials, ``token=``), their tokens fetched from a token endpoint on 127.0.0.1
and sent to fake-gcs-server (through the fault server, which logs every header)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, gcs_options
from faults import FaultServer, fault_server
from servers import free_port, running

import asyncbatch as ab
from asyncbatch.stores import open_store

#: Errors no retry can fix come from the first attempt (the bound leaves room for a loaded
#: machine; retried, they would take the default policy's 30 s).
AT_ONCE = 10.0
#: What the issue asks of a misspelt option: no request at all, well under 2 s.
OPTION_TYPO = 2.0
REFUSED_BUDGET = 15.0
TOKENS = np.arange(4_000, dtype=np.uint16)

Entry = Callable[[str, dict[str, Any]], object]


def through_open_dataset(url: str, options: dict[str, Any]) -> object:
    return ab.open_dataset(url, options)


def through_loader(url: str, options: dict[str, Any]) -> object:
    with ab.Loader(url, batch_size=4, seq_len=16, storage_options=options) as loader:
        return next(iter(loader))


@pytest.fixture(params=[through_open_dataset, through_loader], ids=["open_dataset", "Loader"])
def entry(request: pytest.FixtureRequest) -> Entry:
    function: Entry = request.param
    return function


def fails(
    expected: type[BaseException], call: Callable[[], object], within: float
) -> BaseException:
    began = time.monotonic()
    with pytest.raises(expected) as caught:
        call()
    elapsed = time.monotonic() - began
    assert elapsed < within, f"{type(caught.value).__name__} after {elapsed:.1f} s"
    return caught.value


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """What opening a dataset imports (torch, the formats) loaded before anything is timed:
    the bounds are for the checks, not for a first import on a loaded machine."""
    import asyncbatch._loader
    import asyncbatch._open
    import asyncbatch.stores._gcs  # noqa: F401


@pytest.fixture(scope="module")
def dataset_url(gcs_endpoint: str) -> str:
    url = f"gs://{BUCKET}/misconfig/tokens"
    ab.write_tokens(url, TOKENS, storage_options=gcs_options(gcs_endpoint))
    return url


@pytest.fixture(scope="module")
def gcs_proxy(gcs_endpoint: str) -> Iterator[FaultServer]:
    with fault_server(upstream=gcs_endpoint) as server:
        yield server


@pytest.fixture
def proxy(gcs_proxy: FaultServer) -> FaultServer:
    gcs_proxy.reset()
    return gcs_proxy


# -- options, URLs, endpoints ------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "suggested"),
    [({"endpoint": "http://127.0.0.1:9"}, "endpoint_url"), ({"tokn": "anon"}, "token")],
)
def test_unknown_storage_option_names_the_closest(
    entry: Entry, given: dict[str, Any], suggested: str
) -> None:
    error = fails(ab.ConfigError, lambda: entry(f"gs://{BUCKET}/x", given), OPTION_TYPO)
    (name,) = given
    message = str(error)
    assert f"unknown storage_options for GCS: {name!r}" in message
    assert f"did you mean {suggested!r} for {name!r}?" in message
    assert "requester_pays" in message.split("known: ")[1]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"endpoint_url": "127.0.0.1:4443"}, "must be an http:// or https:// URL"),
        ({"access": "write"}, "access='write' is not one of read_only, read_write"),
        ({"token": "/no/such/key.json"}, "token='/no/such/key.json' is not a file"),
        ({"token": 3}, "token= must be a key file's path"),
        ({"requester_pays": True}, "requester_pays=True needs the project to bill"),
    ],
)
def test_bad_option_values_fail_at_once(entry: Entry, options: dict[str, Any], named: str) -> None:
    error = fails(ab.ConfigError, lambda: entry(f"gs://{BUCKET}/x", options), OPTION_TYPO)
    assert named in str(error)


@pytest.mark.parametrize(
    ("url", "fixed"), [("gs:/bucket/tokens", "gs://bucket/tokens"), ("GS://b/t", "gs://b/t")]
)
def test_malformed_urls_are_refused_with_the_fix(entry: Entry, url: str, fixed: str) -> None:
    error = fails(ab.ConfigError, lambda: entry(url, {}), OPTION_TYPO)
    assert url in str(error) and f"use {fixed}" in str(error)


def test_invalid_bucket_name_is_a_config_error(entry: Entry, gcs_endpoint: str) -> None:
    url = "gs://No_Such!/tokens"
    error = fails(ab.ConfigError, lambda: entry(url, gcs_options(gcs_endpoint)), AT_ONCE)
    assert "invalid bucket name 'No_Such!'" in str(error) and url in str(error)


def test_a_missing_bucket_says_so(entry: Entry, gcs_endpoint: str) -> None:
    url = "gs://no-such-bucket/tokens"
    error = fails(ab.BucketNotFoundError, lambda: entry(url, gcs_options(gcs_endpoint)), AT_ONCE)
    assert "the bucket 'no-such-bucket' does not exist (HTTP 404)" in str(error)
    assert url in str(error)


def test_a_url_without_an_object_is_a_config_error(gcs_endpoint: str) -> None:
    async def size() -> int:
        store = open_store(f"gs://{BUCKET}", gcs_options(gcs_endpoint))
        try:
            return await store.size(f"gs://{BUCKET}/")
        finally:
            await store.close()

    with pytest.raises(ab.ConfigError, match=f"no object named in gs://{BUCKET}/"):
        asyncio.run(size())


def test_a_missing_object_is_not_found(gcs_endpoint: str) -> None:
    url = f"gs://{BUCKET}/misconfig/none"
    error = fails(ab.NotFoundError, lambda: ab.open_dataset(url, gcs_options(gcs_endpoint)), 10)
    assert url in str(error) and "bucket" not in str(error)


def test_an_unresolvable_endpoint_fails_at_once(entry: Entry) -> None:
    options = {"endpoint_url": "http://nonexistent.invalid:9", "token": "anon"}
    error = fails(ab.EndpointError, lambda: entry(f"gs://{BUCKET}/tokens", options), AT_ONCE)
    assert "nonexistent.invalid:9 does not resolve" in str(error)


def test_connection_refused_gives_up_within_seconds(entry: Entry) -> None:
    options = gcs_options(f"http://127.0.0.1:{free_port()}")
    error = fails(
        ab.RetriesExhaustedError, lambda: entry(f"gs://{BUCKET}/tokens", options), REFUSED_BUDGET
    )
    assert "(refused connections are retried for 3 s), each: connection refused by" in str(error)


def test_the_emulator_host_variable_needs_no_options(
    dataset_url: str, gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As Google's client libraries do: STORAGE_EMULATOR_HOST (host:port), no credentials.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint.removeprefix("http://"))
    assert ab.open_dataset(dataset_url).manifest.total_elements == TOKENS.size


# -- credentials -------------------------------------------------------------------------


class TokenHandler(BaseHTTPRequestHandler):
    """An OAuth token endpoint: a new access token per request, or ``server.refuse``."""

    server: TokenServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.requests += 1
            number = self.server.requests
        body: dict[str, object]
        if self.server.refuse:
            status = 400
            body = {"error": "invalid_grant", "error_description": "Token has been revoked."}
        else:
            status = 200
            body = {"access_token": f"token-{number}", "expires_in": 3600, "token_type": "Bearer"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class TokenServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), TokenHandler)
        self.lock = threading.Lock()
        self.requests = 0
        self.refuse = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/token"


@pytest.fixture
def token_server() -> Iterator[TokenServer]:
    server = TokenServer()
    with running(server, "test-token-server"):
        yield server


@functools.cache
def _private_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def service_account_key(token_url: str) -> dict[str, str]:
    """A service account's key file, its token endpoint on 127.0.0.1 (google-auth sends
    an authorized user's refresh to Google's own endpoint, whatever its file says)."""
    return {
        "type": "service_account",
        "project_id": "test-project",
        "private_key_id": "1",
        "private_key": _private_key(),
        "client_email": "reader@test-project.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_url,
    }


@pytest.fixture
def no_google_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials where google-auth looks, and no metadata server asked (what
    ``NO_GCE_CHECK=true`` does when set before google-auth is imported)."""
    from google.auth.compute_engine import _metadata

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", True)


def authorization(proxy: FaultServer) -> set[str | None]:
    return {headers.get("Authorization") for headers in proxy.headers}


@pytest.mark.usefixtures("no_google_credentials")
def test_no_credentials_fail_at_once_naming_the_fix(
    entry: Entry, dataset_url: str, proxy: FaultServer
) -> None:
    error = fails(
        ab.CredentialsError, lambda: entry(dataset_url, {"endpoint_url": proxy.url}), AT_ONCE
    )
    message = str(error)
    assert message.startswith("no Google credentials found")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message and "token='anon'" in message
    assert dataset_url in message and message.count("no Google credentials") == 1
    assert proxy.total == 0  # nothing was sent without credentials


@pytest.mark.usefixtures("no_google_credentials")
@pytest.mark.parametrize("where", ["GOOGLE_APPLICATION_CREDENTIALS", "gcloud", "token=", "dict"])
def test_credentials_are_found_where_google_tools_look(
    dataset_url: str,
    proxy: FaultServer,
    token_server: TokenServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    info = service_account_key(token_server.url)
    key = tmp_path / "key.json"
    key.write_text(json.dumps(info))
    options: dict[str, Any] = {"endpoint_url": proxy.url}
    if where == "GOOGLE_APPLICATION_CREDENTIALS":
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    elif where == "gcloud":
        (tmp_path / "gcloud").mkdir()
        (tmp_path / "gcloud" / "application_default_credentials.json").write_text(json.dumps(info))
        monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    elif where == "token=":
        options["token"] = str(key)
    else:
        options["token"] = info
    with ab.Loader(dataset_url, batch_size=4, seq_len=16, storage_options=options) as loader:
        batches = sum(1 for _ in loader)
    assert batches == TOKENS.size // 16 // 4
    assert authorization(proxy) == {"Bearer token-1"}
    assert token_server.requests == 1  # one token for the open and every read


@pytest.mark.usefixtures("no_google_credentials")
def test_a_refused_token_is_a_credentials_error(
    dataset_url: str, proxy: FaultServer, token_server: TokenServer
) -> None:
    token_server.refuse = True
    options = {"endpoint_url": proxy.url, "token": service_account_key(token_server.url)}
    error = fails(ab.CredentialsError, lambda: ab.open_dataset(dataset_url, options), AT_ONCE)
    assert "invalid_grant" in str(error) and dataset_url in str(error)
    assert proxy.total == 0


@pytest.mark.usefixtures("no_google_credentials")
def test_a_missing_key_file_in_the_environment_is_named(
    dataset_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "gone.json"
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    error = fails(
        ab.CredentialsError,
        lambda: ab.open_dataset(dataset_url, {"endpoint_url": "http://127.0.0.1:9"}),
        AT_ONCE,
    )
    assert str(missing) in str(error)


class MetadataHandler(BaseHTTPRequestHandler):
    """The metadata server of a Compute Engine VM, as google-auth asks it."""

    server: MetadataServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        root = "/computeMetadata/v1/"
        body: object
        if path == "/":
            body = "ok"  # google-auth's ping: it checks the Metadata-Flavor header
        elif path == root + "project/project-id":
            body = "test-project"
        elif path == root + "universe/universe-domain":
            body = "googleapis.com"
        elif path.startswith(root + "instance/service-accounts/") and path.endswith("/token"):
            with self.server.lock:
                self.server.tokens += 1
            body = {"access_token": "metadata-token", "expires_in": 3600, "token_type": "Bearer"}
        elif path.startswith(root + "instance/service-accounts/"):
            body = {"email": "vm@test-project.iam.gserviceaccount.com", "aliases": ["default"]}
        else:
            self.send_error(404)
            return
        json_body = not isinstance(body, str)
        data = (json.dumps(body) if json_body else str(body)).encode()
        self.send_response(200)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "application/json" if json_body else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class MetadataServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), MetadataHandler)
        self.lock = threading.Lock()
        self.tokens = 0


METADATA_CHILD = """
import sys

import asyncbatch as ab

if __name__ == "__main__":
    url, endpoint = sys.argv[1:]
    # Application Default Credentials (found on the metadata server), then token="cloud".
    for options in ({"endpoint_url": endpoint}, {"endpoint_url": endpoint, "token": "cloud"}):
        print(ab.open_dataset(url, options).manifest.total_elements)
"""


@pytest.mark.timeout(120)
def test_the_metadata_server_gives_credentials(
    dataset_url: str, proxy: FaultServer, tmp_path: Path
) -> None:
    # google-auth reads where the metadata server is when it is imported: a new process.
    server = MetadataServer()
    script = tmp_path / "child.py"
    script.write_text(METADATA_CHILD)
    host = f"127.0.0.1:{server.server_address[1]}"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "NO_GCE_CHECK")
    }
    env.update(
        GCE_METADATA_HOST=host,
        GCE_METADATA_IP=host,
        CLOUDSDK_CONFIG=str(tmp_path / "no-gcloud"),
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    with running(server, "test-metadata-server"):
        done = subprocess.run(
            [sys.executable, str(script), dataset_url, proxy.url],
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(TOKENS.size)] * 2
    assert authorization(proxy) == {"Bearer metadata-token"}
    assert server.tokens == 2  # one for each kind of credentials
