"""Schemes to stores (``stores/_registry.py``): an unknown scheme named, ``register_store``,
synchronous fsspec filesystems, the ``asyncbatch.stores`` entry-point group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import expected_windows

import asyncbatch as ab
from asyncbatch._errors import (
    ConfigError,
    UnknownSchemeError,
)
from asyncbatch.stores import open_store, register_store, registered_stores
from asyncbatch.stores._stack import RetryingStore, TransportStore


class _MemoryStore:
    """A third-party store: objects in a dict."""

    coalesce_gap = 0

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    async def size(self, url: str) -> int:
        return len(self.objects[url])

    async def list(self, url: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(url))

    async def read_ranges(self, url: str, *, starts: Any, ends: Any, buffers: Any) -> None:
        for start, end, buffer in zip(starts, ends, buffers, strict=True):
            buffer[:] = self.objects[url][start:end]

    async def write(self, url: str, data: Any) -> None:
        self.objects[url] = bytes(data)

    async def close(self) -> None:
        pass


def test_unknown_scheme_names_it() -> None:
    with pytest.raises(UnknownSchemeError, match="nosuchscheme"):
        open_store("nosuchscheme://x/y")


def test_registered_store_serves_its_scheme(tokens: npt.NDArray[np.uint16]) -> None:
    objects: dict[str, bytes] = {}
    register_store("memtest", lambda scheme, options, max_inflight: _MemoryStore(objects))
    assert "memtest" in registered_stores
    with pytest.raises(ConfigError, match="already registered"):
        register_store("memtest", lambda *a, **k: None)
    with pytest.raises(TypeError):
        registered_stores["x"] = "y"  # type: ignore[index]
    ab.write_tokens("memtest://bucket/ds", tokens, shard_size=5000)
    with ab.Loader("memtest://bucket/ds", batch_size=5, seq_len=50, prefetch=2) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 50)
            )


def test_sync_fsspec_filesystem_runs_in_threads(tokens: npt.NDArray[np.uint16]) -> None:
    # fsspec's memory filesystem is synchronous: served from a thread pool, never the loop.
    ab.write_tokens("memory://asyncbatch-tests/ds", tokens, shard_size=3000)
    with ab.Loader("memory://asyncbatch-tests/ds", batch_size=3, seq_len=70) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 70)
            )


def test_entry_point_adds_a_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A third-party package, installed as a real distribution on sys.path.
    (tmp_path / "thirdparty_store.py").write_text(
        "from asyncbatch.stores._local import LocalStore\n"
        "def factory(scheme, options, *, max_inflight):\n"
        "    store = LocalStore()\n"
        "    store.served_scheme = scheme\n"
        "    return store\n"
    )
    info = tmp_path / "thirdparty_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[asyncbatch.stores]\nepstore = thirdparty_store:factory\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from asyncbatch.stores import _registry as registry

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    store = open_store("epstore://anything")
    # The registry stacks its guards over what the factory returned.
    assert isinstance(store, RetryingStore) and isinstance(store.inner, TransportStore)
    assert getattr(store.inner.transport, "served_scheme", None) == "epstore"
    asyncio.run(store.close())
