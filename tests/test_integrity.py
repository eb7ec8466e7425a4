"""Integrity: checksums in the manifest, verify=off|size|block|full, ``asyncbatch verify``."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import xxhash
from conftest import WriteDataset, expected_windows

import asyncbatch as ab
from asyncbatch._checksums import block_digests, encode_blocks
from asyncbatch._cli import main as cli_main
from asyncbatch._errors import ChecksumError, ConfigError, ManifestError
from asyncbatch._verify import verify_dataset
from asyncbatch.stores import ObjectInfo
from asyncbatch.stores import _checked as checked
from asyncbatch.stores import _registry as registry
from asyncbatch.stores._local import LocalStore

SHARD = 8000  # bytes: 4000 uint16 tokens, so the 20_011 test tokens make 6 shards
BLOCK = 1024  # checksum block: 512 tokens
SEQ_LEN = 50
BATCH = 4


def write(tmp_path: Path, tokens: npt.NDArray[Any], name: str = "ds", **kwargs: Any) -> ab.Dataset:
    kwargs.setdefault("shard_size", SHARD)
    kwargs.setdefault("checksum_block", BLOCK)
    return ab.write_tokens(str(tmp_path / name), tokens, **kwargs)


def flip(path: str | Path, offset: int) -> None:
    """Invert one byte of a local file, behind the manifest's back."""
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def edit_manifest(root: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = Path(root) / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def strip_checksums(raw: dict[str, Any]) -> None:
    """What a manifest written before checksums existed looks like."""
    raw.pop("checksum", None)
    raw.pop("checksum_block", None)
    for shard in raw["shards"]:
        shard.pop("checksum", None)
        shard.pop("block_checksums", None)


def take(loader: ab.Loader) -> tuple[list[ab.Batch], BaseException | None]:
    """The batches a loader delivers, and the error that ended it (None at the epoch's end)."""
    batches: list[ab.Batch] = []
    try:
        for batch in loader:
            batches.append(batch)
    except ab.AsyncBatchError as exc:
        return batches, exc
    return batches, None


def assert_exact(tokens: npt.NDArray[Any], batches: Sequence[ab.Batch], next_token: bool) -> None:
    for batch in batches:
        np.testing.assert_array_equal(
            batch["tokens"].numpy(),
            expected_windows(tokens, batch.global_indexes, SEQ_LEN, next_token),
        )


def first_batch_touching(batches: Sequence[ab.Batch], low: int, high: int) -> int:
    """Index of the first batch with a window overlapping elements ``[low, high)``."""
    for index, batch in enumerate(batches):
        starts = batch.global_indexes * SEQ_LEN
        if np.any((starts < high) & (starts + SEQ_LEN > low)):
            return index
    raise AssertionError("no batch touches the range")


# --- the writer and the manifest ----------------------------------------------------------


def test_writer_records_shard_and_block_checksums(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens)
    raw = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert raw["checksum"] == "xxh3_64" and raw["checksum_block"] == BLOCK
    for entry, url in zip(raw["shards"], dataset.shard_urls, strict=True):
        data = Path(url).read_bytes()
        assert entry["checksum"] == f"{xxhash.xxh3_64_intdigest(data):016x}"
        blocks = np.frombuffer(base64.b64decode(entry["block_checksums"]), dtype="<u8")
        expected = [
            xxhash.xxh3_64_intdigest(data[a : a + BLOCK]) for a in range(0, len(data), BLOCK)
        ]
        assert blocks.tolist() == expected  # the last block is the shorter rest
    # Parsed back as written, and written again identically.
    manifest = ab.open_dataset(dataset.url).manifest
    assert manifest == dataset.manifest
    assert json.loads(manifest.to_json()) == raw


def test_whole_shard_checksums_only_and_bad_block_sizes(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens, checksum_block=None)
    raw = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert "checksum_block" not in raw and "block_checksums" not in raw["shards"][0]
    assert dataset.manifest.shards[0].checksum is not None
    for bad in (0, -4, True, "1MiB", 1.5):
        with pytest.raises(ConfigError, match=f"checksum_block.*{bad!r}"):
            write(tmp_path, tokens, name=f"bad-{bad}", checksum_block=bad)


def _drop_last_block(raw: dict[str, Any]) -> None:
    packed = base64.b64decode(raw["shards"][1]["block_checksums"])
    raw["shards"][1]["block_checksums"] = base64.b64encode(packed[:-8]).decode()


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda raw: raw.update(checksum="md5"), "field 'checksum' is 'md5'"),
        (lambda raw: raw.update(checksum_block=0), "'checksum_block' must be a positive"),
        (lambda raw: raw.update(checksum_block=True), "'checksum_block' must be a positive"),
        (lambda raw: raw.pop("checksum"), "'checksum_block' is set without 'checksum'"),
        (
            lambda raw: raw["shards"][0].update(checksum="0x12"),
            "shard 'shard-00000.bin' field 'checksum': expected 16",
        ),
        (
            lambda raw: raw["shards"][2].pop("checksum"),
            "shard 'shard-00002.bin' lacks field 'checksum'",
        ),
        (
            lambda raw: raw["shards"][1].update(block_checksums="not base64!"),
            "shard 'shard-00001.bin' field 'block_checksums': not base64",
        ),
        (_drop_last_block, "shard 'shard-00001.bin' field 'block_checksums': expected 8 block"),
    ],
)
def test_bad_checksum_fields_are_manifest_errors(
    tmp_path: Path,
    tokens: npt.NDArray[np.uint16],
    change: Callable[[dict[str, Any]], None],
    names: str,
) -> None:
    dataset = write(tmp_path, tokens)
    edit_manifest(dataset.url, change)
    with pytest.raises(ManifestError, match="manifest.json") as caught:
        ab.open_dataset(dataset.url)
    assert names in str(caught.value)


