"""Validation of the current weights (Sec. 6.1's dev-set perplexity): the label-smoothed loss and the NLL per
real target token over every rank's share of the valid split.

    valid = validate(model, batches, label_smoothing, ctx, autocast)   # {"valid_loss", "valid_nll", "valid_ppl"}

The Trainer (pipeline/training/trainer.py) calls it every train.eval_every steps and at the end.
"""

from __future__ import annotations

import math

import torch

from model.loss import projected_smoothed_and_nll, real_hidden
from model.transformer import Transformer
from pipeline.device import distributed
from pipeline.device.distributed import Dist
from pipeline.training.loader import Batch


@torch.no_grad()
def validate(model: Transformer, batches: list[Batch], label_smoothing: float, ctx: Dist, autocast) -> dict[str, float]:
    """valid_loss (label-smoothed) and valid_nll per real target token, valid_ppl = exp(nll), over all ranks.

    The loss chunked as in training (projected_smoothed_and_nll): no [N, V] logits, whatever a batch's size."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # smoothed, nll, tokens
    for b in batches:
        with autocast:
            hidden, targets = real_hidden(model, b.src, b.tgt_in, b.labels, b.tokens)
            smoothed, nll = projected_smoothed_and_nll(hidden, model.embedding.weight, targets, label_smoothing)
        sums[0] += smoothed
        sums[1] += nll
        sums[2] += b.tokens
    model.train()
    smoothed, nll, tokens = distributed.all_sum(sums, ctx).tolist()
    tokens = max(tokens, 1.0)
    return {"valid_loss": smoothed / tokens, "valid_nll": nll / tokens, "valid_ppl": math.exp(nll / tokens)}
