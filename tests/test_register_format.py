"""``register_format``: a format added from outside is read like a built-in one, and the
registry refuses silent replacements."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import expected_windows

import asyncbatch as ab
from asyncbatch.formats import registry
from asyncbatch.formats.base import Opener, Source
from asyncbatch.formats.tokens import token_windows
from asyncbatch.open import open_dataset_async


def reversed_windows(
    datasets: Sequence[ab.Dataset],
    *,
    seq_len: int | None,
    next_token: bool,
    dtype: Any,
    **options: Any,
) -> Source:
    """Token windows whose tokens come back reversed: a format of its own, built on tokens."""
    source = token_windows(datasets, seq_len=seq_len, next_token=next_token, dtype=dtype)
    decode = source.decode

    def reverse(buffer: Any, ids: Any) -> dict[str, Any]:
        fields = decode(buffer, ids)
        reversed_rows = fields["tokens"].numpy()[:, ::-1]  # torch has no flip for uint16
        fields["tokens"] = torch.from_numpy(np.ascontiguousarray(reversed_rows))
        return fields

    source.decode = reverse  # type: ignore[method-assign]
    return source


@pytest.fixture
def restore_registry() -> Iterator[None]:
    """Put the registry back as it was: registrations are process-wide."""
    saved = (dict(registry._SOURCES), dict(registry._INDEX_LOADERS), dict(registry._OPENERS))
    yield
    for table, old in zip(
        (registry._SOURCES, registry._INDEX_LOADERS, registry._OPENERS), saved, strict=True
    ):
        table.clear()
        table.update(old)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("restore_registry")
def test_a_registered_source_reads_its_manifest_format(tmp_path: Path) -> None:
    tokens = np.arange(4000, dtype=np.uint16)
    url = str(tmp_path / "data")
    ab.write_tokens(url, tokens)
    manifest = Path(url, "manifest.json")
    raw = json.loads(manifest.read_text())
    raw["format"] = "reversed_tokens"
    manifest.write_text(json.dumps(raw))
    with pytest.raises(ab.ConfigError, match="reversed_tokens"):
        ab.Loader(ab.open_dataset(url), batch_size=4, seq_len=16)
    ab.register_format("reversed_tokens", source=reversed_windows)
    with ab.Loader(ab.open_dataset(url), batch_size=4, seq_len=16, shuffle=False) as loader:
        batch = next(iter(loader))
    expected = expected_windows(tokens, batch.global_indexes, 16)[:, ::-1]
    np.testing.assert_array_equal(batch["tokens"].numpy(), expected)


@pytest.mark.usefixtures("restore_registry")
def test_a_registered_opener_is_named_by_format_and_tried_by_suffix(tmp_path: Path) -> None:
    path = tmp_path / "x.tok"
    path.write_bytes(b"\x00" * 8)
    opened: list[str] = []

    async def open_tok(url: str, store: Any, options: Any, extra: Any) -> ab.Dataset:
        opened.append(url)
        return await open_dataset_async(str(tmp_path / "data"))

    ab.write_tokens(str(tmp_path / "data"), np.arange(100, dtype=np.uint16))
    opener = Opener("tok", open_tok, claims=lambda url: url.endswith(".tok"))
    ab.register_format("tok", opener=opener)
    assert ab.open_dataset(str(path)).manifest.total_elements == 100
    assert ab.open_dataset(str(tmp_path / "data"), format="tok").manifest.format == "tokens"
    assert opened == [str(path), str(tmp_path / "data")]
    assert registry.openers()[-1] is opener


@pytest.mark.usefixtures("restore_registry")
def test_register_format_refuses_a_silent_replacement() -> None:
    with pytest.raises(ab.ConfigError, match="already registered"):
        ab.register_format("tokens", source=reversed_windows)
    assert registry.FORMATS["tokens"] is token_windows
    ab.register_format("tokens", source=token_windows)  # the same one again: no change
    ab.register_format("tokens", source=reversed_windows, clobber=True)
    assert registry.FORMATS["tokens"] is reversed_windows


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("",), "non-empty string"),
        (("nothing",), "give a source"),
    ],
)
def test_register_format_checks_its_arguments(args: tuple[str], match: str) -> None:
    with pytest.raises(ab.ConfigError, match=match):
        ab.register_format(*args)
    with pytest.raises(ab.ConfigError, match="is named 'raw'"):
        ab.register_format("other", opener=Opener("raw", lambda *a: None))  # type: ignore[arg-type,return-value]


def test_the_built_in_formats_are_registered() -> None:
    assert set(registry.FORMATS) == {
        "tokens",
        "documents",
        "metadata_stream",
        "llmbatch",
        "parquet",
        "arrow",
    }
    names = [o.name for o in registry.openers()]
    assert names == ["megatron", "npy", "raw", "llmbatch", "parquet", "arrow"]
    with pytest.raises(TypeError):
        registry.FORMATS["x"] = token_windows  # type: ignore[index]
