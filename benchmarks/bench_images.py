"""Images from S3: asyncbatch beside litData, MosaicML streaming and webdataset, every line
decoding, cropping and flipping the same JPEGs on the same cores.

**The corpus** (``--images``, 20,000 by default) is built once, offline, under
``~/.cache/asyncbatch/bench-images-<N>``: random crops of the photographs scikit-image's wheel
ships (``skimage.data``: astronaut, coffee, chelsea, rocket, hubble_deep_field,
immunohistochemistry, retina in colour; camera, coins, moon, grass, gravel, brick in grey,
tinted), rescaled to 300-500 px a side, with film grain (the photographs are only 300-1400 px,
and their upscaled crops alone come to ~40 KB), saved at JPEG quality 85-95 (~100 KB each);
labels drawn over 1,000 classes. Each system's own writer makes its copy there:

* webdataset's ``ShardWriter`` (``jpg`` + ``cls``, 64 MB shards): read by asyncbatch (with
  the sidecars ``ab.index_webdataset`` writes beside them, and without) and by webdataset;
* litData's ``optimize`` (``{"jpg": bytes, "cls": int}``, 64 MB chunks);
* MosaicML's ``MDSWriter`` (``jpg: bytes``, ``cls: int``, its default 64 MiB shards);
* Hugging Face ``datasets`` with an ``Image`` column, ``to_parquet`` (~64 MB files): read by
  asyncbatch's Parquet reader (the column's bytes).

**The servers**: s3rver (``--server s3rver``, the default, as ``bench_remote.py`` runs it:
node, objects in files) or moto's S3 server (``--server moto``, server mode as
``tests/servers.py`` starts it), with every copy uploaded, and in front of it
``delayproxy.py`` (+``--delay-ms`` 10 ms per request, counting the bytes it passes back).
moto is not the default: it reads a whole object into memory for every ranged GET (its
``FakeKey.value``), so one GET of 100 KB out of a 64 MB shard costs the server a 64 MB copy,
which caps any one-GET-per-sample reader at a few dozen images/s. Local lines read the cached
copies (page cache warm).

**Every line does the same work**: each JPEG decoded by ``asyncbatch._decode.decode_image``
(simplejpeg where installed, else Pillow), then ``random_resized_crop_flip`` below
(torchvision's ``RandomResizedCrop(224)`` parameters, Pillow's bilinear resize of the box, a
horizontal flip half the time), batches of 256 (``[256, 3, 224, 224]`` uint8 and the labels).
Each line runs in a fresh process on the line CPUs, with as many threads or workers as there
are of them (``--cores``): the peers through a ``DataLoader`` with ``num_workers=<cores>``
(their docs' advice; litData's and Mosaic's caches in a fresh local folder), asyncbatch with
``decode_threads=<cores>``. The S3 server and the proxy run on CPUs of their own
(``--server-cpus``, by default the last CPU: on 2 cores, the lines get one and the servers the
other), as storage is not on the loader's cores in a real run; ``--server-cpus shared`` puts
everything on every CPU.

Lines (``--lines``, all by default):

* ``ceiling``: the same JPEG bytes already in memory, decoded, cropped and stacked in batches
  on ``<cores>`` threads: no I/O;
* ``ab exact S3`` / ``ab block S3``: ``ab.Loader(<shards>, shuffle=True | "block", ...)``
  through the proxy;
* ``ab no sidecars S3``: the exact shuffle over a copy of the shards without sidecars (the
  shards scanned at open), ``--probe-batches`` batches: its time to first batch;
* ``ab Parquet S3``: the ``datasets`` Parquet files, ``decode={"image": "image"}``, exact;
* ``ab cached S3``: ``cache=<a fresh folder>``: epoch 1 untimed fills it, epoch 2 timed;
* ``ab local``: the local shards: epoch 1 timed (``ab exact local``), then epoch 2
  (``ab local, 2nd epoch``), as the cached line;
* ``litData S3`` / ``litData local``: ``StreamingDataset(shuffle=True)`` +
  ``StreamingDataLoader``;
* ``Mosaic S3`` / ``Mosaic local``: ``streaming.StreamingDataset(shuffle=True)`` +
  ``DataLoader``;
* ``webdataset S3`` / ``webdataset local``: ``wds.WebDataset(shardshuffle=100)
  .shuffle(1000)`` (its docs' example) + ``DataLoader``; from S3 through ``pipe:curl``.

Figures per line, medians over ``--rounds`` interleaved rounds (the order rotated each
round): img/s from building the loader to the last batch; time to the first batch; CPU
seconds per 1,000 images (user + system of the line's process and its worker processes,
``getrusage``); bytes the proxy passed back per JPEG byte delivered (images x the corpus's
mean JPEG size). Paired ratios (the median of the per-round ratios) against the issue's
targets are printed at the end.

Usage: ``.venv/bin/python benchmarks/bench_images.py [--images 20000] [--rounds 2]
[--server-cpus auto|shared|1] [--cores N] [--delay-ms 10] [--lines ...] [--quick]
[--json PATH]`` (needs
``scripts/bench-setup``: scikit-image, litdata, mosaicml-streaming, datasets).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import REPO, compile_package, git_revision, moto_server, paired_ratio, positive
from common import run_child as common_run_child
from delayproxy import Counts, read_counts, running_proxy
from PIL import Image
from s3rver import default_s3rver_dir, ensure_s3rver, running_s3rver, s3rver_version

sys.path.insert(0, str(REPO))

import asyncbatch as ab  # noqa: E402
from asyncbatch._decode import decode_image, jpeg_module  # noqa: E402

BATCH = 256
CROP = 224
CLASSES = 1000
SHARD_BYTES = 64_000_000
BUCKET = "bench"
#: A line that takes longer than this is stopped.
RUN_TIMEOUT = 1800
COLOUR = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")
COLOUR += ("immunohistochemistry", "retina")
GREY = ("camera", "coins", "moon", "grass", "gravel", "brick")
LINES = (
    "ceiling",
    "ab exact S3",
    "ab block S3",
    "ab no sidecars S3",
    "ab Parquet S3",
    "ab cached S3",
    "ab local",
    "litData S3",
    "Mosaic S3",
    "webdataset S3",
    "litData local",
    "Mosaic local",
    "webdataset local",
)


# ---------------------------------------------------------------------------------------------
# The work every line does


def crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` (scale 0.08-1, ratio 3/4-4/3): top,
    left, height, width."""
    area = height * width
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, height - h), random.randint(0, width - w), h, w
    ratio = width / height  # torchvision's fallback: a central crop
    if ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop_flip(image: torch.Tensor) -> torch.Tensor:
    """``RandomResizedCrop(224)`` + ``RandomHorizontalFlip()`` of a uint8 ``[3, H, W]``
    image (a view of ``[H, W, 3]`` memory, as ``decode_image`` gives): Pillow resizes the box
    (bilinear, antialiased) with its GIL released."""
    pixels = image.permute(1, 2, 0).numpy()
    top, left, h, w = crop_box(*pixels.shape[:2])
    out = Image.fromarray(pixels).resize(
        (CROP, CROP), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
    )
    if random.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1)


