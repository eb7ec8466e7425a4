"""asyncbatch's store conformance suite, and a Loader epoch, over a real S3 server (moto)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest

import asyncbatch as ab
from asyncbatch.stores import open_store
from asyncbatch.testing import StoreConformance, StoreKit

BUCKET = "adapter"
CREDENTIALS = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """moto's S3 server in its own process on a free port of 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing"),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                    break
            except OSError:
                assert process.poll() is None, "moto's server exited"
                assert time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.1)
        s3 = client(url)
        s3.create_bucket(Bucket=BUCKET)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def client(endpoint: str) -> object:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def options(endpoint: str) -> dict[str, object]:
    return {"endpoint_url": endpoint, **CREDENTIALS}


class TestObstoreStore(StoreConformance):
    @pytest.fixture
    def store_kit(self, endpoint: str, request: pytest.FixtureRequest) -> StoreKit:
        s3 = client(endpoint)
        prefix = request.node.name

        def put(name: str, data: bytes) -> None:
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)  # type: ignore[attr-defined]

        return StoreKit(
            open=lambda: open_store(f"obstore+s3://{BUCKET}/", options(endpoint)),
            url=lambda name: f"obstore+s3://{BUCKET}/{prefix}/{name}",
            put=put,
        )


def test_a_loader_reads_an_epoch_exactly(endpoint: str, tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, 40_000, dtype=np.uint16)
    url = f"s3://{BUCKET}/tokens"
    ab.write_tokens(url, tokens, shard_size=15_000, storage_options=options(endpoint))
    with ab.Loader(
        f"obstore+s3://{BUCKET}/tokens",
        batch_size=4,
        seq_len=64,
        shuffle=True,
        storage_options=options(endpoint),
    ) as loader:
        windows = np.concatenate([b["tokens"].numpy() for b in loader]).reshape(-1, 64)
    expected = tokens[: len(tokens) // 64 * 64].reshape(-1, 64)
    assert len(windows) == len(expected) // 4 * 4
    found = {w.tobytes() for w in windows}
    assert len(found) == len(windows)
    assert found <= {w.tobytes() for w in expected}
