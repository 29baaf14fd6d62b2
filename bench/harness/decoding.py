"""The benches' decoding: a random model whose outputs end near the source length, random Multi30k-like sources, and
translate_ids timed (bench.decoding.search, bench.decoding.precision, bench.gpu.check's decoding lines)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bench.harness.gpu import Setup
from model import flops as flops_lib
from model.transformer import DecoderState, Transformer
from pipeline.device import precision as training_precision
from pipeline.core.config import TranslateConfig
from pipeline.corpus.formats import EOS_ID
from pipeline.translation.decoding import decoding_precision, translate_ids

class EosNearSourceLength(nn.Module):
    """A Transformer whose EOS logit is raised by slope x (t - S_i) at output position t (see the docstring).

    Both decoding paths get the same bias: `decode_step` knows t from the state;
    `decode` appends the bias of every position as one extra hidden column, which
    `project` removes and adds to the EOS logit.
    """

    def __init__(self, model: Transformer, slope: float):
        super().__init__()
        self.model, self.slope = model, slope
        self.pad_id, self.max_positions, self.embedding = model.pad_id, model.max_positions, model.embedding

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.encode(src)

    def init_state(self, memory: Tensor, src_mask: Tensor, beams: int) -> DecoderState:
        return self.model.init_state(memory, src_mask, beams)

    def _bias(self, t: Tensor, src_len: Tensor) -> Tensor:
        """slope x (t - S) for t [R, T] output positions (1 = first token) and source lengths S [R]."""
        return self.slope * (t - src_len[:, None])

    def decode_step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        logits, state = self.model.decode_step(tokens, state)
        src_len = state.src_bias.isfinite().sum(dim=(1, 2, 3))[state.slots // state.beams]  # [R]
        t = torch.full((len(tokens), 1), state.position, device=tokens.device)
        logits[:, EOS_ID] += self._bias(t, src_len)[:, 0]
        return logits, state

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        hidden = self.model.decode(tgt_in, memory, src_mask)  # [R, T, D]
        t = torch.arange(1, tgt_in.shape[1] + 1, device=tgt_in.device).expand(tgt_in.shape)  # [R, T]
        return torch.cat([hidden, self._bias(t, src_mask.sum(dim=(1, 2, 3)))[..., None]], dim=-1)  # [R, T, D + 1]

    def project(self, hidden: Tensor) -> Tensor:
        logits = self.model.project(hidden[..., :-1])
        logits[..., EOS_ID] += hidden[..., -1]
        return logits


def multi30k_like_sources(n: int, vocab_size: int, generator: torch.Generator) -> list[np.ndarray]:
    """n random sentences of 7 to 29 token ids (8 to 30 with the EOS the search appends)."""
    lengths = torch.randint(7, 30, (n,), generator=generator).tolist()
    return [torch.randint(4, vocab_size, (length,), generator=generator).numpy() for length in lengths]


def timed(model: nn.Module, sources: Sequence[np.ndarray], cfg: TranslateConfig,
          use_cache: bool = True) -> tuple[list[list[int]], float]:
    """translate_ids over `sources`: (outputs, seconds), a GPU drained before and after (the benches' one timing
    of decoding: this one, bench/decoding/precision.py, bench/harness/decoding.py)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = translate_ids(model, sources, cfg, progress=False, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return outputs, time.perf_counter() - start


def decoding_model(s: Setup, stage_precision: bool) -> tuple[nn.Module, torch.dtype]:
    """The preset's Transformer (seeded, untrained) with bench.decoding.search's EOS bias, and its dtype: cast as the translate
    stage casts it (decoding_precision of the preset's translate.precision) where `stage_precision`, else to the
    device's training precision (precision.autocast_dtype)."""
    torch.manual_seed(s.train_cfg.seed)
    model = Transformer(s.model_cfg, s.vocab).to(s.device)
    if stage_precision:
        dtype = decoding_precision(model, s.translate_cfg.precision)
    else:
        dtype = training_precision.autocast_dtype(s.device)
        model.to(dtype)
    return EosNearSourceLength(model, slope=2.0).eval(), dtype


def time_decoding(s: Setup, sources: list[np.ndarray], stage_precision: bool) -> tuple[float, str]:
    """(sentences per second, precision) of translate_ids (beam 4, the preset's length penalty and limits)."""
    model, dtype = decoding_model(s, stage_precision)
    timed(model, sources[: max(1, len(sources) // 20)], s.translate_cfg)  # warm-up
    _, seconds = timed(model, sources, s.translate_cfg)
    return len(sources) / seconds, flops_lib.DTYPE_NAMES[dtype]