def transform(jpeg: bytes, label: int) -> tuple[torch.Tensor, int]:
    """One sample's work for the peers: the same decoder and crop as asyncbatch's lines."""
    return random_resized_crop_flip(decode_image(bytes(jpeg))), int(label)


def ab_sample_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """asyncbatch's ``sample_transform`` for the WebDataset shards."""
    return {"image": random_resized_crop_flip(sample["jpg"]), "label": sample["cls"]}


def ab_parquet_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """The same for the Parquet files (the label column is read as it is)."""
    return {"image": random_resized_crop_flip(sample["image"])}


# ---------------------------------------------------------------------------------------------
# The corpus and its copies


def photographs() -> list[np.ndarray]:
    """The photographs in scikit-image's wheel, RGB uint8 (no download)."""
    import skimage.data

    photos = [np.asarray(getattr(skimage.data, name)()) for name in COLOUR]
    photos += [
        np.repeat(np.asarray(getattr(skimage.data, name)())[..., None], 3, -1) for name in GREY
    ]
    return photos


def make_jpegs(count: int, seed: int = 0) -> Iterator[tuple[bytes, int]]:
    """``count`` (JPEG, label) pairs: a random crop of a photograph, rescaled to 300-500 px a
    side, tinted (the grey ones), with grain, at quality 85-95; labels over 1,000 classes."""
    photos = photographs()
    rng = np.random.default_rng(seed)
    for _ in range(count):
        k = int(rng.integers(len(photos)))
        photo = photos[k]
        height, width = photo.shape[:2]
        scale = rng.uniform(0.5, 1.0)
        h = int(height * scale * rng.uniform(0.8, 1.0))
        w = int(width * scale * rng.uniform(0.8, 1.0))
        y, x = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        out_h, out_w = (int(v) for v in rng.integers(300, 501, 2))
        crop = Image.fromarray(np.ascontiguousarray(photo[y : y + h, x : x + w]))
        pixels = np.asarray(crop.resize((out_w, out_h), Image.Resampling.BICUBIC), np.float32)
        gain = rng.uniform(0.6, 1.1, 3) if k >= len(COLOUR) else rng.uniform(0.9, 1.1, 3)
        noise = rng.normal(0, 1, (out_h, out_w, 3)).astype(np.float32)
        pixels = pixels * gain.astype(np.float32)
        pixels += noise[..., :1] * rng.uniform(14, 24) + noise * 12
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        data = io.BytesIO()
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        image.save(data, "JPEG", quality=int(rng.integers(85, 96)))
        yield data.getvalue(), int(rng.integers(CLASSES))


