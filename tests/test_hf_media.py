"""Hugging Face ``Image`` and ``Audio`` columns (a struct of ``bytes`` and ``path``) and other
struct columns, in Parquet and in ``save_to_disk`` Arrow folders written by the real
``datasets`` library: a media struct reads as its bytes under the column's name, every row
once per epoch under every shuffle; any other struct reads as its leaves, dotted.

Every expectation comes from what the test wrote: PNGs made by Pillow, and the rows as
pyarrow reads them back.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BUCKET, s3_options

import asyncbatch as ab
from asyncbatch._batch import Strings
from asyncbatch._errors import ConfigError, FormatError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

ROWS = 45


def png(i: int) -> bytes:
    """A PNG of ``i``'s own size and colour."""
    out = io.BytesIO()
    Image.new("RGB", (1 + i % 5, 1 + i % 3), (i % 256, 7, 9)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The ``datasets`` module, offline, its cache in a folder of its own."""
    home = tmp_path_factory.mktemp("hf-home")
    settings = {
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        datasets = pytest.importorskip("datasets")
        datasets.disable_progress_bars()
        yield datasets
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def media(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A folder holding one ``Image`` + ``Audio`` dataset three ways: ``to_parquet``
    (``hub/``), a Parquet file with a page index and small row groups (``paged/``), and
    ``save_to_disk`` in 2 shards (``saved/``); and its rows as pyarrow reads them."""
    datasets = hf
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "image": datasets.Image(),
            "audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
        }
    )
    data = datasets.Dataset.from_dict(
        {
            "id": list(range(ROWS)),
            "image": [{"bytes": png(i), "path": None} for i in range(ROWS)],
            # Audio without torchcodec: the struct cast to Audio(decode=False), never encoded.
            "audio": [{"bytes": b"RIFF" + bytes([i]) * i, "path": f"{i}.wav"} for i in range(ROWS)],
        },
        features=features,
    ).cast_column("audio", datasets.Audio(decode=False))
    assert str(data.data.schema.field("image").type) == "struct<bytes: binary, path: string>"
    assert b'"_type": "Image"' in data.data.schema.metadata[b"huggingface"]
    assert b'"_type": "Audio"' in data.data.schema.metadata[b"huggingface"]
    folder = tmp_path_factory.mktemp("media")
    (folder / "hub").mkdir()
    data.to_parquet(str(folder / "hub" / "train-00000.parquet"))
    (folder / "paged").mkdir()
    pq.write_table(
        data.data.table,
        folder / "paged" / "p.parquet",
        row_group_size=20,
        data_page_size=256,
        write_page_index=True,
    )
    data.save_to_disk(str(folder / "saved"), num_shards=2)
    return folder, data.data.table.to_pylist()


def check(batch: ab.Batch, rows: list[dict[str, Any]]) -> None:
    """Each field equals the row's own: the bytes of its image and audio."""
    assert list(batch.schema) == ["id", "image", "audio"]
    assert batch.schema["image"].dtype == "bytes"
    ids = batch.global_indexes.tolist()
    assert batch["id"].tolist() == ids
    assert isinstance(batch["image"], Strings)
    assert batch["image"].to_pylist() == [rows[i]["image"]["bytes"] for i in ids]
    assert batch["audio"].to_pylist() == [rows[i]["audio"]["bytes"] for i in ids]


@pytest.mark.parametrize("shuffle", [False, "block", True])
@pytest.mark.parametrize("kind", ["hub", "paged", "saved"])
def test_image_and_audio_read_as_bytes(
    media: tuple[Path, list[dict[str, Any]]], kind: str, shuffle: Any
) -> None:
    folder, rows = media
    dataset = ab.open_dataset(str(folder / kind))
    assert dataset.manifest.format == ("arrow" if kind == "saved" else "parquet")
    extra: dict[str, Any] = {"window": 2} if shuffle == "block" else {}
    with ab.Loader(dataset, batch_size=8, shuffle=shuffle, drop_last=False, **extra) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = []
            for batch in loader:
                check(batch, rows)
                seen += batch.global_indexes.tolist()
            assert sorted(seen) == list(range(ROWS))
    # The bytes are the image: Pillow opens them at the size it was made.
    with ab.Loader(dataset, batch_size=4, shuffle=False) as loader:
        batch = next(iter(loader))
    assert Image.open(io.BytesIO(batch["image"][3])).size == (4, 1)


