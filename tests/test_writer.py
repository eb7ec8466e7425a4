"""The writer: shards by size, manifest last, no silently wrapped integers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import asyncbatch as ab
from asyncbatch._errors import ConfigError, ManifestError


def test_shards_by_size_and_manifest(tmp_path: Path) -> None:
    chunks = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.int64) for i in range(7)]
    dataset = ab.write_tokens(str(tmp_path / "ds"), chunks, dtype=np.uint16, shard_size=3000)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert [s["bytes"] for s in manifest["shards"]] == [3000] * 4 + [2000]
    assert manifest["dtype"] == "<u2"
    joined = np.concatenate([np.fromfile(u, dtype=np.uint16) for u in dataset.shard_urls])
    assert np.array_equal(joined, np.arange(7000))


def test_values_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="70000"):
        ab.write_tokens(str(tmp_path / "ds"), np.array([1, 70000]), dtype=np.uint16)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_bad_manifest_is_a_clear_error(tmp_path: Path) -> None:
    ab.write_tokens(str(tmp_path / "ds"), np.arange(100, dtype=np.uint16))
    path = tmp_path / "ds" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["shards"][0]["bytes"] = 7
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="shard-00000.bin"):
        ab.open_dataset(str(tmp_path / "ds"))
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="manifest.json"):
        ab.open_dataset(str(tmp_path / "ds"))


def test_structured_dtype_survives_the_manifest(tmp_path: Path) -> None:
    record = np.dtype([("token", "<u4"), ("meta", "<i2", (2,))])
    data = np.zeros(10, dtype=record)
    dataset = ab.write_tokens(str(tmp_path / "ds"), data)
    assert ab.open_dataset(dataset.url).manifest.dtype == record


@pytest.mark.timeout(60)
def test_a_failed_write_leaves_no_open_file_and_no_temporary(tmp_path: Path) -> None:
    """One shard cannot be written (a folder sits at its path): the error reaches the caller,
    the writes cancelled with it finish closing their files, and no temporary stays behind."""
    for attempt in range(10):
        root = tmp_path / f"ds{attempt}"
        (root / "shard-00003.bin").mkdir(parents=True)
        chunks = (np.full(50_000, i, dtype=np.uint16) for i in range(40))
        with pytest.raises(OSError, match="shard-00003"):
            ab.write_tokens(str(root), chunks, shard_size=20_000, max_concurrency=8)
        assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]
        assert not (root / "manifest.json").exists()
