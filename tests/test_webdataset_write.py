"""``write_webdataset``: tar shards and their sidecars written through the stores, read back
sample for sample by the webdataset library itself and by asyncbatch (from the sidecars,
no scan); the same samples make the same bytes; shards cut at ``shard_size`` and
``max_count``; moto's S3 server; samples webdataset would not read back as given.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BUCKET, s3_options

import asyncbatch as ab
from asyncbatch._errors import ConfigError
from asyncbatch.formats import _webdataset_index
from asyncbatch.formats._webdataset_index import ShardIndex, sidecar_url

wds = pytest.importorskip("webdataset")

_names = itertools.count()
SAMPLES = 40


def make_samples(count: int = SAMPLES) -> list[dict[str, Any]]:
    """Every kind of value webdataset's default encoders take, and a metadata entry that is
    not written."""
    rng = np.random.default_rng(0)
    return [
        {
            "__key__": f"train/{i:05d}",
            "__url__": "ignored: metadata",
            "bin": rng.bytes(int(rng.integers(0, 900))),
            "cls": i % 7,
            "json": {"i": i, "caption": f"photo {i}"},
            "txt": f"légende {i}",
            "seg.png": bytearray(rng.bytes(20)),
            "npy": np.arange(i % 5, dtype=np.int16),
        }
        for i in range(count)
    ]


def reference(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """webdataset's own reading of the shards (``tar_file_expander`` + ``group_by_keys``,
    the files opened and closed here: its readers leave them to the garbage collector)."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    with contextlib.ExitStack() as stack:
        sources = [{"url": str(p), "stream": stack.enter_context(open(p, "rb"))} for p in paths]
        return list(group_by_keys(tar_file_expander(sources)))


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.tar"))


def test_webdataset_reads_what_we_write_as_its_own_writer_encodes_it(tmp_path: Path) -> None:
    samples = make_samples()
    written = ab.write_webdataset(str(tmp_path / "ours"), samples, shard_size=16 << 10)
    paths = shards(tmp_path / "ours")
    assert len(paths) == len(written.shard_urls) > 2
    assert written.shard_urls == [str(p) for p in paths]
    assert [p.name for p in paths[:2]] == ["shard-000000.tar", "shard-000001.tar"]
    # webdataset's TarWriter writes the same samples: the same fields, the same bytes.
    with wds.TarWriter(str(tmp_path / "theirs.tar")) as sink:
        for sample in samples:
            sink.write({k: bytes(v) if k == "seg.png" else v for k, v in sample.items()})
    theirs = reference([tmp_path / "theirs.tar"])
    ours = reference(paths)
    assert len(ours) == SAMPLES
    for got, want, sample in zip(ours, theirs, samples, strict=True):
        assert got["__key__"] == want["__key__"] == sample["__key__"]
        assert got["__url__"] in {str(p) for p in paths}
        assert set(got) - {"__url__"} == set(want) - {"__url__"}
        for field in set(want) - {"__key__", "__url__"}:
            assert got[field] == want[field], field
        assert got["bin"] == sample["bin"] and got["cls"] == str(sample["cls"]).encode()
        assert json.loads(got["json"]) == sample["json"]
        assert got["txt"].decode() == sample["txt"]
        np.testing.assert_array_equal(np.load(io.BytesIO(got["npy"])), sample["npy"])
    # Plain ustar members: no pax header, fixed owner, mode and time.
    for path in paths:
        with tarfile.open(path) as tar:
            members = tar.getmembers()
        assert {(m.mode, m.mtime, m.uid, m.gid, m.uname, m.type) for m in members} == {
            (0o444, 0, 0, 0, "", tarfile.REGTYPE)
        }
        assert not any(m.pax_headers for m in members)


def test_asyncbatch_reads_it_back_from_the_sidecars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = make_samples()
    folder = str(tmp_path / "ds")
    written = ab.write_webdataset(folder, samples, max_count=9)
    paths = shards(tmp_path / "ds")
    assert [
        ShardIndex.parse(Path(sidecar_url(str(p))).read_bytes(), "x").num_samples for p in paths
    ] == [9, 9, 9, 9, 4]
    # The sidecars made while writing are those a scan of the shards makes.
    made = [Path(sidecar_url(str(p))).read_bytes() for p in paths]
    ab.index_webdataset(folder)
    assert [Path(sidecar_url(str(p))).read_bytes() for p in paths] == made

    def no_scan(*args: Any) -> None:
        raise AssertionError("a shard was scanned")

    monkeypatch.setattr(_webdataset_index, "scan_shard", no_scan)
    dataset = ab.open_dataset(folder)
    assert dataset.manifest.metadata["sidecars"] == len(paths)
    assert dataset.fingerprint() == written.fingerprint()
    assert dataset.shard_urls == written.shard_urls
    expected = {s["__key__"]: s for s in reference(paths)}
    with ab.Loader(dataset, batch_size=6, shuffle=True, seed=3, drop_last=False) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            keys = []
            for batch in loader:
                assert list(batch) == [
                    "__key__",
                    "__url__",
                    "bin",
                    "cls",
                    "json",
                    "npy",
                    "seg.png",
                    "txt",
                ]
                for k, key in enumerate(batch["__key__"].to_pylist()):
                    for field in ("bin", "cls", "json", "npy", "seg.png", "txt"):
                        assert batch[field][k] == expected[key][field]
                    keys.append(key)
            assert sorted(keys) == sorted(expected)  # every sample once per epoch