def test_old_manifests_without_checksums_still_load(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens)
    edit_manifest(dataset.url, strip_checksums)
    old = ab.open_dataset(dataset.url)
    assert old.manifest.checksum is None and old.manifest.shards[0].checksum is None
    for verify in ("off", "size"):
        with ab.Loader(old, batch_size=BATCH, seq_len=SEQ_LEN, verify=verify) as loader:
            batches, error = take(loader)
        assert error is None and len(batches) == len(tokens) // SEQ_LEN // BATCH
        assert_exact(tokens, batches, False)
    for verify in ("block", "full"):
        with pytest.raises(ConfigError, match=f"verify='{verify}' needs checksums.*{old.url}"):
            ab.Loader(old, batch_size=BATCH, seq_len=SEQ_LEN, verify=verify)
    # Whole-shard checksums only: "full" works, "block" says to use it.
    whole = write(tmp_path, tokens, name="whole", checksum_block=None)
    with pytest.raises(ConfigError, match=f"block checksums.*{whole.url}.*verify='full'"):
        ab.Loader(whole, batch_size=BATCH, seq_len=SEQ_LEN, verify="block")
    ab.Loader(whole, batch_size=BATCH, seq_len=SEQ_LEN, verify="full").close()


def test_verify_values_are_checked_at_construction(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens)
    for bad in ("fast", None, 2, "Block"):
        with pytest.raises(ConfigError, match=f"verify={bad!r}"):
            ab.Loader(dataset, batch_size=BATCH, seq_len=SEQ_LEN, verify=bad)
        with pytest.raises(ConfigError, match=f"verify={bad!r}"):
            ab.AsyncLoader(dataset.url, batch_size=BATCH, seq_len=SEQ_LEN, verify=bad)
    with pytest.raises(ConfigError, match="verify='quick'"):
        ab.LoaderDataset(dataset, batch_size=BATCH, seq_len=SEQ_LEN, verify="quick")


