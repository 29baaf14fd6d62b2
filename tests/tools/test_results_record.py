"""tools.results record: a finished run's own records become one line of the results record, nothing typed."""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import yaml

from pipeline.core.errors import PipelineError
from tests.fixtures import finished_run
from tests.fixtures.cpu import EPYC, ZEN
from tools.results import main, record, store


def test_a_finished_run_appends_its_line_read_from_its_records(tmp_path):
    repo = tmp_path / "run"
    commit = finished_run.make(repo, seed=2)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    finished_run.log_stages(uri, repo, commit)
    out = tmp_path / "runs.jsonl"
    assert main.main(["record", "--repo", str(repo), "--record", str(out), "--tracking-uri", uri, "--sitting", "s1",
                      "--id", "r2"]) == 0
    (line,) = store.read(out)
    assert line["commit"] == commit and line["clean"] is True and line["seed"] == 2 and line["sitting"] == "s1"
    assert line["preset"] == "multi30k_small" and line["params_hash"] == "abc123" and line["transcribed"] is None
    assert line["steps"] == 4600 and line["stopped_by"] == "max_steps" and line["flops"] == 2.2e14
    assert line["test"] == {"bleu": 40.48, "lc_norm_tok": 40.92, "bleu_tokenized": 40.46, "chrf": 64.45}
    assert line["valid"] == {"bleu": 40.98, "lc_norm_tok": 41.15, "chrf": 63.9, "ppl": 5.05}
    assert line["machine"]["threads"] == 2 and line["decode_sentences_per_s"] == 150.5
    assert line["wall_s"]["train"] == 1080 and line["wall_s"]["run"] == sum(finished_run.STAGE_SECONDS.values())
    with pytest.raises(PipelineError, match="id 'r2' already in the record"):
        main.main(["record", "--repo", str(repo), "--record", str(out), "--tracking-uri", uri, "--id", "r2"])


def test_a_run_cut_short_by_the_safety_stop_says_so_in_its_line(tmp_path):
    repo = tmp_path / "run"
    finished_run.make(repo, train={"steps": 3100, "stopped_by": "max_minutes"})
    line = record.line(repo, command="make run", recipe="the default", uri=os.environ["MLFLOW_TRACKING_URI"])
    assert line["stopped_by"] == "max_minutes" and line["steps"] == 3100
    assert line["wall_s"] == {"train": 1080.0}  # no MLflow record: the train stage's own hours only


def test_an_isa_cap_and_an_edited_tree_are_in_the_line(tmp_path):
    repo = tmp_path / "run"
    finished_run.make(repo)
    (repo / "notes.txt").write_text("uncommitted")
    caps = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    line = record.line(repo, command="make run", recipe="the default", uri=os.environ["MLFLOW_TRACKING_URI"],
                       environ=caps, cpu_text=ZEN)
    assert line["clean"] is False and line["machine"]["class"] == "AVX2"
    assert line["emulated"].startswith("AVX2 by an ISA cap") and "ATEN_CPU_CAPABILITY=avx2" in line["emulated"]
    plain = record.line(repo, command="make run", recipe="the default", uri=os.environ["MLFLOW_TRACKING_URI"],
                        environ={}, cpu_text=EPYC)
    assert plain["emulated"] is None and plain["machine"]["class"] == "AVX2"


def test_metrics_changed_after_the_run_are_refused_in_one_line_and_nothing_appended(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "run"
    finished_run.make(repo)
    eval_json = repo / "metrics" / "eval.json"
    eval_json.write_text(eval_json.read_text().replace("40.48", "41.48"))
    out = tmp_path / "runs.jsonl"
    monkeypatch.setattr(sys, "argv", ["tools.results", "record", "--repo", str(repo), "--record", str(out)])
    with pytest.raises(SystemExit) as ended:  # the command as `python -m tools.results` runs it, in this process
        runpy.run_module("tools.results", run_name="__main__")
    assert ended.value.code == 2 and not out.exists()
    (message,) = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("results: error: ") and "eval.json: md5" in message and "dvc.lock" in message


def test_what_the_run_itself_wrote_leaves_the_tree_clean(tmp_path):
    repo = tmp_path / "run"
    finished_run.make(repo)
    (repo / "dvc.yaml").write_text("stages:\n  train:\n    cmd: python -m stages.train\n    plots:\n"
                                   "      - plots/train.csv:\n          x: step\n    outs:\n      - data/model\n")
    finished_run.git(repo, "add", "dvc.yaml")
    finished_run.git(repo, "commit", "-qm", "dvc.yaml")
    with open(repo / "dvc.lock", "a") as f:
        f.write("# rewritten by the run\n")
    (repo / "plots").mkdir()
    (repo / "plots" / "train.csv").write_text("step,loss\n")
    uri = os.environ["MLFLOW_TRACKING_URI"]
    assert record.line(repo, command="make run", recipe="the default", uri=uri, cpu_text=ZEN)["clean"] is True
    (repo / "data").mkdir()
    (repo / "data" / "notes.txt").write_text("not an out")
    assert record.line(repo, command="make run", recipe="the default", uri=uri, cpu_text=ZEN)["clean"] is False


def test_a_seed_set_in_params_yaml_leaves_the_tree_clean_and_any_other_change_does_not(tmp_path):
    repo = tmp_path / "run"
    finished_run.make(repo)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["seed"] = params["batch"]["seed"] = 3  # as tools.seeds sets them
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert record.line(repo, command="dvc repro", recipe="the default", uri=uri, cpu_text=ZEN)["clean"] is True
    params["tokenize"]["seed"] = 3
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert record.line(repo, command="dvc repro", recipe="the default", uri=uri, cpu_text=ZEN)["clean"] is False
