"""Positional encoding (Sec. 3.5): the paper's sinusoids, and rotary positions (not in the paper).

model/transformer.py adds the sinusoids (or a learned table, Table 3 row E) to the embeddings, or turns the
queries and keys of self-attention with Rotary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import SINUSOID_BASE


def sinusoidal_encoding(max_positions: int, d_model: int, base: float = SINUSOID_BASE) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d_model)), PE(pos, 2i+1) = cos(same); [max_positions, D]. Paper: base 10000."""
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]
    div = torch.pow(float(base), torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(max_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe.float()


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer; not in the paper): in self-attention, each pair
    (2i, 2i+1) of a head's query and key is turned by the angle pos / base^(2i/d_k), the sinusoids' angles when
    base is their 10000, so q.k depends on the two positions only through their distance. A smaller base turns
    more pairs by a full circle within a short sentence. Nothing is added to the embeddings. One table, shared by
    every self-attention layer; cross-attention keeps its queries and keys as they are."""

    def __init__(self, d_k: int, max_positions: int, base: float = SINUSOID_BASE):
        super().__init__()
        angles = sinusoidal_encoding(max_positions, d_k, base)  # [P, d_k]: sin at even, cos at odd columns
        self.register_buffer("sin", angles[:, 0::2].contiguous(), persistent=False)  # [P, d_k / 2]
        self.register_buffer("cos", angles[:, 1::2].contiguous(), persistent=False)

    def forward(self, x: Tensor, start: int) -> Tensor:
        """x [B, L, G * d_k], G heads' queries or keys side by side, at positions start..start+L-1 -> the same shape.

        Eager, each pair is one complex number times e^(i angle), in fp64 for fp64 and in fp32 for every other dtype
        (a bf16 or fp16 x under autocast is rounded back once): one kernel each way, faster than turning pair by pair
        with real products (forward + backward: about half the time in fp32, a quarter in bf16 on a CPU and half on an
        H200) and nearer the exact turn (docs/benchmarks.md). Compiled graphs turn pair by pair in x's dtype (inductor
        fuses the real products, not complex ones); in fp32 both ways compute the same rounded products and sums (equal
        to the bit on the x86 CPU measured)."""
        return self.pair_by_pair(x, start) if torch.compiler.is_compiling() else self.complex_turn(x, start)

    def complex_turn(self, x: Tensor, start: int) -> Tensor:
        """forward's eager turn: each pair one complex number in fp32 (fp64 for fp64), x's dtype again after."""
        L, half = x.shape[1], self.sin.shape[1]
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        pairs = x.unflatten(-1, (-1, half, 2)).to(dtype)  # [B, L, G, d_k / 2, 2]
        sin, cos = (t[start : start + L, None].to(dtype) for t in (self.sin, self.cos))
        # e^(i angle) made here, not held: casting a module to a real dtype would drop a complex buffer's i.
        turned = torch.view_as_complex(pairs) * torch.complex(cos, sin)
        return torch.view_as_real(turned).flatten(2).to(x.dtype)

    def pair_by_pair(self, x: Tensor, start: int) -> Tensor:
        """forward's compiled turn: each pair by real products in x's dtype."""
        L, half = x.shape[1], self.sin.shape[1]
        even, odd = x.unflatten(-1, (-1, half, 2)).unbind(-1)  # [B, L, G, d_k / 2] each
        sin, cos = (t[start : start + L, None].to(x.dtype) for t in (self.sin, self.cos))
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(2)
