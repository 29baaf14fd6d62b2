"""The micro-batch plan: how many rows of its share of a step a process runs at once, from the device's memory.

    budget = micro_batch_tokens(cfg.micro_batch_tokens, model_cfg, vocab_size, device)   # padded tokens, 0 = no cap
    chunks = split_rows(rows, padded_tokens, budget)                                   # row chunks of one piece

The step is the paper's (train.tokens_per_step, the same pairs on any world:
pipeline/corpus/steps.py); what fits in one forward and backward is the
device's business. A process's share of a step comes as pieces (a stored batch,
or a row part of one); a piece whose padded tokens exceed the budget is cut by
rows into the fewest chunks that fit (chunk j: rows j, j + k, ... so that every
chunk spans the piece's lengths and the chunks share a few shapes). The
gradients are summed over the chunks as over any micro-batches, so the plan
does not shape the weights beyond rounding (train.micro_batch_tokens is not in
params_hash).

The budget: train.micro_batch_tokens when set; else no cap on a CPU (the
default preset's step is one micro-batch, as it always was), and on a GPU what
the activation estimate below fits into 80% of the device's memory after the
weights, their gradients and Adam's moments (16 bytes a parameter):
  saved activations a padded token, autocast (2-byte products, 4-byte residual
  stream and LayerNorm inputs), per encoder layer 2 x (16 d_model + 4 d_ff)
  bytes, a decoder layer 1.5 times that (cross-attention); attention through the
  memory-efficient and flash kernels keeps no L x L scores; the loss builds
  no [N, V] logits (model/loss.py). Base (d_model 512, d_ff 2048, 6 + 6
  layers): 0.47 MiB a token; big: 0.94 MiB. So an 80 GB GPU takes the
  presets' step (26400 padded tokens) in one micro-batch, a 16 GB one base in 2
  and big in 3 (tests/test_plan.py). It is an estimate: where a device runs out
  of memory, set train.micro_batch_tokens.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from model.config import ModelConfig

log = logging.getLogger(__name__)

MEMORY_SHARE = 0.8  # of the device's memory the plan fills; the rest: allocator slack, the loss's chunks, NCCL
STATE_BYTES = 16  # a parameter: fp32 weight, gradient, and Adam's two moments
PRODUCT_BYTES = 2  # autocast's bf16 / fp16


def activation_bytes(cfg: ModelConfig) -> float:
    """Saved activations of one padded token (each side) through the whole model, under autocast."""
    encoder_layer = PRODUCT_BYTES * (16 * cfg.d_model + 4 * cfg.d_ff)
    return cfg.n_layers * encoder_layer * (1 + 1.5)


def parameters(cfg: ModelConfig, vocab_size: int) -> int:
    from model.transformer import Transformer  # the real count, on the meta device (no memory)

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg, vocab_size).parameters())


def tokens_for_memory(cfg: ModelConfig, vocab_size: int, memory_bytes: float) -> int:
    """Padded tokens a micro-batch may hold on a device of `memory_bytes` (0 when even the weights do not fit)."""
    free = MEMORY_SHARE * memory_bytes - STATE_BYTES * parameters(cfg, vocab_size)
    return max(0, int(free // activation_bytes(cfg)))


def micro_batch_tokens(setting: int, cfg: ModelConfig, vocab_size: int, device: torch.device) -> int:
    """The budget of padded tokens a micro-batch: the param when set, else 0 (no cap) on a CPU, else from memory."""
    if setting > 0:
        log.info("micro-batches of at most %d padded tokens (train.micro_batch_tokens)", setting)
        return setting
    if device.type != "cuda":
        log.info("micro-batches: each piece of a step whole (a CPU; train.micro_batch_tokens caps them)")
        return 0
    memory = torch.cuda.get_device_properties(device).total_memory
    budget = max(1, tokens_for_memory(cfg, vocab_size, memory))
    log.info("micro-batches of at most %d padded tokens: %.0f GiB of device memory, ~%.2f MiB a token "
             "(pipeline/training/plan.py; train.micro_batch_tokens overrides)", budget, memory / 2**30,
             activation_bytes(cfg) / 2**20)
    return budget


def split_rows(rows: np.ndarray, padded_tokens: int, budget: int) -> list[np.ndarray]:
    """`rows` of one piece (padded to `padded_tokens` a side) as the fewest row chunks within `budget`."""
    if budget <= 0 or padded_tokens <= budget:
        return [rows]
    k = min(len(rows), math.ceil(padded_tokens / budget))
    return [rows[j::k] for j in range(k)]
