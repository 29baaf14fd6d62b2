"""The optimizer and one update of it: Adam (Sec. 5.3), gradients accumulated over a step's micro-batches.

    optimizer = build_optimizer(model, train_cfg)
    loss = train_step(loss_model, optimizer, micro, global_tokens, lr, ctx, autocast, scaler)

What the trainer (pipeline/training/trainer.py) runs every step, and what the benchmarks
time, so a bench measures what `dvc repro` runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.core.config import TrainConfig
from pipeline.device.distributed import Dist
from pipeline.training.loader import Batch


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam with the paper's betas and epsilon (Sec. 5.3); the learning rate is set before every step.

    With train.weight_decay > 0: AdamW, Adam with decoupled weight decay (Loshchilov & Hutter, 2019), each
    step multiplying the parameters of two or more dimensions (the weight matrices, the shared embedding) by
    1 - lr x weight_decay; biases and the layer norms' gains and shifts are not decayed.
    """
    betas, eps = (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps
    if cfg.weight_decay == 0:
        return torch.optim.Adam(model.parameters(), lr=0.0, betas=betas, eps=eps, fused=True)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], lr=0.0, betas=betas, eps=eps, fused=True)


def train_step(loss_model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[tuple[Batch, bool]],
               global_tokens: int, lr: float, ctx: Dist, autocast, scaler: torch.amp.GradScaler,
               forward=None) -> Tensor:
    """Accumulate the gradients of this rank's micro-batches, then one Adam update; returns this rank's summed loss.

    Each micro-batch's summed loss is scaled by world / global_tokens: DDP
    averages gradients over the world, so the update is the gradient of the
    step's summed loss over its real target tokens on all ranks. A padding
    micro-batch (False: none left for this rank at an epoch's tail) is weighted
    0, so the rank still joins the all-reduce without changing the update.
    `scaler` scales the loss for fp16 (a disabled scaler passes everything through). `forward`: the loss
    model's compiled whole step (pipeline/device/compiled.py compile_step), called in its place; None: the module.
    """
    scale = ctx.world / global_tokens
    total, forward = torch.zeros((), device=ctx.device), forward or loss_model
    ddp = isinstance(loss_model, DistributedDataParallel)
    # static_graph (train.ddp_static_graph): DDP records the graph in its first backward, which torch's reducer
    # refuses under no_sync; so that step syncs every micro-batch (the same sum: all-reduce is linear), later ones once
    first_static = ddp and loss_model.static_graph and not getattr(loss_model, "graph_recorded", False)
    for i, (batch, real) in enumerate(micro):
        sync = i == len(micro) - 1 or not ddp or first_static
        with (contextlib.nullcontext() if sync else loss_model.no_sync()), autocast:
            loss = forward(batch.src, batch.tgt_in, batch.labels, batch.tokens)
        scaler.scale(loss * (scale if real else 0.0)).backward()
        if real:
            total += loss.detach().float()
    if first_static:
        loss_model.graph_recorded = True
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.step(optimizer)
    scaler.update()
    zero_grads(optimizer, loss_model)
    return total


def zero_grads(optimizer: torch.optim.Optimizer, loss_model: nn.Module) -> None:
    """Clear the gradients for the next step: in place under DDP, else dropped (no gradient memory between steps).

    DDP (pipeline/device/distributed.py) keeps each gradient as a view of its all-reduce bucket
    (gradient_as_bucket_view); gradients set to None would make the reducer copy every fresh gradient into its
    bucket again each step, one gradient's copy and memory more. In place, the fused Adam's zero_grad zeroes them
    with one multi-tensor call per device and dtype (torch's Optimizer.zero_grad; tests/device/test_ddp_compat.py).
    """
    optimizer.zero_grad(set_to_none=not isinstance(loss_model, DistributedDataParallel))
