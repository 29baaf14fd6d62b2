"""train.weight_decay: the paper's Adam at 0; above it, AdamW's decoupled decay of the weight matrices only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core.config import TrainConfig
from pipeline.training.optimizer import build_optimizer
from tests.fixtures.train import MODEL, TRAIN, VOCAB, final_weights, run_stage, write_corpus, write_params

pytestmark = pytest.mark.usefixtures("one_thread")


def step_without_gradient(weight_decay: float, lr: float) -> tuple[dict, dict]:
    """The parameters before and after one optimizer step whose gradients are all zero."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, TrainConfig(**TRAIN, weight_decay=weight_decay))
    for group in optimizer.param_groups:
        group["lr"] = lr
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return before, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_a_step_without_gradient_shrinks_the_matrices_by_lr_times_weight_decay_and_nothing_else(weight_decay):
    lr = 0.1
    before, after = step_without_gradient(weight_decay, lr)
    matrices = [name for name, p in after.items() if p.dim() >= 2]
    vectors = [name for name, p in after.items() if p.dim() < 2]
    assert "embedding.weight" in matrices and any("norm" in name for name in vectors), (matrices, vectors)
    for name in matrices:
        torch.testing.assert_close(after[name], before[name] * (1 - lr * weight_decay), rtol=1e-6, atol=0)
    for name in vectors:  # biases, the layer norms' gains and shifts: Adam's step of a zero gradient is zero
        assert torch.equal(after[name], before[name]), name


def train_to(root: Path, *steps: int, weight_decay: float) -> dict:
    """Run the train stage on root's corpus to each of `steps` in turn; the final weights."""
    write_corpus(root)
    for max_steps in steps:
        metrics = run_stage(root, write_params(root / "params.yaml", max_steps=max_steps, weight_decay=weight_decay))
    assert metrics["steps"] == steps[-1]
    return final_weights(root)


def test_the_train_stage_decays_with_weight_decay_and_resumes_its_optimizer_exactly(tmp_path):
    adam = train_to(tmp_path / "adam", 6, weight_decay=0.0)
    adamw = train_to(tmp_path / "adamw", 6, weight_decay=0.5)
    resumed = train_to(tmp_path / "resumed", 4, 6, weight_decay=0.5)

    def norm(weights: dict) -> float:
        return sum(float(w.double().square().sum()) for w in weights.values() if w.dim() >= 2)

    assert norm(adamw) < norm(adam)
    assert adamw.keys() == resumed.keys()
    for name in adamw:  # both parameter groups' moments come back from the checkpoint
        assert torch.equal(adamw[name], resumed[name]), name
