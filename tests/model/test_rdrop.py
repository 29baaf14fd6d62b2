"""train.rdrop_alpha (model/rdrop.py): R-Drop's loss, its two passes, and the train stage's records of it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model import loss as loss_module
from model.loss import SmoothedLoss
from model.rdrop import pair_terms, paired_rows, rdrop_loss
from model.transformer import Transformer
from pipeline.core.config import ParamsError, TrainConfig, parse
from pipeline.training import plan
from tests.fixtures.train import MODEL, TRAIN, VOCAB, final_weights, run_stage, write_corpus, write_params
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)

pytestmark = pytest.mark.usefixtures("one_thread")
EPS = 0.1


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) summed over rows, from the definition."""
    return (p_log.exp() * (p_log - q_log)).sum()


def test_the_loss_is_the_mean_smoothed_ce_of_the_two_passes_plus_alpha_over_4_times_both_kls():
    g = torch.Generator().manual_seed(0)
    n, v, alpha = 7, 11, 5.0
    logits, targets = torch.randn(2 * n, v, generator=g) * 3, torch.randint(0, v, (n,), generator=g)
    both = torch.cat([targets, targets])
    ce = [F.cross_entropy(half, targets, label_smoothing=EPS, reduction="sum") for half in logits.split(n)]
    lp1, lp2 = F.log_softmax(logits[:n], -1), F.log_softmax(logits[n:], -1)
    expected = (ce[0] + ce[1]) / 2 + alpha / 4 * (kl(lp1, lp2) + kl(lp2, lp1))
    torch.testing.assert_close(rdrop_loss(logits, both, EPS, alpha), expected)
    # two equal passes: no KL, and alpha changes nothing
    same = torch.cat([logits[:n], logits[:n]])
    torch.testing.assert_close(rdrop_loss(same, both, EPS, alpha), ce[0])
    torch.testing.assert_close(rdrop_loss(same, both, EPS, 0.0), ce[0])


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A padded batch of 3 pairs (PAD = 0) and its real target tokens."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (3, 6), generator=g)
    tgt = torch.randint(4, VOCAB, (3, 5), generator=g)
    src[0, 4:], tgt[1, 3:] = 0, 0
    labels = torch.cat([tgt[:, 1:], torch.zeros(3, 1, dtype=tgt.dtype)], dim=1)
    labels[1, 2:] = 0
    return src, tgt, labels, int((labels != 0).sum())


def model(dropout: float) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**MODEL, "dropout": dropout}), VOCAB)


def test_without_dropout_the_two_passes_agree_and_the_loss_is_the_plain_one():
    src, tgt_in, labels, tokens = batch()
    net = model(0.0).train()
    plain = SmoothedLoss(net, EPS)(src, tgt_in, labels, tokens)
    torch.testing.assert_close(SmoothedLoss(net, EPS, rdrop_alpha=5.0)(src, tgt_in, labels, tokens), plain)


def test_with_dropout_each_pass_draws_its_own_masks_and_the_kl_trains_both():
    src, tgt_in, labels, tokens = batch()
    net = model(0.3).train()
    torch.manual_seed(1)
    without_kl = SmoothedLoss(net, EPS, rdrop_alpha=1e-12)(src, tgt_in, labels, tokens)
    torch.manual_seed(1)
    with_kl = SmoothedLoss(net, EPS, rdrop_alpha=5.0)(src, tgt_in, labels, tokens)
    assert with_kl > without_kl + 1e-3  # the passes differ: a positive KL
    with_kl.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters() if p.dim() >= 2)
    # in evaluation (validation, translation) one pass, the plain loss
    net.eval()
    torch.testing.assert_close(SmoothedLoss(net, EPS, rdrop_alpha=5.0)(src, tgt_in, labels, tokens),
                               SmoothedLoss(net, EPS)(src, tgt_in, labels, tokens))


def test_a_negative_alpha_is_refused_naming_the_key():
    with pytest.raises(ParamsError, match=r"train\.rdrop_alpha"):
        parse({"train": {**TRAIN, "rdrop_alpha": -1.0}}, "train", TrainConfig)


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_a_fraction_outside_0_to_1_is_refused_naming_the_key(fraction):
    with pytest.raises(ParamsError, match=r"train\.rdrop_fraction"):
        parse({"train": {**TRAIN, "rdrop_alpha": 5.0, "rdrop_fraction": fraction}}, "train", TrainConfig)


def test_paired_rows_are_all_rows_at_fraction_1_else_distinct_rows_drawn_from_torchs_generator():
    assert paired_rows(8, 1.0, torch.device("cpu")) is None
    torch.manual_seed(3)
    rows = paired_rows(8, 0.25, torch.device("cpu"))
    assert rows.tolist() != [] and len(set(rows.tolist())) == len(rows) == 2 and 0 <= rows.min() <= rows.max() < 8
    torch.manual_seed(3)
    assert torch.equal(paired_rows(8, 0.25, torch.device("cpu")), rows)  # the generator's state rules the draw
    assert len(paired_rows(3, 0.01, torch.device("cpu"))) == 1  # at least one


