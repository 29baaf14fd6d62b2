"""Training cost in floating-point operations: counted from the model, estimated as the paper did, and MFU.

Analytic count: every matrix product of m x k by k x n costs 2*m*n*k FLOPs
(one multiply and one add per term), the per-token accounting of Kaplan et al.
2020 ("Scaling Laws for Neural Language Models", Table 1) extended to the
encoder-decoder and to attention over sequences of each sentence's own length.
Ignored, as there: embedding lookups, softmax, layer normalization, ReLU,
dropout, residual adds and biases (all O(tokens x d_model), not matrix products).
Backward costs twice the forward (a gradient for the input and one for the
weights of every product; Kaplan et al. 2020 Sec. 2.1), so training = 3 x forward.

The paper's estimate (Sec. 6.1, Table 2 footnote): training time x number of
GPUs x sustained single-precision throughput of one GPU.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from model.config import ModelConfig


def forward_flops(cfg: ModelConfig, vocab_size: int, src_lens: Sequence[int] | Tensor,
                  tgt_lens: Sequence[int] | Tensor) -> float:
    """FLOPs of one forward pass over sentences of real source lengths S_i and target lengths T_i.

    Per layer and sentence (D = d_model, H = n_heads):
      encoder self-attention  2*S*D*H*(2*d_k + d_v) (Q, K, V) + 2*S*H*d_v*D (W^O)
                              + 2*H*S^2*(d_k + d_v) (Q K^T and the weighted sum A V)
      decoder self-attention  the same with T; the full T x T square, not its causal
                              half: the kernels (SDPA, and the math path training
                              uses under FlopCounterMode) compute all of it
      cross-attention         2*T*D*H*d_k (Q) + 2*S*D*H*(d_k + d_v) (K, V of the
                              encoder output) + 2*H*T*S*(d_k + d_v) + 2*T*H*d_v*D (W^O)
      feed-forward            2 * 2*L*D*d_ff for L = S (encoder) or T (decoder)
    plus the output projection 2*T*D*V over target tokens. Padding is not counted.
    """
    # numpy: host arithmetic on host lengths (a training step counts them), no tensor made or read
    S, T = np.asarray(src_lens, dtype=np.float64), np.asarray(tgt_lens, dtype=np.float64)
    if S.shape != T.shape or S.ndim != 1:
        raise ValueError(f"src_lens and tgt_lens: expected two 1-D sequences of equal length, got {S.shape}, {T.shape}")
    D, H, d_k, d_v, d_ff = cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.d_ff
    s, t, s2, t2, ts = (float(x.sum()) for x in (S, T, S * S, T * T, T * S))
    qkv_o = 2 * D * H * (2 * d_k + d_v) + 2 * H * d_v * D  # per token: Q, K, V and W^O of self-attention
    ffn = 4 * D * d_ff  # per token
    scores = 2 * H * (d_k + d_v)  # per (query, key) pair: one row of Q K^T and of A V
    encoder = s * (qkv_o + ffn) + s2 * scores
    decoder_self = t * qkv_o + t2 * scores
    cross = t * (2 * D * H * d_k + 2 * H * d_v * D) + s * 2 * D * H * (d_k + d_v) + ts * scores
    decoder = decoder_self + cross + t * ffn
    return cfg.n_layers * (encoder + decoder) + t * 2 * D * vocab_size


def training_flops(cfg: ModelConfig, vocab_size: int, src_lens: Sequence[int] | Tensor,
                   tgt_lens: Sequence[int] | Tensor) -> float:
    """Forward plus backward = 3 x forward_flops (backward = 2 x forward, Kaplan et al. 2020)."""
    return 3 * forward_flops(cfg, vocab_size, src_lens, tgt_lens)


# Peak throughput per device in TFLOPS: "fp32" without tensor cores, "bf16" (or
# "fp16" on GPUs without bf16, which train in fp16) dense tensor-core math (not
# the 2x "with sparsity" figures the datasheets print first).
# K80, K40, M40, P100: the paper's sustained single-precision figures (Sec. 6.1),
# not datasheet peaks (P100 SXM2's datasheet says 10.6). Others from the vendor's
# datasheets: V100 (Tesla V100 datasheet, SXM2 15.7, PCIe 14; no bf16; fp16 tensor 125 / 112), A100
# (A100 datasheet: 19.5 fp32, 312 bf16 for both SXM and PCIe), H100 (H100
# datasheet: SXM 67 / 989.4, PCIe 51 / 756, NVL 60 / 835.5), H200 (H200 datasheet,
# SXM: 67 / 989.5, half its 1979 "with sparsity"),
# L40S (L40S datasheet: 91.6 / 362.05), L4 (L4 datasheet: 30.3 / 121), A10 (A10
# datasheet: 31.2 / 125), RTX 4090 (Ada Lovelace architecture whitepaper,
# appendix table: 82.6 fp32, 165.2 bf16 with fp32 accumulate).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "K80": {"fp32": 2.8},
    "K40": {"fp32": 3.7},
    "M40": {"fp32": 6.0},
    "P100": {"fp32": 9.5},
    "V100-SXM2": {"fp32": 15.7, "fp16": 125.0},
    "V100-PCIe": {"fp32": 14.0, "fp16": 112.0},
    "A100": {"fp32": 19.5, "bf16": 312.0},
    "A10": {"fp32": 31.2, "bf16": 125.0},
    "L4": {"fp32": 30.3, "bf16": 121.0},
    "L40S": {"fp32": 91.6, "bf16": 362.05},
    "RTX-4090": {"fp32": 82.6, "bf16": 165.2},
    "H100-SXM": {"fp32": 67.0, "bf16": 989.4},
    "H100-PCIe": {"fp32": 51.0, "bf16": 756.0},
    "H100-NVL": {"fp32": 60.0, "bf16": 835.5},
    "H200": {"fp32": 67.0, "bf16": 989.5},
}

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# torch.cuda.get_device_name() strings -> PEAK_TFLOPS keys; first match wins.
_DEVICE_PATTERNS = [
    (r"H200", "H200"),
    (r"H100.*PCIe", "H100-PCIe"),
    (r"H100.*NVL", "H100-NVL"),
    (r"H100", "H100-SXM"),  # "NVIDIA H100 80GB HBM3": the SXM5 part
    (r"A100", "A100"),
    (r"L40S", "L40S"),
    (r"\bL4\b", "L4"),
    (r"\bA10G?\b", "A10"),
    (r"RTX 4090", "RTX-4090"),
    (r"V100.*PCIE", "V100-PCIe"),
    (r"V100", "V100-SXM2"),
    (r"P100", "P100"),
    (r"M40", "M40"),
    (r"K40", "K40"),
    (r"K80", "K80"),
]


def device_key(cuda_name: str) -> str:
    """Map a torch.cuda.get_device_name() string (e.g. "NVIDIA H100 80GB HBM3") to its PEAK_TFLOPS key."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, cuda_name, flags=re.IGNORECASE):
            return key
    raise KeyError(f"no peak throughput known for device {cuda_name!r}; known: {sorted(PEAK_TFLOPS)}")