def tar_samples(folder: Path) -> Iterator[tuple[str, bytes, int]]:
    """(key, JPEG, label) of every sample of the WebDataset shards in ``folder``, in order."""
    for path in sorted(folder.glob("*.tar")):
        with tarfile.open(path) as tar:
            key, fields = "", {}
            for member in tar:
                file = tar.extractfile(member)
                assert file is not None
                name, _, field = member.name.partition(".")
                if name != key:
                    if fields:
                        yield key, fields["jpg"], int(fields["cls"])
                    key, fields = name, {}
                fields[field] = file.read()
            if fields:
                yield key, fields["jpg"], int(fields["cls"])


def build_corpus(root: Path, count: int) -> dict[str, Any]:
    """Write every copy under ``root`` that is not there yet; its summary."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    made: dict[str, float] = {}
    wds_dir = root / "wds"
    if not (wds_dir / "done").exists():
        start = time.perf_counter()
        shutil.rmtree(wds_dir, ignore_errors=True)
        wds_dir.mkdir()
        pattern = str(wds_dir / "shard-%06d.tar")
        with wds.ShardWriter(pattern, maxsize=SHARD_BYTES, verbose=0) as sink:
            for i, (jpeg, label) in enumerate(make_jpegs(count)):
                sink.write({"__key__": f"{i:08d}", "jpg": jpeg, "cls": label})
        ab.index_webdataset(str(wds_dir))  # sidecars for the local lines
        (wds_dir / "done").touch()
        made["webdataset ShardWriter (with the JPEGs)"] = time.perf_counter() - start
    writers: list[tuple[str, str, Callable[[Path, Path], None]]] = [
        ("litdata", "litData optimize", write_litdata),
        ("mds", "Mosaic MDSWriter", write_mds),
        ("parquet", "datasets to_parquet", write_parquet),
    ]
    for name, what, writer in writers:
        folder = root / name
        if not (folder / "done").exists():
            start = time.perf_counter()
            shutil.rmtree(folder, ignore_errors=True)
            writer(wds_dir, folder)
            (folder / "done").touch()
            made[what] = time.perf_counter() - start
    sizes = [len(jpeg) for _, jpeg, _ in tar_samples(wds_dir)]
    if len(sizes) != count:
        raise RuntimeError(f"{wds_dir} holds {len(sizes)} images, not {count}")
    return {
        "images": len(sizes),
        "mean_jpeg": statistics.mean(sizes),
        "jpeg_bytes": sum(sizes),
        "made": made,
        "folders": {p.name: folder_bytes(p) for p in sorted(root.iterdir()) if p.is_dir()},
    }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _litdata_items(wds_dir: str, _input: int) -> Iterator[dict[str, Any]]:
    for _, jpeg, label in tar_samples(Path(wds_dir)):
        yield {"jpg": jpeg, "cls": label}


def write_litdata(wds_dir: Path, folder: Path) -> None:
    """litData's own writer, in a child process (it starts worker processes)."""
    run_child({"mode": "write-litdata", "wds": str(wds_dir), "out": str(folder)}, "scratch")


def child_write_litdata(spec: dict[str, Any]) -> dict[str, Any]:
    from functools import partial

    from litdata import optimize

    optimize(
        fn=partial(_litdata_items, spec["wds"]),
        inputs=[0],
        output_dir=spec["out"],
        chunk_bytes=SHARD_BYTES,
        num_workers=1,
        verbose=False,
    )
    return {}


def write_mds(wds_dir: Path, folder: Path) -> None:
    base = import_mosaicml()
    columns = {"jpg": "bytes", "cls": "int"}
    with base.MDSWriter(out=str(folder), columns=columns) as writer:
        for _, jpeg, label in tar_samples(wds_dir):
            writer.write({"jpg": jpeg, "cls": label})


def write_parquet(wds_dir: Path, folder: Path) -> None:
    """``datasets`` with an ``Image`` column, ``to_parquet``, in files of ~64 MB."""
    import datasets

    samples = list(tar_samples(wds_dir))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    table = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": jpeg, "path": None} for _, jpeg, _ in samples],
            "label": [label for _, _, label in samples],
        },
        features=features,
    )
    files = max(1, round(sum(len(jpeg) for _, jpeg, _ in samples) / SHARD_BYTES))
    folder.mkdir()
    for n in range(files):
        table.shard(files, n, contiguous=True).to_parquet(str(folder / f"part-{n:05d}.parquet"))


