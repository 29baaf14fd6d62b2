"""What MLflow and tools.report record of real `dvc repro` runs: each run holds its own results and no one else's.

A is the session's finished tiny run (tests/fixtures/tiny_run.py: committed first, so that its parent run is named by
its commit; the default store, mlflow.db at its root; the stages' views on, which a test reads); S to E run on a copy
of it, with its store, each run committed first (views off: no test reads theirs):

    A  `dvc repro`                                   the whole pipeline: a BLEU
    S  translate.max_tokens 2000 -> 500, `dvc repro` translate re-runs, writes the same translations, and
                                                     DVC skips evaluate: A's BLEU is this run's too
    B  train.max_steps 10 -> 15, `dvc repro train`   trains only: no BLEU (A's eval.json is still in metrics/)
    C  average.last_n 2 -> 50, `dvc repro`           train is current, average fails: no BLEU
    D  `python -m stages.evaluate --translations other ...` by hand, on other translations
    E  `python -m tools.report`
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.fixtures.pipeline_repo import ROOT, dvc_run, git_commit, write_params
from tests.fixtures.tiny_run import copy_run, run_env, tiny_run  # noqa: F401 (tiny_run is a fixture)

STAGES = ["download", "tokenize", "batch", "train", "average", "export", "translate", "evaluate"]


def commit_of(repo) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def story(tiny_run, tmp_path_factory):
    """A (the session's tiny run), then S to E run once on a copy of it; returns what the tests look at."""
    repo = copy_run(tiny_run, tmp_path_factory.mktemp("records") / "repo", store=True)
    env = run_env(views=False)
    params = copy.deepcopy(tiny_run.params)
    assert (params["train"]["max_steps"], params["average"]["last_n"], params["translate"]["max_tokens"]) \
        == (10, 2, 2000), "the story below starts from these"
    runs = {"A": {"rc": tiny_run.returncode, "output": tiny_run.output, "commit": commit_of(repo),
                  "params_hash": hashlib.sha256((repo / "params.yaml").read_bytes()).hexdigest(),
                  "eval": json.loads((repo / "metrics" / "eval.json").read_text())}}
    for name, change, args in (("S", ("translate", "max_tokens", 500), ["repro"]),
                               ("B", ("train", "max_steps", 15), ["repro", "train"]),
                               ("C", ("average", "last_n", 50), ["repro"])):
        params[change[0]][change[1]] = change[2]
        path = write_params(repo, params)
        git_commit(repo, name)
        done = dvc_run(repo, *args, env=env)
        runs[name] = {"rc": done.returncode, "output": done.stdout + done.stderr, "commit": commit_of(repo),
                      "params_hash": hashlib.sha256(path.read_bytes()).hexdigest()}
    shutil.copytree(repo / "data" / "translations", repo / "other")
    shutil.copy(repo / "data" / "raw" / "test.de", repo / "other" / "test.de")  # the references: BLEU 100
    shutil.copy(repo / "data" / "raw" / "valid.de", repo / "other" / "valid.de")
    for command in (["stages.evaluate", "--translations", "other", "--raw", "data/raw", "--metrics", "other/eval.json"],
                    ["tools.report", "--out", "reports"]):
        done = subprocess.run([sys.executable, "-m", *command], cwd=repo, env=env | {"PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)  # tools/ is not in the temporary repo
        assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    every = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for run in runs.values():
        run["parent"] = next((r for r in every if r.data.tags.get("params_file_sha256") == run["params_hash"]
                              and "pipeline_key" in r.data.tags), None)
        run["children"] = {r.data.tags["stage"]: r for r in every if run["parent"] is not None
                           and r.data.tags.get("mlflow.parentRunId") == run["parent"].info.run_id}
    report = (repo / "reports" / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| run"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(columns, [c.strip() for c in line.strip("|").split("|")])) for line in report.splitlines()
            if line.startswith("| synthetic")]
    return {"runs": runs, "every": every, "report_rows": {row["commit"]: row for row in rows},
            "uri": f"sqlite:///{repo / 'mlflow.db'}"}


@pytest.mark.slow
def test_a_full_run_has_a_child_run_per_stage_with_its_params_and_metrics(story):
    a = story["runs"]["A"]
    assert a["rc"] == 0, a["output"][-4000:]
    children = a["children"]
    assert sorted(children) == sorted(STAGES) and {r.info.status for r in children.values()} == {"FINISHED"}
    assert children["download"].data.metrics["train_lines"] == 200 and "data.name" in children["download"].data.params
    assert children["tokenize"].data.params["tokenize.vocab_size"] == "100"
    assert children["tokenize"].data.metrics["vocab_size"] == 100
    assert children["batch"].data.params["batch.max_tokens"] == "600"
    assert 0 < children["batch"].data.metrics["padding_efficiency"] <= 1
    parent = a["parent"].data
    assert parent.metrics["eval.bleu"] == a["eval"]["bleu"] and parent.metrics["train.steps"] == 10
    assert parent.metrics["download.train_lines"] == 200 and "tokenize.vocab_size" in parent.metrics


@pytest.mark.slow
def test_each_stage_run_holds_its_outputs_view_as_tools_inspect_shows_it(story, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", story["uri"])  # load_table searches the default store, not the client's
    client = MlflowClient(story["uri"])
    shown = {"download": "raw/words.png", "tokenize": "tokenized/tokens.png", "batch": "batches/batches.png",
             "average": "model/view.txt", "translate": "translations/length_ratio.png", "evaluate": "eval/sentences.json"}
    for stage, run in story["runs"]["A"]["children"].items():
        logged = {a.path for d in client.list_artifacts(run.info.run_id, "inspect")
                  for a in client.list_artifacts(run.info.run_id, d.path)}
        assert logged >= ({f"inspect/{shown[stage]}", f"inspect/{shown[stage].split('/')[0]}/view.txt"}
                          if stage in shown else set()), (stage, logged)
        assert stage in shown or not logged
    evaluate = story["runs"]["A"]["children"]["evaluate"]
    table = client.load_table(evaluate.info.experiment_id, "inspect/eval/sentences.json", run_ids=[evaluate.info.run_id])
    assert len(table) == 20 and set(table.split) == {"test", "valid"}


@pytest.mark.slow
def test_train_only_and_failed_runs_after_a_full_run_carry_no_bleu(story):
    b, c = story["runs"]["B"], story["runs"]["C"]
    assert b["rc"] == 0, b["output"][-4000:]
    assert c["rc"] != 0 and "average.last_n = 50" in c["output"], c["output"][-4000:]
    for run in (b, c):
        data = run["parent"].data
        assert not [k for k in [*data.metrics, *data.tags] if k.startswith("eval.")], sorted(data.metrics)
        assert data.metrics["train.steps"] == 15 and data.metrics["batch.max_tokens"] == 600  # current upstream
    assert sorted(b["children"]) == ["train"] and sorted(c["children"]) == ["average"]
    assert c["children"]["average"].info.status == "FAILED" and c["parent"].info.status == "FAILED"
    rows = story["report_rows"]
    assert set(rows) == {story["runs"][name]["commit"][:8] for name in "ASBC"}
    full = rows[story["runs"]["A"]["commit"][:8]]
    assert full["BLEU (sacreBLEU)"] == f"{story['runs']['A']['eval']['bleu']:.2f}" and full["model"] != "-"
    for run in (b, c):
        row = rows[run["commit"][:8]]
        assert [row["BLEU (sacreBLEU)"], row["BLEU (tokenized, as the paper)"], row["chrF"]] == ["-"] * 3, row


@pytest.mark.slow
def test_a_run_whose_evaluate_dvc_skips_carries_the_bleu_of_its_unchanged_translations(story):
    a, s = story["runs"]["A"], story["runs"]["S"]
    assert s["rc"] == 0 and "Stage 'evaluate' didn't change, skipping" in s["output"], s["output"][-4000:]
    assert sorted(s["children"]) == ["translate"]
    assert s["parent"].data.metrics["eval.bleu"] == a["eval"]["bleu"]
    assert s["parent"].data.metrics["train.steps"] == 10
    row = story["report_rows"][s["commit"][:8]]
    assert row["BLEU (sacreBLEU)"] == f"{a['eval']['bleu']:.2f}" and row["model"] != "-"


@pytest.mark.slow
def test_a_stage_run_by_hand_is_a_run_of_its_own_tagged_with_its_paths(story):
    by_hand = [r for r in story["every"] if r.data.tags.get("hand_run") == "true"]
    assert len(by_hand) == 1
    run = by_hand[0]
    assert run.info.run_name == "evaluate (by hand)" and "mlflow.parentRunId" not in run.data.tags
    assert run.data.tags["path.translations"] == "other" and run.data.metrics["bleu"] == 100.0
    a = story["runs"]["A"]
    assert a["parent"].data.metrics["eval.bleu"] == a["eval"]["bleu"] < 100
    assert sorted(r.data.tags["stage"] for r in story["every"] if r.data.tags.get("stage") == "evaluate") \
        == ["evaluate", "evaluate"]  # A's, and the run by hand
