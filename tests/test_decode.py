"""``decode=``, ``sample_transform=`` and ``on_error=``: real JPEG and PNG bytes made by Pillow,
in WebDataset shards written by the webdataset library (and a Parquet binary column),
decoded on the loader's decode pool and compared with Pillow's own decode of the same bytes.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import asyncbatch_threads

import asyncbatch as ab
from asyncbatch._decode import OrderedPool
from asyncbatch._errors import ConfigError, DecodeError, FormatError, TransformError

wds = pytest.importorskip("webdataset")
Image = pytest.importorskip("PIL.Image")

SAMPLES = 30
PER_SHARD = 12  # 3 shards: 12, 12, 6


def image_bytes(width: int, height: int, seed: int, kind: str = "JPEG", mode: str = "RGB") -> bytes:
    """A real image file made by Pillow from smooth gradients and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    image.save(out, kind)
    return out.getvalue()


def pil_chw(data: bytes) -> torch.Tensor:
    """What ``decode="image"`` must give: Pillow's RGB decode, channels first."""
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


def make_samples(count: int = SAMPLES, *, sizes: bool = False) -> list[dict[str, Any]]:
    """Samples with a JPEG, a grayscale PNG named ``seg.png``, a label and JSON; ``sizes``:
    JPEGs of three sizes, else one."""
    samples = []
    for i in range(count):
        width, height = (12 + 4 * (i % 3), 10) if sizes else (12, 10)
        samples.append(
            {
                "__key__": f"s{i:05d}",
                "jpg": image_bytes(width, height, i),
                "seg.png": image_bytes(6, 5, 1000 + i, "PNG", "L"),
                "cls": str(i % 7).encode(),
                "json": json.dumps({"i": i}).encode(),
            }
        )
    return samples