def import_mosaicml() -> Any:
    from bench_scale import import_mosaicml as base

    return base()


def upload(fs: Any, folder: Path, prefix: str, suffix: str = "") -> None:
    """Every file of ``folder`` ending in ``suffix`` to ``s3://bench/<prefix>/``."""
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name.endswith(suffix) and path.name != "done":
            fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.name}")


# ---------------------------------------------------------------------------------------------
# Timing, in a child process per line: python bench_images.py --child '{"mode": ...}'


def cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Meter:
    """From construction to the last batch: images, seconds, first batch, CPU, proxy bytes."""

    def __init__(self, counters: str | None) -> None:
        self.counters = Path(counters) if counters else None
        self.before = self.counts()
        self.cpu = cpu_seconds()
        self.start = time.perf_counter()
        self.images = 0
        self.first = 0.0
        self.first_down = 0
        self.seconds = 0.0

    def counts(self) -> Counts:
        return read_counts(self.counters) if self.counters else Counts()

    def batch(self, images: torch.Tensor, labels: Any) -> None:
        if tuple(images.shape[1:]) != (3, CROP, CROP) or images.dtype != torch.uint8:
            raise RuntimeError(f"unexpected batch: {tuple(images.shape)} {images.dtype}")
        if len(labels) != len(images):
            raise RuntimeError(f"{len(labels)} labels for {len(images)} images")
        if self.images == 0:
            self.first = time.perf_counter() - self.start
            self.first_down = (self.counts() - self.before).down_bytes
        self.images += len(images)
        self.seconds = time.perf_counter() - self.start

    def result(self) -> dict[str, Any]:
        """Read once the line's worker processes have ended (their CPU is counted then)."""
        return {
            "images": self.images,
            "seconds": self.seconds,
            "first_batch": self.first,
            "cpu": cpu_seconds() - self.cpu,
            "down": (self.counts() - self.before).down_bytes,
            "first_down": self.first_down,
        }


