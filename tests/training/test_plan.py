"""The micro-batch plan: a process's share of a step cut by rows to fit its device, the update unchanged."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.transformer import Transformer
from pipeline.core.config import compose, parse
from pipeline.training import plan
from pipeline.training.loader import TrainingData
from tests.fixtures.train import MODEL, write_corpus

GB = 1e9
CPU = torch.device("cpu")


def preset(experiment: str) -> tuple[ModelConfig, int, int]:
    params = compose([f"experiment={experiment}"])
    return parse(params, "model", ModelConfig), params["tokenize"]["vocab_size"], params["train"]["tokens_per_step"]


@pytest.mark.parametrize("experiment, pieces_80gb, pieces_16gb", [
    ("wmt14_en_de_base", 1, 1), ("wmt14_en_de_big", 1, 2), ("wmt14_en_fr_big", 1, 2)])
def test_an_80gb_gpu_takes_the_presets_step_in_one_micro_batch_a_16gb_one_in_a_few(experiment, pieces_80gb,
                                                                                 pieces_16gb):
    cfg, vocab, step = preset(experiment)
    for memory, expected in ((80 * GB, pieces_80gb), (16 * GB, pieces_16gb)):
        budget = plan.tokens_for_memory(cfg, vocab, memory)
        assert -(-step // budget) == expected, (memory, budget)
    # the estimate grows with the model: big's activations twice base's a token, its weights and Adam 3x
    base, big = preset("wmt14_en_de_base")[0], preset("wmt14_en_de_big")[0]
    assert plan.activation_bytes(big) == 2 * plan.activation_bytes(base)
    assert plan.tokens_for_memory(base, 37000, 0.5 * GB) == 0  # weights and Adam alone fill it


def saved_bytes(loss_model: SmoothedLoss, rows: int, length: int) -> int:
    """Bytes autograd saves for backward in one forward of `rows` pairs of `length` tokens a side, CPU bf16 autocast,
    through the real loss: each storage once, the parameters' own left out."""
    vocab = loss_model.model.embedding.weight.shape[0]
    g = torch.Generator().manual_seed(rows)
    src, tgt_in, labels = (torch.randint(4, vocab, (rows, length), generator=g) for _ in range(3))
    parameters = {p.untyped_storage().data_ptr() for p in loss_model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss_model(src, tgt_in, labels, rows * length)
    return sum(storages.values())


@pytest.mark.parametrize("model", ["default", "default with activation dropout", "tiny"])
def test_the_activation_estimate_is_what_a_micro_batch_saves_for_backward(model):
    """Measured: the growth of the saved bytes from 8 to 16 rows of 32 tokens (the weights' casts and the loss's
    [V, D] gradient do not grow with the tokens), a padded token each side, in training mode (dropout's masks).
    The plan's estimate within 1.25x of it either way (it fits small and base within 3%, the tiny model's
    d_model 16 and no dropout within 11%: pipeline/training/plan.py)."""
    cfg = ModelConfig(**MODEL) if model == "tiny" else parse(compose([]), "model", ModelConfig)
    if model == "default with activation dropout":
        cfg = dataclasses.replace(cfg, activation_dropout=0.1)
        assert plan.activation_bytes(cfg) > plan.activation_bytes(dataclasses.replace(cfg, activation_dropout=0.0))
    torch.manual_seed(0)
    loss_model = SmoothedLoss(Transformer(cfg, 8000), 0.1)
    rows, length = 8, 32
    measured = (saved_bytes(loss_model, 2 * rows, length) - saved_bytes(loss_model, rows, length)) / (rows * length)
    assert 1 / 1.25 < plan.activation_bytes(cfg) / measured < 1.25, (plan.activation_bytes(cfg), measured)


def test_the_whole_logits_of_the_compiled_step_cost_what_the_plan_counts():
    """SmoothedLoss(padded) (train.compile_scope = step) keeps the whole logits for backward: measured eagerly as
    above, its growth a padded token beyond the real-rows loss's is WHOLE_LOGIT_BYTES a vocabulary entry (within
    5%), and the budget of an 80 GB GPU shrinks by as much."""
    torch.manual_seed(0)
    vocab, rows, length = 2000, 8, 32
    model = Transformer(ModelConfig(**MODEL), vocab)
    growth = [(saved_bytes(SmoothedLoss(model, 0.1, padded=padded), 2 * rows, length)
               - saved_bytes(SmoothedLoss(model, 0.1, padded=padded), rows, length)) / (rows * length)
              for padded in (False, True)]
    assert (growth[1] - growth[0]) / vocab == pytest.approx(plan.WHOLE_LOGIT_BYTES, rel=0.05)
    cfg, vocab, _ = preset("wmt14_en_de_base")
    per_token = [80 * GB * plan.MEMORY_SHARE / plan.tokens_for_memory(cfg, vocab, 80 * GB, whole_logits=whole)
                 for whole in (False, True)]  # ~ bytes a token (weights aside)
    assert per_token[1] > per_token[0] + plan.WHOLE_LOGIT_BYTES * vocab * 0.9


def test_the_budget_is_the_param_when_set_else_whole_on_a_cpu(caplog):
    cfg = ModelConfig(**MODEL)
    with caplog.at_level(logging.INFO, logger="pipeline.training.plan"):
        assert plan.micro_batch_tokens(0, cfg, 100, CPU) == 0
        assert plan.micro_batch_tokens(500, cfg, 100, CPU) == 500
    assert "each piece of a step whole (a CPU" in caplog.text and "at most 500 padded tokens" in caplog.text


def test_split_rows_makes_the_fewest_interleaved_chunks_within_the_budget():
    rows = np.arange(10, 30)
    assert [c.tolist() for c in plan.split_rows(rows, 200, 0)] == [rows.tolist()]
    assert [c.tolist() for c in plan.split_rows(rows, 200, 200)] == [rows.tolist()]
    chunks = plan.split_rows(rows, 200, 70)  # ceil(200 / 70) = 3
    assert [c.tolist() for c in chunks] == [rows[0::3].tolist(), rows[1::3].tolist(), rows[2::3].tolist()]
    assert len(plan.split_rows(rows[:2], 200, 1)) == 2  # never an empty chunk


def test_micro_batches_within_the_budget_give_the_gradient_of_the_whole_piece(tmp_path):
    write_corpus(tmp_path, n_train=40, max_tokens=48)
    data = TrainingData.load(tmp_path / "tokenized", tmp_path / "batches")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), data.vocab_size)
    loss_model = SmoothedLoss(model, 0.1)

    def gradient(budget: int, parts: int) -> tuple[list[tuple[int, ...]], dict[str, torch.Tensor]]:
        model.zero_grad()
        micro = data.micro_batches([(0, p) for p in range(parts)], parts, 0, CPU, parts, budget)
        for batch, real in micro:
            assert real
            loss_model(batch.src, batch.tgt_in, batch.labels, batch.tokens).backward()
        return [tuple(b.src.shape) for b, _ in micro], {n: p.grad.clone() for n, p in model.named_parameters()}

    whole_shapes, whole = gradient(0, 1)
    rows = len(data.train_batches[0])
    for budget, parts in ((12, 1), (0, 3), (20, 2)):
        shapes, split = gradient(budget, parts)
        assert len(shapes) > 1 and sum(s[0] for s in shapes) == rows == whole_shapes[0][0]
        assert all(s[0] * s[1] <= budget for s in shapes) if budget else True
        assert max((whole[k] - split[k]).abs().max().item() for k in whole) < 1e-5