def write_shards(folder: Path, samples: Sequence[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n, start in enumerate(range(0, len(samples), PER_SHARD)):
        with wds.TarWriter(str(folder / f"shard-{n:06d}.tar")) as sink:
            for sample in samples[start : start + PER_SHARD]:
                sink.write(sample)
    return folder


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    return make_samples()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, samples: list[dict[str, Any]]) -> str:
    return str(write_shards(tmp_path_factory.mktemp("wds"), samples))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    samples = make_samples(sizes=True)
    return str(write_shards(tmp_path_factory.mktemp("mixed"), samples)), samples


def test_images_decode_to_pillows_pixels_stacked(
    shards: str, samples: list[dict[str, Any]]
) -> None:
    seen = []
    with ab.Loader(shards, batch_size=8, shuffle=True, drop_last=False, decode="image") as loader:
        for batch in loader:
            ids = batch.global_indexes.tolist()
            assert batch["jpg"].shape == (len(ids), 3, 10, 12)
            assert batch["jpg"].dtype == torch.uint8
            # a grayscale PNG comes as RGB, its gray repeated (torchvision's ImageReadMode.RGB)
            assert batch["seg.png"].shape == (len(ids), 3, 5, 6)
            for row, i in enumerate(ids):
                assert torch.equal(batch["jpg"][row], pil_chw(samples[i]["jpg"]))
                assert torch.equal(batch["seg.png"][row], pil_chw(samples[i]["seg.png"]))
            # fields not decoded are the format's own columns, rows matching
            assert batch["cls"].to_pylist() == [samples[i]["cls"] for i in ids]
            assert batch["__key__"].to_pylist() == [samples[i]["__key__"] for i in ids]
            seen += ids
    assert sorted(seen) == list(range(SAMPLES))


def test_images_of_several_sizes_come_as_lists(mixed: tuple[str, list[dict[str, Any]]]) -> None:
    shards, samples = mixed
    with ab.Loader(shards, batch_size=6, shuffle=False, decode={"jpg": "image"}) as loader:
        batches = list(loader)
    assert len(batches) == SAMPLES // 6
    for batch in batches:
        ids = batch.global_indexes.tolist()
        images = batch["jpg"]
        assert isinstance(images, list)
        assert len(images) == len(ids)
        for image, i in zip(images, ids, strict=True):
            assert torch.equal(image, pil_chw(samples[i]["jpg"]))
        assert not batch.schema["jpg"].tensor
        assert "seg.png" not in batch.schema or not batch.schema["seg.png"].tensor


def test_a_batch_of_one_size_is_stacked_though_others_are_not(
    mixed: tuple[str, list[dict[str, Any]]],
) -> None:
    shards, samples = mixed
    # Batches of one sample each: every one is one size, stacked.
    with ab.Loader(shards, batch_size=1, shuffle=False, decode={"jpg": "image"}) as loader:
        for batch in loader:
            (i,) = batch.global_indexes.tolist()
            assert batch["jpg"].shape == (1, *pil_chw(samples[i]["jpg"]).shape)


def test_callables_decode_labels_json_and_text(shards: str, samples: list[dict[str, Any]]) -> None:
    decode = {"jpg": "image", "cls": int, "json": json.loads, "__key__": str}
    with ab.Loader(shards, batch_size=5, shuffle=True, decode=decode) as loader:
        for batch in loader:
            ids = batch.global_indexes.tolist()
            # int on bytes as webdataset users expect: b"3" is 3
            assert batch["cls"].dtype == torch.int64
            assert batch["cls"].tolist() == [i % 7 for i in ids]
            assert batch["json"] == [{"i": i} for i in ids]
            assert batch["__key__"] == [f"s{i:05d}" for i in ids]


def test_a_key_matches_fields_by_last_extension(shards: str, samples: list[dict[str, Any]]) -> None:
    with ab.Loader(shards, batch_size=4, shuffle=False, decode={"png": "image"}) as loader:
        batch = next(iter(loader))
    assert batch["seg.png"].shape == (4, 3, 5, 6)
    assert not isinstance(batch["jpg"], torch.Tensor)  # not asked for: the bytes as read


def test_sample_transform_runs_on_the_pool_and_transform_after_it(shards: str) -> None:
    threads: set[str] = set()
    batch_threads: set[str] = set()

    def crop(sample: dict[str, Any]) -> dict[str, Any]:
        threads.add(threading.current_thread().name)
        return {"image": sample["jpg"][:, :4, :4], "label": sample["cls"]}

    def per_batch(batch: ab.Batch) -> ab.Batch:
        batch_threads.add(threading.current_thread().name)
        assert batch["image"].shape[1:] == (3, 4, 4)
        return batch

    options: dict[str, Any] = dict(
        decode={"jpg": "image", "cls": int}, sample_transform=crop, transform=per_batch
    )
    with ab.Loader(shards, batch_size=8, shuffle=True, decode_threads=2, **options) as loader:
        for batch in loader:
            assert batch["image"].shape == (len(batch.global_indexes), 3, 4, 4)
            assert set(batch) >= {"image", "label", "__key__"}
            assert "jpg" not in batch  # the transform's fields replace the decoded ones
    assert threads
    assert all(name.startswith("asyncbatch-samples") for name in threads)
    assert threading.current_thread().name not in threads
    assert batch_threads == {"asyncbatch-transform_0"}


def test_an_error_in_sample_transform_names_the_sample(shards: str) -> None:
    def broken(sample: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("no crop")

    with (
        ab.Loader(shards, batch_size=4, decode="image", sample_transform=broken) as loader,
        pytest.raises(TransformError, match="no crop") as caught,
    ):
        next(iter(loader))
    assert "sample_transform failed on sample 's0" in str(caught.value)


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]], set[int]]:
    samples = make_samples()
    bad = {3, 17, 18}
    for i in bad:
        samples[i]["jpg"] = samples[i]["jpg"][:40] + b"\0" * 20  # a JPEG cut short
    return str(write_shards(tmp_path_factory.mktemp("corrupt"), samples)), samples, bad


