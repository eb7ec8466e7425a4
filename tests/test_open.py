"""``open_dataset`` (``_open.py``): only the manifest read, a missing dataset, an unknown
format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from conftest import WriteDataset

import asyncbatch as ab


def test_manifest_only_at_open(
    store: str,
    write_dataset: WriteDataset,
    tokens: npt.NDArray[np.uint16],
    request: pytest.FixtureRequest,
) -> None:
    url, options = write_dataset(tokens, shard_size=4000)
    if store == "http":
        server = request.getfixturevalue("http_root")[1]
        before = server.requests
        dataset = ab.open_dataset(url, options)
        assert server.requests - before == 1  # one GET: the manifest; no shard touched
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.total_elements == tokens.size
    assert len(dataset.shard_urls) == -(-tokens.nbytes // 4000)


def test_missing_dataset_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ab.open_dataset(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ab.open_dataset(str(tmp_path / "nothing"), format="manifest")


def test_unknown_format_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ab.ConfigError, match="format=.orc."):
        ab.open_dataset(str(tmp_path), format="orc")
