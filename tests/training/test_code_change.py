"""A code change re-runs exactly what it affects: training never resumes the weights of other code.

The session's finished tiny run (tests/fixtures/tiny_run.py: every stage ran once under `dvc repro`, 10 steps, a
checkpoint every 5) is copied once for the module; each test edits that copy (and puts it back) or a copy of it, and
runs `dvc status` or `dvc repro` there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from pipeline.core import tracking
from pipeline.weights import fingerprint
from pipeline.weights.checkpoint import ACROSS_CODE_CHANGE_ENV, load_checkpoint, resume_point, save_checkpoint
from tests.fixtures.pipeline_repo import dvc, dvc_run, write_params
from tests.fixtures.tiny_run import copy_run, tiny_run  # noqa: F401 (tiny_run is a fixture)
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: on only where a test reads the runs)

pytestmark = pytest.mark.slow

SEMANTIC_EDITS = {  # a change to what training computes, in each part of it: file -> (old, new)
    "model/schedule.py": ("return d_model**-0.5 * min(", "return 0.5 * d_model**-0.5 * min("),
    "model/loss.py": ("eps, chunk = label_smoothing, chunk or", "eps, chunk = label_smoothing / 2, chunk or"),
    "model/transformer.py": ("self.embedding(tokens) * math.sqrt(self.d_model)",
                             "self.embedding(tokens) * 0.5 * math.sqrt(self.d_model)"),
    "pipeline/training/optimizer.py": ('group["lr"] = lr * group.get("lr_scale", 1.0)\n',
                                       'group["lr"] = lr * 0.5 * group.get("lr_scale", 1.0)\n'),
}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path}: expected {old!r} once"
    path.write_text(text.replace(old, new), encoding="utf-8")


def comment_only_edit(path: Path) -> None:
    """A new comment, a reworded module docstring and a blank line: nothing the code does."""
    text = path.read_text(encoding="utf-8")
    if text.startswith('"""'):
        text = '"""Reworded: ' + text[3:]
    path.write_text("# an added comment\n" + text.replace("\n\n", "\n\n# another comment\n\n", 1) + "\n\n",
                    encoding="utf-8")


def newest(repo: Path) -> Path:
    return sorted((repo / "data" / "checkpoints").glob("step_*.pt"))[-1]


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """A copy of the session's tiny run: `dvc repro` ran every stage once, 10 steps, a checkpoint every 5."""
    train = tiny_run.params["train"]
    assert (train["max_steps"], train["checkpoint_every"], train["keep_checkpoints"], tiny_run.params["average"]
            ["last_n"]) == (10, 5, 5, 2), "the tests below count steps and checkpoints from these"
    copy = copy_run(tiny_run, tmp_path_factory.mktemp("code_change") / "repo")
    assert changed_stages(copy) == set(), "the trained repo is not up to date"
    return copy


@pytest.fixture
def repo(trained, tmp_path) -> Path:
    """A copy of the trained repo, for one test to edit."""
    copy = tmp_path / "repo"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def changed_stages(repo: Path) -> set[str]:
    """The stages `dvc status` lists as changed: DVC's status, in this process (what the command runs, under the lock
    it takes, without a new process importing DVC each time)."""
    from dvc.repo import Repo, lock_repo

    with contextlib.chdir(repo), Repo() as project, lock_repo(project):  # stage names as seen from the repo's root
        return set(project.status())


@pytest.mark.parametrize("path, stages", [
    ("pipeline/training/trainer.py", {"train"}),
    ("model/transformer.py", {"train", "average", "export", "translate"}),
    ("pipeline/corpus/fetch.py", {"download", "translate"}),  # translate reads stdin by rawtext's rule
    ("pipeline/corpus/subwords.py", {"tokenize"}),
    ("pipeline/corpus/batching.py", {"batch", "train"}),  # train pads to batching's length buckets
    ("pipeline/weights/averaging.py", {"average"}),
    ("model/beam_search.py", {"export", "translate"}),  # export checks its model against our greedy search
    ("pipeline/translation/scoring.py", {"evaluate", "export"}),  # export scores both engines' greedy outputs
    ("tools/inspect/data.py", set()),  # a view: no stage imports it
])
def test_an_edit_changes_only_the_stages_that_import_the_file(trained, path, stages):
    """`dvc status` after an edit lists exactly the stages whose command imports the edited file; undone, none (as
    the copy was made: trained)."""
    target = trained / path
    target.parent.mkdir(parents=True, exist_ok=True)
    before = target.read_bytes() if target.exists() else None
    try:
        with open(target, "a", encoding="utf-8") as f:
            f.write("\nEDITED = True\n")
        assert changed_stages(trained) == stages
    finally:
        if before is None:
            target.unlink()
        else:
            target.write_bytes(before)
    assert changed_stages(trained) == set()


