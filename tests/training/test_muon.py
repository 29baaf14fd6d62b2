"""train.optimizer = muon: Muon for exactly the layers' weight matrices, Adam for the rest; a tiny run learns, resumes
its own state exactly, is hashed apart from Adam's, and never resumes a checkpoint of the other optimizer."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from mlflow.tracking import MlflowClient

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core import tracking
from pipeline.core.config import BatchConfig, ParamsError, TrainConfig, parse
from pipeline.device.distributed import Dist
from pipeline.training.loader import Batch, TrainingData
from pipeline.training.optimizer import MuonAdam, build_optimizer, hidden_matrices, train_step
from pipeline.training.params import params_hash
from tests.fixtures.train import (MODEL, TRAIN, VOCAB, final_weights, last_checkpoint, run_stage, torchrun,
                                  write_corpus, write_params)
from tests.fixtures.trainer_steps import trained_steps

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")

LAYERS = {"encoder": ("self_attn.w_qkv", "self_attn.w_o", "ffn.w_1", "ffn.w_2"),
          "decoder": ("self_attn.w_qkv", "self_attn.w_o", "cross_attn.w_q", "cross_attn.w_kv", "cross_attn.w_o",
                      "ffn.w_1", "ffn.w_2")}


def names(model: torch.nn.Module, params: list) -> set[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_muon_holds_exactly_the_layers_weight_matrices_and_adam_everything_else(positions):
    model = Transformer(ModelConfig(**{**MODEL, "positional_encoding": positions}), VOCAB)
    optimizer = build_optimizer(model, TrainConfig(**TRAIN, optimizer="muon", weight_decay=0.1))
    assert isinstance(optimizer, MuonAdam) and isinstance(optimizer.muon, torch.optim.Muon)
    muon = names(model, [p for g in optimizer.muon.param_groups for p in g["params"]])
    adam = names(model, [p for g in optimizer.adam.param_groups for p in g["params"]])
    expected = {f"{side}.{i}.{m}.weight" for side, ms in LAYERS.items() for i in range(MODEL["n_layers"]) for m in ms}
    assert muon == expected == {name for name, _ in hidden_matrices(model)}
    assert muon | adam == {name for name, _ in model.named_parameters()} and not muon & adam
    two_d_to_adam = {name for name in adam if model.get_parameter(name).dim() == 2}
    assert two_d_to_adam == {"embedding.weight", *(["learned_pe.weight"] if positions == "learned" else [])}
    assert all(name.endswith(".bias") or "norm" in name for name in adam - two_d_to_adam)
    decayed = names(model, optimizer.adam.param_groups[0]["params"])  # AdamW: the embeddings decayed, vectors not
    assert decayed == two_d_to_adam and optimizer.adam.param_groups[1]["weight_decay"] == 0.0


class ZeroLoss(torch.nn.Module):
    """A loss model whose loss is 0 x the weights' sum: every gradient zero, whatever the batch."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *batch) -> torch.Tensor:
        return sum(p.sum() for p in self.model.parameters()) * 0


def test_the_schedule_sets_muons_rate_times_its_factor_and_adams_as_is():
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    optimizer = build_optimizer(model, TrainConfig(**TRAIN, optimizer="muon", muon_lr_factor=0.25))
    batch = Batch(*(torch.zeros(1, 1, dtype=torch.long),) * 3, tokens=1)
    train_step(ZeroLoss(model), optimizer, [(batch, True)], 1, 0.004, Dist(0, 1, 0, CPU),
               torch.autocast("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=False))
    assert [g["lr"] for g in optimizer.muon.param_groups] == [0.001]
    assert [g["lr"] for g in optimizer.adam.param_groups] == [0.004]


def loss_rows(root) -> list[float]:
    lines = (root / "plots" / "train.csv").read_text().splitlines()
    col = lines[0].split(",").index("loss")
    return [float(line.split(",")[col]) for line in lines[1:] if line.split(",")[col]]


def test_a_tiny_muon_run_learns_the_synthetic_language(tmp_path):
    write_corpus(tmp_path, n_train=40, max_tokens=48)
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_tokens=48, max_steps=80, log_every=10,
                                               eval_every=0, checkpoint_every=0, warmup_steps=10, optimizer="muon",
                                               label_smoothing=0.0, model={"d_model": 32, "d_ff": 64, "n_heads": 4}))
    losses = loss_rows(tmp_path)
    assert metrics["steps"] == 80 and len(losses) == 8
    # from about ln 24 (uniform over the vocabulary) to 2.0 (Adam: 2.9, stalled from step 30 on, in this setting)
    assert losses[-1] < 0.7 * losses[0] and losses[-1] < min(losses[:-1]), losses
    assert last_checkpoint(tmp_path)["optimizer_name"] == "muon"
    client = MlflowClient()  # the run's params say which optimizer trained it, and Muon's keys
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {k: run.data.params[f"train.{k}"] for k in ("optimizer", "muon_lr_factor", "muon_ns_steps")} == \
        {"optimizer": "muon", "muon_lr_factor": "1.0", "muon_ns_steps": "5"}


