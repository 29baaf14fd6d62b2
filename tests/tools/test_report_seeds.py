"""tools.report over seeds: runs that differ only by seed are one row (mean, sd, min, max), the frontier, the CSV."""

from __future__ import annotations

import shutil
import statistics

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tests.fixtures.report import log_pipeline_run, no_global_tracking_uri  # noqa: F401 (autouse fixture)
from tools import groups, report

SEEDS = {1: (34.0, 36.0, 5.0, 1000), 2: (35.0, 37.0, 5.5, 1100), 3: (36.5, 38.5, 6.5, 1300)}  # bleu, tokenized, ppl, tokens


@pytest.fixture(scope="module")
def reported(tmp_path_factory, _new_store) -> dict:
    """Three seeds of warmup 4000; warmup 8000 (more FLOPs, less BLEU); warmup 2000 (fewer FLOPs, less BLEU);
    warmup 4000 at another commit (the same FLOPs, less BLEU). The report's CSV and markdown rows."""
    tmp_path = tmp_path_factory.mktemp("seeds")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shutil.copyfile(_new_store, tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    for seed, (bleu, tokenized, ppl, tokens) in SEEDS.items():
        log_pipeline_run(client, f"seed{seed}", 4000, bleu, tokenized, 0.3, seed=seed, train_valid_ppl=ppl,
                         train_train_tokens=tokens)
    log_pipeline_run(client, "warm8000", 8000, 33.0, 35.5, 0.35, train_valid_ppl=6.0, train_train_tokens=1200)
    log_pipeline_run(client, "warm2000", 2000, 28.0, 30.0, 0.1, seed=2, train_valid_ppl=9.0, train_train_tokens=400)
    log_pipeline_run(client, "oldcode", 4000, 20.0, 21.0, 0.3, commit="fedcba9876543210", train_valid_ppl=7.0,
                     train_train_tokens=1000)
    out = tmp_path / "reports"
    report.main(["--out", str(out), "--tracking-uri", uri])
    lines = (out / "report.md").read_text().splitlines()
    columns = [c.strip() for c in next(line for line in lines if line.startswith("| run")).strip("|").split("|")]
    rows = {cells[0]: dict(zip(columns, cells)) for line in lines if line.startswith(("| seed", "| warm", "| old"))
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    csv = pd.read_csv(out / "bleu_vs_flops.csv", dtype={"commit": str}).set_index("run")
    return {"csv": csv, "rows": rows, "columns": columns, "out": out}


def test_runs_that_differ_only_by_seed_are_one_row_with_mean_sd_min_max(reported):
    csv = reported["csv"]
    assert list(csv.index) == ["seed1, seed2, seed3", "warm8000", "warm2000", "oldcode"]  # oldest first
    seeds = csv.loc["seed1, seed2, seed3"]
    assert seeds["n"] == 3 and seeds["train.seed"] == seeds["batch.seed"] == "1, 2, 3"
    for k, label in enumerate(("BLEU (sacreBLEU)", "BLEU (tokenized, as the paper)", "valid ppl", "train tokens")):
        values = [figures[k] for figures in SEEDS.values()]
        assert seeds[f"{label} mean"] == pytest.approx(statistics.mean(values)), label
        assert seeds[f"{label} sd"] == pytest.approx(statistics.stdev(values)), label  # n - 1
        assert (seeds[f"{label} min"], seeds[f"{label} max"]) == (min(values), max(values)), label
    assert seeds["chrF mean"] == 55.0 and seeds["chrF sd"] == 0.0
    assert seeds["hours mean"] == pytest.approx(0.3) and "hours sd" not in csv.columns  # no spread for costs
    single = csv.loc["warm8000"]
    assert single["n"] == 1 and single["BLEU (sacreBLEU) mean"] == 33.0 and pd.isna(single["BLEU (sacreBLEU) sd"])
    assert csv.loc["oldcode", "commit"] == "fedcba98"  # the same params at another commit: its own row


def test_the_markdown_row_shows_n_and_mean_sd_min_max(reported):
    row = reported["rows"]["seed1, seed2, seed3"]
    assert "train.seed" in reported["columns"] and "params_hash" not in reported["columns"]
    assert row["n"] == "3" and row["train.warmup_steps"] == "4000" and row["train.seed"] == "1, 2, 3"
    assert row["BLEU (sacreBLEU)"] == "35.17 ± 1.26 [34.00, 36.50]"
    assert row["valid ppl"] == "5.67 ± 0.76 [5.00, 6.50]"
    assert row["train tokens"] == "1,133 ± 153 [1,000, 1,300]"
    assert row["chrF"] == "55.0 ± 0.0 [55.0, 55.0]"
    assert reported["rows"]["warm8000"]["BLEU (sacreBLEU)"] == "33.00"  # one run: its figure alone


def test_the_frontier_is_marked_in_the_table_and_the_csv(reported):
    frontier = reported["csv"]["frontier"]
    assert frontier.to_dict() == {"seed1, seed2, seed3": True, "warm8000": False, "warm2000": True, "oldcode": False}
    assert {run: row["frontier"] for run, row in reported["rows"].items()} == {
        "seed1, seed2, seed3": "yes", "warm8000": "", "warm2000": "yes", "oldcode": ""}


def test_seeds_without_the_model_they_came_from_do_not_count(tmp_path, _new_store):
    shutil.copyfile(_new_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    log_pipeline_run(client, "seed1", 4000, 34.0, 36.0, 0.3, seed=1)
    log_pipeline_run(client, "seed2", 4000, 99.0, 99.0, 0.3, seed=2, trained=False)  # an earlier model's BLEU
    table = report.configurations(report.load_runs(uri))
    assert table.loc[0, "n"] == 2 and table.loc[0, "BLEU (sacreBLEU) mean"] == 34.0
    assert pd.isna(table.loc[0, "BLEU (sacreBLEU) sd"]) and table.loc[0, "model"] == "seed1000"


def test_frontier_is_pareto_on_flops_and_bleu():
    flops = pd.Series([1.0, 2.0, 2.0, 3.0, 0.5, None, 4.0])
    bleu = pd.Series([10.0, 12.0, 11.0, 12.0, 10.0, 50.0, 13.0])
    # 0: 4 has its BLEU for fewer FLOPs; 2: 1 has more BLEU for the same FLOPs; 3: 1 the same BLEU for fewer;
    # 5: no FLOPs, no place on it
    assert groups.on_frontier(flops, bleu).tolist() == [False, True, False, False, True, False, True]


def test_a_param_that_some_runs_never_logged_does_not_split_their_seeds():
    runs = pd.DataFrame({"tags.git_commit": ["c"] * 4, "tags.preset": ["p"] * 4, "params.train.seed": ["1", "2", "3", "1"],
                         "params.data.name": ["m30k", None, None, "m30k"],  # seeds 2, 3: download served by DVC's cache
                         "params.train.warmup_steps": ["800", "800", "800", "400"]})
    keys = groups.config_keys(runs, set())
    assert keys[0] == keys[1] == keys[2] != keys[3]
