"""The training loop of Sec. 5: Adam, warmup then inverse-square-root LR, label smoothing, data parallel.

    trainer = Trainer(data, model_cfg, train_cfg, max_tokens, ctx, run, phash, checkpoints, plot, precision=precision)
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
Checkpoints every checkpoint_every steps and at the end, never by the clock, so
the checkpoints average takes are the same on any hardware; on start the newest
matching one is resumed exactly (run_checkpoints.py).
Precision: one value resolved from the device and train.cpu_matmul (precision.py). train.compile compiles
the encoder and decoder layers, or the whole step (train.compile_scope; pipeline/device/compiled.py: checkpoints
unchanged); if compiling fails, the step is repeated eager and the run stays eager, with one warning. The next
step's micro-batches are built in a background thread while this one trains (loader.Prefetcher).

Beside it in pipeline/training: validation.py (the valid loss and perplexity), records.py (Progress, the plot rows,
metrics/train.json, the STAGES_TRAIN_TRACE debug lines), params.py (params_hash); the run's Precision: pipeline/device/precision.py,
run_checkpoints.py (Trainer.save and Trainer.resume).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from pipeline.progress import progress_bar

from model import flops as flops_lib
from model import rdrop
from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.schedule import lrate
from model.transformer import Transformer
from pipeline.weights import checkpoint as ckpt
from pipeline.device import attention, compiled, distributed, graphs, peak
from pipeline.training import plan, records
from pipeline.weights import faults, fingerprint
from pipeline.core import signals, tracking
from pipeline.corpus import steps
from pipeline.core.config import TrainConfig
from pipeline.device.distributed import Dist
from pipeline.core.files import write_text
from pipeline.training.loader import Prefetcher, TrainingData
from pipeline.training.optimizer import build_optimizer, train_step, zero_grads
from pipeline.device.precision import Precision
from pipeline.training.records import plot_csv, trace, widen
from pipeline.training.run_checkpoints import RunCheckpoints
from pipeline.training.validation import validate

log = logging.getLogger(__name__)


class Trainer(RunCheckpoints):
    """One training run, fresh or resumed: model, Adam, data position and counters; rank 0 writes.

    `checkpoints` and `plot` may be None (benchmarks): then nothing is resumed or written.
    """

    def __init__(self, data: TrainingData, model_cfg: ModelConfig, cfg: TrainConfig, max_tokens: int, ctx: Dist,
                 run: tracking.StageRun, phash: str, checkpoints: Path | None = None, plot: Path | None = None, *,
                 precision: Precision, ddp: bool = False):
        self.data, self.model_cfg, self.cfg, self.ctx, self.run = data, model_cfg, cfg, ctx, run
        self.phash, self.checkpoints, self.plot = phash, checkpoints, plot
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # (epoch, its batch order)
        self.stopped_by_time = False
        self.preemption: signals.Asked | None = None  # set by the stage under SLURM: a signal checkpoints and stops
        self.preempted = False  # stopped by that signal (fit raises signals.Preempted)
        self.saved_step: int | None = None  # the newest checkpoint written or resumed from
        self.saved_path: Path | None = None  # the newest checkpoint written (rank 0)
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
        # bf16 (the weights and Adam stay fp32). CPUs: train.cpu_matmul. How the step computes, never what it
        # trains (precision.py): the stage resolved it once and hashed it into phash.
        self.precision = precision
        self.precision.use()  # this process's products and attention kernels
        distributed.check_precision(self.precision.label, ctx)
        self.autocast, self.scaler = self.precision.autocast(), self.precision.grad_scaler()
        torch.manual_seed(cfg.seed + ctx.rank)  # dropout masks differ between ranks
        # The code that shapes the weights (every project file train imports), recorded in each checkpoint:
        # a checkpoint of other code is not resumed (pipeline/weights/checkpoint.py, resume_point).
        self.code = fingerprint.code_fingerprint("stages.train") if checkpoints is not None else {}
        self.code_hash = fingerprint.code_hash(self.code)
        distributed.check_same(self.code_hash, "code fingerprint (the project files train imports)", ctx)
        self.progress = self.resume()
        # Compiled after resuming (load_state_dict on the plain module): the layers inside DDP, which stays eager,
        # or the whole step, DDP included (compile_scope). train.cuda_graphs: the compiled graphs replayed as CUDA
        # graphs (graphs.py).
        scope = cfg.compile_scope if cfg.compile or cfg.cuda_graphs else None
        self.layers = compiled.compile_layers(self.model, graphs.mode(cfg.cuda_graphs)) if scope == "layers" else []
        # chunked: no [N, V] logits (model/loss.py), but with R-Drop (model/rdrop.py) and the whole step compiled
        self.loss_model: nn.Module = SmoothedLoss(self.model, cfg.label_smoothing, rdrop_alpha=cfg.rdrop_alpha,
                                                  rdrop_fraction=cfg.rdrop_fraction, padded=scope == "step")
        if ctx.world > 1 or ddp:  # `ddp`: in a process group of one too (bench.gpu.check's share line times it)
            self.loss_model = distributed.ddp(self.loss_model, ctx, cfg.ddp_bucket_mb, cfg.ddp_static_graph,
                                              cfg.grad_compression)  # no buffer sync per forward, on any torch
        self.forward = compiled.compile_step(self.loss_model, graphs.mode(cfg.cuda_graphs)) if scope == "step" else None
        # Steps, validation and the rest of the process: the SDPA kernels chosen on CUDA (none changed on a CPU).
        self.attention_kernels = attention.use(ctx.device)
        log.info("attention: %s", self.attention_kernels)
        budget = plan.micro_batch_tokens(cfg.micro_batch_tokens, model_cfg, data.vocab_size, ctx.device,
                                         rdrop.passes(cfg.rdrop_alpha, cfg.rdrop_fraction), scope == "step")
        self.prefetch = Prefetcher(lambda share: data.micro_batches(*share, ctx.device, self.parts, budget), ctx.device)
        self.valid, left_out = data.valid_share(ctx.rank, ctx.world, model_cfg.max_positions, ctx.device)
        if left_out:
            log.warning("%d valid pair(s) longer than model.max_positions = %d are left out of validation",
                        left_out, model_cfg.max_positions)
        self.peak = (peak.peak_flops(ctx, precision=self.precision) if ctx.is_main
                     else peak.Peak(0.0, 0.0, "", "", None))
        run.log_params({"model": asdict(model_cfg), "train": asdict(cfg), "batch.max_tokens": max_tokens,
                        "batch.length_bucket_step": data.bucket_step,
                        "grad_accum": self.accum, "device": self.peak.device, "precision": self.precision.label,
                        "precision_key": self.precision.key,
                        "params_hash": phash,
                        "code_hash": self.code_hash,
                        "attention": ",".join(attention.choice(ctx.device) or ("cpu-default",))})

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled: the layers (compile_scope layers) or the whole step (step)."""
        return bool(self.layers) or self.forward is not None

    def close(self) -> None:
        """Drop DDP before the process group ends (distributed.teardown): its reducer holds the group, and a group
        ended by the reducer's destructor joins the group's threads while holding the interpreter lock, which one of
        them may be waiting for (a gloo rank hung at exit so)."""
        self.loss_model = None
        gc.collect()

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
        if self.cfg.cuda_graphs and self.compiled:
            graphs.step_begins()
        loss_sum = self.compiled_or_eager(lambda: train_step(self.loss_model, self.optimizer, micro, int(T.sum()), lr,
                                                             ctx, self.autocast, self.scaler, self.forward))
        p.step += 1
        p.eager_steps += bool(p.fallback)  # steps trained eager after a compiled run fell back
        p.train_tokens += int(T.sum())
        p.src_tokens += int(S.sum())
        p.step_tokens_range = widen(p.step_tokens_range, int(S.sum()), int(T.sum()))
        p.flops += rdrop.passes(self.cfg.rdrop_alpha, self.cfg.rdrop_fraction) * flops_lib.training_flops(self.model_cfg, self.data.vocab_size,
                                                                                 S, T)
        trace(ctx, p.step, mine[0], self.model)
        return loss_sum, sum(b.tokens for b, real in micro if real), lr

    def compiled_or_eager(self, run, step: bool = True):
        """run(); if the compiled layers fail to compile or pass the recompile limit, back to eager (one warning,
        recorded: Progress.fell_back) and run() again; train.compile_on_limit = fail stops at a limit instead.

        A failure comes from a layer's forward, before any Adam update: the step's gradients so far are
        dropped and the RNGs (dropout) put back, so the repeat is the step eager would have trained.
        In a training step (`step`), the seconds and graphs spent compiling are added to the progress
        (compile_seconds, compile_graphs), a failed compile's seconds too, and each recompile with its reasons."""
        if not self.compiled:
            return run()
        rng = ckpt.capture_rng()
        seconds, graphs = compiled.compile_totals()
        cached = compiled.cache_counts()
        try:
            with compiled.watch() as seen, compiled.limited(self.cfg.compile_recompile_limit):
                return run()
        except (*compiled.COMPILE_FAILURES, compiled.RecompileLimitHit) as e:
            if isinstance(e, compiled.RecompileLimitHit):
                e = compiled.limit_reason(self.cfg.compile_recompile_limit, seen.reasons)
                if self.cfg.compile_on_limit == "fail":
                    raise compiled.RecompileLimitError(f"train.compile: step {self.progress.step + 1}: {e}; raise "
                                                       "train.compile_recompile_limit, or set train.compile_on_limit="
                                                       "eager to go on eager") from None
            self.progress.fell_back(self.progress.step + 1, compiled.fallback(self.layers, e))
            self.layers, self.forward = [], None
            zero_grads(self.optimizer, self.loss_model)
            ckpt.restore_rng(rng)
            return run()
        finally:
            if step:
                now_seconds, now_graphs = compiled.compile_totals()
                self.progress.compile_seconds += max(now_seconds - seconds, 0.0)
                self.progress.compile_graphs += max(now_graphs - graphs, 0)
                self.progress.recompiled(seen.reasons)
                p = self.progress
                p.compile_cache = [a + now - before for a, now, before in zip(p.compile_cache, compiled.cache_counts(), cached)]

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
        asked = self.preemption is not None and self.preemption.signum is not None
        done, out_of_time, due, asked = distributed.broadcast_flags([p.step >= cfg.max_steps, out_of_time, due, asked],
                                                                    self.ctx)
        self.preempted = asked and not (done or out_of_time)  # rank 0's signal stops every rank after this step
        if out_of_time and not done:
            if not self.stopped_by_time:
                log.warning("step %d: train.max_minutes = %g reached before train.max_steps = %d; stopping (safety stop: "
                            "this run's result depends on the machine's speed)", p.step, cfg.max_minutes, cfg.max_steps)
            self.stopped_by_time = True
        return done or out_of_time or self.preempted, due

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
            evaluated = (stop and not self.preempted) or (cfg.eval_every > 0 and p.step % cfg.eval_every == 0)
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
                self.save(aside=self.preempted and not due_save)
                saved_at = p.step
            p.elapsed_seconds = time.monotonic() - start
        bar.close()
        if self.preempted:
            raise self.preempted_here()
        if not p.valid:  # resumed at max_steps from a checkpoint written before any evaluation
            self.validate()
        if saved_at != p.step:
            self.save()
        if ctx.is_main and p.train_seconds:  # MFU <= 1: a run faster than the peak raises it
            self.peak = peak.settle(self.peak, p.flops / (p.train_seconds * ctx.world))
        return self.metrics()

    def metrics(self) -> dict:
        """metrics/train.json (records.train_metrics): flat, the DVC record of the run."""
        return records.train_metrics(
            self.progress, stopped_by_time=self.stopped_by_time, train_batches=len(self.data.train_batches),
            cuda_graphs=graphs.totals(self.ctx.device) if self.cfg.cuda_graphs else (None, None), peak=self.peak,
            world=self.ctx.world, accum=self.accum, code_hash=self.code_hash, phash=self.phash, precision=self.precision)