def child_ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    """The same JPEGs from memory, decoded, cropped and stacked on ``cores`` threads."""
    samples = [(jpeg, label) for _, jpeg, label in tar_samples(Path(spec["wds"]))]
    random.Random(0).shuffle(samples)
    batches = [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]

    def make(batch: list[tuple[bytes, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [transform(jpeg, label) for jpeg, label in batch]
        images = torch.stack([image for image, _ in pairs])
        return images, torch.tensor([label for _, label in pairs])

    with ThreadPoolExecutor(spec["cores"]) as pool:
        list(pool.map(make, [batches[0][:4]] * spec["cores"]))  # threads started, codecs warm
        meter = Meter(None)
        for images, labels in pool.map(make, batches):
            meter.batch(images, labels)
    return {"epochs": [meter.result()]}


def child_asyncbatch(spec: dict[str, Any]) -> dict[str, Any]:
    """One loader, ``spec["epochs"]`` epochs (each timed), or ``spec["batches"]`` batches."""
    parquet = spec.get("parquet", False)
    decode = {"image": "image"} if parquet else {"jpg": "image", "cls": int}
    options: dict[str, Any] = {"shuffle": True}
    if spec["shuffle"] == "block":
        options = {"shuffle": "block"}
    if spec.get("cache"):
        options["cache"] = spec["scratch"]
    meter = Meter(spec.get("counters"))
    results = []
    with ab.Loader(
        spec["url"],
        batch_size=BATCH,
        seed=0,
        drop_last=False,
        decode=decode,
        sample_transform=ab_parquet_transform if parquet else ab_sample_transform,
        decode_threads=spec["cores"],
        storage_options=spec.get("storage_options"),
        **options,
    ) as loader:
        for epoch in range(spec["epochs"]):
            if epoch:
                meter = Meter(spec.get("counters"))
            for done, batch in enumerate(loader, 1):
                meter.batch(batch["image"], batch["label"])
                if done == spec.get("batches"):
                    break
            results.append(meter.result())
    return {"epochs": results}


def drain(loader: Iterable[Any], meter: Meter, unpack: Callable[[Any], tuple[Any, Any]]) -> None:
    """Read a DataLoader to its end, so that its workers end (and their CPU is counted)."""
    iterator = iter(loader)
    for batch in iterator:
        meter.batch(*unpack(batch))
    del iterator


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def child_litdata(spec: dict[str, Any]) -> dict[str, Any]:
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader, StreamingDataset

    # litData fetches chunks with obstore, which refuses plain-HTTP endpoints unless told.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    class Images(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
            item = super().__getitem__(index)
            return transform(item["jpg"], item["cls"])

    storage = None
    if spec.get("endpoint"):
        storage = {
            "endpoint_url": spec["endpoint"],
            "aws_access_key_id": spec["key"],
            "aws_secret_access_key": spec["secret"],
        }
    meter = Meter(spec.get("counters"))
    dataset = Images(
        spec["url"], shuffle=True, seed=0, storage_options=storage, cache_dir=spec["scratch"]
    )
    loader = StreamingDataLoader(dataset, batch_size=BATCH, num_workers=spec["cores"])
    drain(loader, meter, lambda batch: (batch[0], batch[1]))
    return {"epochs": [meter.result()]}


def child_mosaic(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("endpoint"):
        os.environ.update(
            S3_ENDPOINT_URL=spec["endpoint"],
            AWS_ACCESS_KEY_ID=spec["key"],
            AWS_SECRET_ACCESS_KEY=spec["secret"],
        )
    base = import_mosaicml()
    # Its docs' advice before a run: shared memory a run before left behind (its second
    # run in a round once got another sample's bytes) is cleared.
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    class Images(base.StreamingDataset):  # type: ignore[misc,name-defined]
        def get_item(self, index: int) -> tuple[torch.Tensor, int]:
            item = super().get_item(index)
            return transform(item["jpg"], item["cls"])

    meter = Meter(spec.get("counters"))
    if spec.get("endpoint"):
        where = {"remote": spec["url"], "local": spec["scratch"]}
    else:
        where = {"local": spec["url"]}
    dataset = Images(**where, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=spec["cores"])
    drain(loader, meter, lambda batch: (batch[0], batch[1]))
    return {"epochs": [meter.result()]}


def child_webdataset(spec: dict[str, Any]) -> dict[str, Any]:
    import webdataset as wds

    meter = Meter(spec.get("counters"))
    dataset = (
        wds.WebDataset(spec["urls"], shardshuffle=100, seed=0, empty_check=False)
        .shuffle(1000)
        .to_tuple("jpg", "cls")
        .map(lambda pair: transform(pair[0], int(pair[1])))
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, num_workers=spec["cores"], collate_fn=collate
    )
    drain(loader, meter, lambda batch: batch)
    return {"epochs": [meter.result()]}


def run_child(spec: dict[str, Any], folder: str) -> dict[str, Any]:
    return common_run_child(Path(__file__).resolve(), spec, folder, RUN_TIMEOUT)


def child_main(text: str) -> None:
    spec = json.loads(text)
    modes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "write-litdata": child_write_litdata,
        "ceiling": child_ceiling,
        "asyncbatch": child_asyncbatch,
        "litdata": child_litdata,
        "mosaic": child_mosaic,
        "webdataset": child_webdataset,
    }
    result = modes[spec["mode"]](spec)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_server(kind: str) -> Iterator[tuple[str, str, str]]:
    """s3rver (node, objects in files) or moto's server (Python, objects in memory or spooled
    files): its endpoint, its key (= its secret) and its name and version."""
    if kind == "moto":
        import moto

        with moto_server("testing", "testing") as (endpoint, _):
            yield endpoint, "testing", f"moto {moto.__version__} (server mode)"
        return
    script = ensure_s3rver(default_s3rver_dir())
    with running_s3rver(script, BUCKET) as endpoint:
        yield endpoint, "S3RVER", f"s3rver {s3rver_version(script)}"


def line_specs(
    args: argparse.Namespace, root: Path, key: str, proxy_url: str, counters: str
) -> dict[str, dict[str, Any]]:
    """Each line's child spec (its mode and what it reads)."""
    import s3fs

    s3 = {"endpoint_url": proxy_url, "key": key, "secret": key}
    tars = sorted(p.name for p in (root / "wds").glob("*.tar"))
    # webdataset reads URLs through a pipe: curl, on URLs signed for the proxy's address.
    signer = s3fs.S3FileSystem(**s3, skip_instance_cache=True)
    signed = [signer.url(f"{BUCKET}/wds/{name}", expires=24 * 3600) for name in tars]
    remote = {"counters": counters, "cores": args.cores, "key": key, "secret": key}
    local = {"cores": args.cores}
    ab_s3 = {**remote, "mode": "asyncbatch", "storage_options": s3, "epochs": 1}
    specs = {
        "ceiling": {"mode": "ceiling", "wds": str(root / "wds"), **local},
        "ab exact S3": {**ab_s3, "url": f"s3://{BUCKET}/wds", "shuffle": "exact"},
        "ab block S3": {**ab_s3, "url": f"s3://{BUCKET}/wds", "shuffle": "block"},
        "ab no sidecars S3": {
            **ab_s3,
            "url": f"s3://{BUCKET}/wds-bare",
            "shuffle": "exact",
            "batches": args.probe_batches,
        },
        "ab Parquet S3": {
            **ab_s3,
            "url": f"s3://{BUCKET}/parquet",
            "shuffle": "exact",
            "parquet": True,
        },
        "ab cached S3": {
            **ab_s3,
            "url": f"s3://{BUCKET}/wds",
            "shuffle": "exact",
            "cache": True,
            "epochs": 2,
        },
        "ab local": {
            **local,
            "mode": "asyncbatch",
            "url": str(root / "wds"),
            "shuffle": "exact",
            "epochs": 2,
        },
        "litData S3": {
            **remote,
            "mode": "litdata",
            "url": f"s3://{BUCKET}/litdata",
            "endpoint": proxy_url,
        },
        "litData local": {**local, "mode": "litdata", "url": str(root / "litdata")},
        "Mosaic S3": {
            **remote,
            "mode": "mosaic",
            "url": f"s3://{BUCKET}/mds",
            "endpoint": proxy_url,
        },
        "Mosaic local": {**local, "mode": "mosaic", "url": str(root / "mds")},
        "webdataset S3": {
            **remote,
            "mode": "webdataset",
            "urls": [f"pipe:curl -s -f '{url}'" for url in signed],
        },
        "webdataset local": {
            **local,
            "mode": "webdataset",
            "urls": [str(root / "wds" / name) for name in tars],
        },
    }
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=positive, default=20_000, help="images in the corpus")
    parser.add_argument("--rounds", type=positive, default=2, help="interleaved rounds (median)")
    parser.add_argument(
        "--cores", type=positive, default=None, help="decode threads / workers (the line CPUs)"
    )
    parser.add_argument(
        "--server-cpus",
        default="auto",
        help="CPUs the S3 server and the proxy run on, the lines on the others ('auto': the"
        " last CPU where there are two or more; 'shared': every line and server on all)",
    )
    parser.add_argument("--delay-ms", type=float, default=10.0, help="proxy delay per request")
    parser.add_argument(
        "--probe-batches", type=positive, default=4, help="batches of the no-sidecars line"
    )
    parser.add_argument("--lines", default=",".join(LINES), help="lines, comma-separated")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "asyncbatch", help="corpus"
    )
    parser.add_argument(
        "--server",
        choices=("s3rver", "moto"),
        default="s3rver",
        help="the S3 server (moto reads a whole object for every ranged GET)",
    )
    parser.add_argument("--quick", action="store_true", help="600 images, 1 round: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write the per-round figures")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    if args.quick:
        args.images, args.rounds = 600, 1
    args.server_cpus, args.line_cpus = split_cpus(args.server_cpus)
    if args.cores is None:
        args.cores = len(args.line_cpus)
    names = [name.strip() for name in args.lines.split(",") if name.strip()]
    unknown = sorted(set(names) - set(LINES))
    if unknown:
        parser.error(f"unknown lines {unknown}; known: {', '.join(LINES)}")
    if "webdataset S3" in names and shutil.which("curl") is None:
        parser.error("the webdataset S3 line needs curl")

    # SIGTERM unwinds like Ctrl-C, so every server and child process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    root = args.cache_dir / f"bench-images-{args.images}"
    compile_package()  # the lines time loaders' construction: no module compiled in it
    start = time.perf_counter()
    corpus = build_corpus(root, args.images)
    corpus_seconds = time.perf_counter() - start
    with s3_server(args.server) as (endpoint, key, server):
        start = time.perf_counter()
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=key, secret=key)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        upload(fs, root / "wds", "wds", ".tar")
        direct = {"endpoint_url": endpoint, "key": key, "secret": key}
        indexed = time.perf_counter()
        ab.index_webdataset(f"s3://{BUCKET}/wds", storage_options=direct)
        indexed = time.perf_counter() - indexed
        if "ab no sidecars S3" in names:
            upload(fs, root / "wds", "wds-bare", ".tar")
        if any(name.startswith("litData") for name in names):
            upload(fs, root / "litdata", "litdata")
        if any(name.startswith("Mosaic") for name in names):
            upload(fs, root / "mds", "mds")
        if "ab Parquet S3" in names:
            upload(fs, root / "parquet", "parquet")
        uploaded = time.perf_counter() - start
        with running_proxy(endpoint, args.delay_ms / 1e3) as proxy:
            header(args, corpus, corpus_seconds, uploaded, server)
            print(f"  ab.index_webdataset over S3 (no delay): {indexed:.1f} s")
            specs = line_specs(args, root, key, proxy.url, str(proxy.counters_path))
            rounds = measure(args, names, specs)
    report(args, corpus, names, rounds)


