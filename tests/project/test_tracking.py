"""pipeline.core.tracking: parent and child runs in a real sqlite store; a dead server costs one warning and seconds."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from pipeline.device import distributed
from pipeline.core import lineage, signals, tracking
from stages import evaluate, train
from tests.fixtures.files_server import FileServer
from tests.fixtures.evaluate import HYPS, REFS, write_split_files
from tests.fixtures.train import ROOT, stage_args, stage_env, write_corpus, write_params


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


def stage_args_of(params: Path, **paths: Path) -> argparse.Namespace:
    """A stage's parsed command line: --params and its path arguments."""
    return argparse.Namespace(params=params, **paths)


def evaluate_params(path: Path) -> Path:
    """A params file for the evaluate stage (13a, German references)."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())["data"] | {"tgt_lang": "de"}
    path.write_text(yaml.safe_dump({"evaluate": {"tokenize": "13a"}, "data": data}))
    return path


def own_store() -> str:
    """The URI of the test's own sqlite store: a copy of a new one, its tables made (tests/conftest.py), where a new
    store's migrations would cost seconds in each test."""
    return os.environ["MLFLOW_TRACKING_URI"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dvc_queue_temp_copy_tracks_into_the_repos_database(tmp_path, monkeypatch):
    from dvc.repo.experiments.utils import EXEC_TMP_DIR  # where dvc makes its temp copies: <repo>/.dvc/tmp/<this>

    repo = tmp_path / "repo"
    copy = repo / ".dvc" / "tmp" / EXEC_TMP_DIR / "tmpab12cd"
    copy.mkdir(parents=True)
    for root in (repo, copy):
        (root / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert tracking.repo_root(copy) == repo
    monkeypatch.chdir(copy)  # where `dvc exp run --queue` runs the stages
    assert tracking.tracking_uri() == f"sqlite:///{repo / 'mlflow.db'}"
    monkeypatch.chdir(repo / ".dvc")
    assert tracking.tracking_uri() == f"sqlite:///{repo / 'mlflow.db'}"
    monkeypatch.setenv("DVC_ROOT", str(copy))  # what DVC sets for the stages it runs
    assert tracking.tracking_uri() == f"sqlite:///{repo / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking.tracking_uri() == "http://tracking.example:5000"


def test_a_queued_experiment_reads_its_own_copy_not_the_repo_that_queued_it(tmp_path, monkeypatch):
    from dvc.repo.experiments.utils import EXEC_TMP_DIR

    repo = tmp_path / "repo"
    copy = repo / ".dvc" / "tmp" / EXEC_TMP_DIR / "tmpab12cd"
    (copy / "sub").mkdir(parents=True)
    for root in (repo, copy):
        (root / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("DVC_ROOT", str(repo))  # what DVC sets in a queued experiment: the repo that queued it
    monkeypatch.chdir(copy / "sub")  # where the stage runs: the copy, whose dvc.lock and metrics are this run's
    assert lineage.work_root() == copy
    assert tracking.tracking_uri() == f"sqlite:///{repo / 'mlflow.db'}"  # one store all the same
    monkeypatch.chdir(repo)
    assert lineage.work_root() == repo
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "other"))  # a copy of another repo: DVC_ROOT as DVC set it
    monkeypatch.chdir(copy)
    assert lineage.work_root() == tmp_path / "other"


def test_the_store_stays_at_the_repo_root_whatever_params_file_is_passed(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "some" / "dir").mkdir(parents=True)
    (repo / "dvc.yaml").write_text("stages: {}\n")
    params = evaluate_params(repo / "some" / "dir" / "file.yaml")
    translations, raw = write_split_files(repo, HYPS, REFS)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(repo / "some")
    evaluate.main(["--translations", str(translations), "--raw", str(raw), "--metrics", str(repo / "eval.json"),
                   "--params", str(params)])
    assert (repo / "mlflow.db").is_file() and not (params.parent / "mlflow.db").exists()
    assert [r.data.tags["stage"] for r in all_runs(f"sqlite:///{repo / 'mlflow.db'}")] == ["evaluate"]


UNTRACKED_STAGE = """
import sys
from stages import evaluate
evaluate.main(sys.argv[1:])
print(sorted(m for m in ("mlflow", "dvc.repo", "sqlalchemy") if m in sys.modules))
"""


def test_pipeline_tracking_0_runs_a_stage_of_a_pipeline_run_without_mlflow_or_dvc(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dvc.yaml").write_text("stages: {}\n")
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # a lineage to read, were tracking on
    params = evaluate_params(repo / "params.yaml")
    translations, raw = write_split_files(repo, HYPS, REFS)
    args = ["--translations", str(translations), "--raw", str(raw), "--metrics", str(repo / "eval.json"),
            "--params", str(params)]
    env = stage_env(PIPELINE_TRACKING="0", DVC_STAGE="evaluate", DVC_ROOT=str(repo),
                    MLFLOW_TRACKING_URI=f"sqlite:///{repo / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-c", UNTRACKED_STAGE, *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"  # neither MLflow, its database layer nor DVC loaded
    assert "tracking is off (PIPELINE_TRACKING=0)" in done.stderr
    assert json.loads((repo / "eval.json").read_text())["bleu"] > 0 and not (repo / "mlflow.db").exists()
    done = subprocess.run([sys.executable, "-c", UNTRACKED_STAGE, *args], cwd=repo, env={**env, "PIPELINE_TRACKING": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "['dvc.repo', 'mlflow', 'sqlalchemy']"
    runs = all_runs(f"sqlite:///{repo / 'mlflow.db'}")  # tracking on: the stage's run under its pipeline's parent
    assert sorted(r.data.tags.get("stage", "the parent") for r in runs) == ["evaluate", "the parent"]


def test_a_training_run_is_a_train_child_under_its_pipeline_parent(tmp_path, monkeypatch):
    uri = own_store()
    monkeypatch.setenv("DVC_EXP_NAME", "brisk-wren")
    monkeypatch.setenv("DVC_STAGE", "train")  # as `dvc repro` runs it
    monkeypatch.chdir(tmp_path)
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
    assert child.data.tags["path.checkpoints"] == str(tmp_path / "checkpoints")
    history = MlflowClient(uri).get_metric_history(child.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    tags = parent.data.tags
    assert tags["dvc_exp_name"] == "brisk-wren" and tags["preset"] == "synthetic_custom"
    assert len(tags["pipeline_key"]) == 64 and tags["git_commit"] and tags["params_file_sha256"]
    # the DVC record, copied into the parent with the file stem as prefix
    assert parent.data.metrics["train.flops_analytic"] == pytest.approx(metrics["flops_analytic"])
    assert parent.data.tags["train.device"] == metrics["device"]


def test_later_stages_join_the_same_parent_and_a_params_change_opens_another(tmp_path, monkeypatch):
    uri = own_store()
    monkeypatch.chdir(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"name": "multi30k"}, "average": {"last_n": 5}}))
    (tmp_path / "metrics").mkdir()
    metrics = tmp_path / "metrics" / "eval.json"
    monkeypatch.setenv("DVC_STAGE", "average")
    with tracking.stage_run("average", stage_args_of(params)) as run:
        run.log_metrics({"averaged_checkpoints": 5})
    monkeypatch.setenv("DVC_STAGE", "evaluate")
    with tracking.stage_run("evaluate", stage_args_of(params, metrics=metrics)) as run:
        metrics.write_text(json.dumps({"test": {"bleu": 30.5, "signature": "nrefs:1"}}))
        run.log_metrics({"bleu": 30.5})
    runs = all_runs(uri)
    parents = [r for r in runs if "stage" not in r.data.tags]
    assert len(parents) == 1 and parents[0].data.tags["preset"] == "multi30k_custom"
    assert sorted(r.data.tags["stage"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id) \
        == ["average", "evaluate"]
    assert parents[0].data.metrics["eval.test.bleu"] == 30.5
    assert parents[0].data.tags["eval.test.signature"] == "nrefs:1"

    params.write_text(yaml.safe_dump({"data": {"name": "multi30k"}, "average": {"last_n": 3}}))
    monkeypatch.setenv("DVC_STAGE", "average")
    with tracking.stage_run("average", stage_args_of(params)):
        pass
    assert len([r for r in all_runs(uri) if "stage" not in r.data.tags]) == 2


def test_a_failing_stage_marks_its_run_failed(tmp_path, monkeypatch):
    uri = own_store()
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
    with pytest.raises(RuntimeError, match="boom"):
        with tracking.stage_run("average", stage_args_of(params)):
            raise RuntimeError("boom")
    child = next(r for r in all_runs(uri) if r.data.tags.get("stage") == "average")
    assert child.info.status == "FAILED"


@pytest.mark.parametrize("sig, raised", [(signal.SIGTERM, signals.Stopped), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_during_an_mlflow_call_is_raised_after_it_and_the_runs_end_killed(tmp_path, monkeypatch, sig, raised):
    uri = own_store()
    monkeypatch.setenv("DVC_STAGE", "average")  # a child of a pipeline run, as `dvc repro` runs it
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
    logged = []
    with pytest.raises(raised) as stopped:
        with tracking.stage_run("average", stage_args_of(params)) as run:
            real = run.client.log_batch

            def log_batch(*args, **kwargs):  # the signal lands in the middle of an MLflow call
                os.kill(os.getpid(), sig)
                logged.append(real(*args, **kwargs))  # the call still runs to its end
            monkeypatch.setattr(run.client, "log_batch", log_batch)
            run.log_metrics({"x": 1.0})
            raise AssertionError("the signal was not raised once the call ended")
    assert len(logged) == 1 and (sig == signal.SIGINT or stopped.value.code == 128 + sig)
    runs = all_runs(uri)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"KILLED"}


def test_an_error_raised_while_handling_ctrl_c_ends_the_runs_killed_not_failed(tmp_path, monkeypatch):
    """A library that turns a KeyboardInterrupt into its own error (torch.save did) still closes the runs KILLED."""
    uri = own_store()
    monkeypatch.setenv("DVC_STAGE", "average")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"average": {"last_n": 5}}))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with tracking.stage_run("average", stage_args_of(params)):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("unexpected pos 64 vs 25041") from None  # `from None` keeps __context__
    runs = all_runs(uri)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"KILLED"}


OPEN_RUNS_TOGETHER = """
import argparse, json, os, sys, traceback
from pathlib import Path
from pipeline.core import tracking
for key, value in tracking.ENV_DEFAULTS.items():  # as tracking._client sets them before it imports mlflow
    os.environ.setdefault(key, value)
import dvc.repo, mlflow.tracking, mlflow.store.tracking.sqlalchemy_store  # what opening a run imports, once:
# the processes below are forks of this one
go_read, go_write = os.pipe()
pids = []
for params in sys.argv[1:]:  # one process a params file
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # every process opens at the same moment
        status = 0
        try:
            with tracking.stage_run("average", argparse.Namespace(params=Path(params))) as run:
                run.log_metrics({"x": 1.0})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    pids.append(pid)
os.write(go_write, b"x" * len(pids))
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]))
"""


@pytest.mark.slow
def test_stages_that_start_together_on_a_new_store_all_get_their_runs(tmp_path):
    """Queued experiments (`tools.seeds --run -j 3`) start their first stages at once: each used to create the new
    sqlite store's tables (and the experiment) itself; the losers warned and ran untracked. Four processes, forked
    once MLflow and DVC are imported, open their runs on a new store at the same moment."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    params = []
    for k in range(4):
        params.append(tmp_path / f"params{k}.yaml")  # four pipelines: four parents
        params[-1].write_text(yaml.safe_dump({"average": {"last_n": k + 1}}))
    env = stage_env(MLFLOW_TRACKING_URI=uri, DVC_STAGE="average", DVC_ROOT=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", OPEN_RUNS_TOGETHER, *map(str, params)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and json.loads(done.stdout) == [0] * 4, done.stderr
    assert "tracking is off" not in done.stderr, done.stderr
    runs = all_runs(uri)
    assert len(runs) == 8 and {r.info.status for r in runs} == {"FINISHED"}
    assert len({r.info.experiment_id for r in runs}) == 1


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
        with caplog.at_level(logging.WARNING), tracking.stage_run("average", stage_args_of(params)) as run:
            run.log_metrics({"x": 1.0})
            run.log_params({"a": 1})
        asked = len(server.requests)
        # off for the rest of the process: no more requests
        with tracking.stage_run("evaluate", stage_args_of(params)) as run:
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
        with caplog.at_level(logging.WARNING), tracking.stage_run("average", stage_args_of(params)) as run:
            for step in range(20):
                run.log_metrics({"x": float(step)}, step=step)
        elapsed = time.monotonic() - started
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert elapsed < 10, f"{elapsed:.1f} s"


def test_the_preset_tag_names_the_model_size_of_each_paper_preset():
    from pipeline.core.config import compose

    for experiment, size in (("multi30k_small", "small"), ("wmt14_en_de_base", "base"), ("wmt14_en_fr_big", "big")):
        assert tracking.model_size(compose([f"experiment={experiment}"])["model"]) == size
    assert tracking.model_size({"n_layers": 2, "d_model": 16}) == "custom"


def test_a_stage_run_by_hand_gets_its_own_run_tagged_with_its_paths(tmp_path, monkeypatch):
    uri = own_store()
    monkeypatch.chdir(tmp_path)
    params = evaluate_params(tmp_path / "params.yaml")
    translations, raw = write_split_files(tmp_path, HYPS, REFS)
    (tmp_path / "other").mkdir()
    other, _ = write_split_files(tmp_path / "other", REFS, REFS)
    monkeypatch.setenv("DVC_STAGE", "evaluate")  # the pipeline's evaluate, as `dvc repro` runs it
    evaluate.main(["--translations", str(translations), "--raw", str(raw), "--metrics", "metrics/eval.json",
                   "--params", str(params)])
    monkeypatch.delenv("DVC_STAGE")  # then by hand, on other translations, same commit and params
    evaluate.main(["--translations", str(other), "--raw", str(raw), "--metrics", "other/eval.json",
                   "--params", str(params)])

    runs = all_runs(uri)
    parent = next(r for r in runs if "pipeline_key" in r.data.tags)
    assert [r.data.tags["stage"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id] \
        == ["evaluate"]
    assert parent.data.metrics["eval.bleu"] < 100  # the pipeline's translations, not the hand run's
    by_hand = next(r for r in runs if r.data.tags.get("hand_run") == "true")
    assert "mlflow.parentRunId" not in by_hand.data.tags and "pipeline_key" not in by_hand.data.tags
    assert by_hand.info.run_name == "evaluate (by hand)" and by_hand.info.status == "FINISHED"
    assert by_hand.data.tags["path.translations"] == str(other) and by_hand.data.metrics["bleu"] == 100.0
    assert by_hand.data.tags["path.params"] == str(params)


@pytest.fixture(scope="module")
def killed_store(tmp_path_factory, _new_store) -> str:
    """One sqlite store for the signal tests, a copy of a new one (its tables made by MLflow: a new store's migrations
    cost seconds in the stage that opens it first); each test finds its runs by params_hash."""
    db = tmp_path_factory.mktemp("killed") / "store.db"
    shutil.copyfile(_new_store, db)
    return f"sqlite:///{db}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_stage_closes_its_run_and_its_parent_as_killed(tmp_path, sig, killed_store):
    """A real train stage in a subprocess, run as `dvc repro` runs it, signalled once it has written a checkpoint."""
    uri = killed_store
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", max_steps=100_000 + sig, log_every=1)
    params_hash = hashlib.sha256(params.read_bytes()).hexdigest()
    env = stage_env(MLFLOW_TRACKING_URI=uri, DVC_STAGE="train", DVC_ROOT=str(tmp_path))
    # SIGINT as a terminal delivers it: a shell starts background jobs with SIGINT ignored, and a child inherits that
    proc = subprocess.Popen([sys.executable, "-m", "stages.train", *stage_args(tmp_path, params)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "checkpoints").glob("*.sha256")):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.1)
        assert {r.info.status for r in all_runs(uri) if r.data.tags["params_file_sha256"] == params_hash} == {"RUNNING"}
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=180)  # torchrun stops its workers with SIGTERM, then waits: slow when loaded
    finally:
        proc.kill()
    assert proc.returncode != 0, stderr[-3000:]
    runs = [r for r in all_runs(uri) if r.data.tags["params_file_sha256"] == params_hash]
    assert len(runs) == 2 and {r.info.status for r in runs} == {"KILLED"}, \
        ([(r.info.run_name, r.info.status) for r in runs], stderr[-3000:])


def test_a_finished_stage_logs_its_view_and_a_view_that_fails_costs_one_warning(tmp_path, monkeypatch, caplog):
    uri = own_store()
    monkeypatch.setenv("PIPELINE_VIEWS", "1")
    monkeypatch.setenv("DVC_STAGE", "evaluate")
    monkeypatch.chdir(tmp_path)
    translations, raw = write_split_files(tmp_path, HYPS, REFS)
    for split in REFS:  # the view shows the sources beside the references
        (raw / f"{split}.en").write_text((raw / f"{split}.de").read_text(encoding="utf-8"), encoding="utf-8")
    params = evaluate_params(tmp_path / "params.yaml")
    args = stage_args_of(params, translations=translations, raw=raw, metrics=tmp_path / "metrics" / "eval.json")
    evaluate.main(["--translations", str(translations), "--raw", str(raw), "--metrics", str(args.metrics),
                   "--params", str(params)])
    child = next(r for r in all_runs(uri) if r.data.tags.get("stage") == "evaluate")
    names = {a.path for a in MlflowClient(uri).list_artifacts(child.info.run_id, "inspect/eval")}
    assert {"inspect/eval/view.txt", "inspect/eval/sentences.json", "inspect/eval/sentence_chrf.png"} <= names

    (translations / "test.de").unlink()  # the view cannot show the sentences: the stage still finishes, warned once
    with caplog.at_level(logging.WARNING), tracking.stage_run("evaluate", args):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("the evaluate view was not logged to MLflow: inspect: "), \
        warnings
    assert "test.<lang>: expected one translated test file" in warnings[0]
    assert {r.info.status for r in all_runs(uri) if r.data.tags.get("stage") == "evaluate"} == {"FINISHED"}
