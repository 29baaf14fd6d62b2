"""The run's records: the progress a resumed run continues from, and what the run writes of itself.

    p = Progress()                                     # counters, data position, validation, plot rows
    p.step_tokens_range = widen(p.step_tokens_range, src, tgt)
    write_text(plot, plot_csv(p.plot_rows))            # plots/train.csv: PLOT_COLUMNS
    train_metrics(p, ...)                              # metrics/train.json, flat
    trace(ctx, step, pieces, model)                    # STAGES_TRAIN_TRACE=DIR: per-step debug lines (tests)

Set STAGES_TRAIN_TRACE=DIR to have every rank append, per step, the batches it
trained on and a checksum of its parameters to DIR/rank<r>.jsonl (tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from model import flops as flops_lib
from pipeline.corpus import steps
from pipeline.device.distributed import Dist
from pipeline.device.peak import Peak
from pipeline.device.precision import Precision

PLOT_COLUMNS = ("step", "loss", "lr", "tokens_per_second", "valid_ppl")
TRACE_ENV = "STAGES_TRAIN_TRACE"
RECOMPILE_REASONS = 10  # recompile reasons a run keeps (metrics/train.json); the count is whole


@dataclass
class Progress:
    """Everything besides weights, Adam and RNGs that a resumed run must continue from."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0  # next position in the epoch's batch order
    train_tokens: int = 0  # real target tokens (with EOS)
    src_tokens: int = 0  # real source tokens (with EOS)
    step_tokens_range: list[int] = field(default_factory=list)  # [src min, src max, tgt min, tgt max] over the steps
    flops: float = 0.0
    elapsed_seconds: float = 0.0  # wall clock of the training loop (evaluation and checkpoints included)
    step_seconds: float = 0.0  # time in training steps only (tokens per second, MFU)
    compile_seconds: float = 0.0  # of step_seconds, compiling (train.compile: graphs built inside a step)
    compile_graphs: int = 0  # graphs torch.compile built inside steps
    recompiles: int = 0  # of them, rebuilt for a shape or value their guards did not admit (compiled.watch)
    recompile_reasons: list = field(default_factory=list)  # the first RECOMPILE_REASONS, as dynamo gave them
    compile_cache: list[int] = field(default_factory=lambda: [0, 0])  # compiled graphs loaded, built (cache_counts)
    fallback: str = ""  # why a compiled run turned eager (a compile failure, the recompile limit), "" while it has not
    fallback_step: int | None = None  # the step it turned eager at
    eager_steps: int = 0  # steps trained eager since
    valid: dict = field(default_factory=dict)
    plot_rows: list = field(default_factory=list)
    code_changes: list = field(default_factory=list)  # [{"step", "files"}]: resumed across a code change
    # [{"step", "label"}]: the precision each segment of a resumed run computed in, from that step (Trainer.resume)
    precisions: list = field(default_factory=list)

    def recompiled(self, reasons: list[str]) -> None:
        """Count a step's recompiles and keep the first RECOMPILE_REASONS reasons of the run."""
        self.recompiles += len(reasons)
        self.recompile_reasons += reasons[: max(RECOMPILE_REASONS - len(self.recompile_reasons), 0)]

    def fell_back(self, step: int, reason: str) -> None:
        """The compiled steps turned eager at `step`, for `reason` (the last fallback of a resumed run is kept)."""
        self.fallback, self.fallback_step = reason, step

    @property
    def train_seconds(self) -> float:
        """Time in training steps, less their compiling: what tokens per second and MFU are over."""
        return max(self.step_seconds - self.compile_seconds, 0.0)


def plot_csv(rows: list[list]) -> str:
    lines = [",".join(PLOT_COLUMNS)]
    lines += [",".join("" if v is None else (str(v) if isinstance(v, int) else f"{v:.6g}") for v in r) for r in rows]
    return "\n".join(lines) + "\n"


