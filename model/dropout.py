"""Dropout (Sec. 5.4) whose mask costs a CPU a quarter of a random word an element.

torch's CPU dropout draws one Bernoulli sample an element on one thread: on the
default model's two cores its masks took about a tenth of a training step. Here
a CPU draws one 64-bit random word (torch's generator, so torch.manual_seed
and the saved RNG states of a checkpoint rule it as before) for every 4
elements, and keeps an element where its 16-bit lane is at or above the cut:
dropped with probability round(p * 65536) / 65536 (within 2^-17 of p), the kept
ones scaled by the inverse of the keep rate, so the expectation is the input's
exactly. A GPU keeps torch's fused kernel (F.dropout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 65536  # values of a 16-bit lane


def keep_mask(shape: torch.Size, dropped: int) -> Tensor:
    """Bool mask of `shape`, each element False with probability dropped / 65536, from torch's CPU generator."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # all 64 bits uniform
    return words.view(torch.int16)[:n].view(shape) >= dropped - LANES // 2


class Dropout(nn.Module):
    """nn.Dropout's behaviour (training only, kept elements scaled) with keep_mask on a CPU."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.dropped = min(round(p * LANES), LANES - 1)
        self.scale = LANES / (LANES - self.dropped)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.dropped == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        # x times a mask of 0 and the scale: the values of where(keep, x * scale, 0) and their gradient, at half
        # its time on a CPU (where and its backward are slower passes than two products)
        mask = keep_mask(x.shape, self.dropped).to(x.dtype)
        if x.dtype == torch.float32:
            return x * mask.mul_(self.scale)
        return x * mask * self.scale  # a 16-bit mask would round the scale

    def extra_repr(self) -> str:
        return f"p={self.p}"
