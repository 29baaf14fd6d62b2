"""tools.compare: paired bootstrap between two tracked runs, from the hypotheses the evaluate stage logged."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from tests.fixtures.evaluate import HYPS, REFS, run
from tests.fixtures.translation import shared_store, store  # noqa: F401 (fixtures)
from tools import compare

MANY_REFS = {split: lines * 10 for split, lines in REFS.items()}  # 40 test sentences: enough for a bootstrap
MANY_HYPS = {split: lines * 10 for split, lines in HYPS.items()}


def scored_run(root, hyps: dict, refs: dict) -> None:
    """The evaluate stage on hypotheses and references written under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    run(root, hyps, refs)


def evaluate_runs(client: MlflowClient) -> list[str]:
    """The evaluate stage's run ids, oldest first."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, "tags.stage = 'evaluate'", order_by=["attributes.start_time ASC"])
    return [r.info.run_id for r in runs]


def test_identical_hypotheses_compare_as_no_difference(tmp_path, store, capsys):
    scored_run(tmp_path / "a", MANY_HYPS, MANY_REFS)
    scored_run(tmp_path / "b", MANY_HYPS, MANY_REFS)
    a, b = evaluate_runs(MlflowClient(store))[-2:]
    compare.main([a, b, "--tracking-uri", store, "--samples", "200"])
    out = capsys.readouterr().out
    assert "BLEU: A " in out and "B - A +0.00  p = 1.0000: no significant difference" in out
    assert "chrF2: A " in out and out.count("no significant difference") == 2


def test_a_better_run_differs_significantly_and_is_found_by_experiment_name(tmp_path, store, capsys, monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "worse")
    scored_run(tmp_path / "a", MANY_HYPS, MANY_REFS)
    monkeypatch.setenv("DVC_EXP_NAME", "better")
    better = {split: list(lines) for split, lines in MANY_REFS.items()}  # the references themselves: BLEU 100
    scored_run(tmp_path / "b", better, MANY_REFS)
    compare.main(["worse", "better", "--tracking-uri", store, "--samples", "200"])
    out = capsys.readouterr().out
    bleu = next(line for line in out.splitlines() if line.startswith("BLEU: "))
    assert "B 100.00" in bleu and "differs (p < 0.05)" in bleu
    assert float(bleu.split("B - A ")[1].split()[0]) > 10


def test_runs_scored_on_different_references_are_refused(tmp_path, store):
    scored_run(tmp_path / "a", MANY_HYPS, MANY_REFS)
    other = {split: [line.replace("Mann", "Herr") for line in lines] for split, lines in MANY_REFS.items()}
    scored_run(tmp_path / "b", MANY_HYPS, other)
    a, b = evaluate_runs(MlflowClient(store))[-2:]
    with pytest.raises(SystemExit, match=r"compare: error: .* were scored on different references"):
        compare.main([a, b, "--tracking-uri", store, "--samples", "50"])


def test_a_run_that_never_evaluated_is_named(tmp_path, store):
    client = MlflowClient(store)
    experiment = client.create_experiment(f"no-eval-{os.getpid()}")
    parent = client.create_run(experiment, tags={"pipeline_key": "k"}).info.run_id
    with pytest.raises(SystemExit, match=rf"{parent}: run {parent} has no evaluate stage: it never translated"):
        compare.main([parent, parent, "--tracking-uri", store])
    with pytest.raises(SystemExit, match=r"nope: no MLflow run id, and no evaluate run of a DVC experiment named 'nope'"):
        compare.main(["nope", parent, "--tracking-uri", store])
