"""A finished stage's output, as `python -m tools.inspect` shows it, logged to the stage's MLflow run.

The view's text (view.txt), its pictures (PNG) and tables (CSV) land under the
run's artifacts `inspect/<layout>/`; a table of one row per sentence (the
evaluate stage's: source, reference, hypothesis, sentence BLEU and chrF) is
also logged with MLflow's log_table, so the UI shows it as a table.

    stage      view of          stage      view of
    download   data/raw         average    data/model
    tokenize   data/tokenized   translate  data/translations
    batch      data/batches     evaluate   metrics/eval.json

train has none here (its view reads every checkpoint: gigabytes at the paper's
scale; `python -m tools.inspect data/checkpoints` shows it on demand).

The view runs as a process of its own once the stage's outputs are written, so
tools/ is not a dependency of any stage: a view changes no output DVC tracks,
and editing one re-runs nothing. Like all tracking it never stops a stage: a
view that fails costs one warning. PIPELINE_VIEWS=0 in the environment turns
the views off (the test suite does, but where it checks them).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "PIPELINE_VIEWS"
VIEWED = {"download": "out", "tokenize": "out", "batch": "out", "average": "out", "translate": "out",
          "evaluate": "metrics"}  # stage -> the path argument whose view is logged
SIBLINGS = ("raw", "tokenized", "translations")  # path arguments a view may need beside its own
TIMEOUT_S = 600
CODE_ROOT = Path(__file__).resolve().parents[2]


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def command(stage: str, paths: dict[str, Path], out: Path, run_id: str) -> list[str] | None:
    """The tools.inspect command line that logs `stage`'s view to run_id, or None when the stage has none."""
    if stage not in VIEWED or VIEWED[stage] not in paths:
        return None
    cmd = [sys.executable, "-m", "tools.inspect", str(paths[VIEWED[stage]]), "--out", str(out), "--mlflow-run", run_id]
    for name in ("params", *SIBLINGS):
        if name in paths and name != VIEWED[stage]:
            cmd += [f"--{name}", str(paths[name])]
    return cmd


def environment(uri: str) -> dict[str, str]:
    """The view's environment: the store's URI, and this checkout first on the path (its tools/, beside pipeline/)."""
    path = os.pathsep.join(p for p in (str(CODE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": path}


def log_stage_view(stage: str, paths: dict[str, Path], uri: str, run_id: str) -> None:
    """Run the view of `stage`'s output into run_id of the store `uri`; a failure is one warning."""
    if not enabled():
        return
    with tempfile.TemporaryDirectory(prefix=f"view-{stage}-") as tmp:
        cmd = command(stage, paths, Path(tmp), run_id)
        if cmd is None:
            return
        log.info("logging the %s view to MLflow", stage)
        try:
            done = subprocess.run(cmd, env=environment(uri), capture_output=True, text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("the %s view was not logged to MLflow: %s", stage, e)
            return
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        log.warning("the %s view was not logged to MLflow: %s", stage, last)