def header(
    args: argparse.Namespace,
    corpus: dict[str, Any],
    corpus_seconds: float,
    uploaded: float,
    server: str,
) -> None:
    import datasets
    import litdata
    import skimage
    import webdataset
    from bench_scale import mosaicml_version

    jpeg = jpeg_module()
    print(f"asyncbatch bench_images  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(
        f"  git {git_revision()}  python {platform.python_version()}  torch {torch.__version__}"
        f"  litdata {litdata.__version__}  mosaicml-streaming {mosaicml_version()}"
        f"  webdataset {webdataset.__version__}  datasets {datasets.__version__}"
        f"  scikit-image {skimage.__version__}"
        f"  decoder {'simplejpeg ' + jpeg.__version__ if jpeg else 'Pillow'}"
    )
    print(
        f"  cpus {os.cpu_count()}: lines on {sorted(args.line_cpus)} ({args.cores} threads"
        f" / workers), {server} and the proxy on {sorted(args.server_cpus)};"
        f" load {os.getloadavg()};"
        f" {server} + proxy (+{args.delay_ms:g} ms per request)"
    )
    print(
        f"  corpus: {corpus['images']} JPEGs, mean {corpus['mean_jpeg'] / 1e3:.1f} KB,"
        f" ready in {corpus_seconds:.0f} s {corpus['made'] or '(cached)'}; uploaded in"
        f" {uploaded:.0f} s"
    )
    print(
        "  copies (MB): "
        + ", ".join(f"{name} {size / 1e6:.0f}" for name, size in corpus["folders"].items())
    )


