"""pipeline.tracking: parent and child runs in a real sqlite store; a dead server costs one warning and seconds."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from pipeline import distributed, tracking
from stages import train
from tests.http_fixtures import FileServer
from tests.train_fixtures import stage_args, write_corpus, write_params


@pytest.fixture(autouse=True)
def _fresh_tracking(monkeypatch):
    """Each test starts with tracking on (a failure turns it off for the rest of a process) and one thread."""
    monkeypatch.setattr(tracking, "_disabled", False)
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def all_runs(uri: str) -> list:
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dvc_queue_temp_copy_tracks_into_the_repos_database(tmp_path, monkeypatch):
    from dvc.repo.experiments.utils import EXEC_TMP_DIR  # where dvc makes its temp copies: <repo>/.dvc/tmp/<this>

    repo = tmp_path / "repo"
    copy = repo / ".dvc" / "tmp" / EXEC_TMP_DIR / "tmpab12cd"
    copy.mkdir(parents=True)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.repo_root(copy / "params.yaml") == repo
    assert tracking.tracking_uri(copy / "params.yaml") == f"sqlite:///{repo / 'mlflow.db'}"
    assert tracking.tracking_uri(repo / "params.yaml") == f"sqlite:///{repo / 'mlflow.db'}"
    assert Path(tracking.tracking_uri(Path("params.yaml")).removeprefix("sqlite:///")).is_absolute()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking.tracking_uri(copy / "params.yaml") == "http://tracking.example:5000"


def test_a_training_run_is_a_train_child_under_its_pipeline_parent(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DVC_EXP_NAME", "brisk-wren")
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", max_steps=4, log_every=1)
    train.main(stage_args(tmp_path, params))
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())

    runs = all_runs(uri)
    assert len(runs) == 2
    parent = next(r for r in runs if "stage" not in r.data.tags)
    child = next(r for r in runs if r.data.tags.get("stage") == "train")
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.status == "FINISHED" and child.info.run_name == "train"
    for key in ("flops_analytic", "mfu", "valid_ppl", "train_tokens", "tokens_per_second"):
        assert child.data.metrics[key] == pytest.approx(metrics[key]), key
    assert child.data.params["model.d_model"] == "16" and child.data.params["train.warmup_steps"] == "4"
    history = MlflowClient(uri).get_metric_history(child.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    tags = parent.data.tags
    assert tags["dvc_exp_name"] == "brisk-wren" and tags["preset"] == "synthetic_custom"
    assert len(tags["pipeline_key"]) == 64 and tags["git_commit"] and tags["params_hash"]
    # the DVC record, copied into the parent with the file stem as prefix
    assert parent.data.metrics["train.flops_analytic"] == pytest.approx(metrics["flops_analytic"])
    assert parent.data.tags["train.device"] == metrics["device"]


def test_later_stages_join_the_same_parent_and_a_params_change_opens_another(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"name": "multi30k"}, "average": {"last_n": 5}}))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"test": {"bleu": 30.5, "signature": "nrefs:1"}}))
    with tracking.stage_run("average", params) as run:
        run.log_metrics({"averaged_checkpoints": 5})
    with tracking.stage_run("evaluate", params) as run:
        run.log_metrics({"bleu": 30.5})
    runs = all_runs(uri)
    parents = [r for r in runs if "stage" not in r.data.tags]
    assert len(parents) == 1 and parents[0].data.tags["preset"] == "multi30k_custom"
    assert sorted(r.data.tags["stage"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id) \
        == ["average", "evaluate"]
    assert parents[0].data.metrics["eval.test.bleu"] == 30.5
    assert parents[0].data.tags["eval.test.signature"] == "nrefs:1"

    params.write_text(yaml.safe_dump({"data": {"name": "multi30k"}, "average": {"last_n": 3}}))
    with tracking.stage_run("average", params):
        pass
    assert len([r for r in all_runs(uri) if "stage" not in r.data.tags]) == 2


def test_a_failing_stage_marks_its_run_failed(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
    with pytest.raises(RuntimeError, match="boom"):
        with tracking.stage_run("average", params):
            raise RuntimeError("boom")
    child = next(r for r in all_runs(uri) if r.data.tags.get("stage") == "average")
    assert child.info.status == "FAILED"


def test_an_unreachable_server_costs_one_warning_and_seconds(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    for key in tracking.ENV_DEFAULTS:  # our low retry and timeout defaults, not the caller's; unset afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", max_steps=4, log_every=1)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        train.main(stage_args(tmp_path, params))
    elapsed = time.monotonic() - started
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MLflow tracking" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 4 and "flops_analytic" in metrics and "valid_ppl" in metrics
    assert elapsed < 30, f"training with a dead tracking server took {elapsed:.0f} s"


def test_a_server_answering_errors_turns_tracking_off_after_one_warning(tmp_path, monkeypatch, caplog):
    with FileServer(tmp_path / "www") as server:
        server.fail_first = 1000
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.base_url)
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
        with caplog.at_level(logging.WARNING), tracking.stage_run("average", params) as run:
            run.log_metrics({"x": 1.0})
            run.log_params({"a": 1})
        asked = len(server.requests)
        with tracking.stage_run("evaluate", params) as run:  # off for the rest of the process: no more requests
            run.log_metrics({"y": 2.0})
        assert len(server.requests) == asked == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert not run.active


def test_a_server_that_never_answers_costs_one_timeout(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) but never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{listener.getsockname()[1]}")
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
        started = time.monotonic()
        with caplog.at_level(logging.WARNING), tracking.stage_run("average", params) as run:
            for step in range(20):
                run.log_metrics({"x": float(step)}, step=step)
        elapsed = time.monotonic() - started
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert elapsed < 10, f"{elapsed:.1f} s"


def test_the_preset_tag_names_the_model_size_of_each_paper_preset():
    from pipeline.config import compose

    for experiment, size in (("multi30k_small", "small"), ("wmt14_en_de_base", "base"), ("wmt14_en_fr_big", "big")):
        assert tracking.model_size(compose([f"experiment={experiment}"])["model"]) == size
    assert tracking.model_size({"n_layers": 2, "d_model": 16}) == "custom"
