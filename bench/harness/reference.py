"""gpu-check's reference line: the train stage's step at its simplest, one fixed-shape micro-batch, the whole loss
under one torch.compile (bench/gpu/check.py)."""

from __future__ import annotations

import torch

from bench.harness.gpu import Setup, fresh
from bench.harness.steps import timed, trainer
from model import flops as flops_lib
from model.schedule import lrate
from pipeline.corpus.formats import BOS_ID, EOS_ID
from pipeline.device import compiled as compiled_lib
from pipeline.device import distributed
from pipeline.training.loader import Batch, TrainingData
from pipeline.training.optimizer import train_step

REFERENCE_LENGTH = 32  # the reference micro-batch: [tokens_per_step // 32, 32], every position a real token


def reference_batch(vocab: int, rows: int, device: torch.device, seed: int) -> Batch:
    """[rows, REFERENCE_LENGTH] on every side, no padding: source + EOS, BOS + target, target + EOS."""
    g = torch.Generator().manual_seed(seed)
    src, tgt = (torch.randint(4, vocab, (rows, REFERENCE_LENGTH - 1), generator=g) for _ in range(2))
    eos, bos = torch.full((rows, 1), EOS_ID), torch.full((rows, 1), BOS_ID)
    tensors = (torch.cat([src, eos], 1), torch.cat([bos, tgt], 1), torch.cat([tgt, eos], 1))
    return Batch(*(x.to(device) for x in tensors), tokens=rows * REFERENCE_LENGTH)


def time_reference(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int, micro: int = 1) -> dict:
    """The train stage's step at its simplest: a Trainer's model, loss module (without DDP), Adam, autocast and
    gradient scaler (so its attention kernels too), the whole loss under one torch.compile, train_step over
    `micro` fixed-shape micro-batches of the step's tokens. `data` only builds the Trainer: nothing trains on it."""
    fresh(s.device)
    t = trainer(s, data, ctx, "eager", None)
    loss_module = t.loss_model.module if hasattr(t.loss_model, "module") else t.loss_model
    t.close()  # its DDP is not used here
    rows = s.train_cfg.tokens_per_step // REFERENCE_LENGTH // micro
    batch = reference_batch(s.vocab, rows, s.device, s.train_cfg.seed)
    batches, step_tokens = [(batch, True)] * micro, micro * batch.tokens
    loss = torch.compile(loss_module, backend=compiled_lib.backend())
    state = {"step": 0, "compiled": True}
    step_flops = flops_lib.training_flops(s.model_cfg, s.vocab, [REFERENCE_LENGTH] * rows * micro,
                                          [REFERENCE_LENGTH] * rows * micro)

    def step() -> None:
        nonlocal loss
        lr = s.train_cfg.lr_factor * lrate(state["step"] + 1, s.model_cfg.d_model, s.train_cfg.warmup_steps)
        try:
            train_step(loss, t.optimizer, batches, step_tokens, lr, ctx, t.autocast, t.scaler)
        except compiled_lib.COMPILE_FAILURES as e:  # as the trainer: one warning, eager from here
            compiled_lib.fallback([], e)
            loss, state["compiled"] = loss_module, False
            t.optimizer.zero_grad(set_to_none=True)
            train_step(loss, t.optimizer, batches, step_tokens, lr, ctx, t.autocast, t.scaler)
        state["step"] += 1

    r = timed(step, lambda: (state["step"] * step_tokens, state["step"] * step_flops), steps, s.device)
    return r | {"peak": t.peak, "dtype": t.precision.dtype, "compiled": state["compiled"],
                "shape": (rows, REFERENCE_LENGTH), "micro": micro,
                "adam": "fused Adam" if t.optimizer.defaults.get("fused") else "Adam"}


def fitting_reference(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int) -> dict:
    """time_reference in one micro-batch, or in 2, 4, ... of the same shape (the step's tokens) until it fits."""
    micro = 1
    while True:
        try:
            return time_reference(s, data, ctx, steps, micro)
        except torch.OutOfMemoryError:
            if micro >= 64:
                raise
        torch.cuda.empty_cache()
        micro *= 2
        print(f"  {s.name} reference: out of memory; {micro} micro-batches", flush=True)
