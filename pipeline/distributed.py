"""Data-parallel plumbing for the train stage: processes, devices, who trains on which batch.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them (plain `python -m
stages.train`) there is one process and no process group at all. GPUs: one per
process, NCCL. CPUs: `train.devices` gloo processes sharing the cores.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    """This process's place in the run."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def setup(devices: int) -> Dist:
    """Join the torchrun process group (if any) and pick this process's device and threads."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world != devices:
        raise ValueError(
            f"train.devices={devices} but {world} process(es) were started; run "
            f"`torchrun --standalone --nproc_per_node={devices} -m stages.train ...` (as dvc.yaml does)")
    if torch.cuda.is_available():
        if devices > torch.cuda.device_count():
            raise ValueError(f"train.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, available_cores() // world))
        backend = "gloo"
    if world > 1:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Dist(rank, world, local_rank, device)


def teardown(ctx: Dist) -> None:
    if ctx.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def grad_accumulation(tokens_per_step: int, max_tokens: int, devices: int) -> int:
    """Micro-batches per device per step: ceil(tokens_per_step / (max_tokens x devices)).

    Sec. 5.1 trains on ~25000 target tokens per step (8 GPUs of ~3100 each).
    A batch holds at most batch.max_tokens, so each of `devices` processes
    accumulates this many batches before the update: the tokens per step stay
    what train.tokens_per_step says however many devices run (users change only
    train.devices; the accumulation follows).
    """
    return max(1, math.ceil(tokens_per_step / (max_tokens * devices)))


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled batch order of one epoch; the same in every process (seeded by seed + epoch)."""
    return np.random.default_rng(seed + epoch).permutation(num_batches)


def rank_share(step_batches: np.ndarray, rank: int, world: int) -> tuple[list[int], int]:
    """This rank's batches of one step (every world-th, from `rank`) and the micro-batch count all ranks run.

    At an epoch's tail the step holds fewer than world x accumulation batches;
    ranks left short run zero-weighted micro-batches so every rank joins every
    gradient all-reduce.
    """
    return [int(b) for b in step_batches[rank::world]], math.ceil(len(step_batches) / world)


def all_sum(t: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """Sum a tensor over all ranks, in place."""
    if ctx.world > 1:
        dist.all_reduce(t)
    return t


def broadcast_flags(flags: list[bool], ctx: Dist) -> list[bool]:
    """Rank 0's decisions (stop, checkpoint...) for every rank."""
    if ctx.world == 1:
        return flags
    t = torch.tensor([float(f) for f in flags], device=ctx.device)
    dist.broadcast(t, src=0)
    return [bool(v) for v in t.tolist()]


def broadcast_object(obj: object, ctx: Dist) -> object:
    if ctx.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: object, ctx: Dist) -> list:
    """Every rank's `obj`, in rank order (e.g. RNG states for a checkpoint)."""
    if ctx.world == 1:
        return [obj]
    out: list = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out
