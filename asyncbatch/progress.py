"""A minimal progress bar on stderr (no dependency), redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: float, label: str, unit: str = "", stream: TextIO | None = None):
        self.total = total
        self.label = label
        self.unit = unit
        self.done = 0.0
        self.stream = stream or sys.stderr
        self._start = time.perf_counter()
        self._drawn = 0.0

    def update(self, amount: float) -> None:
        self.done += amount
        now = time.perf_counter()
        if now - self._drawn >= 0.1 or self.done >= self.total:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * 30)
        rate = self.done / max(now - self._start, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%}"
            f" {_human(rate)}{self.unit}/s"
        )
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()


def _human(value: float) -> str:
    for suffix in ("", "k", "M", "G", "T"):
        if abs(value) < 1000:
            return f"{value:.1f}{suffix}"
        value /= 1000
    return f"{value:.1f}P"