def server_cpu(pids: list[int]) -> float:
    """User + system seconds so far of the processes ``pids`` (the S3 server and the proxy)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def server_pids() -> list[int]:
    """This process's children now: the S3 server and the proxy (Linux ``/proc``)."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


def split_cpus(server: str) -> tuple[set[int], set[int]]:
    """The CPUs for the S3 server and the proxy, and those for the lines (``--server-cpus``):
    apart, as storage is apart from the loader's cores in a real run, unless ``shared``."""
    mine = os.sched_getaffinity(0)
    if server == "shared" or (server == "auto" and len(mine) < 2):
        return set(mine), set(mine)
    servers = {max(mine)} if server == "auto" else {int(cpu) for cpu in server.split(",")}
    if not servers < mine:
        raise SystemExit(f"--server-cpus {server}: expected some of the CPUs {sorted(mine)}")
    return servers, mine - servers


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (threads started later inherit it) onto ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def measure(
    args: argparse.Namespace, names: list[str], specs: dict[str, dict[str, Any]]
) -> list[dict[str, list[dict[str, Any]]]]:
    """Each line once per round, the order rotated each round; the servers on their CPUs,
    this process (so every line's process) on the others."""
    servers = server_pids()
    for pid in servers:
        pin(pid, args.server_cpus)
    pin(os.getpid(), args.line_cpus)
    rounds = []
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        results: dict[str, list[dict[str, Any]]] = {}
        for name in names[shift:] + names[:shift]:
            before = server_cpu(servers)
            try:
                epochs = run_child(specs[name], "scratch")["epochs"]
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # One failed run leaves a gap in its line; the rounds go on.
                print(f"  round {round_ + 1} {name}: FAILED ({exc})", file=sys.stderr, flush=True)
                continue
            # The servers' CPU over the whole child goes to its first epoch (a cached second
            # epoch asks the store nothing).
            for n, epoch in enumerate(epochs):
                epoch["server_cpu"] = server_cpu(servers) - before if n == 0 else 0.0
            results[name] = epochs
            for epoch in epochs:
                print(
                    f"  round {round_ + 1} {name}: {epoch['images']} images in"
                    f" {epoch['seconds']:.2f} s, {epoch['images'] / epoch['seconds']:.0f} img/s,"
                    f" 1st batch {epoch['first_batch']:.2f} s, CPU {epoch['cpu']:.1f} s,"
                    f" server+proxy CPU {epoch['server_cpu']:.1f} s,"
                    f" fetched {epoch['down'] / 1e6:.0f} MB"
                    f" ({epoch['first_down'] / 1e6:.1f} by 1st)",
                    file=sys.stderr,
                    flush=True,
                )
        rounds.append(results)
    return rounds


