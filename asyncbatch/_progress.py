"""Progress of long commands on stderr: a tqdm bar on a terminal; elsewhere (a log file, a
pipe, a CI job) a plain line now and then and one at the end, never a ``\\r`` redraw."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, NoReturn, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

#: Seconds between two plain lines when the stream is not a terminal.
LINE_INTERVAL = 10.0


class Progress:
    """Counts ``amount``s of ``unit`` (``"B"``: bytes) done out of ``total`` (0: unknown),
    under ``label``. ``initial``: done before this run (a resumed one): counted in the
    fraction, not in the rate, and shown at once."""

    def __init__(
        self,
        total: float,
        label: str,
        unit: str = "",
        stream: TextIO | None = None,
        *,
        interval: float = LINE_INTERVAL,
        initial: float = 0.0,
        note: str = "",
    ) -> None:
        self.total = total
        self.label = label
        self.unit = unit.strip()
        self.initial = self.done = float(initial)
        self.stream = stream or sys.stderr
        self.interval = interval
        self._start = self._written = time.perf_counter()
        self._bar: tqdm[NoReturn] | None = None
        self._note = note
        self._shown: float | None = None  # ``done`` in the last plain line
        if _is_terminal(self.stream):
            from tqdm import tqdm  # imported only when drawn: `asyncbatch --help` stays fast

            self._bar = tqdm(
                total=total or None,
                desc=label,
                unit=self.unit or "it",
                unit_scale=True,
                file=self.stream,
                dynamic_ncols=True,
                initial=initial,
                postfix=note or None,
            )
        elif initial:
            self._line(self._start)  # a resumed run says where it stands at once

    def update(self, amount: float) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
            return
        now = time.perf_counter()
        if now - self._written >= self.interval:
            self._written = now
            self._line(now)

    def tick(self) -> None:
        """Called now and then while nothing may be done: the clock and ETA move on a
        terminal, and a plain line still comes every ``interval``."""
        now = time.perf_counter()
        if self._bar is not None:
            if now - self._written >= 0.5:
                self._written = now
                self._bar.refresh()
            return
        if now - self._written >= self.interval:
            self._written = now
            self._line(now)

    def note(self, text: str) -> None:
        """A few words shown after the count (tqdm's postfix; the plain lines end with it)."""
        self._note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        """The final state: the bar closed, or one last line (unless the last line already
        showed it)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._shown != self.done:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        self._shown = self.done
        elapsed = now - self._start
        rate = (self.done - self.initial) / max(elapsed, 1e-9)
        unit = f" {self.unit}" if self.unit else ""
        done = f"{_human(self.done)}{unit}"
        if self.total:
            fraction = min(1.0, self.done / self.total)
            done = f"{fraction:.1%} ({_human(self.done)} of {_human(self.total)}{unit})"
        note = f", {self._note}" if self._note else ""
        self.stream.write(f"{self.label}: {done}, {_human(rate)}{unit}/s, {elapsed:.1f} s{note}\n")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _human(value: float) -> str:
    for suffix in ("", "k", "M", "G", "T"):
        if abs(value) < 1000:
            whole = not suffix and value == int(value)
            return f"{value:.0f}" if whole else f"{value:.1f}{suffix}"
        value /= 1000
    return f"{value:.1f}P"
