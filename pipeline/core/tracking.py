"""MLflow tracking: one parent run per pipeline run, one child run under it per stage; runs by hand stand alone.

    from pipeline.core import tracking
    with tracking.stage_run("train", args) as run:           # args: the stage's parsed command line
        run.log_params({"model": asdict(model_cfg)})         # nested dicts -> "model.d_model"
        run.log_metrics({"loss": 2.3}, step=100)
        run.set_tags({"device": "cpu"})

Browse:  mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1

Where: $MLFLOW_TRACKING_URI if set, else the sqlite database `mlflow.db` in
the repo root as an absolute path. The root is where the stage runs
(pipeline/core/lineage.py, work_root: $DVC_ROOT under DVC, else the nearest
directory from the cwd up that holds dvc.yaml), never the params file's directory; inside the temporary copy that
`dvc exp run --queue` / `--temp` runs in (`<root>/.dvc/tmp/exps/<tmpdir>/`,
dvc/repo/experiments/executor/local.py) it is the `<root>` that holds the
copy, so queued experiments land in the same database (a sqlite store is opened
under the file lock `<database>.lock`: queued experiments start together, and
the first client creates a new store's tables). Experiment:
`transformer-<data.name>` (runs on the same data compare).

A stage run by DVC (pipeline/core/lineage.py: $DVC_STAGE) is a child of its
pipeline run. The parent is found (or created) by its tag `pipeline_key` =
sha256 of the git commit and the full params file, and tagged with git_commit,
dvc_exp_name ($DVC_EXP_NAME, which dvc sets for queued/temp experiments),
preset (data name and model size) and params_file_sha256 (sha256 of the params file; params_hash names
only the train stage's hash of what shapes the weights).
The parent holds the DVC metrics files as `<file stem>.<key>` (numbers as
metrics, strings as tags), only those of this run: when a stage opens, those
that pipeline/core/lineage.py finds current (so the parent shows the whole pipeline
even when DVC skipped cached stages); when it finishes, its own --metrics file
and those found current once it counts as done (downstream stages that DVC
will skip because this one wrote the same outputs as before). A stage run by hand (`python -m stages.x`)
gets a run of its own, named `<stage> (by hand)` and tagged hand_run, with no
parent and no metrics files: it never joins, nor changes, a pipeline run.
Every stage's run is tagged `path.<argument>` with the paths it was given.

Runs end FINISHED, FAILED (an exception) or KILLED (SIGINT, SIGTERM or SIGHUP:
pipeline/core/signals.py raises them as exceptions while a run is open, so the runs
are closed on the way out; one arriving inside an MLflow call waits for the call
to end; SIGKILL cannot be caught).

PIPELINE_TRACKING=0 in the environment turns tracking off: the stages run as
they would after a tracking failure, with neither MLflow nor the DVC lineage
loaded (seconds a stage), and the DVC metrics files are the record (the test
suite does, but where a test reads the runs).

Failure policy: tracking never stops a stage. The first MLflow error (server
unreachable, gone mid-run, database locked...) logs ONE warning and turns
tracking off for the rest of the process; the DVC metrics files remain the
record. HTTP retries and timeouts are set low (env vars below, overridable) so a
dead server costs seconds. Telemetry is off (MLFLOW_DISABLE_TELEMETRY, checked
in mlflow/telemetry/utils.py), set before mlflow is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from pipeline.core import collector, lineage, signals, views
from pipeline.core.switches import switch

log = logging.getLogger(__name__)

EXPERIMENT_PREFIX = "transformer"
DB_NAME = "mlflow.db"
ENV_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
}
ENV = "PIPELINE_TRACKING"
MAX_BATCH = 100  # keys per log_batch call (below MLflow's limits)
OPEN_LOCK_SECONDS = 120  # the longest a stage waits for others opening their runs in the same sqlite store

_disabled = False  # set by the first failure: tracking stays off for this process


def switched_on() -> bool:
    """False when $PIPELINE_TRACKING turns tracking off (0, false, no, off)."""
    return switch(ENV, default=True)


def repo_root(work: Path | None = None) -> Path:
    """The repo whose mlflow.db is used: where stages run (lineage.work_root()), or the repo holding a dvc exp copy."""
    here = (work or lineage.work_root()).resolve()
    return lineage.exp_copy_of(here) or here


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else an absolute sqlite URI for <repo root>/mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / DB_NAME}"


def git_commit(directory: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def model_size(model: dict) -> str:
    """The conf/model preset (small, base, big, tiny) whose shape (ModelConfig.shape) the model section has, else 'custom'."""
    from model.config import ModelConfig
    from pipeline.core.config import CONF_DIR

    fields = ModelConfig.__dataclass_fields__
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        preset = {k: v for k, v in yaml.safe_load(path.read_text(encoding="utf-8")).items() if k in fields}
        if set(preset) == set(fields) and all(model.get(k) == v for k, v in ModelConfig(**preset).shape().items()):
            return path.stem
    return "custom"


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def numbers_and_strings(flat: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """Split flat values into finite numbers (MLflow metrics) and strings (tags); booleans and the rest are dropped."""
    numbers, strings = {}, {}
    for key, value in flat.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            numbers[key] = float(value)
        elif isinstance(value, str):
            strings[key] = value
    return numbers, strings


def dvc_metrics(paths: list[Path]) -> tuple[dict[str, float], dict[str, str]]:
    """The metrics files `paths` flattened to `<stem>.<key>`: (numbers, strings)."""
    numbers, strings = {}, {}
    for path in paths:
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("not copying %s into MLflow: %s", path, e)
            continue
        found = numbers_and_strings(flatten(content, path.stem))
        numbers |= found[0]
        strings |= found[1]
    return numbers, strings


def _chunks(items: list, n: int = MAX_BATCH) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class StageRun:
    """A child run (or a no-op when tracking is off); every call survives MLflow failures."""

    def __init__(self, client: Any = None, run_id: str | None = None, uri: str = ""):
        self.client, self.run_id, self.uri = client, run_id, uri

    @property
    def active(self) -> bool:
        return self.run_id is not None and not _disabled

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.active:
            return None
        return _guard(self.uri, fn)

    def log_params(self, params: dict) -> None:
        if not self.active:  # no run (tracking off, failed, or a rank other than 0): MLflow stays unloaded
            return
        from mlflow.entities import Param

        flat = [Param(k, str(v)) for k, v in flatten(params).items()]
        for chunk in _chunks(flat):
            self._call(lambda chunk=chunk: self.client.log_batch(self.run_id, params=chunk))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.active:  # no run (tracking off, failed, or a rank other than 0): MLflow stays unloaded
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        flat = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None and math.isfinite(v)]
        for chunk in _chunks(flat):
            self._call(lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk))

    def log_artifact(self, path: str | Path, artifact_path: str) -> None:
        """Store a copy of file `path` with the run, under `artifact_path/` (e.g. the hypotheses a BLEU came from)."""
        self._call(lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def set_tags(self, tags: dict[str, Any]) -> None:
        if not self.active:  # no run (tracking off, failed, or a rank other than 0): MLflow stays unloaded
            return
        from mlflow.entities import RunTag

        flat = [RunTag(k, str(v)) for k, v in tags.items()]
        for chunk in _chunks(flat):
            self._call(lambda chunk=chunk: self.client.log_batch(self.run_id, tags=chunk))

    def log_results(self, results: dict[str, Any]) -> None:
        """A stage's flat metrics file: numbers as metrics, strings as tags."""
        numbers, strings = numbers_and_strings(results)
        self.log_metrics(numbers)
        self.set_tags(strings)


