"""Draw the plots of docs/benchmarks.md from the benchmarks' JSON figures.

Every ``bench_*.json`` in the folder (default ``docs/img``) becomes the PNG of the same name:

- ``bench_scale.json`` (``bench_scale.py``): bytes fetched / delivered, max over ranks,
  against world size, one line per loader;
- ``bench_parquet.json`` (``bench_parquet.py --json``): open seconds, tokens/s and time to
  first batch of each loader, one panel each;
- any other (a script's ``--json``, written by ``common.write_rates``): each line's paired
  ratio to its baseline (median over rounds of the ratio within one round), with the range
  of the per-round ratios, since on a shared machine the ratios hold where absolute rates
  do not.

Usage: ``.venv/bin/python benchmarks/plot.py [FOLDER]`` (matplotlib: ``scripts/bench-setup``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import REPO


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
    print(f"wrote {path}")


def plot_scale(figures: dict[str, Any], path: Path) -> None:
    """Bytes fetched / delivered (max over ranks) against world size, one line per loader."""
    import matplotlib.ticker

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    points: dict[str, list[tuple[int, float]]] = {}
    for row in figures["scale"]:
        points.setdefault(row["loader"], []).append(
            (row["world_size"], row["fetched_per_delivered_max"])
        )
    for loader in points:  # in the order the script measured them
        sizes, ratios = zip(*sorted(points[loader]), strict=True)
        axes.plot(sizes, ratios, marker="o", label=loader)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    worlds = sorted({row["world_size"] for row in figures["scale"]})
    axes.set_xticks(worlds, [str(world) for world in worlds])
    axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    axes.set_xlabel("world size (ranks)")
    axes.set_ylabel("object bytes fetched / bytes delivered (max over ranks)")
    settings = figures["settings"]
    git = figures["header"][1].split()[1]
    title = figures.get("title") or (
        f"One epoch over N ranks from S3 (+{settings['delay_ms']:g} ms): {settings['size_mb']}"
        f" MiB, {settings['shard_mb']} MiB shards, git {git}"
    )
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    _save(figure, path)


def plot_parquet(figures: dict[str, Any], path: Path) -> None:
    """Open seconds, M tokens/s and first-batch seconds of each loader on the same files."""
    plt = _pyplot()
    opens = {
        k[5:]: v["seconds"]
        for k, v in figures.items()
        if k.startswith("open_") and isinstance(v, dict)  # not the paired ratio
    }
    reads = {k[5:]: v for k, v in figures.items() if k.startswith("read_")}
    panels = [
        ("open: seconds", opens),
        (
            "read input_ids: M tokens/s",
            {k: v["tokens"] / v["seconds"] / 1e6 for k, v in reads.items()},
        ),
        ("read: first batch, seconds", {k: v["first_batch_s"] for k, v in reads.items()}),
    ]
    figure, all_axes = plt.subplots(3, 1, figsize=(7, 1.2 + 0.4 * (len(opens) + 2 * len(reads))))
    for axes, (label, values) in zip(all_axes, panels, strict=True):
        names = list(values)
        rows = range(len(names))
        colors = ["tab:blue" if n.startswith("asyncbatch") else "tab:gray" for n in names]
        axes.barh(rows, list(values.values()), color=colors, alpha=0.85)
        axes.set_yticks(rows, names)
        axes.invert_yaxis()  # the first line on top, as in the table
        for row, value in zip(rows, values.values(), strict=True):
            axes.annotate(f"{value:.3g}", (value, row), xytext=(4, -3), textcoords="offset points")
        axes.set_xlim(0, 1.15 * max(values.values()))  # room for the labels
        axes.set_xlabel(label)
        axes.grid(True, axis="x", alpha=0.3)
    machine = figures["machine"]
    all_axes[0].set_title(
        f"Parquet on s3rver (+{machine['delay_ms']:g} ms): {figures['files']:,} files,"
        f" {figures['tokens'] / 1e6:.1f} M tokens, git {machine['revision']}",
        fontsize=9,
    )
    _save(figure, path)


def plot_rates(figures: dict[str, Any], path: Path) -> None:
    """Each line's paired ratio to the baseline, the per-round range as an error bar."""
    plt = _pyplot()
    rates: dict[str, list[float]] = figures["rates"]
    names = list(rates)
    # Each line against its own baseline when the script named one, else the common one.
    bases = [figures.get("baselines", {}).get(name, figures["baseline"]) for name in names]
    ratios = [
        [a / b for a, b in zip(rates[name], rates[base], strict=True)]
        for name, base in zip(names, bases, strict=True)
    ]
    medians = [statistics.median(r) for r in ratios]
    low = [m - min(r) for m, r in zip(medians, ratios, strict=True)]
    high = [max(r) - m for m, r in zip(medians, ratios, strict=True)]
    figure, axes = plt.subplots(figsize=(7, 0.45 * len(names) + 1.4))
    rows = range(len(names))
    axes.barh(rows, medians, xerr=[low, high], color="tab:blue", alpha=0.8, capsize=3)
    labels = [
        name if base == figures["baseline"] else f"{name} (/ {base})"
        for name, base in zip(names, bases, strict=True)
    ]
    axes.set_yticks(rows, labels)
    axes.invert_yaxis()  # the first line on top, as in the table
    axes.axvline(1, color="black", linewidth=0.8)
    for row, value in zip(rows, medians, strict=True):
        axes.annotate(f"{value:.2f}", (value, row), xytext=(4, 6), textcoords="offset points")
    axes.set_xlabel(f"{figures['unit']} / baseline: median of per-round ratios, bar: range")
    git = figures["header"][1].split()[1]
    axes.set_title(f"{figures['title']}, git {git}\nbaseline: {figures['baseline']}", fontsize=9)
    axes.grid(True, axis="x", alpha=0.3)
    _save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", default=REPO / "docs" / "img")
    args = parser.parse_args()
    found = sorted(args.folder.glob("bench_*.json"))
    if not found:
        raise SystemExit(f"no bench_*.json in {args.folder}")
    for source in found:
        figures = json.loads(source.read_text())
        target = source.with_suffix(".png")
        if "scale" in figures:
            plot_scale(figures, target)
        elif "open_asyncbatch" in figures:
            plot_parquet(figures, target)
        else:
            plot_rates(figures, target)


if __name__ == "__main__":
    main()
