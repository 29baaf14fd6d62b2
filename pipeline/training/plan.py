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
  saved activations a padded token (each side), autocast, per encoder layer
  26 d_model + 2 d_ff bytes, per decoder layer 45 d_model + 2 d_ff (its
  cross-attention, and the loss's share). Measured, not counted by hand: the
  bytes of the tensors autograd saves for backward (saved_tensors_hooks,
  storages counted once, the parameters left out) through the real loss under
  CPU bf16 autocast, their growth from 8 to 16 rows of 32 tokens (what does not
  grow with the tokens, the weights' bf16 casts and the loss's weight gradient,
  drops out), fits within 3% on small and base and 11% on the tiny test model
  (tests/training/test_plan.py holds it to the measurement). What is saved: each
  attention's q, k, v and output in bf16 and its log-sum-exp (the flash and
  memory-efficient kernels keep no L x L scores), the fp32 residual stream and
  LayerNorm inputs, the bf16 inputs of the matrix products, one [tokens, d_ff]
  bf16 tensor per feed-forward, dropout's masks (in their input's dtype on a
  CPU, 1 byte on a GPU: a GPU saves a little less); the loss builds no [N, V] logits (model/loss.py).
  With model.activation_dropout > 0, each feed-forward saves its mask and the
  dropped [tokens, d_ff] tensor as well: 3 bytes more a unit of d_ff on a GPU.
  Base (d_model 512, d_ff 2048, 6 + 6 layers): 0.25 MiB a token; big: 0.51 MiB.
  So an 80 GB GPU takes the presets' step (27400 padded tokens) in one
  micro-batch, a 16 GB one base in 1 and big in 2 (tests/training/test_plan.py). It is
  an estimate of what is saved, not of the peak (the backward's transient
  buffers and the loss's chunks sit in the 20% left over): where a device runs
  out of memory, set train.micro_batch_tokens.
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
RDROP_LOGIT_BYTES = 12  # R-Drop, a token and vocabulary entry: fp32 log-probability, its exp (the KL), its gradient
# train.compile_scope = step (model/loss.py SmoothedLoss(padded)): the whole logits, a padded target position and
# vocabulary entry: the low-precision logits kept for the backward and their gradient (counted, not measured)
WHOLE_LOGIT_BYTES = 4
# Saved bytes a padded token per layer, under autocast: per unit of d_model, and per unit of d_ff (one bf16
# [tokens, d_ff] tensor a feed-forward); measured (module docstring, tests/training/test_plan.py).
ENCODER_BYTES_PER_D_MODEL = 26
DECODER_BYTES_PER_D_MODEL = 45
BYTES_PER_D_FF = 2
BYTES_PER_D_FF_DROPPED = 3  # model.activation_dropout > 0: the mask (1 byte on a GPU) and the dropped bf16 tensor


def activation_bytes(cfg: ModelConfig) -> float:
    """Saved activations of one padded token (each side) through the whole model, under autocast."""
    ffn = (BYTES_PER_D_FF + (BYTES_PER_D_FF_DROPPED if cfg.activation_dropout > 0 else 0)) * cfg.d_ff
    encoder_layer = ENCODER_BYTES_PER_D_MODEL * cfg.d_model + ffn
    decoder_layer = DECODER_BYTES_PER_D_MODEL * cfg.d_model + ffn
    return cfg.n_layers * (encoder_layer + decoder_layer)


def parameters(cfg: ModelConfig, vocab_size: int) -> int:
    from model.transformer import Transformer  # the real count, on the meta device (no memory)

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg, vocab_size).parameters())


def tokens_for_memory(cfg: ModelConfig, vocab_size: int, memory_bytes: float, passes: float = 1,
                      whole_logits: bool = False) -> int:
    """Padded tokens a micro-batch may hold on a device of `memory_bytes` (0 when even the weights do not fit).

    passes = 1 + f (R-Drop, model/rdrop.py, a share f of the rows twice): those rows' activations twice, and
    their two passes' fp32 log-probabilities whole, RDROP_LOGIT_BYTES a vocabulary entry (counted, not measured).
    whole_logits (the whole step compiled): WHOLE_LOGIT_BYTES a vocabulary entry more a token."""
    free = MEMORY_SHARE * memory_bytes - STATE_BYTES * parameters(cfg, vocab_size)
    per_token = passes * activation_bytes(cfg) + 2 * (passes - 1) * RDROP_LOGIT_BYTES * vocab_size
    per_token += WHOLE_LOGIT_BYTES * vocab_size if whole_logits else 0
    return max(0, int(free // per_token))


def micro_batch_tokens(setting: int, cfg: ModelConfig, vocab_size: int, device: torch.device,
                       passes: float = 1, whole_logits: bool = False) -> int:
    """The budget of padded tokens a micro-batch: the param when set, else 0 (no cap) on a CPU, else from memory
    (for `passes` passes of each pair, with the whole logits or not: tokens_for_memory)."""
    if setting > 0:
        log.info("micro-batches of at most %d padded tokens (train.micro_batch_tokens)", setting)
        return setting
    if device.type != "cuda":
        log.info("micro-batches: each piece of a step whole (a CPU; train.micro_batch_tokens caps them)")
        return 0
    memory = torch.cuda.get_device_properties(device).total_memory
    budget = max(1, tokens_for_memory(cfg, vocab_size, memory, passes, whole_logits))
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
