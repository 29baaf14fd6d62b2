"""tools.report over a real sqlite MLflow store, and tools.attention's pictures."""

from __future__ import annotations

import matplotlib.image
import pytest
from mlflow.tracking import MlflowClient

from tools import attention, report
import torch

from pipeline.weights.checkpoint import load_model
from pipeline.corpus.formats import load_split
from tests.fixtures.report import log_pipeline_run, no_global_tracking_uri  # noqa: F401 (autouse fixture)
from tests.fixtures.translation import make_corpus, one_thread, save_model, write_params  # noqa: F401 (fixture)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_tables_both_runs_with_the_params_that_differ_and_plots_them(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    log_pipeline_run(client, "warm4000", 4000, 34.5, 36.25, 0.3)
    log_pipeline_run(client, "warm8000", 8000, 33.0, 35.5, 0.35, stopped_by="max_minutes")
    out = tmp_path / "reports"
    report.main(["--out", str(out), "--tracking-uri", uri])

    text = (out / "report.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "train.warmup_steps" in columns  # differs
    assert "model.d_model" not in columns and "translate.beam_size" not in columns  # the same in both
    assert "params_hash" not in columns
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| warm")}
    assert set(rows) == {"warm4000", "warm8000"}
    row = dict(zip(columns, rows["warm8000"]))
    assert row["train.warmup_steps"] == "8000" and row["preset"] == "multi30k_small"
    assert row["BLEU (sacreBLEU)"] == "33.00" and row["BLEU (tokenized, as the paper)"] == "35.50"
    assert row["FLOPs counted"] == "3.85e+14" and row["FLOPs paper's way"] == "8.40e+14"
    assert row["FLOPs at peak"] == "1.26e+15"  # 0.35 h x 3600 s x 1 device x 1e12 FLOP/s
    assert row["device"] == "1 x cpu (2 threads/process)" and row["model"] == "warm8000"
    assert row["stopped by"] == "max_minutes"  # the wall-clock safety stop fired: shown, not hidden
    assert dict(zip(columns, rows["warm4000"]))["stopped by"] == "max_steps"
    assert "27.3" in text and "2.3e+19" in text  # the paper's rows
    assert "tok:13a" in text

    png = (out / "bleu_vs_flops.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    image = matplotlib.image.imread(out / "bleu_vs_flops.png")
    assert image.shape[0] > 300 and image.shape[1] > 400


def test_report_shows_no_bleu_without_the_model_it_came_from(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    log_pipeline_run(client, "scored", 4000, 34.5, 36.25, 0.3)
    log_pipeline_run(client, "orphan", 8000, 33.0, 35.5, 0.35, trained=False)  # eval.* but no train record
    report.main(["--out", str(tmp_path / "reports"), "--tracking-uri", uri])
    lines = (tmp_path / "reports" / "report.md").read_text().splitlines()
    columns = [c.strip() for c in next(line for line in lines if line.startswith("| run")).strip("|").split("|")]
    rows = {cells[0]: dict(zip(columns, cells)) for line in lines if line.startswith(("| scored", "| orphan"))
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert rows["scored"]["BLEU (sacreBLEU)"] == "34.50" and rows["scored"]["model"] == "scored00"
    assert [rows["orphan"][c] for c in ("model", "BLEU (sacreBLEU)", "BLEU (tokenized, as the paper)", "chrF")] \
        == ["-"] * 4


def test_report_without_runs_says_so(tmp_path):
    with pytest.raises(LookupError, match="no pipeline runs"):
        report.main(["--out", str(tmp_path / "reports"), "--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert not (tmp_path / "reports").exists()


def test_attention_pictures_have_one_heat_map_per_head(tmp_path):
    raw, tokenized = make_corpus(tmp_path)
    model_dir = save_model(tmp_path / "model", tokenized)
    out = tmp_path / "attention"
    attention.main(["--model", str(model_dir), "--tokenized", str(tokenized), "--raw", str(raw), "--out", str(out),
                    "--n", "2", "--params", str(write_params(tmp_path / "params.yaml"))])
    sources = load_split(tokenized, "test", "en")
    chosen = attention.pick_sentences(sources, 2)
    assert all(5 <= sources.lengths[i] <= 30 for i in chosen)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"test_{i + 1}.png" for i in chosen)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in out.iterdir())


def test_cross_attention_rows_are_distributions_over_the_source(tmp_path):
    raw, tokenized = make_corpus(tmp_path)
    model = load_model(save_model(tmp_path / "model", tokenized), torch.device("cpu"))
    weights = attention.cross_attention(model, [10, 11, 12, 13], [20, 21])
    assert weights.shape == (2, 3, 5)  # heads, output pieces + EOS, source pieces + EOS
    assert weights.sum(axis=-1) == pytest.approx(1.0, abs=1e-5)
