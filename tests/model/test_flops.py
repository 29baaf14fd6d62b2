"""FLOPs accounting (model/flops.py): hand count, FlopCounterMode, the paper's estimates, MFU."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model.flops import (
    PEAK_TFLOPS,
    device_key,
    device_tflops,
    forward_flops,
    measure_matmul_peak,
    mfu,
    paper_estimate_flops,
    training_flops,
)
from model.config import ModelConfig
from model.transformer import Transformer

TINY = ModelConfig(n_layers=1, d_model=4, d_ff=8, n_heads=2, d_k=2, d_v=3, dropout=0.0, positional_encoding="sinusoidal",
                   max_positions=16)
V = 10


def test_forward_flops_matches_a_hand_count():
    """One layer, D=4, d_ff=8, H=2, d_k=2, d_v=3, V=10; sentences (S, T) = (3, 2) and (5, 1)."""

    def sentence(S, T):
        enc = (2 * S * 4 * 14  # Q, K, V: [S, 4] x [4, 2*(2+2+3)]
               + 2 * 2 * S * S * 2 + 2 * 2 * S * S * 3  # Q K^T and A V, 2 heads
               + 2 * S * 6 * 4  # W^O: [S, 6] x [6, 4]
               + 2 * S * 4 * 8 + 2 * S * 8 * 4)  # FFN
        dec_self = 2 * T * 4 * 14 + 2 * 2 * T * T * 2 + 2 * 2 * T * T * 3 + 2 * T * 6 * 4
        cross = (2 * T * 4 * 4 + 2 * S * 4 * 10  # Q from the decoder; K, V from the encoder output
                 + 2 * 2 * T * S * 2 + 2 * 2 * T * S * 3 + 2 * T * 6 * 4)
        return enc + dec_self + cross + 2 * T * 4 * 8 + 2 * T * 8 * 4 + 2 * T * 4 * 10

    expected = sentence(3, 2) + sentence(5, 1)
    assert forward_flops(TINY, V, src_lens=[3, 5], tgt_lens=[2, 1]) == expected
    assert forward_flops(TINY, V, src_lens=torch.tensor([3, 5]), tgt_lens=torch.tensor([2, 1])) == expected
    assert training_flops(TINY, V, src_lens=[3, 5], tgt_lens=[2, 1]) == 3 * expected
    with pytest.raises(ValueError, match="tgt_lens"):
        forward_flops(TINY, V, src_lens=[3, 5], tgt_lens=[2])


def test_training_flops_match_flop_counter_on_forward_and_backward():
    cfg = ModelConfig(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.0,
                      positional_encoding="sinusoidal", max_positions=64)
    torch.manual_seed(0)
    model = Transformer(cfg, 30)
    B, S, T = 4, 9, 7  # no padding: every sentence is S long on the source side, T on the target side
    src, tgt = torch.randint(4, 30, (B, S)), torch.randint(4, 30, (B, T))
    counter = FlopCounterMode(display=False)
    # FlopCounterMode has no formula for the CPU flash-attention kernel; the math backend spells
    # attention out as matrix products (the full T x T square, masked afterwards) that it does count.
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(src, tgt).logsumexp(-1).sum().backward()
    counted = counter.get_total_flops()
    analytic = training_flops(cfg, 30, src_lens=[S] * B, tgt_lens=[T] * B)
    assert abs(analytic - counted) / counted < 0.10, (analytic, counted)


def test_paper_estimates_for_base_and_big():
    base = paper_estimate_flops(12, 8, device_tflops("P100", torch.float32))  # Sec. 5.2: 12 hours on 8 P100
    big = paper_estimate_flops(3.5 * 24, 8, device_tflops("P100", "fp32"))  # 3.5 days
    assert abs(base - 3.3e18) / 3.3e18 < 0.01 and math.isclose(base, 3.2832e18)
    assert abs(big - 2.3e19) / 2.3e19 < 0.01


def test_peak_table_and_device_names():
    assert [PEAK_TFLOPS[k]["fp32"] for k in ("K80", "K40", "M40", "P100")] == [2.8, 3.7, 6.0, 9.5]
    assert device_key("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert device_key("NVIDIA H100 PCIe") == "H100-PCIe"
    assert device_key("NVIDIA A100-SXM4-80GB") == "A100"
    assert device_key("NVIDIA GeForce RTX 4090") == "RTX-4090"
    assert device_key("Tesla V100-SXM2-16GB") == "V100-SXM2"
    assert device_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    for peaks in PEAK_TFLOPS.values():
        assert peaks.get("bf16", math.inf) > peaks["fp32"]
    with pytest.raises(KeyError, match="bf16"):
        device_tflops("P100", torch.bfloat16)
    with pytest.raises(KeyError, match="Radeon"):
        device_key("AMD Radeon Pro W7900")


def test_mfu_arithmetic():
    assert math.isclose(mfu(3.0e18, 3600.0, 8, 312e12), 3.0e18 / (3600 * 8 * 312e12))
    # The paper's own estimate is 100% of its assumed throughput by construction.
    assert math.isclose(mfu(paper_estimate_flops(12, 8, 9.5), 12 * 3600, 8, 9.5e12), 1.0)


def test_measure_matmul_peak_is_plausible():
    flops_per_second = measure_matmul_peak(torch.float32, n=512, seconds=0.6)
    assert 1e9 < flops_per_second < 1e14  # more than a GFLOP/s, less than any CPU's peak
