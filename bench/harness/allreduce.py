"""What the share line's compute leaves out of an 8-GPU step, modelled so that a GPU measurement can replace each part.

    buckets = Buckets(ddp)                                         # then train: buckets.layout, bytes in order
    slowest = slowest_rank(data, steps_batches, ranks, parts)      # the slowest rank's padded tokens over rank 0's
    parts = predict(compute_s, layout, ranks, busbw, flag_s, slowest)

The buckets are DDP's own, as it rebuilds them after its first step in the order the gradients become ready: a
comm hook sees each (a process group of one lists them as 8 GPUs would have them: the same model, the same order).
The model: a ring all-reduce of b bytes over k GPUs takes 2 (k - 1) / k * b / busbw (the bus bandwidth of
nccl-tests); every bucket but the last overlaps backward (taken as 2/3 of the step's compute: backward's FLOPs are
twice forward's), what does not fit under it is exposed; the last bucket all-reduces after backward's last kernel,
exposed whole; the trainer's per-step flag broadcast (rank 0's stop / checkpoint decision, gloo, over the host) is
a constant a step; the step waits for the slowest rank, whose compute is taken in proportion to its padded tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pipeline.corpus import steps as division
from pipeline.training.loader import TrainingData

# NVLink 4 on an H100 SXM: 900 GB/s a GPU, both directions together; 450 GB/s each way bounds a ring's bus bandwidth.
NVLINK_BUSBW_GBS = 450.0
# rank 0's three flags a step (pipeline/device/distributed.broadcast_flags, gloo): an input until a GPU host measures it
FLAG_BROADCAST_MS = 0.2
BACKWARD_SHARE = 2 / 3  # of a step's compute: backward's FLOPs are twice forward's


class Buckets:
    """A DDP comm hook that records each bucket's bytes as DDP hands it over, then all-reduces it as DDP's own hook
    does: after DDP's rebuild (its second step) `layout` is the bytes of each bucket in all-reduce order, the last
    after backward's last kernel."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel):
        self.sizes: dict[int, int] = {}

        def record(group, bucket):  # a function, unannotated: DDP checks a hook's name and annotations
            if bucket.index() == 0:  # a new backward (DDP launches its buckets in order): the last one's layout
                self.sizes.clear()
            self.sizes[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(group, bucket)

        ddp.register_comm_hook(ddp.process_group, record)

    @property
    def layout(self) -> list[int]:
        return [self.sizes[i] for i in sorted(self.sizes)]


def slowest_rank(data: TrainingData, step_batches: Sequence[Sequence[int]], ranks: int, parts: int) -> float:
    """Over the steps, the slowest rank's padded tokens (the trainer's division of each step) over rank 0's: how much
    longer than rank 0's share the step waits, its compute taken in proportion to its padded tokens."""
    slowest = first = 0
    for ids in step_batches:
        work = [sum(data.padded_tokens(data.train_batches[b][p::parts]) for b, p in
                    division.rank_share(np.asarray(ids), rank, ranks, parts)[0]
                    if len(data.train_batches[b][p::parts])) for rank in range(ranks)]
        slowest, first = slowest + max(work), first + work[0]
    return slowest / max(first, 1)


def predict(compute_s: float, layout: Sequence[int], ranks: int, busbw_gbs: float = NVLINK_BUSBW_GBS,
            flag_ms: float = FLAG_BROADCAST_MS, slowest: float = 1.0) -> dict[str, float]:
    """A step's seconds on `ranks` GPUs, part by part: the slowest rank's compute, the all-reduce hidden under
    backward, what of it is exposed (the buckets that overflow backward, the last bucket), the flag broadcast."""
    ring = 2 * (ranks - 1) / ranks / (busbw_gbs * 1e9)
    times = [ring * b for b in layout]
    compute = compute_s * slowest
    overlapped = sum(times[:-1])
    overflow = max(overlapped - BACKWARD_SHARE * compute, 0.0)
    tail = times[-1] if times else 0.0
    flags = flag_ms / 1e3
    return {"compute": compute, "rank0_compute": compute_s, "allreduce": sum(times), "hidden": overlapped - overflow,
            "overflow": overflow, "tail": tail, "flags": flags, "step": compute + overflow + tail + flags}
