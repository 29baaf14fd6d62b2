"""One params.yaml, one recipe: the hardware changes how a step computes (the run's Precision), never what it trains;
what it resolved is recorded (metrics/train.json, MLflow) and hashed (params_hash), and a resume that would cross
precisions stops with one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from mlflow.tracking import MlflowClient

from model import rdrop
from model.config import ModelConfig
from pipeline.core.config import BatchConfig, ParamsError, TrainConfig
from pipeline.device import cpu_matmul
from pipeline.training.params import params_hash
from pipeline.device.precision import of_choice, resolve
from pipeline.weights.checkpoint import complete_checkpoints
from tests.fixtures.cpu import AUTOCAST, EPYC, XEON, ZEN, as_cpu
from tests.fixtures.train import MODEL, TRAIN, final_weights, run_stage, write_corpus, write_params

CPU = torch.device("cpu")
RECIPE = {"rdrop_alpha": 5.0, "rdrop_fraction": 0.5, "cpu_matmul": "autocast"}  # one params file for every CPU

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def on_cpu(monkeypatch):
    """Run the train stage as on the CPU of a /proc/cpuinfo text; record the rows each step passes twice."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU's products, on a GPU machine too
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)
    rows: list[list[int]] = []
    drawn = rdrop.paired_rows
    monkeypatch.setattr(rdrop, "paired_rows", lambda *a: rows.append(r := drawn(*a)) or r)

    def train(root, text: str, **train) -> tuple[dict, list, dict]:
        as_cpu(monkeypatch, text)
        rows.clear()
        if not (root / "tokenized").exists():
            write_corpus(root)
        try:
            metrics = run_stage(root, write_params(root / "params.yaml", model={"dropout": 0.2}, **{**RECIPE, **train}))
        finally:
            cpu_matmul.use("fp32")
        return metrics, [r.tolist() for r in rows], final_weights(root)
    return train


def test_the_same_params_train_the_same_recipe_on_two_cpu_kinds_and_differ_only_in_the_recorded_precision(
        tmp_path, on_cpu):
    avx2, avx2_rows, avx2_weights = on_cpu(tmp_path / "avx2", EPYC)  # AVX2 only: fp32 by torch's BLAS
    zen, zen_rows, zen_weights = on_cpu(tmp_path / "zen", ZEN)  # AVX-512 BF16 without AMX: bf16 autocast
    assert (avx2["precision"], avx2["precision_key"]) == ("fp32", "fp32")
    assert (zen["precision"], zen["precision_key"]) == (AUTOCAST, "bf16 autocast")
    # the same loss terms: R-Drop on both, half of each batch's rows, the same rows of every batch of every step
    assert avx2["steps"] == zen["steps"] == TRAIN["max_steps"] and len(avx2_rows) >= TRAIN["max_steps"]
    assert avx2_rows == zen_rows and all(len(r) > 0 for r in avx2_rows)
    same = ("steps", "train_tokens", "src_tokens_per_step_mean", "tgt_tokens_per_step_mean", "flops_analytic", "epochs")
    assert {k: avx2[k] for k in same} == {k: zen[k] for k in same}
    assert "rdrop_alpha" not in avx2  # a param, not a record that could disagree with it
    assert avx2["params_hash"] != zen["params_hash"]  # the precision is part of the run's identity
    assert any(not torch.equal(avx2_weights[k], zen_weights[k]) for k in avx2_weights)  # bf16 rounds otherwise
    client = MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["attributes.start_time"])
    assert len(runs) == 2
    for run, metrics in zip(runs, (avx2, zen)):  # every param of a run is what that run trained with
        params = run.data.params
        assert params["precision"] == metrics["precision"] and params["precision_key"] == metrics["precision_key"]
        assert params["params_hash"] == metrics["params_hash"]
        assert {k: params[f"train.{k}"] for k in RECIPE} == {k: str(v) for k, v in RECIPE.items()}
        assert run.data.metrics["flops_analytic"] == metrics["flops_analytic"]


def test_a_resume_on_a_machine_that_computes_in_another_precision_stops_naming_both_and_moves_nothing(
        tmp_path, on_cpu):
    on_cpu(tmp_path, ZEN, max_steps=2)
    kept = complete_checkpoints(tmp_path / "checkpoints")
    with pytest.raises(ParamsError) as e:
        on_cpu(tmp_path, EPYC, max_steps=4)
    line = str(e.value)
    assert "\n" not in line and kept[-1].name in line
    assert f"was trained in {AUTOCAST}" in line and "this machine computes in fp32" in line
    assert "train.cpu_matmul=autocast" in line and "AMD EPYC (AVX2 only)" in line
    assert complete_checkpoints(tmp_path / "checkpoints") == kept  # nothing set aside
    assert not (tmp_path / "checkpoints.stale").exists()
    metrics, _, _ = on_cpu(tmp_path, ZEN, max_steps=4)  # where it computes the same: resumed, not restarted
    assert metrics["steps"] == 4 and metrics["precision"] == AUTOCAST
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["precision_key"] == "bf16 autocast"


def test_the_params_hash_holds_the_resolved_precision_not_the_setting_as_written(tmp_path):
    tokenized, batches = write_corpus(tmp_path)
    model, batch = ModelConfig(**MODEL), BatchConfig(max_tokens=24, seed=1)

    def phash(setting: str, text: str) -> str:
        cfg = TrainConfig(**{**TRAIN, "cpu_matmul": setting})
        return params_hash(model, cfg, batch, tokenized, batches, resolve(setting, CPU, text).key)

    assert phash("autocast", ZEN) == phash("auto", ZEN) == phash("bf16", ZEN)  # all bf16 autocast there
    assert phash("autocast", EPYC) == phash("fp32", EPYC) == phash("fp32", ZEN) == phash("blas", ZEN)  # all fp32
    assert phash("autocast", ZEN) != phash("autocast", EPYC)  # one setting, two precisions
    assert phash("auto", XEON) not in (phash("auto", ZEN), phash("fp32", XEON))  # AMX's bf16 products


@pytest.mark.parametrize("text, setting, key, machine", [
    (EPYC, "fp32", "fp32", "AMD EPYC (AVX2 only)"), (ZEN, "autocast", "bf16 autocast", "AMD EPYC (AVX-512 BF16, no AMX)"),
    (XEON, "auto", "bf16 products", "Intel(R) Xeon(R) Processor (AMX)"), (ZEN, "blas", "fp32", "(AVX-512 BF16, no AMX)")])
def test_the_line_before_training_names_the_cpu_class_the_precision_and_how_to_force_another(
        monkeypatch, text, setting, key, machine):
    monkeypatch.setattr(cpu_matmul, "onednn_keeps_fp32", lambda: True)
    p = resolve(setting, CPU, text)
    assert p.key == key and p == of_choice(p.products, setting, p.machine)
    line = p.line()
    assert line.startswith(f"precision: {p.label} on ") and machine in line
    assert f"train.cpu_matmul = {setting}" in line and "-S train.cpu_matmul=<" in line and "\n" not in line


def test_the_train_stage_logs_the_precision_line_before_the_first_step(tmp_path, on_cpu, caplog):
    with caplog.at_level(logging.INFO):
        on_cpu(tmp_path, EPYC, max_steps=1)
    lines = [r.getMessage() for r in caplog.records]
    said = next(i for i, m in enumerate(lines) if m.startswith("precision: fp32 on AMD EPYC (AVX2 only)"))
    assert said < next(i for i, m in enumerate(lines) if m.startswith("step 1"))
