"""Progress on a terminal is tqdm's live bar; in a log file or CI it is plain lines, a few a minute at most."""

from __future__ import annotations

import io
import re
import os
import time

import pytest

from pipeline import progress as progress_module
from pipeline.progress import progress_bar
from tests.fixtures.tiny_run import SIZES, tiny_run  # noqa: F401 (tiny_run is a fixture)


def run_bar(stream, steps: int = 200, pause: float = 0.005) -> None:
    with progress_bar(total=steps, desc="encode train", unit="pair", file=stream) as bar:
        for step in range(steps):
            bar.update(1)
            bar.set_postfix(loss=f"{1 / (step + 1):.3f}")  # a forced refresh, as the trainer's log steps do
            time.sleep(pause)


def test_on_a_non_terminal_each_update_is_a_plain_line_the_first_at_once_then_at_most_one_per_interval(monkeypatch):
    monkeypatch.setattr(progress_module, "NON_TERMINAL_SECONDS", 0.25)
    out = io.StringIO()
    start = time.monotonic()
    run_bar(out)
    took = time.monotonic() - start
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("encode train:") and " 0/200 " in lines[0]
    assert " 200/200 " in lines[-1] and "loss=0.005" in lines[-1]  # the final figures, written when the bar closes
    assert 3 <= len(lines) <= took / 0.25 + 2, lines  # rate-limited: not one line per update
    assert all(line.startswith("encode train:") for line in lines)


def test_on_a_terminal_the_bar_redraws_in_place():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w", closefd=True) as tty:
        assert tty.isatty()
        run_bar(tty, steps=20, pause=0.0)
        tty.flush()
        os.set_blocking(leader, False)
        written = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            written += chunk
    os.close(leader)
    assert written.count(b"\r") >= 2 and b"20/20" in written  # tqdm's carriage-return redraws, unchanged


@pytest.mark.slow
def test_dvc_repro_into_a_pipe_logs_progress_as_lines_not_carriage_returns(tiny_run):
    """`dvc repro` of every stage with its output captured (a pipe, as in CI or `dvc repro > log`): no redraws piled in
    a line. The output is the session's tiny run's (tests/fixtures/tiny_run.py), its corpus SIZES sentences."""
    out, lines = tiny_run.output, SIZES["train"]
    assert tiny_run.returncode == 0, out[-2000:]
    assert "\r" not in out
    assert re.search(rf"^encode train: +100% {lines}/{lines} ", out, re.M), out[-2000:]