# --- the loaders --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shuffle", "next_token", "seq_len", "block"),
    [
        (False, False, SEQ_LEN, BLOCK),
        (True, True, SEQ_LEN, BLOCK),  # overlapping windows: pieces copied from scratch
        ("block", False, SEQ_LEN, BLOCK),
        (True, False, 700, 512),  # windows spanning several blocks and shard ends
        (True, True, 7, 4096),  # several windows per block, blocks bigger than shard tails
    ],
)
def test_block_verification_delivers_exact_batches(
    tmp_path: Path,
    tokens: npt.NDArray[np.uint16],
    shuffle: bool | str,
    next_token: bool,
    seq_len: int,
    block: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small scratch chunks: a group's blocks are read, checked and copied in several rounds.
    monkeypatch.setattr(checked, "BLOCK_SCRATCH_BYTES", 5000)
    dataset = write(tmp_path, tokens, checksum_block=block)
    seen = 0
    with ab.Loader(
        dataset,
        batch_size=BATCH,
        seq_len=seq_len,
        shuffle=shuffle,
        next_token=next_token,
        verify="block",
        seed=5,
    ) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(),
                expected_windows(tokens, batch.global_indexes, seq_len, next_token),
            )
            seen += 1
    assert seen == len(loader) > 0


def test_block_verification_over_a_mixture_of_block_sizes(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    other = tokens[::-1].copy()
    datasets = [
        write(tmp_path, tokens, name="a", checksum_block=512),
        write(tmp_path, other, name="b", checksum_block=3000, shard_size=6000),
    ]
    mixture = ab.mix(datasets, seed=2)
    with ab.Loader(mixture, batch_size=BATCH, seq_len=SEQ_LEN, verify="block") as loader:
        batches, error = take(loader)
    assert error is None and batches
    for batch in batches:
        which, samples = mixture.locate(batch.global_indexes, SEQ_LEN)
        for d, source in enumerate((tokens, other)):
            rows = which == d
            if rows.any():
                np.testing.assert_array_equal(
                    batch["tokens"].numpy()[rows], expected_windows(source, samples[rows], SEQ_LEN)
                )


@pytest.mark.timeout(60)
def test_flipped_byte_block_level_fails_at_its_batch_off_reads_it(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens)
    shard, offset = 2, 2 * BLOCK + 477  # block 2 of shard 2
    flip(dataset.shard_urls[shard], offset)
    settings: dict[str, Any] = dict(batch_size=BATCH, seq_len=SEQ_LEN, seed=1, coalesce_gap=0)

    # verify="off" reads the bad byte into a batch: this is what the checks must prevent.
    with ab.Loader(dataset, **settings, verify="off") as loader:
        plain, error = take(loader)
    assert error is None
    wrong = [
        i
        for i, b in enumerate(plain)
        if not np.array_equal(b["tokens"].numpy(), expected_windows(tokens, b.global_indexes, 50))
    ]
    first_element = shard * SHARD // 2  # the shard's first token
    block_tokens = (first_element + 2 * BLOCK // 2, first_element + 3 * BLOCK // 2)
    bad_token = first_element + offset // 2
    assert wrong and wrong[0] == first_batch_touching(plain, bad_token, bad_token + 1)
    at = first_batch_touching(plain, *block_tokens)  # the first batch reading that block

    # prefetch=2: groups of one batch, so the error comes exactly at that batch.
    with ab.Loader(dataset, **settings, verify="block", prefetch=2) as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError)
    message = str(error)
    assert dataset.shard_urls[shard] in message
    assert f"block 2 bytes [{2 * BLOCK}, {3 * BLOCK})" in message
    assert "expected" in message and "got" in message
    assert error.url == dataset.shard_urls[shard] and (error.start, error.end) == (2048, 3072)
    assert len(batches) == at
    assert_exact(tokens, batches, False)

    # Default prefetch (groups of many batches): the error may come earlier, never later, and
    # nothing delivered is wrong.
    with ab.Loader(dataset, **settings, verify="block") as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError) and len(batches) <= at
    assert_exact(tokens, batches, False)


