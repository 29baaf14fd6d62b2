"""gpu-check's training lines: the train stage's Trainer.step timed per mode, and what ran inside (bench/gpu/check.py).

Modes (train settings): eager; compiled (train.compile); graphs (train.cuda_graphs: the compiled layers replayed
as CUDA graphs, pipeline/device/graphs.py); step and step-graphs (the same with train.compile_scope = step: the
whole step one graph, pipeline/device/compiled.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.harness.kernels import Dynamo, attention_kernels, no_host_syncs, profiled
from bench.harness import allreduce, sync
from bench.harness.gpu import SETTLE_STEPS, WARMUP_STEPS, Setup, digest, fresh, training_data
from pipeline.core.tracking import StageRun
from pipeline.corpus import steps as division
from pipeline.device import distributed, graphs
from pipeline.device.precision import resolve
from pipeline.training.loader import TrainingData
from pipeline.training.trainer import Trainer

MODES = ("eager", "compiled", "graphs", "step", "step-graphs")


def records_graphs(mode: str) -> bool:
    """Whether `mode` replays CUDA graphs (whose recording of each new shape synchronises the host)."""
    return mode.endswith("graphs")


def timed(step: Callable[[], object], count: Callable[[], tuple[float, float]], steps: int,
          device: torch.device, check_syncs: bool = True, compiling: Callable[[], float] = lambda: 0.0,
          warmup: int = WARMUP_STEPS, kernels: bool = True) -> dict:
    """`warmup` calls of `step`, and up to SETTLE_STEPS more until one compiles nothing new (compiling falls here:
    the timing starts after a step that built no graph; warmup_steps counts them), then `steps` timed ones (on CUDA
    under set_sync_debug_mode where `check_syncs`: each host sync is recorded), then, where `kernels`, one more
    profiled on CUDA, untimed (the attention kernels it ran: the profiler never runs before a timed step);
    `count`: (target tokens, FLOPs) trained so far. Seconds and dynamo's work of each part apart; tokens/s, FLOP/s
    and peak memory of the timed part, over its seconds less those `compiling` (seconds spent compiling so far)
    grew by: a graph compiled once during the timed steps is a one-off cost of the run, not its rate (its seconds
    are given apart)."""
    start, done = time.perf_counter(), 0
    with Dynamo() as warm:
        while True:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            step()
            done += 1
            settled = torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
            if done >= warmup and (settled or done >= warmup + SETTLE_STEPS):
                break
    sync(device)
    warmup_seconds = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, flops = count()
    compiled_before, start = compiling(), time.perf_counter()
    with Dynamo() as during, no_host_syncs(device, check_syncs) as checked:
        for _ in range(steps):
            step()
    sync(device)
    seconds, compile_seconds = time.perf_counter() - start, compiling() - compiled_before
    tokens, flops = count()[0] - tokens, count()[1] - flops
    rate_seconds = max(seconds - compile_seconds, 1e-9)
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    with profiled(device) if kernels else contextlib.nullcontext() as names:
        if kernels:  # after the timing: the profiler's hooks slow nothing timed
            step()
    return {"tokens_per_s": tokens / rate_seconds, "flops_per_s": flops / rate_seconds, "tokens_per_step": tokens / steps,
            "timed_compile_seconds": compile_seconds, "wall_tokens_per_s": tokens / seconds,
            "memory": memory, "warmup_seconds": warmup_seconds, "warmup_steps": done, "warmup_settled": settled,
            "warmup_graphs": warm.graphs, "new_graphs": during.graphs,
            "dynamo": during, "warmup_dynamo": warm, "syncs_checked": checked.checked, "host_syncs": checked.syncs,
            "attention": None if names is None else attention_kernels(names)}


def trainer(s: Setup, data: TrainingData, ctx: distributed.Dist, mode: str, checkpoints: Path | None,
            ddp: bool = False) -> Trainer:
    """The train stage's Trainer for this preset in `mode` (MODES), writing checkpoints to `checkpoints`; wrapped in
    DDP (over the process group of one) only with `ddp`, as a rank of several GPUs has it: a train.devices=1 run
    has no DDP."""
    cfg = replace(s.train_cfg, compile=mode != "eager", cuda_graphs=records_graphs(mode),
                  compile_scope="step" if mode.startswith("step") else "layers")
    return Trainer(data, s.model_cfg, cfg, s.max_tokens, ctx, StageRun(), phash="gpu-check", checkpoints=checkpoints,
                   precision=resolve(cfg.cpu_matmul, ctx.device), ddp=ddp)


def as_rank_share(t: Trainer, ranks: int) -> None:
    """Make `t` train what rank 0 of `ranks` processes trains of each step (the trainer's own division:
    steps.parts_per_batch row parts of each stored batch, steps.rank_share's pieces), alone: no process group, so
    no gradient all-reduce; the loss is still scaled by the whole step's tokens."""
    t.parts = division.parts_per_batch(t.batches, ranks)

    def share(step_ids: np.ndarray) -> tuple[tuple[tuple[int, int], ...], int, int]:
        mine, n_micro = division.rank_share(step_ids, 0, ranks, t.parts)
        return tuple(mine), n_micro, int(step_ids[0])
    t.share = share


def time_training(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int, mode: str,
                  checkpoints: Path | None = None, ranks: int = 1) -> dict:
    """Trainer.step over its epoch order: timed() (the trainer's own token and FLOP counts; a sync check except
    where graphs record, which synchronises, at each new shape), the batches each step took and their shapes; with
    `checkpoints`, then the seconds Trainer.save takes. Trainer.step alone: validation and logging (Trainer.fit)
    never fall in the timed steps. `ranks` > 1: the step as rank 0's share of that many processes (as_rank_share),
    its own target tokens counted, and its FLOPs as the step's in proportion to them."""
    fresh(s.device)
    t = trainer(s, data, ctx, mode, checkpoints, ddp=ranks > 1)
    p, taken, mine = t.progress, [], [0]
    buckets = None
    if ranks > 1:
        as_rank_share(t, ranks)
        buckets = allreduce.Buckets(t.loss_model) if t.cfg.grad_compression == "none" else None

    def step() -> None:
        order = t.epoch_order()
        start = p.cursor
        mine[0] += t.step(order)[1]
        taken.append([int(b) for b in order[start : p.cursor]])

    count = ((lambda: (p.train_tokens, p.flops)) if ranks == 1 else
             (lambda: (mine[0], p.flops * mine[0] / max(p.train_tokens, 1))))
    r = timed(step, count, steps, s.device, check_syncs=not records_graphs(mode), compiling=lambda: p.compile_seconds)
    timed_batches = [b for ids in taken[r["warmup_steps"]:][:steps] for b in ids]
    recorded, pool = graphs.totals(s.device) if records_graphs(mode) else (None, None)
    if ranks > 1:  # DDP's buckets as it all-reduces them, and how much longer the slowest rank's share is
        r |= {"buckets": buckets.layout if buckets else None,
              "slowest": allreduce.slowest_rank(data, taken[r["warmup_steps"]:][:steps], ranks, t.parts)}
    r |= {"timed_steps": steps, "accum": t.accum, "parts": t.parts, "ranks": ranks, "peak": t.peak, "trainer": t, "compiled": bool(t.compiled), "epochs": p.epoch + 1,
          "dtype": t.precision.dtype, "batches": taken, "corpus": digest(data),
          "cuda_graphs": recorded, "cuda_graphs_pool": pool,
          # (pairs, longest source, longest target) with EOS / BOS, before any length-bucket padding
          "batch_shapes": [(len(data.train_batches[b]), *(int(x.max()) for x in data.lengths(np.array([b]))))
                           for b in timed_batches]}
    if checkpoints is not None:
        start = time.perf_counter()
        t.save()
        r["save_seconds"] = time.perf_counter() - start
    return r


def fitting_training(s: Setup, seed: int, ctx: distributed.Dist, steps: int, mode: str, directory: Path,
                     checkpoints: Path | None = None, ranks: int = 1) -> tuple[dict, Setup]:
    """time_training on a fresh corpus (`seed`) at the preset's batch size, or halved (accumulation doubled) until a
    step fits in memory."""
    while True:
        data = training_data(s, seed, steps, directory / f"max_tokens{s.max_tokens}")
        try:
            return time_training(s, data, ctx, steps, mode, checkpoints, ranks) | {"seed": seed}, s
        except torch.OutOfMemoryError:
            if s.max_tokens < 256:
                raise
        torch.cuda.empty_cache()  # out of the except block: the failed attempt's tensors are garbage now
        s = replace(s, batch_cfg=replace(s.batch_cfg, max_tokens=s.max_tokens // 2))  # the Trainer doubles accum
        print(f"  {s.name}: out of memory; batch.max_tokens -> {s.max_tokens}", flush=True)
