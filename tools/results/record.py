"""One record line from a finished pipeline run's own records, nothing typed (store.py says what a line holds).

Read in the run's repository: dvc.lock (the run finished: every stage there, and each metrics file the one
DVC recorded, by its md5), params.yaml (seed, preset), metrics/train.json (steps, tokens, FLOPs, stopped_by,
precision, threads, valid perplexity), metrics/eval.json (scores), metrics/export.json (greedy decoding
speed on validation, the project's decoder), git (commit, clean tree) and the MLflow store the stages logged
to (each stage's wall time: its latest run under the pipeline run of this commit and params; `run` is the
span from the first stage's start to the last one's end). Read where `record` runs: the CPU's model and
class (/proc/cpuinfo) and an ISA cap in the environment (`emulated`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import yaml

from pipeline.core import tracking
from pipeline.core.errors import PipelineError
from pipeline.device import cpu

STAGES = ("download", "tokenize", "batch", "train", "average", "export", "translate", "evaluate")
METRICS = {"train": "metrics/train.json", "evaluate": "metrics/eval.json"}  # what a line cannot do without
EXPORT = "metrics/export.json"
MEND = "finish the run with `dvc repro` in that repository, then record it"


def _json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{path}: missing; {MEND}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"{path}: not JSON ({e}); {MEND}") from None
    if not isinstance(found, dict):
        raise PipelineError(f"{path}: expected a JSON object; {MEND}")
    return found


def _lock_md5(lock: dict, stage: str, path: str) -> str | None:
    entries = ((lock.get("stages") or {}).get(stage) or {}).get("outs") or []
    return next((e.get("md5") for e in entries if isinstance(e, dict) and e.get("path") == path), None)


def sealed_metrics(repo: Path) -> tuple[dict, dict, dict]:
    """train.json, eval.json and export.json ({} without an export), each checked against dvc.lock's md5."""
    try:
        lock = yaml.safe_load((repo / "dvc.lock").read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise PipelineError(f"{repo / 'dvc.lock'}: missing: not a finished pipeline run; {MEND}") from None
    found = {}
    for stage, rel in (*METRICS.items(), ("export", EXPORT)):
        recorded = _lock_md5(lock, stage, rel)
        if recorded is None and stage == "export" and not (repo / rel).exists():
            found[stage] = {}
            continue
        if recorded is None:
            raise PipelineError(f"{repo / 'dvc.lock'}: no {rel} recorded for stage {stage}; {MEND}")
        try:
            actual = hashlib.md5((repo / rel).read_bytes()).hexdigest()
        except FileNotFoundError:
            raise PipelineError(f"{repo / rel}: missing; {MEND}") from None
        if actual != recorded:
            raise PipelineError(f"{repo / rel}: md5 {actual} differs from dvc.lock's {recorded} (written after "
                                f"the run, or by another); {MEND}")
        found[stage] = _json(repo / rel)
    return found["train"], found["evaluate"], found["export"]


def run_outputs(repo: Path) -> set[str]:
    """What `dvc repro` itself writes in the tree: dvc.lock and every out, metrics file and plot dvc.yaml names."""
    try:
        stages = (yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8")) or {}).get("stages") or {}
    except FileNotFoundError:
        stages = {}
    paths = {"dvc.lock"}
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            paths |= {next(iter(e)) if isinstance(e, dict) else str(e) for e in (stage.get(kind) or [])}
    return {p.rstrip("/") for p in paths}


def only_seeded(repo: Path, committed: str) -> bool:
    """Whether the tree's params.yaml is the committed one (`committed`, its text) but for train.seed and batch.seed,
    as `python -m tools.seeds` or `--compose params.yaml train.seed=N batch.seed=N` set them for a seed of a recipe."""
    try:
        now, then = (yaml.safe_load(text) for text in ((repo / "params.yaml").read_text(encoding="utf-8"), committed))
    except (OSError, yaml.YAMLError):
        return False
    if not (isinstance(now, dict) and isinstance(then, dict)):
        return False
    for section in ("train", "batch"):
        if isinstance(now.get(section), dict) and isinstance(then.get(section), dict):
            then[section] = {**then[section], "seed": now[section].get("seed")}
    return now == then


def git(repo: Path) -> tuple[str, bool]:
    """The commit checked out in `repo` and whether its tree is clean: no change, tracked or not (but ignored), other
    than what the run itself wrote (run_outputs) and the seeds in params.yaml (only_seeded)."""
    def out(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise PipelineError(f"{repo}: not a git repository with a commit ({done.stderr.strip()}); {MEND}")
        return done.stdout
    written = run_outputs(repo)
    changed = [line[3:] for line in out("status", "--porcelain", "--untracked-files=all").splitlines() if line.strip()]
    others = [p for p in changed if not any(p == w or p.startswith(w + "/") for w in written)]
    if others == ["params.yaml"]:
        shown = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=repo, capture_output=True, text=True, timeout=60)
        others = [] if shown.returncode == 0 and only_seeded(repo, shown.stdout) else others
    return out("rev-parse", "HEAD").strip(), not others


def machine(environ: dict, text: str | None = None) -> tuple[dict, str | None]:
    """The CPU as the run saw it (its model; its class: the widest unit it has that an ISA cap in `environ`
    leaves, pipeline/device/cpu.py) and what was capped."""
    capped, kind, model = cpu.caps_line(environ), cpu.unit(text, environ), cpu.cpuinfo("model name", text)
    emulated = f"{kind} by an ISA cap on a {model or 'CPU'}: {capped}" if capped else None
    return {"cpu": model, "class": kind, "threads": None, "gpu": None}, emulated


def stage_walls(uri: str, commit: str, params_text: str) -> dict:
    """Seconds each stage's latest MLflow run under this run's parent took, and `run`: their whole span."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return {}  # no store there: nothing was logged (opening one would create it)
    from mlflow.tracking import MlflowClient  # only here: the tables and their check never need MLflow

    key = hashlib.sha256(f"{commit}\n{params_text}".encode()).hexdigest()  # pipeline.core.tracking's pipeline_key
    client = MlflowClient(tracking_uri=uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(ids, filter_string=f"tags.pipeline_key = '{key}'") if ids else []
    if not parents:
        return {}
    children = client.search_runs(ids, filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    latest: dict[str, Any] = {}
    for run in children:
        stage, info = run.data.tags.get("stage"), run.info
        if stage in STAGES and info.end_time and (stage not in latest or info.end_time > latest[stage].end_time):
            latest[stage] = info
    walls = {s: round((i.end_time - i.start_time) / 1000, 1) for s, i in latest.items()}
    if latest:
        walls["run"] = round((max(i.end_time for i in latest.values())
                              - min(i.start_time for i in latest.values())) / 1000, 1)
    return walls


def _threads(device: str) -> int | None:
    found = re.search(r"(\d+) threads?", device or "")
    return int(found.group(1)) if found else None


def line(repo: Path, *, command: str, recipe: str, sitting: str | None = None, baseline: str | None = None,
         run_id: str | None = None, uri: str | None = None, environ: dict | None = None,
         cpu_text: str | None = None, today: Callable[[], dt.date] = lambda: dt.datetime.now(dt.timezone.utc).date()
         ) -> dict:
    """The record line of the finished run in `repo` (module doc)."""
    environ = dict(os.environ) if environ is None else environ
    train, evaluation, export = sealed_metrics(repo)
    params_text = (repo / "params.yaml").read_text(encoding="utf-8")
    params = yaml.safe_load(params_text) or {}
    commit, clean = git(repo)
    seed = (params.get("train") or {}).get("seed")
    if not isinstance(seed, int) or (params.get("batch") or {}).get("seed") != seed:
        raise PipelineError(f"{repo / 'params.yaml'}: train.seed and batch.seed: expected one whole number, as "
                            f"`python -m tools.seeds` sets them")
    found, emulated = machine(environ, cpu_text)
    device = str(train.get("device", ""))
    found["threads"] = _threads(device)
    if "cuda" in device.lower() or "gpu" in device.lower():
        found |= {"class": "GPU", "gpu": device, "cpu": None}
    walls = stage_walls(uri or f"sqlite:///{repo.resolve() / 'mlflow.db'}", commit, params_text)
    if "train" not in walls and isinstance(train.get("train_hours"), (int, float)):
        walls["train"] = round(train["train_hours"] * 3600, 1)
    day = today().isoformat()
    data, size = (params.get("data") or {}).get("name", "unknown"), tracking.model_size(params.get("model") or {})
    return {
        "id": run_id or f"{day}-{commit[:7]}-s{seed}", "sitting": sitting, "date": day, "commit": commit,
        "clean": clean, "command": command, "preset": f"{data}_{size}", "recipe": recipe,
        "baseline": baseline, "params_hash": train.get("params_hash"), "seed": seed, "machine": found,
        "emulated": emulated, "precision": str(train.get("precision", "fp32")), "wall_s": walls,
        "steps": int(train.get("steps", 0)), "train_tokens": train.get("train_tokens"),
        "flops": train.get("flops_analytic"), "stopped_by": train.get("stopped_by"),
        "valid": {"bleu": evaluation.get("valid_bleu"), "lc_norm_tok": evaluation.get("valid_bleu_lc_norm_tok"),
                  "chrf": evaluation.get("valid_chrf"), "ppl": train.get("valid_ppl")},
        "test": {"bleu": evaluation.get("bleu"), "lc_norm_tok": evaluation.get("bleu_lc_norm_tok"),
                 "bleu_tokenized": evaluation.get("bleu_tokenized"), "chrf": evaluation.get("chrf")},
        "decode_sentences_per_s": export.get("sentences_per_second_project"), "transcribed": None,
    }
