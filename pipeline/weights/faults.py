"""Deterministic fault injection for tests: SIGKILL this process at a named point of a given step.

    TRANSFORMER_FAULT=checkpoint_write@4 python -m stages.train ...

kills the train stage while it writes the checkpoint of step 4 (the temporary
file partly written, not yet renamed). Points, each called once where it
happens: `step` (inside training step N, before its update), `checkpoint_write`
(in pipeline.weights.checkpoint, after the payload went into the temporary file, before
its flush and rename), `validation` (entering the validation run after step N), and the export stage's
`export_written@0` (the export written and sealed in its temporary folder) and `export_checked@0` (checked, not yet
moved into place).
Several faults: `step@3,validation@6`. Unset or empty, inject() is one
environment lookup: nothing else happens.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TRANSFORMER_FAULT"
POINTS = ("step", "checkpoint_write", "validation", "export_written", "export_checked")  # export_*: @0


def parse_spec(spec: str) -> set[tuple[str, int]]:
    """'point@step,...' -> {(point, step)}; an unknown point or a step that is not an integer is an error."""
    faults = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, step = item.partition("@")
        if point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected point@step with point in {POINTS}, got {item!r}")
        faults.add((point, int(step)))
    return faults


def inject(point: str, step: int) -> None:
    """SIGKILL this process if $TRANSFORMER_FAULT names `point@step`; otherwise do nothing."""
    spec = os.environ.get(ENV)
    if spec and (point, step) in parse_spec(spec):
        print(f"{ENV}: SIGKILL at {point}@{step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