def test_a_change_to_what_training_computes_trains_afresh_from_step_0(repo):
    """An edit to each part of what training computes (SEMANTIC_EDITS), made together: the log line names every
    edited file (each has its own line in the fingerprint: changed_files), and training starts afresh."""
    old_newest = newest(repo)
    old_weights = load_checkpoint(old_newest)["model"]
    for path, (old, new) in SEMANTIC_EDITS.items():
        edit(repo / path, old, new)
    out = dvc(repo, "repro", "train")
    assert f"code changed since {old_newest.name} ({', '.join(sorted(SEMANTIC_EDITS))} differ;" in out
    assert "starting afresh" in out and "resuming" not in out
    for stage in ("download", "tokenize", "batch"):
        assert f"Stage '{stage}' didn't change" in out
    metrics = json.loads((repo / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 10 and metrics["code_changes"] == 0
    stale = list(repo.glob(f"data/checkpoints.stale/*/{old_newest.name}"))
    assert len(stale) == 1 and load_checkpoint(stale[0])["code_hash"] != metrics["code_hash"]
    new_weights = load_checkpoint(newest(repo))["model"]
    assert any(not torch.equal(new_weights[k], old_weights[k]) for k in old_weights), "the same weights as the old code"


def test_a_comment_only_edit_resumes_and_keeps_the_newest_checkpoint_byte_for_byte(repo):
    old = newest(repo)
    old_bytes = old.read_bytes()
    for path in ("model/transformer.py", "pipeline/training/trainer.py"):
        comment_only_edit(repo / path)
    out = dvc(repo, "repro", "train")
    assert "Running stage 'train'" in out  # the file changed: DVC re-runs the stage, which resumes
    assert "resuming from step 10 (data/checkpoints/step_00000010.pt)" in out
    assert "code changed" not in out and not (repo / "data" / "checkpoints.stale").exists()
    assert newest(repo) == old and old.read_bytes() == old_bytes


def test_the_switch_resumes_across_a_code_change_records_it_and_average_refuses_the_mix(repo, monkeypatch):
    path = "model/schedule.py"
    edit(repo / path, *SEMANTIC_EDITS[path])
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["max_steps"] = 20
    params["average"]["last_n"] = 4  # steps 5 and 10 of the old code, 15 and 20 of the new
    write_params(repo, params)
    monkeypatch.setenv(ACROSS_CODE_CHANGE_ENV, "1")
    monkeypatch.setenv(tracking.ENV, "1")  # this test reads the train stage's run (and no other: average untracked)
    out = dvc(repo, "repro", "train")
    monkeypatch.setenv(tracking.ENV, "0")
    assert f"resuming step_00000010.pt across a code change ({ACROSS_CODE_CHANGE_ENV}=1): {path} differ" in out
    metrics = json.loads((repo / "metrics" / "train.json").read_text())
    assert (metrics["steps"], metrics["code_changes"], metrics["code_changed_at_step"]) == (20, 1, 10)
    assert metrics["code_changed_files"] == path
    runs = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()],
                                      filter_string="tags.stage = 'train'", order_by=["attributes.start_time DESC"])
    assert runs[0].data.tags.get("code_change_at_step_10") == path
    assert runs[0].data.metrics["code_changes"] == 1

    refused = dvc_run(repo, "repro", "average")
    assert refused.returncode != 0
    assert f"made by different code ({path} differ)" in refused.stdout + refused.stderr
    params["average"]["last_n"] = 2  # steps 15 and 20: one code
    write_params(repo, params)
    dvc(repo, "repro", "average")
    assert json.loads((repo / "data" / "model" / "averaged.json").read_text())["steps"] == [15, 20]


# --- the fingerprint and the resume point, in-process ----------------------------------------------


def test_the_fingerprint_follows_the_code_not_its_comments_docstrings_or_layout(tmp_path):
    for rel in fingerprint.project_imports("stages.train"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fingerprint.ROOT / rel, tmp_path / rel)
    before = fingerprint.code_fingerprint("stages.train", tmp_path)
    assert set(before) == {str(p) for p in fingerprint.project_imports("stages.train")}
    assert {"model/transformer.py", "model/loss.py", "model/schedule.py", "pipeline/training/optimizer.py",
            "pipeline/training/trainer.py", "stages/train.py"} <= set(before)
    for path in before:
        comment_only_edit(tmp_path / path)
    assert fingerprint.code_fingerprint("stages.train", tmp_path) == before
    for path, (old, new) in SEMANTIC_EDITS.items():
        edit(tmp_path / path, old, new)
        after = fingerprint.code_fingerprint("stages.train", tmp_path)
        assert fingerprint.changed_files(before, after) == [path]
        edit(tmp_path / path, new, old)


def test_a_checkpoint_of_other_code_is_set_aside_unless_the_switch_says_resume(tmp_path, caplog):
    code, other = {"model/a.py": "1", "pipeline/b.py": "2"}, {"model/a.py": "1", "pipeline/b.py": "3"}
    for step in (1, 2):
        save_checkpoint(tmp_path / "ck", {"step": step, "model": {}, "params_hash": "p", "code": code}, keep=5)
    resumed = resume_point(tmp_path / "ck", "p", other, across_code_change=True)
    assert resumed.path.name == "step_00000002.pt" and resumed.code_changed == ["pipeline/b.py"]
    assert resume_point(tmp_path / "ck", "p", code).code_changed == []
    with caplog.at_level(logging.WARNING):
        assert resume_point(tmp_path / "ck", "p", other) is None
    assert "code changed since step_00000002.pt (pipeline/b.py differs" in caplog.text
    assert list((tmp_path / "ck").iterdir()) == []
    save_checkpoint(tmp_path / "ck", {"step": 1, "model": {}, "params_hash": "p"}, keep=5)  # no code recorded
    assert resume_point(tmp_path / "ck", "p", code) is None
