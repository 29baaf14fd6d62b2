"""gpu-check's decoding lines: beam search as the translate stage runs it, in its precision (translate.precision) and
in the training precision of the GPU (bf16 where it has it), so that whether bf16 decodes faster stays measured
(bench/gpu_check.py)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from bench.decode import EosNearSourceLength, timed
from bench.gpu_setup import Setup
from model import flops as flops_lib
from model.transformer import Transformer
from pipeline.device import distributed
from stages.translate import decoding_precision


def decoding_model(s: Setup, stage_precision: bool) -> tuple[nn.Module, torch.dtype]:
    """The preset's Transformer (seeded, untrained) with bench.decode's EOS bias, and its dtype: cast as the translate
    stage casts it (decoding_precision of the preset's translate.precision) where `stage_precision`, else to the
    device's training precision (distributed.autocast_dtype)."""
    torch.manual_seed(s.train_cfg.seed)
    model = Transformer(s.model_cfg, s.vocab).to(s.device)
    if stage_precision:
        dtype = decoding_precision(model, s.translate_cfg.precision)
    else:
        dtype = distributed.autocast_dtype(s.device)
        model.to(dtype)
    return EosNearSourceLength(model, slope=2.0).eval(), dtype


def time_decoding(s: Setup, sources: list[np.ndarray], stage_precision: bool) -> tuple[float, str]:
    """(sentences per second, precision) of translate_ids (beam 4, the preset's length penalty and limits)."""
    model, dtype = decoding_model(s, stage_precision)
    timed(model, sources[: max(1, len(sources) // 20)], s.translate_cfg)  # warm-up
    _, seconds = timed(model, sources, s.translate_cfg)
    return len(sources) / seconds, flops_lib.DTYPE_NAMES[dtype]
