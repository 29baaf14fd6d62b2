"""Python's cyclic garbage collector, paused while a stage imports its libraries.

torch, dynamo, MLflow and DVC create millions of objects as they load, and the collector walks all of them again each
time enough new ones pile up: about a fifth of a train process's start, and a third of MLflow's import once torch is
in. Nothing here changes what a stage computes: no object's life depends on when the collector runs.

    pause()          # stages/__init__.py: a stage started as a command, before its imports
    resume()         # pipeline.core.cli.run, before the stage's main(): what the imports left frozen (gc.freeze:
                     # kept out of every later walk), the collector on
    with paused():   # tracking: MLflow's and DVC's imports when a stage opens its run
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


def pause() -> None:
    gc.disable()


def resume() -> None:
    """After pause(): freeze what was imported and turn the collector on; otherwise nothing."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside, on again after (nothing frozen: the caller may be a long-lived process)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
