"""Progress output: a tqdm bar on a terminal (a real pty), plain lines anywhere else."""

from __future__ import annotations

import io
import os
import select
import termios

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
    assert len(lines) == 4  # three updates, then the final line
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
