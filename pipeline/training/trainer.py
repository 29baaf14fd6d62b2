"""The training loop of Sec. 5: Adam, warmup then inverse-square-root LR, label smoothing, data parallel.

    trainer = Trainer(data, model_cfg, train_cfg, max_tokens, ctx, run, phash, checkpoints, plot)
    metrics = trainer.fit()            # or drive it: trainer.step(order), trainer.validate()

Each step updates on batches_per_step() stored batches, whatever the world size
(pipeline/corpus/steps.py): each of the world's processes accumulates
grad_accumulation() micro-batches, one stored batch each (a world that cannot
share them equally fails at start). Each epoch shuffles the batch order (seed
+ epoch); a step takes the next batches_per_step of it and rank r the r-th of
every world. The loss is summed over real target tokens and divided
by the step's real target tokens over all ranks and micro-batches, so the update
is that of one big batch.
The real source and target tokens of every step are counted (metrics/train.json:
{src,tgt}_tokens_per_step_{mean,min,max}; Sec. 5.1 asks for ~25000 of each).

Stops at train.max_steps: the budget, so the same params give the same
weights on any machine. train.max_minutes (across resumes) is only a safety
stop: rank 0's clock decides for every rank, and metrics/train.json records
stopped_by = "max_minutes" when it fired (else "max_steps").
Checkpoints (pipeline/weights/checkpoint.py) every checkpoint_every steps and at
the end, never by the clock, so the checkpoints average takes are the same on any hardware; on start the newest complete checkpoint
with the same params_hash and made by the same code (pipeline/weights/fingerprint.py:
every project file train imports) is resumed exactly (weights, Adam, RNGs, data
position, counters): an interrupted run ends with the same weights as an
uninterrupted one. A checkpoint of other code is set aside like one of other
params, unless RESUME_ACROSS_CODE_CHANGE=1: then it is resumed and the crossing
recorded (metrics code_changes, code_changed_at_step, code_changed_files). Only rank 0 reads and writes checkpoints; it sends the one
it resumes to every rank (other nodes need not see them), on another world size
too when a step keeps its batches (params_hash; RNGs: restore_rank_rng).
Precision: distributed.mixed_precision. train.compile compiles the encoder and decoder layers
(pipeline/training/compiled.py: checkpoints unchanged); if compiling fails, the step is repeated eager
and the run stays eager, with one warning. The next step's micro-batches are built
in a background thread while this one trains (loader.Prefetcher).

Set STAGES_TRAIN_TRACE=DIR to have every rank append, per step, the batches it
trained on and a checksum of its parameters to DIR/rank<r>.jsonl (tests).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from pipeline.progress import progress_bar

from model import flops as flops_lib
from model.config import ModelConfig
from model.loss import SmoothedLoss, projected_smoothed_and_nll, real_hidden
from model.schedule import lrate
from model.transformer import Transformer
from pipeline.weights import checkpoint as ckpt
from pipeline.training import attention, compiled, distributed, graphs, peak, plan
from pipeline.weights import faults, fingerprint
from pipeline.core import signals, tracking
from pipeline.corpus import steps
from pipeline.core.config import BatchConfig, TrainConfig
from pipeline.training.distributed import Dist
from pipeline.core.files import write_text
from pipeline.corpus.formats import batch_paths
from pipeline.training.loader import Batch, Prefetcher, TrainingData
from pipeline.training.optimizer import build_optimizer, train_step, zero_grads

log = logging.getLogger(__name__)

PLOT_COLUMNS = ("step", "loss", "lr", "tokens_per_second", "valid_ppl")
# Train params that do not change the weights of a given step: changing them
# resumes the old run instead of restarting it (e.g. a larger max_steps continues).
# devices: a step's batches do not depend on it (pipeline/corpus/steps.py).
# compile: the same function of the same weights, rounded otherwise (as on another GPU); a run that falls
# back to eager (compiled.py) must resume its own checkpoints, and switching it should not cost the run.
# micro_batch_tokens: how a process cuts its share into micro-batches; the gradient is summed over them all the same.
NOT_WEIGHT_SHAPING = ("max_steps", "max_minutes", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
                      "devices", "timeout_minutes", "compile", "cuda_graphs", "micro_batch_tokens")
TRACE_ENV = "STAGES_TRAIN_TRACE"


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
    valid: dict = field(default_factory=dict)
    plot_rows: list = field(default_factory=list)
    code_changes: list = field(default_factory=list)  # [{"step", "files"}]: resumed across a code change

    @property
    def train_seconds(self) -> float:
        """Time in training steps, less their compiling: what tokens per second and MFU are over."""
        return max(self.step_seconds - self.compile_seconds, 0.0)


def params_hash(model_cfg: ModelConfig, train_cfg: TrainConfig, batch: BatchConfig, tokenized: Path,
                batches: Path) -> str:
    """sha256 of what shapes the weights: model, train (less NOT_WEIGHT_SHAPING), batch.max_tokens and
    length_bucket_step (how batches are padded), the data, and the stored batches per step, which the world size
    does not change: 2 processes x 1 batch resume 1 process x 2 (and the reverse)."""
    train = {k: v for k, v in asdict(train_cfg).items() if k not in NOT_WEIGHT_SHAPING}
    step_batches = steps.batches_per_step(train_cfg.tokens_per_step, batch.max_tokens)
    files = [p for p in (tokenized / "meta.json", tokenized / "spm.model", *batch_paths(batches, "train")) if p.exists()]
    return ckpt.fingerprint({"model": asdict(model_cfg), "train": train, "batch.max_tokens": batch.max_tokens,
                             "batch.length_bucket_step": batch.length_bucket_step, "batches_per_step": step_batches},
                            files)


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


class Trainer:
    """One training run, fresh or resumed: model, Adam, data position and counters; rank 0 writes.

    `checkpoints` and `plot` may be None (benchmarks): then nothing is resumed or written.
    """

    def __init__(self, data: TrainingData, model_cfg: ModelConfig, cfg: TrainConfig, max_tokens: int, ctx: Dist,
                 run: tracking.StageRun, phash: str, checkpoints: Path | None = None, plot: Path | None = None):
        self.data, self.model_cfg, self.cfg, self.ctx, self.run = data, model_cfg, cfg, ctx, run
        self.phash, self.checkpoints, self.plot = phash, checkpoints, plot
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # (epoch, its batch order)
        self.stopped_by_time = False
        self.saved_step: int | None = None  # the newest checkpoint written or resumed from
        self.bar = None  # the progress bar, while training
        self.batches = steps.batches_per_step(cfg.tokens_per_step, max_tokens)
        self.parts = steps.parts_per_batch(self.batches, ctx.world)
        self.accum = steps.grad_accumulation(cfg.tokens_per_step, max_tokens, ctx.world)
        log.info("%d device(s) x %d piece(s) a step: %d batch(es) of <= %d padded tokens%s (train.tokens_per_step = "
                 "%d); %d train batches per epoch", ctx.world, self.accum, self.batches, max_tokens,
                 f", each cut into {self.parts} row parts" if self.parts > 1 else "", cfg.tokens_per_step,
                 len(data.train_batches))
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.model = Transformer(model_cfg, data.vocab_size).to(ctx.device)
        self.optimizer = build_optimizer(self.model, cfg)
        # Paper: fp32 on P100s. GPUs train under autocast: bf16, or fp16 with a gradient scaler on GPUs without
        # bf16 (the weights and Adam stay fp32).
        self.autocast, self.scaler = distributed.mixed_precision(ctx)
        torch.manual_seed(cfg.seed + ctx.rank)  # dropout masks differ between ranks
        # The code that shapes the weights (every project file train imports), recorded in each checkpoint:
        # a checkpoint of other code is not resumed (pipeline/weights/checkpoint.py, resume_point).
        self.code = fingerprint.code_fingerprint("stages.train") if checkpoints is not None else {}
        self.code_hash = fingerprint.code_hash(self.code)
        distributed.check_same(self.code_hash, "code fingerprint (the project files train imports)", ctx)
        self.progress = self.resume()
        # Compiled after resuming (load_state_dict on the plain module) and inside DDP, which stays eager.
        # train.cuda_graphs: the same layers compiled, replayed as CUDA graphs (graphs.py).
        self.compiled = (compiled.compile_layers(self.model, graphs.mode(cfg.cuda_graphs))
                         if cfg.compile or cfg.cuda_graphs else [])
        self.loss_model: nn.Module = SmoothedLoss(self.model, cfg.label_smoothing)  # chunked: no [N, V] logits (model/loss.py)
        if ctx.world > 1 or torch.distributed.is_initialized():  # a group of one too: bench.gpu_check times DDP
            self.loss_model = distributed.ddp(self.loss_model, ctx)  # no buffer sync per forward, on any torch
        # Steps, validation and the rest of the process: the SDPA kernels chosen on CUDA (none changed on a CPU).
        self.attention_kernels = attention.use(ctx.device)
        log.info("attention: %s", self.attention_kernels)
        budget = plan.micro_batch_tokens(cfg.micro_batch_tokens, model_cfg, data.vocab_size, ctx.device)
        self.prefetch = Prefetcher(lambda share: data.micro_batches(*share, ctx.device, self.parts, budget), ctx.device)
        self.valid, left_out = data.valid_share(ctx.rank, ctx.world, model_cfg.max_positions, ctx.device)
        if left_out:
            log.warning("%d valid pair(s) longer than model.max_positions = %d are left out of validation",
                        left_out, model_cfg.max_positions)
        self.peak = peak.peak_flops(ctx) if ctx.is_main else peak.Peak(0.0, 0.0, "", "", None)
        run.log_params({"model": asdict(model_cfg), "train": asdict(cfg), "batch.max_tokens": max_tokens,
                        "grad_accum": self.accum, "device": self.peak.device, "params_hash": phash,
                        "code_hash": self.code_hash,
                        "attention": ",".join(attention.choice(ctx.device) or ("cpu-default",))})

    def close(self) -> None:
        """Drop DDP before the process group ends (distributed.teardown): its reducer holds the group, and a group
        ended by the reducer's destructor joins the group's threads while holding the interpreter lock, which one of
        them may be waiting for (a gloo rank hung at exit so)."""
        self.loss_model = None
        gc.collect()

    def resume(self) -> Progress:
        """Load the newest matching checkpoint (rank 0 reads it and sends it to every rank), else start afresh."""
        if self.checkpoints is None:
            return Progress()
        across = os.environ.get(ckpt.ACROSS_CODE_CHANGE_ENV, "") == "1"
        found = ckpt.resume_point(self.checkpoints, self.phash, self.code, across) if self.ctx.is_main else None
        path, state, changed = distributed.broadcast_object(found or (None, None, []), self.ctx)
        if path is None:
            return Progress()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        progress = Progress(**state["progress"])
        if not ckpt.restore_rank_rng(state["rng"], self.ctx.rank, self.ctx.world, self.cfg.seed, progress.step):
            log.warning("checkpoint of %d process(es) resumed by %d: dropout RNGs seeded afresh from (train.seed, "
                        "step, rank); the weights equal an uninterrupted run's only without dropout",
                        len(state["rng"]), self.ctx.world)
        log.info("resuming from step %d (%s)", progress.step, path)
        if changed:
            log.warning("resuming %s across a code change (%s=1): %s differ; recorded in metrics and MLflow",
                        path.name, ckpt.ACROSS_CODE_CHANGE_ENV, ", ".join(changed))
            progress.code_changes.append({"step": progress.step, "files": changed})
            self.run.set_tags({f"code_change_at_step_{progress.step}": ", ".join(changed)})
        self.saved_step = progress.step
        self.run.set_tags({"resumed_from_step": progress.step})
        return progress

    def save(self) -> None:
        rngs = distributed.gather_objects(ckpt.capture_rng(), self.ctx)
        if self.ctx.is_main and self.checkpoints is not None:
            p = self.progress
            state = {  # weights_only-loadable: see pipeline/weights/checkpoint.py and the average stage
                "step": p.step, "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "model_config": asdict(self.model_cfg), "vocab_size": self.data.vocab_size,
                "params_hash": self.phash, "code": self.code, "code_hash": self.code_hash,
                "optimizer": self.optimizer.state_dict(), "rng": rngs,
                **({"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {}),
                "data_position": {"epoch": p.epoch, "cursor": p.cursor}, "elapsed_seconds": p.elapsed_seconds,
                "train_tokens": p.train_tokens, "progress": asdict(p),
            }
            with signals.held():  # a Ctrl-C while saving is raised once saved_step names the checkpoint on disk
                saved = ckpt.save_checkpoint(self.checkpoints, state, self.cfg.keep_checkpoints)
                self.saved_step = p.step
            log.info("step %d: saved %s", p.step, saved)

    def record(self, row: list) -> None:
        """Append a plot row (step, loss, lr, tokens_per_second, valid_ppl) and rewrite the CSV."""
        self.progress.plot_rows.append(row)
        if self.ctx.is_main and self.plot is not None:
            write_text(self.plot, plot_csv(self.progress.plot_rows))

    def epoch_order(self) -> np.ndarray:
        """The batch order of the current epoch, moving to the next epoch when this one is used up."""
        p = self.progress
        if p.cursor >= len(self.data.train_batches):
            p.epoch, p.cursor = p.epoch + 1, 0
        if self._order[0] != p.epoch:
            self._order = (p.epoch, steps.epoch_order(len(self.data.train_batches), self.cfg.seed, p.epoch))
        return self._order[1]

    def share(self, step_ids: np.ndarray) -> tuple[tuple[tuple[int, int], ...], int, int]:
        """This rank's pieces of a step, the pieces every rank runs, and the spare (micro_batches' arguments)."""
        mine, n_micro = steps.rank_share(step_ids, self.ctx.rank, self.ctx.world, self.parts)
        return tuple(mine), n_micro, int(step_ids[0])

    def step(self, order: np.ndarray) -> tuple[Tensor, int, float]:
        """Train on the next batches_per_step batches of `order`; (this rank's loss sum, its tokens, lr)."""
        p, ctx = self.progress, self.ctx
        step_ids = order[p.cursor : p.cursor + self.batches]
        p.cursor += len(step_ids)
        mine = self.share(step_ids)
        upcoming = steps.next_step(order, p.cursor, p.epoch, self.batches, self.cfg.seed)
        micro = self.prefetch.get(mine, self.share(upcoming))
        S, T = self.data.lengths(step_ids)
        lr = self.cfg.lr_factor * lrate(p.step + 1, self.model_cfg.d_model, self.cfg.warmup_steps)
        faults.inject("step", p.step + 1)  # tests only: TRANSFORMER_FAULT=step@N kills the process here
        loss_sum = self.compiled_or_eager(lambda: train_step(self.loss_model, self.optimizer, micro, int(T.sum()), lr,
                                                             ctx, self.autocast, self.scaler))
        p.step += 1
        p.train_tokens += int(T.sum())
        p.src_tokens += int(S.sum())
        p.step_tokens_range = widen(p.step_tokens_range, int(S.sum()), int(T.sum()))
        p.flops += flops_lib.training_flops(self.model_cfg, self.data.vocab_size, S, T)
        trace(ctx, p.step, mine[0], self.model)
        return loss_sum, sum(b.tokens for b, real in micro if real), lr

    def compiled_or_eager(self, run, step: bool = True):
        """run(); if the compiled layers fail to compile, back to eager (one warning) and run() again.

        A failure comes from a layer's forward, before any Adam update: the step's gradients so far are
        dropped and the RNGs (dropout) put back, so the repeat is the step eager would have trained.
        In a training step (`step`), the seconds and graphs spent compiling are added to the progress
        (compile_seconds, compile_graphs), a failed compile's seconds too."""
        if not self.compiled:
            return run()
        rng = ckpt.capture_rng()
        seconds, graphs = compiled.compile_totals()
        try:
            return run()
        except compiled.COMPILE_FAILURES as e:
            compiled.fallback(self.compiled, e)
            self.compiled = []
            zero_grads(self.optimizer, self.loss_model)
            ckpt.restore_rng(rng)
            return run()
        finally:
            if step:
                now_seconds, now_graphs = compiled.compile_totals()
                self.progress.compile_seconds += max(now_seconds - seconds, 0.0)
                self.progress.compile_graphs += max(now_graphs - graphs, 0)

    def validate(self) -> dict[str, float]:
        """Validation loss and perplexity of the current weights, over all ranks; kept in the progress."""
        p = self.progress
        p.valid = self.compiled_or_eager(
            lambda: validate(self.model, self.valid, self.cfg.label_smoothing, self.ctx, self.autocast), step=False)
        log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f", p.step, p.valid["valid_loss"],
                 p.valid["valid_nll"], p.valid["valid_ppl"])
        self.run.log_metrics(p.valid, step=p.step)
        return p.valid

    def decide(self) -> tuple[bool, bool]:
        """(stop, checkpoint now), decided by rank 0 for every rank: clocks differ between processes."""
        p, cfg = self.progress, self.cfg
        out_of_time = cfg.max_minutes > 0 and p.elapsed_seconds >= cfg.max_minutes * 60
        due = cfg.checkpoint_every > 0 and p.step % cfg.checkpoint_every == 0
        done, out_of_time, due = distributed.broadcast_flags([p.step >= cfg.max_steps, out_of_time, due], self.ctx)
        if out_of_time and not done:
            if not self.stopped_by_time:
                log.warning("step %d: train.max_minutes = %g reached before train.max_steps = %d; stopping (safety stop: "
                            "this run's result depends on the machine's speed)", p.step, cfg.max_minutes, cfg.max_steps)
            self.stopped_by_time = True
        return done or out_of_time, due

    def interrupted(self) -> str:
        """After Ctrl-C: end the progress line; say at which step training stopped and what a re-run continues from."""
        if self.bar is not None:
            self.bar.close()
        if self.saved_step is None:
            return (f"stopped at step {self.progress.step}, before the first checkpoint; "
                    "the same command (or `dvc repro`) starts training again")
        return (f"stopped at step {self.progress.step}; the same command (or `dvc repro`) resumes from the newest "
                f"checkpoint, step {self.saved_step}")

    def fit(self) -> dict:
        """Step until max_steps (or the max_minutes safety stop); evaluate, log and checkpoint on the way; return the metrics."""
        p, cfg, ctx = self.progress, self.cfg, self.ctx
        if ctx.is_main and self.plot is not None:
            write_text(self.plot, plot_csv(p.plot_rows))  # on resume: the rows up to the checkpoint, no more
        interval = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss sum, tokens since the last row
        interval_seconds, interval_tokens, saved_at = 0.0, 0, p.step
        start = time.monotonic() - p.elapsed_seconds
        bar = self.bar = progress_bar(total=cfg.max_steps, initial=p.step, disable=not ctx.is_main, unit="step", dynamic_ncols=True)
        stop, _ = self.decide()
        while not stop:
            t0 = time.perf_counter()
            order = self.epoch_order()
            tokens_before = p.train_tokens
            loss_sum, my_tokens, lr = self.step(order)
            interval[0] += loss_sum
            interval[1] += my_tokens
            seconds = time.perf_counter() - t0
            p.step_seconds += seconds
            interval_seconds, interval_tokens = interval_seconds + seconds, interval_tokens + p.train_tokens - tokens_before
            p.elapsed_seconds = time.monotonic() - start
            bar.update(1)
            stop, due_save = self.decide()
            evaluated = stop or (cfg.eval_every > 0 and p.step % cfg.eval_every == 0)
            if evaluated:
                faults.inject("validation", p.step)  # tests only: TRANSFORMER_FAULT=validation@N kills the process here
                self.validate()
            if evaluated or p.step % cfg.log_every == 0:
                loss, tokens = distributed.all_sum(interval, ctx).tolist()
                row_loss, tok_s = (loss / tokens if tokens else None), interval_tokens / interval_seconds
                self.record([p.step, row_loss, lr, tok_s, p.valid["valid_ppl"] if evaluated else None])
                bar.set_postfix(step=p.step, loss=f"{row_loss:.3f}" if row_loss else "-", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
                log.info("step %d | epoch %d | loss %.4f | lr %.3e | %.0f tok/s", p.step, p.epoch,
                         row_loss or float("nan"), lr, tok_s)
                self.run.log_metrics({"loss": row_loss or float("nan"), "lr": lr, "interval_tokens_per_second": tok_s},
                                     step=p.step)
                interval.zero_()
                interval_seconds, interval_tokens = 0.0, 0
            if due_save or stop:
                self.save()
                saved_at = p.step
            p.elapsed_seconds = time.monotonic() - start
        bar.close()
        if not p.valid:  # resumed at max_steps from a checkpoint written before any evaluation
            self.validate()
        if saved_at != p.step:
            self.save()
        if ctx.is_main and p.train_seconds:  # MFU <= 1: a run faster than the peak raises it
            self.peak = peak.settle(self.peak, p.flops / (p.train_seconds * ctx.world))
        return self.metrics()

    def metrics(self) -> dict:
        """metrics/train.json: flat, the DVC record of the run. tokens_per_second and mfu are over the steps' time
        less their compiling (step_seconds - compile_seconds: Progress.train_seconds), so a compiled run's rate
        is its steady one; step_seconds is every step's time, compiling included."""
        p, world = self.progress, self.ctx.world
        hours = p.elapsed_seconds / 3600
        return {
            "steps": p.step,
            "stopped_by": "max_minutes" if self.stopped_by_time else "max_steps",
            "epochs": p.epoch + p.cursor / max(len(self.data.train_batches), 1),
            "train_tokens": p.train_tokens,  # real target tokens trained on
            **step_tokens_metrics(p),
            "train_hours": hours,
            "step_seconds": p.step_seconds,
            "compile_seconds": p.compile_seconds,  # of step_seconds: train.compile building graphs (compiled.py)
            "compile_graphs": p.compile_graphs,
            # train.cuda_graphs: CUDA graphs recorded and their memory pool's bytes (None off CUDA or when off)
            **dict(zip(("cuda_graphs_recorded", "cuda_graphs_pool_bytes"),
                       graphs.totals(self.ctx.device) if self.cfg.cuda_graphs else (None, None))),
            "flops_analytic": p.flops,
            "flops_paper_estimate": flops_lib.paper_estimate_flops(hours, world, self.peak.fp32_tflops),
            "mfu": flops_lib.mfu(p.flops, p.train_seconds, world, self.peak.flops) if p.train_seconds and self.peak.flops else 0.0,
            "peak_flops": self.peak.flops,
            "peak_flops_source": self.peak.source,
            "tokens_per_second": p.train_tokens / p.train_seconds if p.train_seconds else 0.0,
            "device": self.peak.device,
            "devices": world,
            "grad_accum": self.accum,
            "code_hash": self.code_hash,
            "code_changes": len(p.code_changes),  # resumes across a code change (RESUME_ACROSS_CODE_CHANGE=1)
            "code_changed_at_step": p.code_changes[-1]["step"] if p.code_changes else None,
            "code_changed_files": ", ".join(p.code_changes[-1]["files"]) if p.code_changes else "",
            "params_hash": self.phash,
            **p.valid,
        }