def test_samples_with_other_fields(tmp_path: Path) -> None:
    samples = [{"__key__": f"k{i}", "cls": i, **({"txt": "t"} if i % 2 else {})} for i in range(6)]
    written = ab.write_webdataset(str(tmp_path / "mixed"), samples)
    got = reference(shards(tmp_path / "mixed"))
    assert [("txt" in s) for s in got] == [False, True] * 3  # webdataset sees every field
    assert written.manifest.metadata["columns"] == ["cls"]  # a batch: those all samples hold
    with ab.Loader(written, batch_size=6, shuffle=False) as loader:
        (batch,) = list(loader)
    assert list(batch) == ["__key__", "__url__", "cls"]


def test_the_same_samples_make_the_same_bytes(tmp_path: Path) -> None:
    samples = make_samples(12)
    for name in ("one", "two"):
        ab.write_webdataset(str(tmp_path / name), samples, shard_size=8 << 10, pattern="x-%03d.tar")
    one = sorted((tmp_path / "one").iterdir())
    assert [p.name for p in one][:2] == ["x-000.tar", "x-000.tar.abidx"]
    assert [p.name for p in one] == [p.name for p in sorted((tmp_path / "two").iterdir())]
    for path in one:
        assert path.read_bytes() == (tmp_path / "two" / path.name).read_bytes()


def test_long_keys_use_the_ustar_prefix_then_pax(tmp_path: Path) -> None:
    samples = [
        {"__key__": "d" * 120 + "/k1", "cls": 1},  # 126 bytes: split into prefix and name
        {"__key__": "e" * 300, "cls": 2},  # no '/' to split at: a pax path
        {"__key__": "f" * 60 + "/clé", "cls": 3},  # UTF-8, short enough for ustar
    ]
    ab.write_webdataset(str(tmp_path / "long"), samples)
    (path,) = shards(tmp_path / "long")
    with tarfile.open(path) as tar:
        pax = [bool(m.pax_headers) for m in tar.getmembers()]
    assert pax == [False, True, False]
    assert [(s["__key__"], s["cls"]) for s in reference([path])] == [
        (s["__key__"], str(s["cls"]).encode()) for s in samples
    ]
    with ab.Loader(str(tmp_path / "long"), batch_size=3, shuffle=False) as loader:
        (batch,) = list(loader)
    assert batch["__key__"].to_pylist() == [s["__key__"] for s in samples]


