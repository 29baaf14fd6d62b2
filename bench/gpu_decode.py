"""gpu-check's decoding lines: beam search as the translate stage runs it, in its precision and in fp32
(bench/gpu_check.py)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from bench.decode import EosNearSourceLength, timed
from bench.gpu_setup import Setup
from model import flops as flops_lib
from model.transformer import Transformer
from stages.translate import decoding_precision


def decoding_model(s: Setup, stage_precision: bool) -> tuple[nn.Module, torch.dtype]:
    """The preset's Transformer (seeded, untrained) with bench.decode's EOS bias, and its dtype: cast as the translate
    stage casts it (decoding_precision) where `stage_precision`, else fp32."""
    torch.manual_seed(s.train_cfg.seed)
    model = Transformer(s.model_cfg, s.vocab).to(s.device)
    dtype = decoding_precision(model) if stage_precision else torch.float32
    return EosNearSourceLength(model, slope=2.0).eval(), dtype


def time_decoding(s: Setup, sources: list[np.ndarray], stage_precision: bool) -> tuple[float, str]:
    """(sentences per second, precision) of translate_ids (beam 4, the preset's length penalty and limits)."""
    model, dtype = decoding_model(s, stage_precision)
    timed(model, sources[: max(1, len(sources) // 20)], s.translate_cfg)  # warm-up
    _, seconds = timed(model, sources, s.translate_cfg)
    return len(sources) / seconds, flops_lib.DTYPE_NAMES[dtype]