def device_tflops(name: str, dtype: torch.dtype | str) -> float:
    """Peak TFLOPS of device `name` (a PEAK_TFLOPS key or a CUDA device name) at dtype (torch.float32/bfloat16)."""
    key = name if name in PEAK_TFLOPS else device_key(name)
    dtype_name = DTYPE_NAMES.get(dtype, dtype)
    if dtype_name not in PEAK_TFLOPS[key]:
        raise KeyError(f"no {dtype_name} peak known for {key}; known: {sorted(PEAK_TFLOPS[key])}")
    return PEAK_TFLOPS[key][dtype_name]


def paper_estimate_flops(hours: float, devices: int, tflops: float) -> float:
    """The paper's training cost: hours x 3600 x devices x sustained TFLOPS x 1e12 (Sec. 6.1)."""
    return hours * 3600 * devices * tflops * 1e12


def mfu(flops: float, seconds: float, devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the devices' peak FLOP/s (both in FLOP/s, not TFLOPS)."""
    return flops / (seconds * devices * peak_flops_per_device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    seconds: float = 1.0,
    device: str | torch.device = "cpu",
    repeats: int = 3,
) -> float:
    """Best achieved FLOP/s of back-to-back n x n matmuls over `repeats` timed rounds of ~seconds/repeats each.

    One warm-up product first (allocation, threads, kernels). n = 1024 saturates
    a CPU; use 8192 on a GPU.
    """
    device = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    flops_per_matmul = 2.0 * n**3
    _sync(device)
    start = time.perf_counter()
    a @ b
    _sync(device)
    first = time.perf_counter() - start
    per_round = max(1, int(seconds / repeats / max(first, 1e-6)))  # matmuls per timed round, from the warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_round):
            a @ b
        _sync(device)
        best = max(best, per_round * flops_per_matmul / (time.perf_counter() - start))
    return best
