"""A view of tools.inspect logged to an MLflow run (`--mlflow-run RUN_ID`; the pipeline does it for each stage).

Under the run's artifacts `inspect/<layout>/`: view.txt (what the view
printed), its pictures and its CSV tables. Each CSV table is also logged with
MLflow's log_table as `inspect/<layout>/<name>.json`, which the UI shows as a
table (the eval view's sentences: source, reference, hypothesis, sentence BLEU
and chrF, sortable).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pandas as pd

from pipeline.core.files import write_text

log = logging.getLogger(__name__)


def log_view_artifacts(run_id: str, layout: str, out: Path, text: str) -> list[str]:
    """Log the view's text and the files it wrote to `out` to run_id; the artifact paths logged."""
    from mlflow import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines (creating a store's tables) are noise here
    client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
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
