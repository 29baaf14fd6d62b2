"""model/dropout.py: dropout whose CPU mask takes 16 random bits an element, against nn.Dropout's behaviour."""

import pytest
import torch

from model.dropout import Dropout


def test_each_element_and_each_lane_of_a_word_is_dropped_at_the_rate_and_the_rest_scaled():
    """1M elements at p 0.1: dropped 10% overall and in each of the 4 lanes a 64-bit word gives (a lane short of
    random bits would drift), the kept ones x / (1 - p), the mean preserved."""
    torch.manual_seed(0)
    x = torch.rand(1000, 1000) + 0.5
    out = Dropout(0.1).train()(x)
    dropped = out == 0
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.001)
    for lane in range(4):
        assert dropped.view(-1, 4)[:, lane].float().mean().item() == pytest.approx(0.1, abs=0.003), lane
    assert torch.allclose(out[~dropped], x[~dropped] / (1 - 6554 / 65536))
    assert out.mean().item() == pytest.approx(x.mean().item(), rel=2e-3)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_the_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(1)
    x = torch.randn(7, 33, 5, requires_grad=True)  # 1155 elements: not a multiple of 4
    out = Dropout(0.3).train()(x)
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert torch.allclose(x.grad, kept.float() * Dropout(0.3).scale)
    assert 0.25 < 1 - kept.float().mean().item() < 0.35


def test_the_mask_follows_torchs_seed_and_rng_state_and_eval_or_p_0_draws_nothing():
    x = torch.randn(50, 64)
    drop = Dropout(0.1).train()
    torch.manual_seed(5)
    a = drop(x)
    state = torch.get_rng_state()
    b = drop(x)
    torch.set_rng_state(state)
    assert torch.equal(drop(x), b) and not torch.equal(a, b)
    torch.manual_seed(5)
    assert torch.equal(drop(x), a)
    before = torch.get_rng_state()
    assert torch.equal(drop.eval()(x), x) and torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_half_precision_input_keeps_its_dtype_and_an_unrounded_scale():
    """bf16 on a CPU: the kept elements are x * scale as bf16 arithmetic gives it, not x times a scale rounded to bf16."""
    torch.manual_seed(2)
    x = (torch.rand(200, 300) + 1).bfloat16()
    drop = Dropout(0.1).train()
    out = drop(x)
    kept = out != 0
    assert out.dtype == torch.bfloat16 and 0.08 < 1 - kept.float().mean().item() < 0.12
    assert torch.equal(out[kept], x[kept] * drop.scale)
