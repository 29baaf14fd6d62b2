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

train.rdrop_fraction < 1 sends only that share of a batch's rows twice, drawn
anew each step (paired_rows): every row's first pass takes the plain, chunked
loss, and the drawn rows' two passes add pair_terms, whole logits for those rows
only; a drawn row's loss is then the one above, any other row's the plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def passes(rdrop_alpha: float, fraction: float = 1.0) -> float:
    """Forward and backward passes a training pair takes on average: 1 + fraction with R-Drop, else 1."""
    return 1 + fraction if rdrop_alpha > 0 else 1


def paired_rows(rows: int, fraction: float, device: torch.device) -> Tensor | None:
    """The rows of a batch that pass twice: None for all of them (fraction 1), else round(fraction x rows) of
    them (at least one) drawn from torch's generator, as the dropout masks are (a checkpoint's RNG states rule both)."""
    k = max(1, round(fraction * rows))
    return None if k >= rows else torch.randperm(rows, device=device)[:k]


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


def pair_terms(first: Tensor, second: Tensor, labels: Tensor, pad_id: int, label_smoothing: float,
               alpha: float) -> Tensor:
    """What the k rows that passed twice add to their first pass's label-smoothed CE: logits [k, T, V] of the
    two passes, labels [k, T] (PAD where no token).

    Summed over their real target tokens: (CE_2 - CE_1) / 2 + alpha / 4 * (KL(P_1 || P_2) + KL(P_2 || P_1)),
    so that with the first pass's CE of every row a row that passed twice counts as in rdrop_loss.
    """
    lp1, lp2 = F.log_softmax(first.float(), dim=-1), F.log_softmax(second.float(), dim=-1)
    real = (labels != pad_id).float()

    def smoothed(logp: Tensor) -> Tensor:  # F.cross_entropy's label smoothing, per position
        return -(1 - label_smoothing) * logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - label_smoothing * logp.mean(
            dim=-1)

    kl = (lp1.exp() * (lp1 - lp2)).sum(-1) + (lp2.exp() * (lp2 - lp1)).sum(-1)
    return (((smoothed(lp2) - smoothed(lp1)) / 2 + alpha / 4 * kl) * real).sum()
