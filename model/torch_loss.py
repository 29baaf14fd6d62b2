"""Torch's own chunked loss, F.linear_cross_entropy: whether it computes ours, and which of the two a device runs.

model/loss.py's projected_smoothed_loss asks loss_path; where it says "torch",
summed computes the loss. A feature test, not a version check: a torch whose
op serves takes over with no change here.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@functools.cache
def _chunks_it(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> bool:
    """Whether F.linear_cross_entropy computes this loss chunked, returning it in fp32: tried once on a 2 x 2 input.

    Its documented contract: options it cannot honour fall through to the whole
    logits with a warning (torch 2.13 does so for any label_smoothing != 0), and
    bf16 / fp16 inputs give a loss of their dtype (2.13: a bf16 loss sum).
    """
    weight = torch.ones(3, 2, device=device, requires_grad=True)
    hidden = torch.ones(2, 2, device=device, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            targets = torch.zeros(2, dtype=torch.long, device=device)
            loss = summed(hidden, weight, targets, label_smoothing, dtype, 1)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            return False
    return not caught and loss.dtype == torch.float32


def summed(hidden: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float, dtype: torch.dtype | None,
           chunk: int) -> Tensor:
    """The summed loss by torch's F.linear_cross_entropy, `chunk` rows at a time, its products in `dtype`."""
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk, acc_policy="balanced", acc_dtype=torch.float32)
    dtype = dtype or torch.float32
    return F.linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, reduction="sum",
                                  label_smoothing=label_smoothing, options=options)


def serves(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> bool:
    """Whether this torch has F.linear_cross_entropy, computing this loss chunked, summed in fp32 (a feature test)."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return False  # torch 2.11 (the GPU machine's) has neither
    return _chunks_it(device, dtype, label_smoothing)


def loss_path(device: torch.device, dtype: torch.dtype | None, label_smoothing: float) -> str:
    """Which code computes the loss on `device` with products in `dtype`: "torch" (F.linear_cross_entropy) or "ours".

    GPUs: torch's own chunked F.linear_cross_entropy where it serves
    (serves: chunked with label smoothing, a fp32 loss sum), else
    ours, ProjectedSmoothedLoss in autocast's precision. torch 2.13 (the lock's)
    chunks only label_smoothing == 0 and returns a bf16 sum for bf16 inputs, and
    torch 2.11 (the GPU machine's) has no F.linear_cross_entropy: so for the
    paper's eps = 0.1 every GPU runs ours today; a torch whose op does serve
    takes it over with no change here.

    CPUs: ours, always: torch's is no faster there, and ours in fp32 is the
    code CPUs trained with before, to the bit (the same weights). Measured on
    the 2-core CPU, shared with other jobs (torch 2.13, one thread, N = 1250,
    D = 256, V = 5000, fp32, forward + backward, 21 interleaved rounds), ms
    median / min:
                                                  eps = 0.1    eps = 0
        ours (512-row chunks)                     203 / 154    205 / 157
        F.linear_cross_entropy, 512-row chunks    241 / 168    216 / 159  (eps = 0.1: not chunked, whole logits)
        F.linear_cross_entropy, its own chunks    243 / 164    355 / 305
        whole logits, F.cross_entropy             249 / 167    221 / 158
    Two threads: the same order, within the shared machine's noise. Under CPU
    bf16 autocast (tests only: CPUs train in fp32), where this AVX2 CPU emulates
    bf16 products, ours takes 6.6 s and the whole logits 6.4 s; torch's, at
    eps = 0 only, 0.3 s (fp32 products inside) but a bf16 loss sum.
    """
    if device.type != "cpu" and serves(device, dtype, label_smoothing):
        return "torch"
    return "ours"