def test_path_only_when_asked(media: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, rows = media
    for kind in ("hub", "saved"):
        options = {"columns": ["audio.path", "image", "image.path"]}
        dataset = ab.open_dataset(str(folder / kind), options=options)
        with ab.Loader(dataset, batch_size=16, shuffle=True, drop_last=False) as loader:
            for batch in loader:
                assert list(batch.schema) == ["audio.path", "image", "image.path"]
                ids = batch.global_indexes.tolist()
                assert batch["audio.path"].to_pylist() == [f"{i}.wav" for i in ids]
                # No path (an embedded image's is null) reads empty, whatever nulls=.
                assert batch["image.path"].to_pylist() == [
                    rows[i]["image"]["path"] or "" for i in ids
                ]
                assert batch["image"].to_pylist() == [rows[i]["image"]["bytes"] for i in ids]


def test_only_the_bytes_are_fetched(media: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = media
    # One batch of every row: each row group read once, whole.
    args: dict[str, Any] = dict(batch_size=ROWS, shuffle=False, coalesce_gap=0)

    def fetched(kind: str, columns: list[str]) -> int:
        dataset = ab.open_dataset(str(folder / kind), options={"columns": columns})
        with ab.Loader(dataset, **args) as loader:
            list(loader)
            return int(loader.statistics().bytes_fetched)

    # Parquet: the bytes' column chunks, exactly; not the path's.
    meta = pq.read_metadata(folder / "paged" / "p.parquet")
    leaves = [meta.schema.column(c).path for c in range(meta.num_columns)]
    chunks = sum(
        meta.row_group(g).column(leaves.index("image.bytes")).total_compressed_size
        for g in range(meta.num_row_groups)
    )
    assert fetched("paged", ["image"]) == chunks
    # Arrow: the bytes' buffers come before the path's, which are not read.
    assert fetched("saved", ["image"]) < fetched("saved", ["image", "image.path"])


def test_s3_exact_shuffle(media: tuple[Path, list[dict[str, Any]]], s3_endpoint: str) -> None:
    import s3fs

    folder, rows = media
    options = s3_options(s3_endpoint)
    fs = s3fs.S3FileSystem(**options)
    root = f"s3://{BUCKET}/hf-media"
    fs.put(str(folder / "paged" / "p.parquet"), f"{root}/p.parquet")
    dataset = ab.open_dataset(root, options)
    with ab.Loader(dataset, batch_size=8, shuffle=True, drop_last=False) as loader:
        seen = []
        for batch in loader:
            check(batch, rows)
            seen += batch.global_indexes.tolist()
    assert sorted(seen) == list(range(ROWS))


@pytest.mark.parametrize("kind", ["hub", "saved"])
def test_resume_mid_epoch(media: tuple[Path, list[dict[str, Any]]], kind: str) -> None:
    folder, rows = media
    dataset = ab.open_dataset(str(folder / kind))
    args: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=11, prefetch=2)
    with ab.Loader(dataset, **args) as loader:
        full = [b.global_indexes.tolist() for b in loader]
    with ab.Loader(dataset, **args) as loader:
        it = iter(loader)
        head = [next(it).global_indexes.tolist() for _ in range(3)]
        state = loader.state_dict()
    with ab.Loader(dataset, **args) as loader:
        loader.load_state_dict(state)
        rest = []
        for batch in loader:
            check(batch, rows)
            rest.append(batch.global_indexes.tolist())
    assert head + rest == full


# ---------------------------------------------------------------------------------------------
# An image stored by path only


def test_an_image_stored_by_path_is_refused(hf: Any, tmp_path: Path) -> None:
    datasets = hf
    picture = tmp_path / "elsewhere.png"
    picture.write_bytes(png(3))
    images: list[Any] = [{"bytes": png(i), "path": None} for i in range(12)]
    images[7] = str(picture)  # datasets keeps a local file's path, its bytes not embedded
    data = datasets.Dataset.from_dict(
        {"image": images}, features=datasets.Features({"image": datasets.Image()})
    )
    (tmp_path / "hub").mkdir()
    data.to_parquet(str(tmp_path / "hub" / "a.parquet"))
    table = pq.read_table(tmp_path / "hub" / "a.parquet")
    assert table.column("image")[7].as_py() == {"bytes": None, "path": str(picture)}
    (tmp_path / "paged").mkdir()
    pq.write_table(table, tmp_path / "paged" / "a.parquet", row_group_size=4, write_page_index=True)
    (tmp_path / "ipc").mkdir()
    with pa.ipc.new_file(str(tmp_path / "ipc" / "a.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    for kind in ("hub", "paged", "ipc"):
        for shuffle in (False, True):
            # Whatever nulls=: filling would hand over an empty image for a real one.
            for nulls in ("error", "fill"):
                opened = ab.open_dataset(str(tmp_path / kind), options={"nulls": nulls})
                loader = ab.Loader(opened, batch_size=4, shuffle=shuffle)
                with loader, pytest.raises(FormatError) as caught:
                    list(loader)
                message = str(caught.value)
                assert f"{kind}/a.{'arrow' if kind == 'ipc' else 'parquet'}: row 7" in message
                assert f"column 'image' holds no bytes, only the path {str(picture)!r}" in message
        # As they are, on request: the plain bytes child and the path.
        options = {"columns": ["image.bytes", "image.path"], "nulls": "fill"}
        dataset = ab.open_dataset(str(tmp_path / kind), options=options)
        with ab.Loader(dataset, batch_size=12, shuffle=False) as loader:
            (batch,) = list(loader)
        assert batch["image.bytes"][7] == b""
        assert batch["image.path"][7] == str(picture)
        assert batch["image.bytes"][6] == png(6)


# ---------------------------------------------------------------------------------------------
# Other structs: their leaves, dotted


def struct_table(rows: int) -> Any:
    """``id``, and ``meta``: a score, a tag and a nested position, all functions of ``id``;
    ``meta`` null in every 5th row when ``nulls``."""
    ids = list(range(rows))
    meta = [
        {"score": i / 4, "tag": f"t{i}", "pos": {"x": i, "y": -i, "z": [i] * (i % 3)}} for i in ids
    ]
    kind = pa.struct(
        [
            ("score", pa.float64()),
            ("tag", pa.string()),
            ("pos", pa.struct([("x", pa.int32()), ("y", pa.int64()), ("z", pa.list_(pa.int16()))])),
        ]
    )
    return pa.table({"id": pa.array(ids, pa.int64()), "meta": pa.array(meta, kind)})


def write_struct(tmp_path: Path, table: Any, kind: str) -> str:
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "parquet":
        pq.write_table(table, folder / "a.parquet", row_group_size=7, write_page_index=True)
    else:
        with pa.ipc.new_stream(str(folder / "a.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=7)
    return str(folder)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_structs_read_as_their_leaves(tmp_path: Path, kind: str) -> None:
    root = write_struct(tmp_path, struct_table(30), kind)
    dataset = ab.open_dataset(root)
    names = ["id", "meta.score", "meta.tag", "meta.pos.x", "meta.pos.y", "meta.pos.z"]
    for shuffle in (False, "block", True):
        with ab.Loader(dataset, batch_size=8, shuffle=shuffle, drop_last=False) as loader:
            seen = []
            for batch in loader:
                assert list(batch.schema) == names
                ids = batch.global_indexes.tolist()
                assert batch["id"].tolist() == ids
                np.testing.assert_array_equal(batch["meta.score"].numpy(), np.array(ids) / 4)
                assert batch["meta.tag"].to_pylist() == [f"t{i}" for i in ids]
                assert batch["meta.pos.x"].dtype == torch.int32
                assert batch["meta.pos.x"].tolist() == ids
                assert batch["meta.pos.y"].tolist() == [-i for i in ids]
                assert [batch["meta.pos.z"][k].tolist() for k in range(len(ids))] == [
                    [i] * (i % 3) for i in ids
                ]
                seen += ids
            assert sorted(seen) == list(range(30))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_columns_name_a_struct_or_a_child(tmp_path: Path, kind: str) -> None:
    root = write_struct(tmp_path, struct_table(30), kind)
    for columns, names in (
        (["meta.pos.y", "id"], ["meta.pos.y", "id"]),
        (["meta.pos"], ["meta.pos.x", "meta.pos.y", "meta.pos.z"]),
        (["meta.tag", "meta.pos.x"], ["meta.tag", "meta.pos.x"]),
    ):
        dataset = ab.open_dataset(root, options={"columns": columns})
        with ab.Loader(dataset, batch_size=30, shuffle=True) as loader:
            (batch,) = list(loader)
        assert list(batch.schema) == names
        ids = batch.global_indexes.tolist()
        if "meta.pos.y" in names:
            assert batch["meta.pos.y"].tolist() == [-i for i in ids]
        if "meta.tag" in names:
            assert batch["meta.tag"].to_pylist() == [f"t{i}" for i in ids]
    with pytest.raises(ConfigError, match=r"'meta\.pos\.w' is neither.*'meta\.pos\.x'"):
        ab.open_dataset(root, options={"columns": ["meta.pos.w"]})
    with pytest.raises(ConfigError, match="twice"):
        ab.Loader(ab.open_dataset(root, options={"columns": ["meta", "meta.tag"]}), batch_size=2)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_null_struct_is_a_null_in_each_leaf(tmp_path: Path, kind: str) -> None:
    table = struct_table(20)
    meta = table.column("meta").combine_chunks()
    mask = pa.array([i % 5 == 2 for i in range(20)])
    nulled = pa.StructArray.from_arrays(meta.flatten(), fields=list(meta.type), mask=mask)
    root = write_struct(tmp_path, table.set_column(1, "meta", nulled), kind)
    loader = ab.Loader(ab.open_dataset(root), batch_size=4, shuffle=False)
    with loader, pytest.raises(FormatError, match=r"column 'meta\.score' holds nulls"):
        list(loader)
    filled = ab.open_dataset(root, options={"nulls": "fill"})
    with ab.Loader(filled, batch_size=20, shuffle=False) as loader:
        (batch,) = list(loader)
    expected = [0 if i % 5 == 2 else i for i in range(20)]
    assert batch["meta.pos.x"].tolist() == expected
    assert batch["meta.tag"].to_pylist() == ["" if i % 5 == 2 else f"t{i}" for i in range(20)]


def test_a_list_of_images_is_refused_by_name(tmp_path: Path) -> None:
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    frames = pa.array([[{"bytes": png(i), "path": None}] for i in range(4)], pa.list_(media))
    table = pa.table({"id": pa.array(range(4), pa.int64()), "frames": frames})
    pq.write_table(table, tmp_path / "a.parquet")
    dataset = ab.open_dataset(str(tmp_path))
    with pytest.raises(ConfigError, match=r"column 'frames' has Arrow type list<.*leave it out"):
        ab.Loader(dataset, batch_size=2)
    only = ab.open_dataset(str(tmp_path), options={"columns": ["id"]})
    with ab.Loader(only, batch_size=4, shuffle=False) as loader:
        assert [b["id"].tolist() for b in loader] == [[0, 1, 2, 3]]


def test_images_decode_with_the_loaders_decode_stage(
    media: tuple[Path, list[dict[str, Any]]],
) -> None:
    folder, _ = media
    dataset = ab.open_dataset(str(folder / "hub"), options={"columns": ["image"]})
    with ab.Loader(dataset, batch_size=8, shuffle=True, decode={"image": "image"}) as loader:
        batch = next(iter(loader))
    for i, pixels in zip(batch.global_indexes.tolist(), batch["image"], strict=True):
        expected = np.asarray(Image.open(io.BytesIO(png(i))).convert("RGB")).transpose(2, 0, 1)
        np.testing.assert_array_equal(pixels.numpy(), expected)


@pytest.mark.parametrize("kind", ["hub", "paged", "saved"])
def test_decode_image_takes_the_image_columns(
    media: tuple[Path, list[dict[str, Any]]], kind: str
) -> None:
    # The huggingface metadata says which media column is an Image: decode="image" decodes
    # it by that (its name has no image extension), and leaves the Audio column as bytes.
    folder, rows = media
    dataset = ab.open_dataset(str(folder / kind))
    with ab.Loader(dataset, batch_size=8, shuffle=False) as loader:
        plain = next(iter(loader))
    assert (plain.schema["image"].media, plain.schema["audio"].media) == ("image", "audio")
    with ab.Loader(dataset, batch_size=8, shuffle=True, decode="image") as loader:
        batch = next(iter(loader))
    ids = batch.global_indexes.tolist()
    assert batch["audio"].to_pylist() == [rows[i]["audio"]["bytes"] for i in ids]
    for i, pixels in zip(ids, batch["image"], strict=True):
        expected = np.asarray(Image.open(io.BytesIO(png(i))).convert("RGB")).transpose(2, 0, 1)
        np.testing.assert_array_equal(pixels.numpy(), expected)