def figures(
    names: list[str], rounds: list[dict[str, list[dict[str, Any]]]]
) -> dict[str, list[dict[str, Any] | None]]:
    """Per reported line, its run in each round, None where it failed (the local and cached
    lines give two)."""
    out: dict[str, list[dict[str, Any] | None]] = {}
    for name in names:
        runs = [results.get(name) for results in rounds]
        if name == "ab local":
            out["ab exact local"] = [epochs[0] if epochs else None for epochs in runs]
            out["ab local, 2nd epoch"] = [epochs[1] if epochs else None for epochs in runs]
        elif name == "ab cached S3":
            out["ab cached S3, 1st epoch"] = [epochs[0] if epochs else None for epochs in runs]
            out["ab cached S3, 2nd epoch"] = [epochs[1] if epochs else None for epochs in runs]
        else:
            out[name] = [epochs[0] if epochs else None for epochs in runs]
    return out


def paired(a: list[float | None], b: list[float | None]) -> float | None:
    """The median over the rounds where both lines ran of the ratio of ``a`` to ``b``."""
    both = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    return paired_ratio([x for x, _ in both], [y for _, y in both]) if both else None


def rate(run: dict[str, Any]) -> float:
    return float(run["images"] / run["seconds"])


def report(
    args: argparse.Namespace,
    corpus: dict[str, Any],
    names: list[str],
    rounds: list[dict[str, list[dict[str, Any]]]],
) -> None:
    every = figures(names, rounds)
    lines = {name: [run for run in runs if run] for name, runs in every.items()}
    lines = {name: runs for name, runs in lines.items() if runs}
    rates_by_round = {
        name: [rate(run) if run else None for run in runs] for name, runs in every.items()
    }
    rates = {name: [rate(run) for run in runs] for name, runs in lines.items()}
    ceiling = rates_by_round.get("ceiling") if "ceiling" in lines else None
    print()
    print(
        f"{'line':26} {'img/s':>7} {'min-max':>11} {'1st batch s':>12} {'CPU s/1k img':>13}"
        f" {'server CPU s/1k':>16} {'fetched/delivered':>18} {'/ ceiling':>10}"
    )
    for name, runs in lines.items():
        values = rates[name]
        cpu = statistics.median(run["cpu"] / run["images"] * 1000 for run in runs)
        fetched = statistics.median(
            run["down"] / (run["images"] * corpus["mean_jpeg"]) for run in runs
        )
        shown = f"{fetched:18.3f}" if any(run["down"] for run in runs) else f"{'-':>18}"
        served = statistics.median(run["server_cpu"] / run["images"] * 1000 for run in runs)
        shown = (f"{served:16.2f}" if served else f"{'-':>16}") + shown
        to_ceiling = paired(rates_by_round[name], ceiling) if ceiling else None
        ratio = f"{to_ceiling:10.2f}" if to_ceiling is not None else ""
        print(
            f"{name:26} {statistics.median(values):7.0f}"
            f" {f'{min(values):.0f}-{max(values):.0f}':>11}"
            f" {statistics.median(run['first_batch'] for run in runs):12.2f}"
            f" {cpu:13.2f}{shown}{ratio}"
        )
    print(
        "(img/s: median over rounds, from building the loader to its last batch; CPU: user +"
        " system of the line's processes; server CPU: the S3 server's and the proxy's, over the"
        " line's process (a two-epoch line's all on its first epoch); fetched/delivered: bytes"
        " the proxy passed back / (images delivered x mean JPEG bytes); / ceiling: paired)"
    )
    peers = [n for n in rates if n.split()[0] in ("litData", "Mosaic", "webdataset") and "S3" in n]
    best = max(peers, key=lambda n: statistics.median(rates[n]), default=None)
    targets: list[tuple[str, str, str, float]] = [
        ("exact S3 / best peer on S3", "ab exact S3", best or "", 1.5),
        ("exact S3 / bare decode ceiling", "ab exact S3", "ceiling", 0.85),
        ("exact S3 / block S3", "ab exact S3", "ab block S3", 0.8),
        (
            "cached 2nd epoch / local 2nd epoch",
            "ab cached S3, 2nd epoch",
            "ab local, 2nd epoch",
            0.9,
        ),
        ("cached 2nd epoch / exact local", "ab cached S3, 2nd epoch", "ab exact local", 0.9),
    ]
    print()
    for label, a, b, target in targets:
        ratio = paired(rates_by_round[a], rates_by_round[b]) if a in rates and b in rates else None
        if ratio is not None:
            verdict = "met" if ratio >= target else "NOT met"
            print(f"  {label}: {a} / {b} = {ratio:.2f} (target >= {target}: {verdict})")
    print(f"  load after {os.getloadavg()}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["benchmarks/bench_images.py", *sys.argv[1:]]),
                    "git": git_revision(),
                    "corpus": {k: v for k, v in corpus.items() if k != "made"},
                    "lines": every,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
