"""Progress output: a tqdm bar on a terminal (a real pty), plain lines anywhere else."""

from __future__ import annotations

import io
import os
import select
import termios
import time

from asyncbatch._progress import Progress


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    bar = Progress(300, "writing", "B", stream, interval=0)  # a line at every update
    for _ in range(3):
        bar.update(100)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3  # three updates; the last showed the final state: no second 100%
    assert lines[0].startswith("writing: 33.3% (100 of 300 B), ")
    assert lines[-1].startswith("writing: 100.0% (300 of 300 B), ")


def test_an_unknown_total_shows_no_fraction() -> None:
    stream = io.StringIO()
    bar = Progress(0, "writing", "B", stream)
    bar.update(2500)
    bar.close()
    assert stream.getvalue().startswith("writing: 2.5k B, ")


def test_plain_lines_are_periodic() -> None:
    stream = io.StringIO()
    bar = Progress(10**6, "streaming", " batches", stream)  # the default: every 10 s
    for _ in range(1000):
        bar.update(1)
    bar.close()
    assert stream.getvalue().count("\n") == 1  # only the final line in well under 10 s


def test_a_tqdm_bar_on_a_terminal() -> None:
    master, slave = os.openpty()
    termios.tcsetwinsize(slave, (24, 100))  # a new pty is 0 columns wide
    try:
        with os.fdopen(slave, "w", closefd=True) as terminal:
            assert terminal.isatty()
            bar = Progress(2000, "verifying", "B", terminal)
            bar.update(1000)
            bar.update(1000)
            bar.close()
        chunks = []
        while select.select([master], [], [], 0.5)[0]:  # everything the pty holds
            try:
                chunk = os.read(master, 65536)
            except OSError:  # Linux: EIO once the terminal side is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode()
    finally:
        os.close(master)
    assert "\r" in text  # redrawn in place
    assert "verifying: 100%" in text and "2.00k/2.00k" in text  # tqdm's own format


def test_a_resumed_run_says_where_it_stands_at_once_and_rates_only_new_work() -> None:
    stream = io.StringIO()
    bar = Progress(1000, "prepare", "B", stream, initial=400, note="3 of 8 units already done")
    first = stream.getvalue()
    assert first.startswith("prepare: 40.0% (400 of 1.0k B), 0 B/s, ")  # before any update
    assert first.rstrip().endswith("3 of 8 units already done")
    bar.update(600)
    bar.close()
    assert stream.getvalue().splitlines()[-1].startswith("prepare: 100.0% (1.0k of 1.0k B), ")


def test_the_clock_moves_while_nothing_is_done() -> None:
    stream = io.StringIO()
    bar = Progress(100, "prepare", "B", stream, interval=0.05)
    bar.update(10)
    time.sleep(0.06)
    bar.tick()  # no update: a line all the same, with the time gone by
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare: 10.0% (10 of 100 B), ")
    assert float(lines[0].split(" s")[0].rsplit(", ", 1)[1]) >= 0.05
