"""The optimizer and one update of it: Adam (Sec. 5.3), or Muon for the hidden matrices; gradients accumulated
over a step's micro-batches.

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

# torch.optim.Muon scales each matrix's orthogonalised update to the RMS of an AdamW update (Moonshot's
# 0.2 x sqrt(max(rows, columns))), so the schedule's learning rate serves both optimizers (train.muon_lr_factor)
MUON_LR_MATCH = "match_rms_adamw"


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The weight matrices of the layers' linear maps, by name: W^Q, W^K, W^V (stacked as w_qkv, or w_q and w_kv),
    W^O, and the feed-forward's W_1 and W_2. Not the shared embedding (the output projection too), nor a learned
    position table: embeddings are looked up a row at a time, no linear map to orthogonalise."""
    return [(f"{module_name}.weight", module.weight) for module_name, module in model.named_modules()
            if isinstance(module, nn.Linear)]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | MuonAdam:
    """train.optimizer: adam (the paper's, Sec. 5.3) or muon (MuonAdam); the learning rate is set before every step."""
    if cfg.optimizer == "adam":
        return adam(list(model.parameters()), cfg)
    hidden = [p for _, p in hidden_matrices(model)]
    rest = [p for p in model.parameters() if id(p) not in {id(h) for h in hidden}]
    # Paper: Adam for every parameter (Sec. 5.3); train.optimizer = muon orthogonalises the hidden matrices' momentum
    muon = torch.optim.Muon(hidden, lr=0.0, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                            nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=MUON_LR_MATCH)
    return MuonAdam(muon, adam(rest, cfg), cfg.muon_lr_factor)


def adam(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam with the paper's betas and epsilon (Sec. 5.3), fused.

    With train.weight_decay > 0: AdamW, Adam with decoupled weight decay (Loshchilov & Hutter, 2019), each
    step multiplying the parameters of two or more dimensions (the weight matrices, the shared embedding) by
    1 - lr x weight_decay; biases and the layer norms' gains and shifts are not decayed.
    """
    betas, eps = (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps
    if cfg.weight_decay == 0:
        return torch.optim.Adam(params, lr=0.0, betas=betas, eps=eps, fused=True)
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], lr=0.0, betas=betas, eps=eps, fused=True)


class MuonAdam:
    """train.optimizer = muon: torch.optim.Muon (Jordan et al. 2024) for the hidden matrices (hidden_matrices),
    Adam (AdamW with train.weight_decay) for the embedding, biases and layer norms, stepped as one optimizer.

    The learning rate: the schedule's, as for Adam, times train.muon_lr_factor for Muon's matrices, whose
    updates torch scales to an AdamW update's RMS (MUON_LR_MATCH: Moonshot's "Muon is Scalable for LLM
    Training", which reuses AdamW's learning rate and weight decay). Muon's decoupled decay is AdamW's too:
    1 - lr x train.muon_lr_factor x train.weight_decay a step. Muon orthogonalises each update by
    train.muon_ns_steps Newton-Schulz iterations in bf16 on every device (torch's, as the original): matrix
    products each step that Adam does not have (bench/cpu/optimizer.py measures what they cost).
    What the trainer, GradScaler and a checkpoint use of an optimizer: param_groups (each holds its
    "lr_scale"), step, zero_grad, state_dict and load_state_dict.
    """

    def __init__(self, muon: torch.optim.Muon, adam: torch.optim.Optimizer, muon_lr_factor: float):
        self.muon, self.adam = muon, adam
        for group in muon.param_groups:
            group["lr_scale"] = muon_lr_factor

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adam.param_groups]

    def step(self) -> None:
        self.muon.step()
        self.adam.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adam.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adam": self.adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adam.load_state_dict(state["adam"])


def train_step(loss_model: nn.Module, optimizer: torch.optim.Optimizer | MuonAdam, micro: list[tuple[Batch, bool]],
               global_tokens: int, lr: float, ctx: Dist, autocast, scaler: torch.amp.GradScaler,
               forward=None) -> Tensor:
    """Accumulate the gradients of this rank's micro-batches, then one update; returns this rank's summed loss.

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
    for group in optimizer.param_groups:  # Muon's matrices: times train.muon_lr_factor (MuonAdam)
        group["lr"] = lr * group.get("lr_scale", 1.0)
    scaler.step(optimizer)
    scaler.update()
    zero_grads(optimizer, loss_model)
    return total


def zero_grads(optimizer: torch.optim.Optimizer | MuonAdam, loss_model: nn.Module) -> None:
    """Clear the gradients for the next step: in place under DDP, else dropped (no gradient memory between steps).

    DDP (pipeline/device/distributed.py) keeps each gradient as a view of its all-reduce bucket
    (gradient_as_bucket_view); gradients set to None would make the reducer copy every fresh gradient into its
    bucket again each step, one gradient's copy and memory more. In place, the fused Adam's zero_grad zeroes them
    with one multi-tensor call per device and dtype (torch's Optimizer.zero_grad; tests/device/test_ddp_compat.py).
    """
    optimizer.zero_grad(set_to_none=not isinstance(loss_model, DistributedDataParallel))