def test_pair_terms_are_half_the_second_minus_the_first_smoothed_ce_plus_alpha_over_4_times_both_kls():
    g = torch.Generator().manual_seed(2)
    first, second = (torch.randn(2, 5, 11, generator=g) * 3 for _ in range(2))
    labels = torch.randint(1, 11, (2, 5), generator=g)
    labels[1, 2:] = 0  # PAD: no token there
    real = labels != 0
    lp1, lp2 = F.log_softmax(first[real], -1), F.log_softmax(second[real], -1)
    ce = [F.cross_entropy(z[real], labels[real], label_smoothing=EPS, reduction="sum") for z in (first, second)]
    expected = (ce[1] - ce[0]) / 2 + 5.0 / 4 * (kl(lp1, lp2) + kl(lp2, lp1))
    torch.testing.assert_close(pair_terms(first, second, labels, 0, EPS, 5.0), expected)


def test_with_a_fraction_the_drawn_rows_take_r_drops_loss_and_the_others_the_plain_one():
    src, tgt_in, labels, tokens = batch()
    net = model(0.3).train()
    torch.manual_seed(5)
    loss = SmoothedLoss(net, EPS, rdrop_alpha=5.0, rdrop_fraction=0.34)(src, tgt_in, labels, tokens)
    torch.manual_seed(5)  # the same draw of rows, then the same dropout masks in the same order
    pairs = paired_rows(3, 0.34, torch.device("cpu"))
    logits = net(torch.cat([src, src[pairs]]), torch.cat([tgt_in, tgt_in[pairs]]))  # [3 + 1, T, V]
    once = [r for r in range(3) if r not in pairs.tolist()]
    real_once = labels[once] != 0
    plain = F.cross_entropy(logits[once][real_once], labels[once][real_once], label_smoothing=EPS, reduction="sum")
    both, both_labels = torch.cat([logits[pairs], logits[3:]]), labels[pairs].repeat(2, 1)
    real = both_labels != 0
    torch.testing.assert_close(loss, plain + rdrop_loss(both[real], both_labels[real], EPS, 5.0))


def test_with_a_fraction_and_chunked_off_the_first_passes_take_whole_logits_and_the_same_loss(monkeypatch):
    src, tgt_in, labels, tokens = batch()
    net = model(0.3).train()
    torch.manual_seed(7)  # the same rows drawn, the same dropout masks
    chunked = SmoothedLoss(net, EPS, rdrop_alpha=5.0, rdrop_fraction=0.34)(src, tgt_in, labels, tokens)

    def refused(*args):
        raise AssertionError("chunked=False computed a chunked loss")

    monkeypatch.setattr(loss_module, "projected_smoothed_loss", refused)
    torch.manual_seed(7)
    whole = SmoothedLoss(net, EPS, chunked=False, rdrop_alpha=5.0, rdrop_fraction=0.34)(src, tgt_in, labels, tokens)
    torch.testing.assert_close(whole, chunked)


def test_a_fraction_of_the_rows_without_dropout_gives_the_plain_loss_and_with_it_a_kl():
    src, tgt_in, labels, tokens = batch()
    net = model(0.0).train()
    plain = SmoothedLoss(net, EPS)(src, tgt_in, labels, tokens)
    torch.testing.assert_close(SmoothedLoss(net, EPS, rdrop_alpha=5.0, rdrop_fraction=0.5)(src, tgt_in, labels, tokens),
                               plain)
    net = model(0.3).train()
    torch.manual_seed(1)
    without_kl = SmoothedLoss(net, EPS, rdrop_alpha=1e-12, rdrop_fraction=0.5)(src, tgt_in, labels, tokens)
    torch.manual_seed(1)
    with_kl = SmoothedLoss(net, EPS, rdrop_alpha=5.0, rdrop_fraction=0.5)(src, tgt_in, labels, tokens)
    assert with_kl > without_kl + 1e-3


def test_a_gpu_micro_batch_holds_fewer_tokens_the_more_rows_pass_twice():
    cfg = ModelConfig(**{**MODEL, "d_model": 512, "d_ff": 2048, "n_layers": 6, "n_heads": 8, "d_k": 64, "d_v": 64})
    one, part, two = (plan.tokens_for_memory(cfg, 37000, 80e9, passes) for passes in (1, 1.25, 2))
    assert 0 < two < one / 2 and two < part < one / 1.25  # a quarter of the rows twice: between the two


def train(root: Path, **train) -> tuple[dict, dict]:
    write_corpus(root)
    metrics = run_stage(root, write_params(root / "params.yaml", model={"dropout": 0.2}, **train))
    return metrics, final_weights(root)


def test_the_train_stage_counts_two_passes_of_flops_and_trains_other_weights(tmp_path):
    plain, plain_weights = train(tmp_path / "plain")
    rdrop, rdrop_weights = train(tmp_path / "rdrop", rdrop_alpha=5.0)
    again, again_weights = train(tmp_path / "again", rdrop_alpha=5.0)
    assert rdrop["train_tokens"] == plain["train_tokens"] > 0  # the data's tokens, each counted once
    assert rdrop["flops_analytic"] == pytest.approx(2 * plain["flops_analytic"], rel=1e-12)
    assert any(not torch.equal(plain_weights[k], rdrop_weights[k]) for k in plain_weights)
    assert all(torch.equal(rdrop_weights[k], again_weights[k]) for k in rdrop_weights)  # deterministic
    part, part_weights = train(tmp_path / "part", rdrop_alpha=5.0, rdrop_fraction=0.5)
    assert part["flops_analytic"] == pytest.approx(1.5 * plain["flops_analytic"], rel=1e-12)
    assert any(not torch.equal(part_weights[k], rdrop_weights[k]) for k in part_weights)
