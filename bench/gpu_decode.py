"""gpu-check's decoding lines: beam search as the translate stage runs it, in its precision and in fp32
(bench/gpu_check.py)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from bench.decode import EosNearSourceLength
from bench.gpu_setup import Setup, sync
from model import flops as flops_lib
from model.transformer import Transformer
from stages.translate import decoding_precision, translate_ids


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
    translate_ids(model, sources[: max(1, len(sources) // 20)], s.translate_cfg, progress=False)  # warm-up
    sync(s.device)
    start = time.perf_counter()
    translate_ids(model, sources, s.translate_cfg, progress=False)
    sync(s.device)
    return len(sources) / (time.perf_counter() - start), flops_lib.DTYPE_NAMES[dtype]
