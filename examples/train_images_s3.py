"""Train a small image classifier on WebDataset shards in S3, images decoded and augmented
on the loader's own threads, under an exact global shuffle; stop mid-epoch and resume exactly.

Run the whole demo (needs ``pip install 'asyncbatch[s3,images]' 'moto[server]'``)::

    python examples/train_images_s3.py
    python examples/train_images_s3.py --images 400 --epochs 1   # smaller

It starts moto's S3 server on 127.0.0.1 (a stand-in for S3, in its own process), writes
``--images`` JPEGs of ten classes (each a colour and a stripe pattern, with noise: something
to learn) with their labels as WebDataset shards (``jpg`` + ``cls`` members, sidecar indexes)
with ``ab.write_webdataset``, and trains a small CNN for ``--epochs`` epochs from
``s3://examples/images/``: one ranged GET per image, JPEGs decoded on the loader's pool
(``decode=``), a random crop and flip on the same threads (``sample_transform=``). It checks
that every image comes exactly once per epoch, then stops a loader after ``--stop-at``
batches, resumes a new one from its ``state_dict()`` and checks that together they delivered
the batches of one run without a stop. It exits 1 if any check fails.

On real S3, point ``--url`` at shards webdataset or ``ab.write_webdataset`` wrote (credentials
from the usual AWS variables)::

    python examples/train_images_s3.py --url 's3://my-bucket/shards/{000000..000099}.tar'
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import asyncbatch as ab

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/local_s3.py, run as a file
from local_s3 import MOTO_OPTIONS, moto_server  # noqa: E402

CLASSES = 10
SIZE = 48  # stored images are SIZE x SIZE; training crops CROP x CROP of them
CROP = 40


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """One sample, on a decode thread: a random crop and flip, scaled to [0, 1]."""
    image = sample["jpg"]  # uint8 [3, H, W]
    top, left = np.random.randint(0, image.shape[1] - CROP + 1, size=2).tolist()
    image = image[:, top : top + CROP, left : left + CROP]
    if np.random.rand() < 0.5:
        image = image.flip(2)
    return {"image": image.float() / 255, "label": sample["cls"]}


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def loader(url: str, options: Mapping[str, Any], batch_size: int) -> ab.Loader:
    return ab.Loader(
        url,
        batch_size=batch_size,
        shuffle=True,
        seed=0,
        drop_last=False,
        decode={"jpg": "image", "cls": int},
        sample_transform=augment,
        storage_options=options,
    )


def pictures(count: int) -> Iterator[dict[str, Any]]:
    """JPEGs of ten classes: class ``c`` is a colour and stripes of period ``c + 2``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    palette = rng.integers(40, 216, (CLASSES, 3))
    ys, xs = np.mgrid[0:SIZE, 0:SIZE]
    for i in range(count):
        label = i % CLASSES
        stripes = ((xs + ys * (label % 3)) // (label + 2) % 2)[..., None] * 60
        noise = rng.integers(-30, 31, (SIZE, SIZE, 3))
        pixels = np.clip(palette[label] + stripes + noise, 0, 255).astype(np.uint8)
        jpeg = io.BytesIO()
        Image.fromarray(pixels).save(jpeg, format="JPEG", quality=90)
        yield {"__key__": f"{i:06d}", "jpg": jpeg.getvalue(), "cls": label}


def train(args: argparse.Namespace, url: str, options: Mapping[str, Any]) -> bool:
    torch.manual_seed(0)
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    ok = True
    with loader(url, options, args.batch_size) as images:
        total = images.dataset.manifest.total_elements if images.dataset else 0
        for epoch in range(args.epochs):
            started, seen, losses = time.perf_counter(), [], []
            for batch in images:  # one epoch
                logits = net(batch["image"])  # float [B, 3, CROP, CROP], decoded already
                loss = F.cross_entropy(logits, batch["label"])  # int64 [B]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                seen += batch.global_indexes.tolist()
            rate = len(seen) / (time.perf_counter() - started)
            print(
                f"epoch {epoch}: {len(seen):,} images, {rate:,.0f} images/s,"
                f" loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-3:]):.3f}"
            )
            if sorted(seen) != list(range(total)):
                print(f"FAIL: epoch {epoch} did not deliver every image exactly once")
                ok = False
    return ok


def resume(args: argparse.Namespace, url: str, options: Mapping[str, Any]) -> bool:
    """A loader stopped after ``--stop-at`` batches and a new one resumed from its state
    deliver the batches of one loader that never stopped."""
    with loader(url, options, args.batch_size) as whole:
        reference = [batch.global_indexes.tolist() for batch in whole]
    with loader(url, options, args.batch_size) as first:
        taken = []
        for batch in first:
            taken.append(batch.global_indexes.tolist())
            if len(taken) == args.stop_at:
                break
        state = first.state_dict()  # a few integers: save it with the checkpoint
    with loader(url, options, args.batch_size) as second:
        second.load_state_dict(state)
        taken += [batch.global_indexes.tolist() for batch in second]
    if taken != reference:
        print("FAIL: the resumed loader did not continue exactly")
        return False
    print(f"stopped after {args.stop_at} batches, resumed: the same {len(taken)} batches")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="WebDataset shards to train on (default: moto's S3)")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--stop-at", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        return 0 if train(args, args.url, {}) and resume(args, args.url, {}) else 1
    with moto_server() as endpoint:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, **MOTO_OPTIONS).mkdir("examples")
        url, options = "s3://examples/images", {"endpoint_url": endpoint, **MOTO_OPTIONS}
        dataset = ab.write_webdataset(
            url, pictures(args.images), shard_size=1 << 20, storage_options=options
        )
        print(f"wrote {args.images:,} JPEGs in {len(dataset.shard_urls)} shards to {url}")
        return 0 if train(args, url, options) and resume(args, url, options) else 1


if __name__ == "__main__":
    sys.exit(main())