def test_full_level_checks_each_shard_before_its_first_use(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    dataset = write(tmp_path, tokens)
    settings: dict[str, Any] = dict(batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False, prefetch=2)
    with ab.Loader(dataset, **settings, verify="full") as loader:
        batches, error = take(loader)
    assert error is None and len(batches) == len(loader)
    assert_exact(tokens, batches, False)

    flip(dataset.shard_urls[2], 5000)
    with ab.Loader(dataset, **settings, verify="full") as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError)
    assert dataset.shard_urls[2] in str(error) and "block 4 bytes [4096, 5120)" in str(error)
    # In order, batch 40 is the first to touch shard 2 (tokens 8000 on): 40 batches came.
    assert len(batches) == 2 * SHARD // 2 // (BATCH * SEQ_LEN) == 40
    assert_exact(tokens, batches, False)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_size_level_catches_a_shard_of_another_size(
    tmp_path: Path, tokens: npt.NDArray[np.uint16], change: str
) -> None:
    dataset = write(tmp_path, tokens)
    path = Path(dataset.shard_urls[2])
    data = path.read_bytes()
    path.write_bytes(data[:100] if change == "truncated" else data + b"\1" * 10)
    store_size = 100 if change == "truncated" else SHARD + 10
    settings: dict[str, Any] = dict(batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False, prefetch=2)
    with ab.Loader(dataset, **settings) as loader:  # verify="size" is the default
        batches, error = take(loader)
    assert isinstance(error, ManifestError)
    assert str(error) == (
        f"size mismatch: {path} has {store_size} bytes in the store, the manifest says {SHARD}"
    )
    assert len(batches) == 40  # checked lazily: the batches before shard 2 came
    assert_exact(tokens, batches, False)
    if change == "extended":  # without checks the extra bytes are never read
        with ab.Loader(dataset, **settings, verify="off") as loader:
            batches, error = take(loader)
        assert error is None and len(batches) == len(loader)
        assert_exact(tokens, batches, False)


class CountingStore(LocalStore):
    """The local store under the ``counted://`` scheme, counting ``stat`` calls per URL (the
    stack above asks the transport for sizes with ``stat``)."""

    calls: Counter[str] = Counter()

    async def stat(self, url: str) -> ObjectInfo:
        CountingStore.calls[url] += 1
        return await super().stat(url.removeprefix("counted://"))

    async def read_into(self, urls: Sequence[str], *args: Any) -> None:
        await super().read_into([u.removeprefix("counted://") for u in urls], *args)

    async def read_windows(self, urls: Sequence[str], *args: Any) -> bool:
        return await super().read_windows([u.removeprefix("counted://") for u in urls], *args)

    async def read_ranges(self, url: str, **kwargs: Any) -> None:
        await super().read_ranges(url.removeprefix("counted://"), **kwargs)


def test_sizes_are_checked_once_per_shard(
    tmp_path: Path, tokens: npt.NDArray[np.uint16], monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, tokens, shard_size=800)  # 26 shards
    monkeypatch.setitem(registry._registry, "counted", lambda *a, **k: CountingStore())
    dataset = ab.open_dataset(f"counted://{tmp_path / 'ds'}")
    for verify, calls in (("off", 0), ("size", 1)):
        CountingStore.calls.clear()
        with ab.Loader(
            dataset, batch_size=BATCH, seq_len=SEQ_LEN, prefetch=16, verify=verify
        ) as lo:
            for _epoch in range(2):  # two runs of one loader: still one call per shard
                batches, error = take(lo)
                assert error is None
                assert_exact(tokens, batches, False)
        # Shard 50 holds only the 11-token tail no window reads: never touched, never checked.
        assert [CountingStore.calls[url] for url in dataset.shard_urls] == [calls] * 50 + [0]