def test_shards_are_cut_at_shard_size_and_max_count(tmp_path: Path) -> None:
    # One 1000-byte member: a 512-byte header and 1024 bytes of padded data per sample; a
    # shard ends with two 512-byte zero blocks.
    samples = [{"__key__": f"k{i}", "bin": bytes([i]) * 1000} for i in range(10)]

    def counts(name: str, **args: Any) -> list[int]:
        ab.write_webdataset(str(tmp_path / name), samples, **args)
        paths = shards(tmp_path / name)
        assert [s["__key__"] for s in reference(paths)] == [s["__key__"] for s in samples]
        sizes = [p.stat().st_size for p in paths]
        per = [(size - 1024) // 1536 for size in sizes]
        assert sizes == [1024 + 1536 * n for n in per]
        return per

    assert counts("exact", shard_size=1024 + 3 * 1536) == [3, 3, 3, 1]
    assert counts("under", shard_size=1024 + 3 * 1536 - 1) == [2, 2, 2, 2, 2]
    assert counts("count", max_count=4) == [4, 4, 2]
    assert counts("both", shard_size=1024 + 3 * 1536, max_count=2) == [2, 2, 2, 2, 2]
    # A sample larger than a shard makes a shard of its own.
    assert counts("small", shard_size=100) == [1] * 10


def test_write_to_s3_and_read_back(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    import s3fs

    options = s3_options(request.getfixturevalue("s3_endpoint"))
    url = f"s3://{BUCKET}/wds-write-{next(_names)}"
    samples = make_samples(25)
    written = ab.write_webdataset(url, samples, shard_size=8 << 10, storage_options=options)
    local = ab.write_webdataset(str(tmp_path / "local"), samples, shard_size=8 << 10)
    fs = s3fs.S3FileSystem(**options)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/{url.rsplit('/', 1)[1]}"))
    assert names == sorted(p.name for p in (tmp_path / "local").iterdir())
    for name in names:  # byte for byte what the local write made
        assert fs.cat_file(f"{url}/{name}") == (tmp_path / "local" / name).read_bytes()
    dataset = ab.open_dataset(url, options)
    assert dataset.manifest.metadata["sidecars"] == len(local.shard_urls)
    assert dataset.fingerprint() == written.fingerprint()  # the listing's ETags included
    assert written.versions and None not in written.versions
    expected = {s["__key__"]: s for s in reference(shards(tmp_path / "local"))}
    with ab.Loader(written, batch_size=8, shuffle=True, drop_last=False) as loader:
        keys = []
        for batch in loader:
            for k, key in enumerate(batch["__key__"].to_pylist()):
                assert batch["bin"][k] == expected[key]["bin"]
                assert batch["json"][k] == expected[key]["json"]
                keys.append(key)
    assert sorted(keys) == sorted(expected)


BAD = [
    ({"cls": 1}, r"sample 2: no '__key__'"),
    ({"__key__": 7, "cls": 1}, r"sample 2 \(key 7\): __key__ must be a non-empty str"),
    ({"__key__": "k1", "cls": 1}, r"sample 2 \(key 'k1'\): the same key as the sample before"),
    ({"__key__": "a.b", "cls": 1}, r"sample 2 \(key 'a.b'\), field 'cls': webdataset would read"),
    ({"__key__": "k", "x/y": b""}, r"sample 2 \(key 'k'\), field 'x/y'"),
    ({"__key__": "k", "jpg": np.zeros(3)}, r"sample 2 \(key 'k'\), field 'jpg': a ndarray"),
    ({"__key__": "k", "cls": "1", "CLS": "2"}, r"sample 2 \(key 'k'\): fields 'CLS' and 'cls'"),
    ({"__key__": "k", "json": {1, 2}}, r"sample 2 \(key 'k'\), field 'json': cannot encode"),
    ({"__key__": "k", "cls": True}, r"sample 2 \(key 'k'\), field 'cls': a bool"),
    ({"__key__": "k"}, r"sample 2 \(key 'k'\): no fields"),
    (["k", b""], r"sample 2: expected a dict"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_a_sample_webdataset_would_misread_is_refused(
    tmp_path: Path, bad: Any, message: str
) -> None:
    samples = [{"__key__": "k0", "cls": 0}, {"__key__": "k1", "cls": 1}, bad]
    with pytest.raises(ConfigError, match=message):
        ab.write_webdataset(str(tmp_path / "bad"), samples, max_count=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"shard_size": 0}, "shard_size must be a positive int"),
        ({"max_count": 0}, "max_count must be a positive int"),
        ({"pattern": "shard.tar"}, "pattern='shard.tar'"),
        ({"pattern": "shard-%06d.tar.gz"}, "ending in .tar"),
    ],
)
def test_bad_arguments(tmp_path: Path, args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ab.write_webdataset(str(tmp_path / "x"), make_samples(2), **args)
    with pytest.raises(ConfigError, match="no samples given"):
        ab.write_webdataset(str(tmp_path / "y"), [])


def test_errors_of_the_store_and_of_the_samples_come_through(tmp_path: Path) -> None:
    def samples(fail: bool) -> Iterator[dict[str, Any]]:
        for i in range(10):
            if fail and i == 5:
                raise RuntimeError("the samples' own error")
            yield {"__key__": f"k{i}", "bin": b"x" * 100}

    (tmp_path / "file").touch()  # a file where the folder should be: every write fails
    with pytest.raises(ab.StoreError, match="shard-000000.tar"):
        ab.write_webdataset(str(tmp_path / "file" / "ds"), samples(False), max_count=2)
    with pytest.raises(RuntimeError, match="the samples' own error"):
        ab.write_webdataset(str(tmp_path / "x"), samples(True), max_count=2)
    # The async form, several shards written at once.
    folder = str(tmp_path / "async")
    dataset = asyncio.run(
        ab.write_webdataset_async(folder, samples(False), max_count=3, max_concurrency=2)
    )
    assert [s.elements for s in dataset.manifest.shards] == [3, 3, 3, 1]
    assert [s["__key__"] for s in reference(shards(tmp_path / "async"))] == [
        f"k{i}" for i in range(10)
    ]
