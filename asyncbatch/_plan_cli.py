"""``asyncbatch plan URL ...``: the cost of a run before it starts (see :mod:`asyncbatch._plan`).

Registered by :mod:`asyncbatch._cli`; numpy and the loader load inside the command, so
``asyncbatch --help`` stays light.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ._defaults import MAX_INFLIGHT


def _shuffle(value: str) -> bool | str:
    return {"true": True, "false": False}.get(value.lower(), value)


def key_value_pairs(pairs: Sequence[str], what: str) -> dict[str, Any]:
    """``--what KEY=VALUE`` pairs as a dict, JSON values allowed (every command's options)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--{what} takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def add_plan_command(commands: Any) -> None:
    """Add ``plan`` to the ``asyncbatch`` subcommands (an argparse subparsers action)."""
    cost = commands.add_parser(
        "plan",
        help="the requests, bytes, time and dollars of a run, before it starts",
        description="Cost a run from the dataset's manifest (and footers, index metadata)"
        " and the loader's own order and read planning, without reading data: per rank and"
        " in total, requests, bytes fetched and delivered, amplification, index bytes; the"
        " epoch time at a latency, bandwidth and max_inflight; dollars for GETs and egress."
        " See docs/plan.md.",
    )
    cost.add_argument("url", help="the dataset (a root URL or path)")
    cost.add_argument("--world-size", type=int, default=1, help="ranks (default: %(default)s)")
    cost.add_argument(
        "--batch-size",
        type=int,
        required=True,
        help="samples a batch, per rank (no default: required)",
    )
    cost.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="window length (default: none, documents as samples)",
    )
    cost.add_argument(
        "--shuffle",
        type=_shuffle,
        default=True,
        help="true (global), false, block or batch (default: true)",
    )
    cost.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="samples a block, with --shuffle block (default: the loader's)",
    )
    cost.add_argument(
        "--window",
        type=int,
        default=None,
        help="blocks a window, with --shuffle block (default: the loader's)",
    )
    cost.add_argument("--epochs", type=int, default=1, help="epochs (default: %(default)s)")
    cost.add_argument("--seed", type=int, default=0, help="order seed (default: %(default)s)")
    cost.add_argument(
        "--next-token", action="store_true", help="windows of seq_len + 1 (default: seq_len)"
    )
    cost.add_argument(
        "--latency",
        type=float,
        default=10.0,
        help="milliseconds a request takes (default: %(default)s)",
    )
    cost.add_argument(
        "--bandwidth",
        type=float,
        default=10.0,
        help="Gbit/s a rank's reads can move (default: %(default)s)",
    )
    cost.add_argument(
        "--max-inflight",
        type=int,
        default=MAX_INFLIGHT,
        help="requests in flight per rank (default: %(default)s)",
    )
    cost.add_argument(
        "--get-price",
        type=float,
        default=0.0004,
        help="dollars per 1,000 GET requests (default: %(default)s, S3 Standard list price)",
    )
    cost.add_argument(
        "--egress-price",
        type=float,
        default=0.09,
        help="dollars per GB transferred out (default: %(default)s, S3 to the internet)",
    )
    cost.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="write a PNG of requests and bytes per rank over the epoch (default: none)",
    )
    cost.add_argument(
        "--format-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="format option (JSON values allowed), repeatable (default: none)",
    )
    cost.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="storage option (JSON values allowed), repeatable (default: none)",
    )
    cost.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from ._plan import plan

    result = plan(
        args.url,
        world_size=args.world_size,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        shuffle=args.shuffle,
        block_size=args.block_size,
        window=args.window,
        epochs=args.epochs,
        seed=args.seed,
        next_token=args.next_token,
        latency=args.latency / 1e3,
        bandwidth=args.bandwidth * 1e9 / 8,
        max_inflight=args.max_inflight,
        get_per_1000=args.get_price,
        egress_per_gb=args.egress_price,
        format_options=key_value_pairs(args.format_option, "format-option"),
        storage_options=key_value_pairs(args.option, "option"),
    )
    print(result)
    if args.plot:
        result.plot(args.plot)
        print(f"  plot: {args.plot}")
    return 0