def test_a_corrupt_image_names_shard_key_and_field(
    corrupt: tuple[str, list[dict[str, Any]], set[int]],
) -> None:
    shards, _, _ = corrupt
    with (
        ab.Loader(shards, batch_size=4, shuffle=False, decode="image") as loader,
        pytest.raises(DecodeError) as caught,
    ):
        list(loader)
    error = caught.value
    assert isinstance(error, FormatError)
    assert error.url.endswith("shard-000000.tar")
    assert error.key == "s00003"
    assert error.field == "jpg"
    assert "shard-000000.tar" in str(error) and "s00003" in str(error) and "'jpg'" in str(error)
    assert error.__cause__ is not None


def test_skip_leaves_corrupt_samples_out_and_counts_them(
    corrupt: tuple[str, list[dict[str, Any]], set[int]],
) -> None:
    shards, samples, bad = corrupt
    with ab.Loader(shards, batch_size=4, shuffle=False, decode="image", on_error="skip") as loader:
        batches = list(loader)
        assert loader.statistics().skipped_samples == len(bad)
    assert [b.extra["batch"] for b in batches] == list(range(SAMPLES // 4))
    ids = [i for b in batches for i in b.global_indexes.tolist()]
    assert ids == [i for i in range(SAMPLES // 4 * 4) if i not in bad]
    for batch in batches:
        rows = batch.global_indexes.tolist()
        assert len(batch["jpg"]) == len(rows) == len(batch["__key__"])
        assert batch["__key__"].to_pylist() == [f"s{i:05d}" for i in rows]
        for row, i in enumerate(rows):
            assert torch.equal(batch["jpg"][row], pil_chw(samples[i]["jpg"]))
    # Batch 4 (samples 16-19) lost two samples; one batch of four would be 4.
    assert batches[4].global_indexes.tolist() == [16, 19]


@pytest.mark.parametrize("transform", [False, True])
def test_a_decode_error_comes_after_the_good_batches_before_it(
    corrupt: tuple[str, list[dict[str, Any]], set[int]], tmp_path: Path, transform: bool
) -> None:
    """Batches 0-3 and 4 are read as one group; batch 4 holds the corrupt sample 17: 0-3
    arrive, then the error, and the state then resumes at batch 4, losing nothing."""
    _, samples, _ = corrupt
    repaired = [dict(sample) for sample in samples]
    repaired[3]["jpg"] = image_bytes(12, 10, 3)  # only 17 and 18 stay corrupt
    url = str(write_shards(tmp_path, repaired))
    args: dict[str, Any] = dict(batch_size=4, shuffle=False, prefetch=8, decode="image")
    if transform:
        args["transform"] = lambda batch: batch
    got: list[list[int]] = []
    with ab.Loader(url, **args) as loader:
        with pytest.raises(DecodeError) as caught:
            for batch in loader:
                got.append(batch.global_indexes.tolist())
        state = loader.state_dict()
    assert caught.value.key == "s00017"
    assert got == [list(range(4 * b, 4 * b + 4)) for b in range(4)]
    with ab.Loader(url, **args) as loader:
        loader.load_state_dict(state)
        with pytest.raises(DecodeError) as again:
            next(iter(loader))
    assert again.value.key == "s00017"


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("stop", [1, 4])
def test_resume_with_decode_is_exact(
    corrupt: tuple[str, list[dict[str, Any]], set[int]], shards: str, on_error: str, stop: int
) -> None:
    url = corrupt[0] if on_error == "skip" else shards
    args: dict[str, Any] = dict(
        batch_size=3, shuffle=True, seed=4, prefetch=4, decode="image", on_error=on_error
    )
    with ab.Loader(url, **args) as loader:
        full = [(b.global_indexes.tolist(), b["jpg"]) for b in loader]
    with ab.Loader(url, **args) as loader:
        it = iter(loader)
        for _ in range(stop):
            next(it)
        state = loader.state_dict()
    with ab.Loader(url, **args) as loader:
        loader.load_state_dict(state)
        rest = [(b.global_indexes.tolist(), b["jpg"]) for b in loader]
    assert [ids for ids, _ in rest] == [ids for ids, _ in full[stop:]]
    for (_, got), (_, want) in zip(rest, full[stop:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_decoding_inside_dataloader_workers(mixed: tuple[str, list[dict[str, Any]]]) -> None:
    shards, samples = mixed
    args: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=2, drop_last=False)
    decode = {"jpg": "image", "cls": int}
    with ab.Loader(shards, decode=decode, **args) as loader:
        want = [b.global_indexes.tolist() for b in loader]
    source = ab.LoaderDataset(shards, decode=decode, decode_threads=1, **args)
    got, lists = [], 0
    for batch in source.dataloader(num_workers=2, timeout=60):
        ids = batch.global_indexes.tolist()
        got.append(ids)
        lists += isinstance(batch["jpg"], list)  # several sizes: a list crossed the process
        for image, i in zip(batch["jpg"], ids, strict=True):
            assert torch.equal(image, pil_chw(samples[i]["jpg"]))
        assert batch["cls"].tolist() == [i % 7 for i in ids]
    assert got == want
    assert lists


def test_async_loader_decodes_off_its_loop(shards: str, samples: list[dict[str, Any]]) -> None:
    import asyncio

    async def collect() -> list[ab.Batch]:
        async with ab.AsyncLoader(shards, batch_size=10, decode="image") as loader:
            return [batch async for batch in loader]

    batches = asyncio.run(collect())
    for batch in batches:
        for row, i in enumerate(batch.global_indexes.tolist()):
            assert torch.equal(batch["jpg"][row], pil_chw(samples[i]["jpg"]))
    assert not asyncbatch_threads()


def test_the_decode_pool_is_sized_and_closed_with_the_loader(shards: str) -> None:
    loader = ab.Loader(shards, batch_size=4, decode="image", decode_threads=2)
    try:
        for _ in loader:
            pass
        names = [t.name for t in asyncbatch_threads()]
        assert 1 <= sum(n.startswith("asyncbatch-samples") for n in names) <= 2
    finally:
        loader.close()
    assert not asyncbatch_threads()


def test_without_decode_no_pool_is_started(shards: str) -> None:
    with ab.Loader(shards, batch_size=4) as loader:
        next(iter(loader))
        assert not [t for t in asyncbatch_threads() if t.name.startswith("asyncbatch-samples")]


def test_parquet_binary_columns_decode_too(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [image_bytes(8, 6, i, "PNG") for i in range(10)]
    table = pa.table({"png": pa.array(images, pa.binary()), "label": list(range(10))})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=4)
    with ab.Loader(str(tmp_path / "data.parquet"), batch_size=5, decode="image") as loader:
        for batch in loader:
            ids = batch.global_indexes.tolist()
            assert torch.equal(batch["png"], torch.stack([pil_chw(images[i]) for i in ids]))
            assert batch["label"].tolist() == ids


def test_decode_image_without_pillow_says_how_to_install(
    shards: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ConfigError, match=r"pip install 'asyncbatch\[images\]'"):
        ab.Loader(shards, batch_size=4, decode="image")
    # callables need no Pillow
    with ab.Loader(shards, batch_size=4, decode={"cls": int}) as loader:
        assert next(iter(loader))["cls"].dtype == torch.int64


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"decode": "images"}, "expected 'image'"),
        ({"decode": {"jpg": "png"}}, "expected 'image' or a callable"),
        ({"decode": {"webp": "image"}}, "no field is named 'webp'"),
        ({"decode": {"__key__": int, "missing": int}}, "no field is named 'missing'"),
        ({"sample_transform": lambda s: s}, "sample_transform applies to decode="),
        ({"on_error": "skip"}, "on_error applies to decode="),
        ({"decode": "image", "on_error": "ignore"}, "on_error='ignore'"),
        ({"decode": "image", "decode_threads": 0}, "decode_threads must be a positive"),
        ({"decode": "image", "sample_transform": 3}, "sample_transform must be a callable"),
    ],
)
def test_bad_decode_options_are_config_errors(
    shards: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ab.Loader(shards, batch_size=4, **options)


@pytest.mark.parametrize("simplejpeg", [True, False])
def test_jpegs_of_every_mode_decode_as_pillow_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, simplejpeg: bool
) -> None:
    from asyncbatch import _decode

    if not simplejpeg:  # Pillow alone decodes every JPEG
        monkeypatch.setattr(_decode, "_simplejpeg", None)
    elif _decode.jpeg_module() is None:
        pytest.skip("simplejpeg is not installed")
    modes = ["RGB", "L", "CMYK"]  # CMYK: simplejpeg declines it, Pillow converts it
    samples = [
        {"__key__": f"k{i}", "jpg": image_bytes(9, 7, i, "JPEG", mode)}
        for i, mode in enumerate(modes)
    ]
    root = write_shards(tmp_path, samples)
    with ab.Loader(str(root), batch_size=3, shuffle=False, decode="image") as loader:
        (batch,) = list(loader)
    assert torch.equal(batch["jpg"], torch.stack([pil_chw(s["jpg"]) for s in samples]))


def test_collation_of_one_fields_values() -> None:
    from asyncbatch._decode import collate_values

    value, schema = collate_values([torch.zeros(2, 3), torch.ones(2, 3)])
    assert value.shape == (2, 2, 3) and schema.shape == (2, 3) and schema.tensor
    value, _ = collate_values([np.zeros(4, np.float32), np.ones(4, np.float32)])
    assert value.dtype == torch.float32 and value.shape == (2, 4)
    value, _ = collate_values([torch.zeros(2), torch.zeros(3)])
    assert isinstance(value, list) and [v.shape[0] for v in value] == [2, 3]
    value, schema = collate_values([1, 2, 3])
    assert value.dtype == torch.int64 and value.tolist() == [1, 2, 3]
    value, _ = collate_values([1, 2.5])
    assert value.dtype == torch.float64 and value.tolist() == [1.0, 2.5]
    value, schema = collate_values([True, False])  # bools are not counted as numbers
    assert value == [True, False] and not schema.tensor
    value, _ = collate_values([{"a": 1}, "x"])
    assert value == [{"a": 1}, "x"]


def test_a_corrupt_image_in_parquet_names_its_file_and_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for n in range(2):
        images = [image_bytes(8, 6, i, "PNG") for i in range(5)]
        if n == 1:
            images[2] = images[2][:30]  # row 7 of the dataset: a PNG cut short
        table = pa.table({"png": pa.array(images, pa.binary())})
        pq.write_table(table, tmp_path / f"part-{n}.parquet")
    with (
        ab.Loader(str(tmp_path), batch_size=10, shuffle=False, decode="image") as loader,
        pytest.raises(DecodeError) as caught,
    ):
        next(iter(loader))
    assert caught.value.url.endswith("part-1.parquet")
    assert caught.value.key == 7
    assert "#7 (global index)" in str(caught.value)


def test_the_decode_pool_runs_the_earliest_batchs_work_first() -> None:
    """A group's collation must not wait behind a later group's decoding (a FIFO pool ran
    them in submission order, delivering batches in pairs with the pool idle between)."""
    pool = OrderedPool(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        blocker = pool.submit_ranked((0, 0), gate.wait, 10)
        later = [pool.submit_ranked((0, 8), ran.append, f"decode 8.{k}") for k in range(2)]
        first = pool.submit_ranked((0, 4), ran.append, "collate 4")
        unranked = pool.submit(ran.append, "unranked")
        next_epoch = pool.submit_ranked((1, 0), ran.append, "epoch 1")
        gate.set()
        for future in [blocker, *later, first, unranked, next_epoch]:
            future.result(timeout=10)
        assert ran == ["collate 4", "decode 8.0", "decode 8.1", "epoch 1", "unranked"]
    finally:
        pool.shutdown()


def test_the_decode_pool_hands_errors_on_and_cancels_waiting_work() -> None:
    pool = OrderedPool(2)
    gate = threading.Event()
    try:
        failed = pool.submit_ranked((0,), int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failed.result(timeout=10)
        busy = [pool.submit_ranked((0,), gate.wait, 10) for _ in range(2)]
        waiting = pool.submit_ranked((1,), lambda: "ran")
        assert waiting.cancel()
        gate.set()
        assert [f.result(timeout=10) for f in busy] == [True, True]
        assert waiting.cancelled()
        assert pool.submit_ranked((2,), lambda: "ran").result(timeout=10) == "ran"
    finally:
        pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncbatch-samples")]
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit_ranked((3,), int, "1")


def test_default_prefetch_holds_decoded_batches_within_its_bytes(tmp_path: Path) -> None:
    """Flat 1024 x 1024 JPEGs of a few KB decode to 3 MiB each: the files' size alone would
    read 128 batches ahead (600 MiB decoded); the default bound is 64 MiB of decoded batches."""
    flat = Image.new("RGB", (1024, 1024), (40, 90, 160))
    out = io.BytesIO()
    flat.save(out, "JPEG")
    jpeg = out.getvalue()
    assert len(jpeg) < 64 * 1024
    samples = [{"__key__": f"f{i:04d}", "jpg": jpeg} for i in range(120)]
    folder = tmp_path / "flat"
    folder.mkdir()
    with wds.TarWriter(str(folder / "shard-000000.tar")) as sink:
        for sample in samples:
            sink.write(sample)
    batch_bytes = 4 * 3 * 1024 * 1024
    with ab.Loader(str(folder), batch_size=4, decode="image", decode_threads=1) as loader:
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
            time.sleep(0.3)  # a slow consumer: the engine reads ahead as far as it may
        seen = loader.statistics()
        assert seen.capacity == 2**26 // batch_bytes  # 5 batches of 12 MiB
        assert seen.peak_bytes <= 2**26 + 2 * batch_bytes  # the bound, and a group being read
        assert sum(1 for _ in iterator) == 30 - 3
    assert loader.prefetch == 5  # kept for the next epochs
    with ab.Loader(str(folder), batch_size=4, decode="image", prefetch=8) as loader:
        next(iter(loader))
        assert loader.statistics().capacity == 8  # an explicit prefetch counts batches


def test_the_next_groups_are_read_while_the_first_one_decodes(tmp_path: Path) -> None:
    """With ``decode=``, the first group's batch is read alone, and the groups after it are
    read while its samples decode: waiting for its decoding left the pool idle for the
    next group's reads (the second batch of an S3 run took twice the others)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    with wds.TarWriter(str(folder / "shard-000000.tar")) as sink:
        for sample in make_samples(40):
            sink.write(sample)
    gate = threading.Event()

    def held(sample: dict[str, Any]) -> dict[str, Any]:
        gate.wait(20)  # the first batch's decoding, held until the test has looked
        return sample

    with ab.Loader(
        str(folder), batch_size=4, decode="image", sample_transform=held, decode_threads=1
    ) as loader:
        iterator = iter(loader)
        first = threading.Thread(target=next, args=(iterator,))
        first.start()
        deadline = time.monotonic() + 10
        while loader.statistics().requests <= 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        read_while_decoding = loader.statistics().requests
        gate.set()
        first.join(20)
        assert sum(1 for _ in iterator) == 9
    assert read_while_decoding > 4  # the first batch's 4 reads (a GET each), and more