def _guard(uri: str, fn: Callable[[], Any]) -> Any:
    """Run one MLflow call; on the first failure warn once and switch tracking off."""
    global _disabled
    if _disabled:
        return None
    with signals.held():  # a signal raised mid-call would leave the database session unusable, the runs RUNNING
        try:
            return fn()
        except Exception as e:  # any failure of the tracking backend, by policy
            _disabled = True
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("MLflow tracking at %s failed (%s); tracking is off for the rest of this process, "
                        "the DVC metrics files remain the record", uri, first_line[:300])
            return None


def _client(uri: str) -> Any:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite store's URI; None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def _store_lock(uri: str) -> contextlib.AbstractContextManager:
    """For a sqlite store, its file lock `<database>.lock`: queued experiments start their stages together, and each
    would create a new store's tables (and the experiment) itself; all but one failed and ran untracked."""
    if (db := _sqlite_path(uri)) is None:
        return contextlib.nullcontext()
    from filelock import FileLock

    return FileLock(f"{db}.lock", timeout=OPEN_LOCK_SECONDS)


def _experiment_id(client: Any, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    db = _sqlite_path(uri)
    location = (db.parent / "mlartifacts").as_uri() if db is not None else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # a tracking server: another stage created it meanwhile
        if (found := client.get_experiment_by_name(name)) is None:
            raise
        return found.experiment_id


def pipeline_tags(params_path: Path) -> dict[str, str]:
    """Tags of the parent run: pipeline_key, git_commit, dvc_exp_name, preset, params_file_sha256."""
    text = params_path.read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    commit = git_commit(lineage.work_root())
    data_name = (raw.get("data") or {}).get("name", "unknown")
    tags = {
        "pipeline_key": hashlib.sha256(f"{commit}\n{text}".encode()).hexdigest(),
        "git_commit": commit,
        "preset": f"{data_name}_{model_size(raw.get('model') or {})}",
        "params_file_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "data_name": data_name,
    }
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_exp_name"] = os.environ["DVC_EXP_NAME"]
    return tags


def path_arguments(args: argparse.Namespace) -> dict[str, Path]:
    """The path arguments of a stage's command line, by name (params, metrics, out...)."""
    return {name: value for name, value in vars(args).items() if isinstance(value, Path)}


def _open_parent(client: Any, experiment_id: str, tags: dict[str, str]) -> str:
    """Find the parent run by its pipeline_key, or create it: its run_id."""
    found = client.search_runs([experiment_id], filter_string=f"tags.pipeline_key = '{tags['pipeline_key']}'",
                               max_results=1, order_by=["attributes.start_time DESC"])
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    run_name = tags.get("dvc_exp_name") or f"{tags['preset']}-{tags['git_commit'][:8]}"
    return client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id


def _current_metrics(stage: str, finished: bool) -> list[Path]:
    """lineage.current_metrics of the repo the stage runs in; a DVC error costs a warning and those files."""
    try:
        return lineage.current_metrics(lineage.work_root(), stage, finished)
    except Exception as e:  # a broken dvc.yaml or dvc.lock must not stop the stage, by policy
        log.warning("not copying other stages' metrics into MLflow: DVC could not compare dvc.lock (%s)", e)
        return []


def _open(uri: str, stage: str, args: argparse.Namespace) -> tuple[Any, str, str | None, list[Path]]:
    """Create the stage's run (under its pipeline's parent when DVC runs it): (client, run_id, parent_id, current files)."""
    tags = pipeline_tags(Path(args.params))
    with _store_lock(uri):  # the client creates a new sqlite store's tables
        client = _client(uri)
        experiment_id = _experiment_id(client, f"{EXPERIMENT_PREFIX}-{tags['data_name']}", uri)
    own = {k: v for k, v in tags.items() if k != "pipeline_key"} | {"stage": stage}
    own |= {f"path.{k}": str(v) for k, v in path_arguments(args).items()}
    if not lineage.run_by_dvc(stage):
        run = client.create_run(experiment_id, tags=own | {"hand_run": "true"}, run_name=f"{stage} (by hand)")
        return client, run.info.run_id, None, []
    current = _current_metrics(stage, finished=False)
    parent_id = _open_parent(client, experiment_id, tags)
    run = client.create_run(experiment_id, tags=own | {"mlflow.parentRunId": parent_id}, run_name=stage)
    return client, run.info.run_id, parent_id, current


def _copy_dvc_metrics(parent: StageRun, paths: list[Path]) -> None:
    numbers, strings = dvc_metrics(paths)
    parent.log_metrics(numbers)
    parent.set_tags(strings)


@contextlib.contextmanager
def stage_run(stage: str, args: argparse.Namespace, enabled: bool = True) -> Iterator[StageRun]:
    """Open the run of `stage` (args: its parsed command line: --params, its paths); close it and its parent on exit."""
    if enabled and not switched_on():
        log.info("tracking is off (%s=%s): the DVC metrics files are the record", ENV, os.environ[ENV])
        enabled = False
    if not enabled or _disabled:
        yield StageRun()
        return
    uri = tracking_uri()
    with collector.paused():  # MLflow's and DVC's imports (pipeline/core/collector.py)
        opened = _guard(uri, lambda: _open(uri, stage, args))
    if opened is None:
        yield StageRun()
        return
    client, run_id, parent_id, current = opened
    run, parent = StageRun(client, run_id, uri), StageRun(client, parent_id, uri)
    _copy_dvc_metrics(parent, current)
    status = "FAILED"
    try:
        with signals.stopping():
            yield run
        status = "FINISHED"
    except BaseException as e:
        status = "KILLED" if signals.caused_by_signal(e) else "FAILED"
        raise
    finally:
        if status == "FINISHED" and run.active:  # its output as tools.inspect shows it (pipeline/core/views.py)
            views.log_stage_view(stage, path_arguments(args), client, run_id)
        run._call(lambda: client.set_terminated(run_id, status=status))
        if status == "FINISHED" and parent.active:  # its own --metrics file, and downstream ones DVC will skip
            own = [path_arguments(args)["metrics"]] if "metrics" in path_arguments(args) else []
            _copy_dvc_metrics(parent, own + _current_metrics(stage, finished=True))
        parent._call(lambda: client.set_terminated(parent_id, status=status))
