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
and editing one re-runs nothing. It prints the view and writes its files to a
temporary folder; the stage's process, whose MLflow client is already open,
logs them (log_view, which `python -m tools.inspect --mlflow-run` uses too).
Like all tracking it never stops a stage: a view that fails costs one warning.
PIPELINE_VIEWS=0 in the environment turns the views off (the test suite does,
but where it checks them).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.core.switches import switch

log = logging.getLogger(__name__)

ENV = "PIPELINE_VIEWS"
VIEWED = {"download": ("out", "raw"), "tokenize": ("out", "tokenized"), "batch": ("out", "batches"),
          "average": ("out", "model"), "translate": ("out", "translations"),
          "evaluate": ("metrics", "eval")}  # stage -> (the path argument whose view is logged, tools.inspect's layout)
SIBLINGS = ("raw", "tokenized", "translations")  # path arguments a view may need beside its own
TIMEOUT_S = 600
CODE_ROOT = Path(__file__).resolve().parents[2]


def enabled() -> bool:
    return switch(ENV, default=True)


def command(stage: str, paths: dict[str, Path], out: Path) -> list[str] | None:
    """The tools.inspect command line that shows `stage`'s view, its files written to `out`, or None when the stage
    has none."""
    if stage not in VIEWED or VIEWED[stage][0] not in paths:
        return None
    cmd = [sys.executable, "-m", "tools.inspect", str(paths[VIEWED[stage][0]]), "--out", str(out)]
    for name in ("params", *SIBLINGS):
        if name in paths and name != VIEWED[stage][0]:
            cmd += [f"--{name}", str(paths[name])]
    return cmd


def environment() -> dict[str, str]:
    """The view's environment: this checkout first on the path (its tools/, beside pipeline/)."""
    path = os.pathsep.join(p for p in (str(CODE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def log_view(client: Any, run_id: str, layout: str, out: Path, text: str) -> list[str]:
    """Log a view to run_id with `client` (an MlflowClient): its text as view.txt and the files it wrote to `out`,
    under inspect/<layout>/, each CSV table also with log_table; the artifact paths logged."""
    import pandas as pd

    from pipeline.core.files import write_text

    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "view.txt", text)
    where = f"inspect/{layout}"
    files = sorted(p for p in out.iterdir() if p.is_file())
    for path in files:
        client.log_artifact(run_id, str(path), where)
    logged = [f"{where}/{p.name}" for p in files]
    for csv in (p for p in files if p.suffix == ".csv"):
        name = f"{where}/{csv.stem}.json"
        client.log_table(run_id, data=pd.read_csv(csv, keep_default_na=False), artifact_file=name)
        logged.append(name)
    log.info("logged %s to MLflow run %s", ", ".join(logged), run_id)
    return logged


def log_stage_view(stage: str, paths: dict[str, Path], client: Any, run_id: str) -> None:
    """Show the view of `stage`'s output in a process of its own, then log it to run_id with `client`; a failure of
    either is one warning."""
    if not enabled():
        return
    with tempfile.TemporaryDirectory(prefix=f"view-{stage}-") as tmp:
        cmd = command(stage, paths, Path(tmp))
        if cmd is None:
            return
        log.info("logging the %s view to MLflow", stage)
        try:
            done = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
            log_view(client, run_id, VIEWED[stage][1], Path(tmp), done.stdout)
        except Exception as e:  # a view that fails, or MLflow's errors (no common base): one warning, the stage goes on
            log.warning("the %s view was not logged to MLflow: %s", stage, " ".join(str(e).split()) or type(e).__name__)
