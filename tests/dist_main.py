"""One rank of the torchrun test (tests/test_torchrun.py): reads an epoch, saves a state.

Run by ``torchrun``; rank and world size reach the loader only through ``torch.distributed``.
Every collective and point-to-point call is replaced by one that fails, so the test proves
the loader needs no communication between ranks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

import asyncbatch as ab

COMMUNICATION = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "scatter",
    "gather",
    "all_to_all",
)


def forbid(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError(f"the loader called torch.distributed.{name}")

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--stop", type=int, required=True)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    options = {"endpoint_url": args.endpoint, "key": "testing", "secret": "testing"}
    dist.init_process_group("gloo")
    saved = {name: getattr(dist, name) for name in COMMUNICATION}
    for name in COMMUNICATION:
        setattr(dist, name, forbid(name))
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "batches": []}
    with ab.Loader(
        args.url,
        batch_size=args.batch_size,
        seq_len=40,
        shuffle="block",
        block_size=8,
        window=4,
        seed=17,
        storage_options=options,
    ) as loader:
        if args.resume is not None:
            loader.load_state_dict(json.loads(args.resume.read_text()))
        for step, batch in enumerate(loader):
            report["batches"].append(batch.global_indexes.tolist())
            if step + 1 == args.stop:
                report["state"] = loader.state_dict()
        report["rank_seen"] = [loader.rank, loader.world_size]
    for name, function in saved.items():
        setattr(dist, name, function)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
