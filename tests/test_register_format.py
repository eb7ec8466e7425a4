"""``register_format``: a format added from outside is read like a built-in one, and the
registry refuses silent replacements."""

from __future__ import annotations

import json
import threading
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from conftest import expected_windows

import asyncbatch as ab
from asyncbatch._open import open_dataset_async
from asyncbatch.formats import _registry as registry
from asyncbatch.formats._base import Fetch, OffLoop, Opener, Read, Source, Step, Wait
from asyncbatch.formats._tokens import token_windows


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
        "megatron",
        "llmbatch",
        "parquet",
        "arrow",
        "webdataset",
    }
    names = [o.name for o in registry.openers()]
    assert names == ["megatron", "npy", "raw", "llmbatch", "parquet", "arrow", "webdataset"]
    with pytest.raises(TypeError):
        registry.FORMATS["x"] = token_windows  # type: ignore[index]


class HalvesSource:
    """A source written as a generator of steps, as a third party would: each window's
    first half and (after the group before it read its own) its second half are read
    concurrently, then decoded off the loop. ``fail``: a step that goes wrong."""

    def __init__(self, datasets: Sequence[ab.Dataset], seq_len: int, fail: str = "") -> None:
        self.inner = token_windows(datasets, seq_len=seq_len, next_token=False, dtype=None)
        inner = self.inner
        self.datasets, self.shard_urls = inner.datasets, inner.shard_urls
        self.shard_dataset, self.sizes = inner.shard_dataset, inner.sizes
        self.num_samples, self.schema = inner.num_samples, inner.schema
        self.sample_bytes = inner.sample_bytes
        self.fail = fail
        self.last: Future[None] | None = None
        self.second_reads: list[int] = []  # the first id of each group, as its second half came
        self.threads: set[str] = set()
        self.waited = 0  # groups that found the group before them still reading

    def fetch(self, ids: npt.NDArray[np.int64], gap: int) -> Fetch:
        half = self.inner.seq_len // 2
        starts = ids * self.inner.seq_len
        first_plan = self.inner.shard_map.plan(starts, half, gap)
        if self.fail == "step":
            yield 42  # type: ignore[misc]
        second = self.second_half(ids, starts + half, gap)
        first, rest = yield (Read(first_plan), second)

        def decode() -> dict[str, Any]:
            self.threads.add(threading.current_thread().name)
            halves = [first.view(np.uint16).reshape(ids.size, -1), rest.reshape(ids.size, -1)]
            return {"tokens": torch.from_numpy(np.concatenate(halves, axis=1))}

        fields: dict[str, Any] = yield OffLoop(decode)
        return fields

    def second_half(
        self, ids: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], gap: int
    ) -> Generator[Step, Any, npt.NDArray[np.uint16]]:
        previous, mine = self.last, Future[None]()
        self.last = mine
        try:
            if previous is not None:
                self.waited += not previous.done()
                yield Wait((previous,))
            length = self.inner.seq_len - self.inner.seq_len // 2
            plan = self.inner.shard_map.plan(starts, length, gap)
            if self.fail == "read":  # from the last shard, which is missing
                last = np.full_like(plan.read_shard, len(self.shard_urls) - 1)
                plan = replace(plan, read_shard=last)
            try:
                buffer = yield Read(plan)
            except ab.NotFoundError as exc:
                raise ab.FormatError(f"no shard for the second halves of {ids[:2]}") from exc
            self.second_reads.append(int(ids[0]))
            return np.asarray(buffer).view(np.uint16)
        finally:
            if not mine.done():
                mine.set_result(None)


@pytest.mark.usefixtures("restore_registry")
def test_a_source_of_steps_reads_concurrently_waits_and_decodes_off_the_loop(
    tmp_path: Path,
) -> None:
    tokens = np.arange(50_000, dtype=np.uint16)
    dataset = ab.write_tokens(str(tmp_path / "data"), tokens, shard_size=6000)
    made: list[HalvesSource] = []

    def halves(
        datasets: Sequence[ab.Dataset],
        *,
        seq_len: int | None,
        next_token: bool,
        dtype: Any,
        **options: Any,
    ) -> Source:
        assert seq_len is not None
        made.append(HalvesSource(datasets, seq_len, options.get("fail", "")))
        return made[-1]

    raw = json.loads(Path(dataset.url, "manifest.json").read_text())
    raw["format"] = "halves"
    Path(dataset.url, "manifest.json").write_text(json.dumps(raw))
    ab.register_format("halves", source=halves)
    data = str(tmp_path / "data")
    with ab.Loader(data, batch_size=4, seq_len=33, shuffle=False, prefetch=16) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) > 8
    for batch in batches:
        expected = expected_windows(tokens, batch.global_indexes, 33)
        np.testing.assert_array_equal(batch["tokens"].numpy(), expected)
    source = made[-1]
    assert source.second_reads == sorted(source.second_reads)  # each waited for the one before
    assert source.waited > 0
    assert {name.split("_")[0] for name in source.threads} == {"asyncbatch-decode"}
    Path(dataset.shard_urls[-1]).unlink()
    for fail, error in [("step", TypeError), ("read", ab.FormatError)]:
        options: dict[str, Any] = {"format_options": {"fail": fail}, "shuffle": False}
        match = "not a step" if fail == "step" else "second halves"
        with (
            ab.Loader(data, batch_size=4, seq_len=33, **options) as loader,
            pytest.raises(error, match=match),
        ):
            next(iter(loader))
