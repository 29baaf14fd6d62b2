"""R-Drop (Liang et al., NeurIPS 2021): each batch through the model twice, the two dropout masks held to agree.

Not in the paper (train.rdrop_alpha: 0 in its presets). Each pair passes twice
in one forward (the batch concatenated with itself, so each copy draws its own
dropout masks), and the loss a target token is

    (CE_1 + CE_2) / 2 + alpha / 4 * (KL(P_1 || P_2) + KL(P_2 || P_1))

with CE the label-smoothed cross-entropy of Sec. 5.4 and P_1, P_2 the two
passes' output distributions: R-Drop's loss with its alpha, halved, so that at
alpha 0 it is the plain loss of one pass (in expectation). The KL terms need
both passes' distributions over the vocabulary at once: the [2N, V] log-probabilities are built whole
(fp32), where the plain loss never holds the logits whole (model/loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def passes(rdrop_alpha: float) -> int:
    """Forward and backward passes a training pair takes: 2 with R-Drop, else 1 (FLOPs, memory)."""
    return 2 if rdrop_alpha > 0 else 1


def rdrop_loss(logits: Tensor, targets: Tensor, label_smoothing: float, alpha: float) -> Tensor:
    """Summed R-Drop loss over N target tokens from the logits [2N, V] of both passes (rows i and N + i agree).

    The label-smoothing target is F.cross_entropy's: (1 - eps) one_hot + eps / V.
    """
    n = targets.shape[0] // 2
    logp = F.log_softmax(logits.float(), dim=-1)  # [2N, V]
    smoothed = (1 - label_smoothing) * F.nll_loss(logp, targets, reduction="sum") - label_smoothing * logp.mean(
        dim=-1).sum()
    first, second = logp[:n], logp[n:]
    kl = F.kl_div(second, first, log_target=True, reduction="sum") + F.kl_div(first, second, log_target=True,
                                                                               reduction="sum")
    return smoothed / 2 + alpha / 4 * kl
