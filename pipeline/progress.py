"""Progress bars that read well wherever the output goes.

    with progress_bar(total=n, desc="encode train", unit="pair") as bar:
        bar.update(k)

On a terminal: tqdm's live bar, as is. Anywhere else (a file, a pipe, CI,
`dvc repro > log`): the same figures as plain lines, one every
NON_TERMINAL_SECONDS at most and one at the end, instead of thousands of
carriage-return redraws piled into a single line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

NON_TERMINAL_SECONDS = 60.0


class _Lines:
    """A stream for tqdm: each redraw ("\\r" + status + padding) becomes a line of its own, the first one at once,
    then at most one every `seconds` (a forced refresh, e.g. set_postfix, waits too), and the last one when the
    bar closes (tqdm then writes "\\n")."""

    def __init__(self, stream: TextIO, seconds: float):
        self.stream, self.seconds = stream, seconds
        self.last: float | None = None
        self.pending = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.pending = line
            if self.last is not None and time.monotonic() - self.last < self.seconds:
                return
        if self.pending and (line or "\n" in text):
            self.stream.write(self.pending + "\n")
            self.pending, self.last = "", time.monotonic()

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(*args, file: TextIO | None = None, **kwargs) -> tqdm:
    """tqdm(*args, **kwargs), writing plain lines at most once a minute when `file` (stderr) is no terminal."""
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return tqdm(*args, file=stream, **kwargs)
    kwargs.update(mininterval=NON_TERMINAL_SECONDS, maxinterval=NON_TERMINAL_SECONDS, ncols=0, dynamic_ncols=False)
    return tqdm(*args, file=_Lines(stream, NON_TERMINAL_SECONDS), **kwargs)
