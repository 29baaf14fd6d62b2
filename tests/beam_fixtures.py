"""A tiny model, padded sources and an EOS-biased wrapper: what the beam-search tests share."""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.transformer import Transformer

PAD, UNK, BOS, EOS, A, B = 0, 1, 2, 3, 4, 5

V = 40

def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.1,
                      positional_encoding="sinusoidal", max_positions=128)
    return Transformer(cfg, V).eval()

def sources(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Padded source batch whose row i has lengths[i] real tokens, the last one EOS: [B, max(lengths)]."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, V, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    return src

class EosBias(nn.Module):
    """`model` with `bias` added to EOS's logit (-1e4: every output runs to the maximum length); records
    (hypotheses decoded, sentences in the batch) at every cached step."""

    def __init__(self, model: nn.Module, bias: float):
        super().__init__()
        self.model, self.pad_id, self.bias, self.steps = model, model.pad_id, bias, []

    def forward(self, src, tgt_in):
        logits = self.model(src, tgt_in)
        logits[..., EOS] += self.bias
        return logits

    def encode(self, src):
        return self.model.encode(src)

    def init_state(self, memory, src_mask, beams):
        return self.model.init_state(memory, src_mask, beams)

    def decode_step(self, tokens, state):
        self.steps.append((len(tokens), state.src_bias.shape[0]))
        logits, state = self.model.decode_step(tokens, state)
        logits[:, EOS] += self.bias
        return logits, state