def trace(ctx: Dist, step: int, pieces: tuple[tuple[int, int], ...], model: nn.Module) -> None:
    """Debug record for tests: this rank's batches of `step` (and their row parts), a checksum of its parameters."""
    directory = os.environ.get(TRACE_ENV)
    if directory:
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        record = {"step": step, "batches": [b for b, _ in pieces], "parts": [p for _, p in pieces], "checksum": checksum}
        with open(Path(directory) / f"rank{ctx.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def widen(bounds: list, src: int, tgt: int) -> list:
    """[src min, src max, tgt min, tgt max] widened to take in one more step's real tokens."""
    if not bounds:
        return [src, src, tgt, tgt]
    return [min(bounds[0], src), max(bounds[1], src), min(bounds[2], tgt), max(bounds[3], tgt)]


def step_tokens_metrics(p: Progress) -> dict[str, float]:
    """Real source and target tokens per step (mean, min, max) of the steps trained so far."""
    lo_s, hi_s, lo_t, hi_t = p.step_tokens_range or [0, 0, 0, 0]
    return steps.per_step_metrics("src", p.src_tokens, p.step, lo_s, hi_s) | steps.per_step_metrics(
        "tgt", p.train_tokens, p.step, lo_t, hi_t)


def train_metrics(p: Progress, *, stopped_by_time: bool, train_batches: int, cuda_graphs: tuple[int | None, int | None],
                  peak: Peak, world: int, accum: int, code_hash: str, phash: str,
                  precision: Precision) -> dict:
    """metrics/train.json: flat, the DVC record of the run. tokens_per_second and mfu are over the steps' time
    less their compiling (step_seconds - compile_seconds: Progress.train_seconds), so a compiled run's rate
    is its steady one; step_seconds is every step's time, compiling included.

    cuda_graphs: (graphs recorded, their pool's bytes) under train.cuda_graphs (graphs.totals), else (None, None)."""
    hours = p.elapsed_seconds / 3600
    return {
        "steps": p.step,
        "stopped_by": "max_minutes" if stopped_by_time else "max_steps",
        "epochs": p.epoch + p.cursor / max(train_batches, 1),
        "train_tokens": p.train_tokens,  # real target tokens trained on
        **step_tokens_metrics(p),
        "train_hours": hours,
        "step_seconds": p.step_seconds,
        "compile_seconds": p.compile_seconds,  # of step_seconds: train.compile building graphs (compiled.py)
        "compile_graphs": p.compile_graphs,
        "compile_recompiles": p.recompiles,  # and the guards that failed, first RECOMPILE_REASONS of them:
        "compile_recompile_reasons": " | ".join(p.recompile_reasons),
        # a compiled run that turned eager: why, at which step, and how many steps ran eager since ("", None, 0)
        "compile_fallback": p.fallback,
        "compile_fallback_step": p.fallback_step,
        "compile_eager_steps": p.eager_steps,
        # of the graphs, loaded from the compile cache (data/compile_cache: a resumed run) and built anew
        "compile_cache_hits": p.compile_cache[0],
        "compile_cache_misses": p.compile_cache[1],
        # train.cuda_graphs: CUDA graphs recorded and their memory pool's bytes (None off CUDA or when off)
        **dict(zip(("cuda_graphs_recorded", "cuda_graphs_pool_bytes"), cuda_graphs)),
        "flops_analytic": p.flops,
        "flops_paper_estimate": flops_lib.paper_estimate_flops(hours, world, peak.fp32_tflops),
        "mfu": flops_lib.mfu(p.flops, p.train_seconds, world, peak.flops) if p.train_seconds and peak.flops else 0.0,
        "peak_flops": peak.flops,
        "peak_flops_source": peak.source,
        "tokens_per_second": p.train_tokens / p.train_seconds if p.train_seconds else 0.0,
        "device": peak.device,
        # how the steps computed (precision.py): the label names the kernels, the key is hashed into params_hash
        "precision": precision_label(p, precision),
        "precision_key": precision.key,
        "devices": world,
        "grad_accum": accum,
        "code_hash": code_hash,
        "code_changes": len(p.code_changes),  # resumes across a code change (RESUME_ACROSS_CODE_CHANGE=1)
        "code_changed_at_step": p.code_changes[-1]["step"] if p.code_changes else None,
        "code_changed_files": ", ".join(p.code_changes[-1]["files"]) if p.code_changes else "",
        "params_hash": phash,
        **p.valid,
    }


def precision_label(p: Progress, precision: Precision) -> str:
    """The precision the run's steps computed in: one label, or each resumed segment's from its first step when a
    resume computed otherwise (cpu_matmul = blas after oneDNN's products: the same key, other kernels)."""
    if len(p.precisions) < 2:
        return precision.label
    return ", then ".join(f"{s['label']} from step {s['step']}" for s in p.precisions)
