"""Fixtures: datasets written through every store, backed by real servers on 127.0.0.1."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from servers import RangeHTTPServer, azurite_server, gcs_emulator, http_server, moto_server

import asyncbatch as ab

STORES = ["local", "s3", "http"]
BUCKET = "asyncbatch-tests"
_names = itertools.count()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=url, key="testing", secret="testing")
        fs.mkdir(BUCKET)
        yield url


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """fake-gcs-server with the bucket ``BUCKET``: its URL (``endpoint_url`` of the store)."""
    with gcs_emulator(BUCKET) as url:
        yield url


def gcs_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon"}


@pytest.fixture(scope="session")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, RangeHTTPServer]]:
    root = tmp_path_factory.mktemp("http-root")
    with http_server(root) as server:
        yield root, server


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's Blob service (scripts/bootstrap installs it): the dev account's endpoint."""
    with azurite_server(tmp_path_factory.mktemp("azurite")) as url:
        yield url


def azure_options(endpoint: str) -> dict[str, Any]:
    """Azurite's well-known development account and key, at ``endpoint``."""
    from asyncbatch.stores._azure_auth import DEV_ACCOUNT, DEV_KEY

    return {"account_name": DEV_ACCOUNT, "account_key": DEV_KEY, "endpoint": endpoint}


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}


WriteDataset = Callable[..., tuple[str, dict[str, Any]]]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """The name of each store in turn: local, s3 (moto server), http (Range server)."""
    name: str = request.param
    return name


@pytest.fixture
def write_dataset(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> WriteDataset:
    """``write_dataset(tokens, **kwargs)`` writes with ``ab.write_tokens`` to the current store
    and returns ``(url, storage_options)`` for reading it back."""

    def write(tokens: npt.ArrayLike, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        name = f"ds-{next(_names)}"
        if store == "local":
            url = str(tmp_path / name)
            ab.write_tokens(url, tokens, **kwargs)
            return url, {}
        if store == "s3":
            options = s3_options(request.getfixturevalue("s3_endpoint"))
            url = f"s3://{BUCKET}/{name}"
            ab.write_tokens(url, tokens, storage_options=options, **kwargs)
            return url, options
        root, server = request.getfixturevalue("http_root")
        ab.write_tokens(str(root / name), tokens, **kwargs)
        return f"{server.url}/{name}", {}

    return write


@pytest.fixture
def tokens() -> npt.NDArray[np.uint16]:
    return np.random.default_rng(0).integers(0, 60_000, 20_011, dtype=np.uint16)


def expected_windows(
    tokens: npt.NDArray[Any], ids: npt.NDArray[np.int64], seq_len: int, next_token: bool = False
) -> npt.NDArray[Any]:
    """The windows a batch must hold, computed directly from the numpy source."""
    width = seq_len + int(next_token)
    return np.stack([tokens[i * seq_len : i * seq_len + width] for i in ids.tolist()])


def asyncbatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncbatch")]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A real local Ray cluster, started once per session (prepare's and index's engines
    join it)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