def test_async_loader_verifies_blocks(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> None:
    dataset = write(tmp_path, tokens)

    async def run() -> tuple[int, BaseException | None]:
        count = 0
        async with ab.AsyncLoader(
            dataset.url, batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False, verify="block"
        ) as loader:
            try:
                async for batch in loader:
                    np.testing.assert_array_equal(
                        batch["tokens"].numpy(),
                        expected_windows(tokens, batch.global_indexes, SEQ_LEN),
                    )
                    count += 1
            except ChecksumError as exc:
                return count, exc
        return count, None

    count, error = asyncio.run(run())
    assert error is None and count == len(tokens) // SEQ_LEN // BATCH
    flip(dataset.shard_urls[0], 3)
    count, error = asyncio.run(run())
    assert isinstance(error, ChecksumError) and count == 0 and "block 0 " in str(error)


# --- asyncbatch verify --------------------------------------------------------------------


def test_cli_verify_names_every_bad_shard_and_block(
    tmp_path: Path, tokens: npt.NDArray[np.uint16], capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write(tmp_path, tokens)
    assert cli_main(["verify", dataset.url]) == 0
    out, err = capsys.readouterr()
    assert "checked   6 shards, level block" in out and "result    clean" in out
    assert "bytes     39.1 KiB (40,022 bytes)" in out
    assert "verifying" in err and "100.0%" in err  # the progress bar

    flip(dataset.shard_urls[1], 10)  # block 0
    flip(dataset.shard_urls[4], 7000)  # block 6
    flip(dataset.shard_urls[4], 7999)  # block 7, the last (shorter) one
    assert cli_main(["verify", dataset.url]) == 1
    out, _ = capsys.readouterr()
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert [line.split()[4:6] for line in bad if "block" in line] == [
        ["block", "0"],
        ["block", "6"],
        ["block", "7"],
    ]
    assert sum("whole shard" in line for line in bad) == 2
    assert f"{dataset.shard_urls[1]} block 0 bytes [0, 1024)" in out
    assert f"{dataset.shard_urls[4]} block 7 bytes [7168, 8000)" in out
    assert "2 bad shards of 6, 3 bad blocks" in out

    assert cli_main(["verify", dataset.url, "--level", "full"]) == 1
    out, _ = capsys.readouterr()
    assert "level full" in out and out.count("whole shard") == 2

    tail = Path(dataset.shard_urls[5]).read_bytes()
    Path(dataset.shard_urls[5]).write_bytes(b"")
    assert cli_main(["verify", dataset.url, "--level", "full"]) == 1
    out, _ = capsys.readouterr()
    assert f"size mismatch: {dataset.shard_urls[5]} has 0 bytes" in out
    assert "3 bad shards of 6" in out
    Path(dataset.shard_urls[5]).write_bytes(tail)
    head = Path(dataset.shard_urls[0]).read_bytes()
    Path(dataset.shard_urls[0]).unlink()
    assert cli_main(["verify", dataset.url]) == 1
    out, _ = capsys.readouterr()
    assert f"not found: {dataset.shard_urls[0]}" in out and "3 bad shards of 6" in out
    Path(dataset.shard_urls[0]).write_bytes(head)

    edit_manifest(dataset.url, strip_checksums)
    assert cli_main(["verify", dataset.url]) == 3
    out, _ = capsys.readouterr()
    assert "no checksums" in out and "level size" in out


def test_cli_verify_exit_code_in_a_process(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> None:
    dataset = write(tmp_path, tokens)
    flip(dataset.shard_urls[3], 2100)
    done = subprocess.run(
        [sys.executable, "-m", "asyncbatch._cli", "verify", dataset.url, "--concurrency", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert f"{dataset.shard_urls[3]} block 2 bytes [2048, 3072)" in done.stdout


def _corrupt_remote(
    store: str, url: str, offset: int, options: dict[str, Any], request: Any
) -> None:
    if store == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        data = bytearray(fs.cat_file(url))
        data[offset] ^= 0xFF
        fs.pipe(url, bytes(data))
        return
    root, server = request.getfixturevalue("http_root")
    flip(root / url.removeprefix(server.url + "/"), offset)


@pytest.mark.parametrize("store", ["s3", "http"])
@pytest.mark.timeout(60)
def test_remote_verify_and_block_level(
    store: str,
    write_dataset: WriteDataset,
    tokens: npt.NDArray[np.uint16],
    request: pytest.FixtureRequest,
) -> None:
    url, options = write_dataset(tokens, shard_size=SHARD, checksum_block=BLOCK)
    assert verify_dataset(url, storage_options=options).clean
    dataset = ab.open_dataset(url, options)
    _corrupt_remote(store, dataset.shard_urls[2], 3 * BLOCK, options, request)
    report = verify_dataset(url, storage_options=options, concurrency=3)
    assert [shard.url for shard in report.bad] == [dataset.shard_urls[2]]
    assert report.bad[0].bad_blocks == [3]
    with ab.Loader(
        dataset, batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False, verify="block", prefetch=2
    ) as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError)
    assert f"{dataset.shard_urls[2]} block 3 bytes [3072, 4096)" in str(error)
    # In order, the first window reaching block 3 of shard 2 (tokens 9536 on) is in batch 47.
    assert len(batches) == (2 * SHARD + 3 * BLOCK) // 2 // (BATCH * SEQ_LEN) == 47
    assert_exact(tokens, batches, False)


def test_checksums_cover_a_shard_header(tmp_path: Path, tokens: npt.NDArray[np.uint16]) -> None:
    """A shard whose elements start after a header (``offset``): size and checksums cover the
    whole object, and block reads check the header's block too."""
    root = tmp_path / "headed"
    root.mkdir()
    header = b"H" * 100
    data = header + tokens.tobytes()
    (root / "part.bin").write_bytes(data)
    manifest = {
        "asyncbatch_manifest": 1,
        "format": "tokens",
        "dtype": "<u2",
        "checksum": "xxh3_64",
        "checksum_block": BLOCK,
        "shards": [
            {
                "path": "part.bin",
                "bytes": tokens.nbytes,
                "elements": tokens.size,
                "offset": len(header),
                "checksum": f"{xxhash.xxh3_64_intdigest(data):016x}",
                "block_checksums": encode_blocks(block_digests(data, BLOCK)),
            }
        ],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    settings: dict[str, Any] = dict(batch_size=BATCH, seq_len=SEQ_LEN, shuffle=False, prefetch=2)
    for verify in ("size", "block", "full"):
        with ab.Loader(str(root), **settings, verify=verify) as loader:
            batches, error = take(loader)
        assert error is None and len(batches) == len(loader)
        assert_exact(tokens, batches, False)
    assert verify_dataset(str(root)).clean
    flip(root / "part.bin", 3)  # in the header, which no window reads
    with ab.Loader(str(root), **settings, verify="off") as loader:
        assert take(loader)[1] is None
    with ab.Loader(str(root), **settings, verify="block") as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError) and "part.bin block 0 bytes [0, 1024)" in str(error)
    assert batches == []
    assert verify_dataset(str(root)).bad[0].bad_blocks == [0]


def test_block_level_reads_a_formats_other_files_unchecked(tmp_path: Path) -> None:
    """Metadata streams read index and metadata files the manifest does not describe: with
    verify="block" the token shards' blocks are checked and those files read as they are."""
    from test_metadata import RECORD, check_batch, make_spans

    spans = make_spans(3, 300)
    root = str(tmp_path / "meta")
    shard_elements = 700
    dataset = ab.write_metadata_stream(root, spans, shard_size=shard_elements * RECORD)

    def add_checksums(raw: dict[str, Any]) -> None:
        raw.update(checksum="xxh3_64", checksum_block=512)
        for entry, url in zip(raw["shards"], dataset.shard_urls, strict=True):
            data = Path(url).read_bytes()
            entry["checksum"] = f"{xxhash.xxh3_64_intdigest(data):016x}"
            entry["block_checksums"] = encode_blocks(block_digests(data, 512))

    edit_manifest(root, add_checksums)
    settings: dict[str, Any] = dict(batch_size=5, seq_len=40, next_token=True, verify="block")
    with ab.Loader(root, **settings) as loader:
        batches, error = take(loader)
    assert error is None and len(batches) == len(loader) > 0
    for batch in batches:
        check_batch(batch, spans, shard_elements, 40)
    flip(dataset.shard_urls[1], 600)
    with ab.Loader(root, **settings) as loader:
        batches, error = take(loader)
    assert isinstance(error, ChecksumError) and "shard-00001.bin block 1 " in str(error)
    for batch in batches:
        check_batch(batch, spans, shard_elements, 40)