def test_a_muon_run_resumes_its_momentum_exactly(tmp_path):
    for root, steps in ((tmp_path / "straight", (6,)), (tmp_path / "resumed", (4, 6))):
        write_corpus(root)
        for max_steps in steps:
            metrics = run_stage(root, write_params(root / "params.yaml", max_steps=max_steps, optimizer="muon",
                                                   weight_decay=0.1))
        assert metrics["steps"] == 6
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    state = last_checkpoint(tmp_path / "resumed")["optimizer"]
    assert set(state) == {"muon", "adam"} and all("momentum_buffer" in s for s in state["muon"]["state"].values())


@pytest.mark.parametrize("first, then", [("adam", "muon"), ("muon", "adam")])
def test_a_checkpoint_of_the_other_optimizer_is_never_resumed_and_one_line_names_both(tmp_path, caplog, first, then):
    write_corpus(tmp_path)
    run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4, optimizer=first))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=2, optimizer=then))
    (line,) = [r.getMessage() for r in caplog.records if "train.optimizer" in r.getMessage()]
    assert (f"step_00000004.pt was trained with train.optimizer = {first}, and this run asks for {then}" in line
            and "starting afresh" in line and "\n" not in line), line
    assert "resuming" not in caplog.text and metrics["steps"] == 2
    assert list(tmp_path.glob("checkpoints.stale/*/step_00000004.pt"))
    assert last_checkpoint(tmp_path)["optimizer_name"] == then


def test_the_params_hash_holds_the_optimizer_and_muons_keys_only_under_muon(tmp_path):
    tokenized, batches = write_corpus(tmp_path)
    model, batch = ModelConfig(**MODEL), BatchConfig(max_tokens=24, seed=1)

    def phash(**train) -> str:
        return params_hash(model, TrainConfig(**{**TRAIN, **train}), batch, tokenized, batches, "fp32")

    assert phash(optimizer="adam") != phash(optimizer="muon")
    assert phash(optimizer="adam") == phash(optimizer="adam", muon_lr_factor=2.0, muon_ns_steps=3)  # Adam's run
    for key, value in (("muon_lr_factor", 2.0), ("muon_momentum", 0.9), ("muon_nesterov", False), ("muon_ns_steps", 3)):
        assert phash(optimizer="muon", **{key: value}) != phash(optimizer="muon"), key


@pytest.mark.parametrize("key, value, expected", [
    ("optimizer", "sgd", "train.optimizer = 'sgd': expected one of 'adam', 'muon'"),
    ("muon_ns_steps", 100, "train.muon_ns_steps = 100: expected an integer in [1, 99]"),
    ("muon_momentum", 1.0, "train.muon_momentum = 1.0: expected a number in [0, 1)"),
    ("muon_nesterov", "yes", "train.muon_nesterov: expected bool, got str 'yes'")])
def test_a_bad_optimizer_key_is_refused_naming_the_key_and_what_it_may_be(key, value, expected):
    with pytest.raises(ParamsError) as e:
        parse({"train": {**TRAIN, key: value}}, "train", TrainConfig)
    assert str(e.value) == expected


def test_two_processes_with_muon_update_like_one_process(tmp_path):
    """DDP: every rank orthogonalises the same all-reduced momentum, so the weights are one process's (to the
    rounding of Newton-Schulz's bf16 products, which a different summation order of the gradients can flip)."""
    one, two = tmp_path / "one", tmp_path / "two"
    for root, devices in ((one, 1), (two, 2)):
        write_corpus(root, max_tokens=48)
        write_params(root / "params.yaml", max_tokens=48, devices=devices, tokens_per_step=48, max_steps=4,
                     checkpoint_every=0, eval_every=0, micro_batch_tokens=12, adam_eps=1e-4, optimizer="muon")
    m1 = run_stage(one, one / "params.yaml")
    out = torchrun(two, two / "params.yaml", 2, **{tracking.ENV: "0"})  # no MLflow run read here
    assert out.returncode == 0, out.stderr[-3000:]
    m2 = json.loads((two / "metrics" / "train.json").read_text())
    assert m1["params_hash"] == m2["params_hash"] and m1["train_tokens"] == m2["train_tokens"]
    a, b, fresh = final_weights(one), final_weights(two), Transformer(ModelConfig(**MODEL), VOCAB).state_dict()
    moved = min((a[k] - fresh[k]).abs().max().item() for k in a if k.endswith("w_1.weight"))
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    assert gap < 1e-4 and moved > 0.05, (gap, moved)  # 1.1e-6 and 0.14 when written


def test_a_muon_run_with_the_layers_compiled_trains_as_eager(tmp_path, aot_eager):
    """train.compile compiles the layers' forward and backward; Muon steps outside the graph, as Adam does: six of
    the trainer's steps compiled (one graph per layer class) train the weights of six eager ones."""
    data = TrainingData.load(*write_corpus(tmp_path))
    eager = trained_steps(data, False, 6, optimizer="muon")
    compiled = trained_steps(data, True, 6, optimizer="muon")
    assert compiled.compile_graphs == 2 and eager.compile_graphs == 0
    assert max((eager.weights[k] - compiled.weights[k]).abs().max().item() for k in eager.weights) < 1e-5
