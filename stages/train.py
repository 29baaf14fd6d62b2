"""Train the Transformer (Sec. 5): Adam, warmup then inverse-square-root LR, label smoothing, data parallel.

    torchrun --standalone --nproc_per_node=${train.devices} -m stages.train --tokenized data/tokenized \
        --batches data/batches --checkpoints data/checkpoints --metrics metrics/train.json \
        --plot plots/train.csv [--params params.yaml]
    python -m stages.train ...                      # the same with one process (train.devices: 1)

Reads params `model` (ModelConfig), `train` (TrainConfig) and `batch.max_tokens`.
Each step updates on train.tokens_per_step target tokens: every one of the
train.devices processes accumulates grad_accumulation() micro-batches (one stored
batch each). Each epoch shuffles the batch order (seed + epoch); a step takes the
next world x accumulation batches of it and rank r the r-th of every world. The
loss is summed over real target tokens and divided by the step's real target
tokens over all ranks and micro-batches, so the update is that of one big batch.

Stops at train.max_steps or after train.max_minutes of training (across
resumes), whichever comes first. Checkpoints (stages/checkpoint.py) every
checkpoint_every steps and/or checkpoint_minutes, and at the end; on start the
newest complete checkpoint with the same params_hash is resumed exactly (weights,
Adam, RNGs, data position, counters): an interrupted run ends with the same
weights as an uninterrupted one. Outputs (rank 0 only): metrics/train.json,
plots/train.csv, checkpoints, and an MLflow child run (stages/tracking.py).

Set STAGES_TRAIN_TRACE=DIR to have every rank append, per step, the batches it
trained on and a checksum of its parameters to DIR/rank<r>.jsonl (tests).
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from model import flops as flops_lib
from model.loss import SmoothedLoss, real_hidden, smoothed_and_nll
from model.schedule import lrate
from model.transformer import Transformer, build_transformer
from stages import checkpoint as ckpt
from stages import cli, config, distributed, faults, tracking
from stages.config import BatchConfig, ModelConfig, TrainConfig
from stages.corpus import BOS_ID, EOS_ID, PAD_ID, Batches, EncodedSplit, batch_paths, load_batches, load_split, read_meta
from stages.distributed import Dist
from stages.files import write_json, write_text

log = logging.getLogger(__name__)

PLOT_COLUMNS = ("step", "loss", "lr", "tokens_per_second", "valid_ppl")
# Train params that do not change the weights of a given step: changing them
# resumes the old run instead of restarting it (e.g. a larger max_steps continues).
NOT_WEIGHT_SHAPING = ("max_steps", "max_minutes", "eval_every", "log_every",
                      "checkpoint_minutes", "checkpoint_every", "keep_checkpoints")
TRACE_ENV = "STAGES_TRAIN_TRACE"


# --- data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One padded batch: encoder input src + [EOS], decoder input [BOS] + tgt, labels tgt + [EOS]."""

    src: Tensor  # [B, S]
    tgt_in: Tensor  # [B, T]
    labels: Tensor  # [B, T], PAD_ID where there is no target token
    tokens: int  # real target tokens: labels != PAD_ID


def pad_rows(split: EncodedSplit, rows: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
    """Sentences `rows` of `split` as one int64 [B, L] array, optionally framed by BOS/EOS, right-padded."""
    starts = split.offsets[rows]
    lengths = split.offsets[rows + 1] - starts
    longest = int(lengths.max())
    out = np.full((len(rows), longest + bos + eos), PAD_ID, dtype=np.int64)
    cols = np.arange(longest)
    real = cols < lengths[:, None]  # [B, longest]
    out[:, int(bos) : int(bos) + longest][real] = split.ids[(starts[:, None] + cols)[real]]
    if bos:
        out[:, 0] = BOS_ID
    if eos:
        out[np.arange(len(rows)), lengths + int(bos)] = EOS_ID
    return out


def make_batch(src: EncodedSplit, tgt: EncodedSplit, rows: np.ndarray, device: torch.device) -> Batch:
    """Tensors of the sentence pairs `rows`, on `device`."""
    rows = np.asarray(rows, dtype=np.int64)
    arrays = (pad_rows(src, rows, False, True), pad_rows(tgt, rows, True, False), pad_rows(tgt, rows, False, True))
    tokens = int((tgt.offsets[rows + 1] - tgt.offsets[rows]).sum()) + len(rows)
    src_t, tgt_in, labels = (torch.from_numpy(a).to(device, non_blocking=True) for a in arrays)
    return Batch(src_t, tgt_in, labels, tokens)


@dataclass(frozen=True)
class Corpus:
    """The train and valid splits and their stored batches."""

    train_src: EncodedSplit
    train_tgt: EncodedSplit
    valid_src: EncodedSplit
    valid_tgt: EncodedSplit
    train_batches: Batches
    valid_batches: Batches

    @staticmethod
    def load(tokenized: Path, batches: Path) -> Corpus:
        meta = read_meta(tokenized)
        s, t = meta["src_lang"], meta["tgt_lang"]
        return Corpus(load_split(tokenized, "train", s), load_split(tokenized, "train", t),
                      load_split(tokenized, "valid", s), load_split(tokenized, "valid", t),
                      load_batches(batches, "train"), load_batches(batches, "valid"))

    def valid_fits(self, max_positions: int) -> np.ndarray:
        """Per valid pair: whether both sides, with EOS / BOS, fit the model's positions."""
        return np.maximum(np.diff(self.valid_src.offsets), np.diff(self.valid_tgt.offsets)) + 1 <= max_positions

    def lengths(self, batch_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Model lengths (source + EOS, target + BOS/EOS) of every pair in train batches `batch_ids`."""
        rows = np.concatenate([self.train_batches[b] for b in batch_ids]) if len(batch_ids) else np.zeros(0, np.int64)
        lengths = [split.offsets[rows + 1] - split.offsets[rows] + 1 for split in (self.train_src, self.train_tgt)]
        return lengths[0], lengths[1]


def micro_batches(corpus: Corpus, mine: list[int], n_micro: int, spare: int, device: torch.device) -> list[tuple[Batch, bool]]:
    """This rank's batches of a step as (batch, real); topped up to n_micro with zero-weight repeats (epoch tail)."""
    micro = [(make_batch(corpus.train_src, corpus.train_tgt, corpus.train_batches[b], device), True) for b in mine]
    if len(micro) < n_micro:
        filler = micro[0][0] if micro else make_batch(corpus.train_src, corpus.train_tgt, corpus.train_batches[spare], device)
        micro += [(filler, False)] * (n_micro - len(micro))
    return micro


@torch.no_grad()
def evaluate(model: Transformer, batches: list[Batch], label_smoothing: float, ctx: Dist, autocast) -> dict[str, float]:
    """valid_loss (label-smoothed) and valid_nll per real target token, valid_ppl = exp(nll), over all ranks."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # smoothed, nll, tokens
    for b in batches:
        with autocast:
            hidden, targets = real_hidden(model, b.src, b.tgt_in, b.labels)
            logits = model.project(hidden)
        smoothed, nll = smoothed_and_nll(logits, targets, label_smoothing)
        sums[0] += smoothed.double()
        sums[1] += nll.double()
        sums[2] += b.tokens
    model.train()
    smoothed, nll, tokens = distributed.all_sum(sums, ctx).tolist()
    tokens = max(tokens, 1.0)
    return {"valid_loss": smoothed / tokens, "valid_nll": nll / tokens, "valid_ppl": math.exp(nll / tokens)}


# --- one step -------------------------------------------------------------------------


def train_step(loss_model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[tuple[Batch, bool]],
               global_tokens: int, lr: float, ctx: Dist, autocast) -> Tensor:
    """Accumulate the gradients of this rank's micro-batches, then one Adam update; returns this rank's summed loss.

    Each micro-batch's summed loss is scaled by world / global_tokens: DDP
    averages gradients over the world, so the update is the gradient of the
    step's summed loss over its real target tokens on all ranks. A padding
    micro-batch (False: none left for this rank at an epoch's tail) is weighted
    0, so the rank still joins the all-reduce without changing the update.
    """
    scale = ctx.world / global_tokens
    total = torch.zeros((), device=ctx.device)
    for i, (batch, real) in enumerate(micro):
        sync = i == len(micro) - 1 or not isinstance(loss_model, DistributedDataParallel)
        with (contextlib.nullcontext() if sync else loss_model.no_sync()), autocast:
            loss = loss_model(batch.src, batch.tgt_in, batch.labels)
        (loss * (scale if real else 0.0)).backward()
        if real:
            total += loss.detach().float()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


# --- state, checkpoints, outputs ---------------------------------------------------------


@dataclass
class Progress:
    """Everything besides weights, Adam and RNGs that a resumed run must continue from."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0  # next position in the epoch's batch order
    train_tokens: int = 0
    flops: float = 0.0
    elapsed_seconds: float = 0.0  # wall clock of the training loop (evaluation and checkpoints included)
    step_seconds: float = 0.0  # time in training steps only (tokens per second, MFU)
    valid: dict = field(default_factory=dict)
    plot_rows: list = field(default_factory=list)


def params_hash(model_cfg: ModelConfig, train_cfg: TrainConfig, max_tokens: int, tokenized: Path, batches: Path) -> str:
    """sha256 of what shapes the weights: model, train (less NOT_WEIGHT_SHAPING), batch.max_tokens, the data."""
    train = {k: v for k, v in asdict(train_cfg).items() if k not in NOT_WEIGHT_SHAPING}
    files = [p for p in (tokenized / "meta.json", tokenized / "spm.model", *batch_paths(batches, "train")) if p.exists()]
    return ckpt.fingerprint({"model": asdict(model_cfg), "train": train, "batch.max_tokens": max_tokens}, files)


def plot_csv(rows: list[list]) -> str:
    lines = [",".join(PLOT_COLUMNS)]
    lines += [",".join("" if v is None else (str(v) if isinstance(v, int) else f"{v:.6g}") for v in r) for r in rows]
    return "\n".join(lines) + "\n"


def payload(model: Transformer, optimizer: torch.optim.Optimizer, progress: Progress, model_cfg: ModelConfig,
            vocab_size: int, phash: str, rngs: list[dict]) -> dict:
    """What a checkpoint holds (weights_only-loadable): see stages/checkpoint.py and the average stage."""
    return {
        "step": progress.step,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": asdict(model_cfg),
        "vocab_size": vocab_size,
        "params_hash": phash,
        "optimizer": optimizer.state_dict(),
        "rng": rngs,  # one capture_rng() per rank
        "data_position": {"epoch": progress.epoch, "cursor": progress.cursor},
        "elapsed_seconds": progress.elapsed_seconds,
        "train_tokens": progress.train_tokens,
        "progress": asdict(progress),
    }


def trace(ctx: Dist, step: int, batch_ids: list[int], model: nn.Module) -> None:
    """Debug record for tests: this rank's batches of `step` and a checksum of its parameters."""
    directory = os.environ.get(TRACE_ENV)
    if directory:
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        with open(Path(directory) / f"rank{ctx.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "batches": batch_ids, "checksum": checksum}) + "\n")


def measured_peak(dtype: torch.dtype, device: torch.device) -> float:
    """The matmul peak measured here, without moving the training RNG (exact resumes)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return flops_lib.measure_matmul_peak(dtype, n=8192 if device.type == "cuda" else 1024, device=device)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "cpu"


def peak_flops(ctx: Dist) -> tuple[float, float, str]:
    """(peak FLOP/s per device for MFU, sustained fp32 TFLOPS for the paper's estimate, device name).

    GPUs: bf16 dense and fp32 peaks from model.flops' table (measured when the
    GPU is not in it). CPUs: the fp32 matmul peak measured now, for both.
    """
    if ctx.cuda:
        name = torch.cuda.get_device_name(ctx.device)
        try:
            return flops_lib.device_tflops(name, "bf16") * 1e12, flops_lib.device_tflops(name, "fp32"), name
        except KeyError as e:
            log.warning("%s; measuring the matmul peaks instead", e)
            return measured_peak(torch.bfloat16, ctx.device), measured_peak(torch.float32, ctx.device) / 1e12, name
    measured = measured_peak(torch.float32, ctx.device)
    return measured, measured / 1e12, f"{cpu_name()} ({torch.get_num_threads()} threads/process)"


def progress_bar(cfg: TrainConfig, p: Progress, show: bool) -> tqdm:
    """Steps out of max_steps, or, under a wall-clock budget (max_minutes), seconds out of that budget."""
    if cfg.max_minutes > 0:
        total = cfg.max_minutes * 60
        return tqdm(total=total, initial=min(p.elapsed_seconds, total), disable=not show, unit="s",
                    dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]")
    return tqdm(total=cfg.max_steps, initial=p.step, disable=not show, unit="step", dynamic_ncols=True)


# --- the loop ---------------------------------------------------------------------------


class Trainer:
    """One training run, fresh or resumed: model, Adam, data position and counters; rank 0 writes."""

    def __init__(self, args: argparse.Namespace, model_cfg: ModelConfig, cfg: TrainConfig, max_tokens: int,
                 ctx: Dist, run: tracking.StageRun):
        if cfg.keep_checkpoints < 1:
            raise config.ParamsError(f"{args.params}: train.keep_checkpoints must be at least 1, got {cfg.keep_checkpoints}")
        self.args, self.model_cfg, self.cfg, self.ctx, self.run = args, model_cfg, cfg, ctx, run
        self.corpus = Corpus.load(args.tokenized, args.batches)
        self.vocab_size = int(read_meta(args.tokenized)["vocab_size"])
        self.accum = distributed.grad_accumulation(cfg.tokens_per_step, max_tokens, ctx.world)
        log.info("%d device(s) x %d micro-batch(es) of <= %d tokens per step (train.tokens_per_step = %d); "
                 "%d train batches per epoch", ctx.world, self.accum, max_tokens, cfg.tokens_per_step,
                 len(self.corpus.train_batches))
        self.phash = params_hash(model_cfg, cfg, max_tokens, args.tokenized, args.batches)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.model = build_transformer(self.vocab_size, **asdict(model_cfg)).to(ctx.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                          eps=cfg.adam_eps, fused=True)
        torch.manual_seed(cfg.seed + ctx.rank)  # dropout masks differ between ranks
        self.progress = self.resume()
        self.loss_model: nn.Module = SmoothedLoss(self.model, cfg.label_smoothing)
        if ctx.world > 1:
            self.loss_model = DistributedDataParallel(self.loss_model, device_ids=[ctx.local_rank] if ctx.cuda else None)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.cuda else contextlib.nullcontext()
        fits = self.corpus.valid_fits(model_cfg.max_positions)  # valid is never length-filtered (stages.tokenize)
        if not fits.all():
            log.warning("%s: %d valid pair(s) longer than model.max_positions = %d are left out of validation",
                        args.tokenized, int((~fits).sum()), model_cfg.max_positions)
        mine = (self.corpus.valid_batches[b] for b in range(ctx.rank, len(self.corpus.valid_batches), ctx.world))
        self.valid = [make_batch(self.corpus.valid_src, self.corpus.valid_tgt, rows[fits[rows]], ctx.device)
                      for rows in mine if fits[rows].any()]
        self.peak, self.fp32_tflops, self.device_name = peak_flops(ctx) if ctx.is_main else (0.0, 0.0, "")
        run.log_params({"model": asdict(model_cfg), "train": asdict(cfg), "batch.max_tokens": max_tokens,
                        "grad_accum": self.accum, "device": self.device_name, "params_hash": self.phash})

    def resume(self) -> Progress:
        """Load the newest matching checkpoint (rank 0 picks it; every rank loads it), else start afresh."""
        found = ckpt.resume_point(self.args.checkpoints, self.phash) if self.ctx.is_main else None
        path = distributed.broadcast_object(found[0] if found else None, self.ctx)
        if path is None:
            return Progress()
        state = found[1] if found else ckpt.load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        ckpt.restore_rng(state["rng"][self.ctx.rank])
        progress = Progress(**state["progress"])
        log.info("resuming from step %d (%s)", progress.step, path)
        self.run.set_tags({"resumed_from_step": progress.step})
        return progress

    def save(self) -> None:
        rngs = distributed.gather_objects(ckpt.capture_rng(), self.ctx)
        if self.ctx.is_main:
            state = payload(self.model, self.optimizer, self.progress, self.model_cfg, self.vocab_size, self.phash, rngs)
            log.info("step %d: saved %s", self.progress.step,
                     ckpt.save_checkpoint(self.args.checkpoints, state, self.cfg.keep_checkpoints))

    def record(self, row: list) -> None:
        """Append a plot row (step, loss, lr, tokens_per_second, valid_ppl) and rewrite the CSV."""
        self.progress.plot_rows.append(row)
        if self.ctx.is_main:
            write_text(self.args.plot, plot_csv(self.progress.plot_rows))

    def step(self, order: np.ndarray) -> tuple[Tensor, int, float]:
        """Train on the next world x accumulation batches of `order`; (this rank's loss sum, its tokens, lr)."""
        p, ctx, m = self.progress, self.ctx, self.model_cfg
        step_ids = order[p.cursor : p.cursor + self.accum * ctx.world]
        p.cursor += len(step_ids)
        mine, n_micro = distributed.rank_share(step_ids, ctx.rank, ctx.world)
        micro = micro_batches(self.corpus, mine, n_micro, int(step_ids[0]), ctx.device)
        S, T = self.corpus.lengths(step_ids)
        lr = self.cfg.lr_factor * lrate(p.step + 1, m.d_model, self.cfg.warmup_steps)
        faults.inject("step", p.step + 1)  # tests only: TRANSFORMER_FAULT=step@N kills the process here
        loss_sum = train_step(self.loss_model, self.optimizer, micro, int(T.sum()), lr, ctx, self.autocast)
        p.step += 1
        p.train_tokens += int(T.sum())
        p.flops += flops_lib.training_flops(self.vocab_size, m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v, S, T)
        trace(ctx, p.step, mine, self.model)
        return loss_sum, sum(b.tokens for b, real in micro if real), lr

    def fit(self) -> dict:
        """Step until max_steps or max_minutes; evaluate, log and checkpoint on the way; return the metrics."""
        p, cfg, ctx = self.progress, self.cfg, self.ctx
        if ctx.is_main:
            write_text(self.args.plot, plot_csv(p.plot_rows))  # on resume: the rows up to the checkpoint, no more
        order = distributed.epoch_order(len(self.corpus.train_batches), cfg.seed, p.epoch)
        interval = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss sum, tokens since the last row
        interval_seconds, interval_tokens, saved_at = 0.0, 0, p.step
        start, last_save = time.monotonic() - p.elapsed_seconds, time.monotonic()
        bar = progress_bar(cfg, p, ctx.is_main)
        stop = p.step >= cfg.max_steps or (cfg.max_minutes > 0 and p.elapsed_seconds >= cfg.max_minutes * 60)
        while not stop:
            t0 = time.perf_counter()
            if p.cursor >= len(order):
                p.epoch, p.cursor = p.epoch + 1, 0
                order = distributed.epoch_order(len(self.corpus.train_batches), cfg.seed, p.epoch)
            tokens_before = p.train_tokens
            loss_sum, my_tokens, lr = self.step(order)
            interval[0] += loss_sum
            interval[1] += my_tokens
            seconds = time.perf_counter() - t0
            p.step_seconds += seconds
            interval_seconds, interval_tokens = interval_seconds + seconds, interval_tokens + p.train_tokens - tokens_before
            p.elapsed_seconds = time.monotonic() - start
            bar.update(min(p.elapsed_seconds, cfg.max_minutes * 60) - bar.n if cfg.max_minutes > 0 else 1)
            # rank 0 decides for all: clocks differ between processes
            stop, due_save = distributed.broadcast_flags([
                p.step >= cfg.max_steps or (cfg.max_minutes > 0 and p.elapsed_seconds >= cfg.max_minutes * 60),
                (cfg.checkpoint_every > 0 and p.step % cfg.checkpoint_every == 0)
                or (cfg.checkpoint_minutes > 0 and time.monotonic() - last_save >= cfg.checkpoint_minutes * 60)], ctx)
            evaluated = stop or (cfg.eval_every > 0 and p.step % cfg.eval_every == 0)
            if evaluated:
                faults.inject("validation", p.step)  # tests only: TRANSFORMER_FAULT=validation@N kills the process here
                p.valid = evaluate(self.model, self.valid, cfg.label_smoothing, ctx, self.autocast)
                log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f", p.step, p.valid["valid_loss"],
                         p.valid["valid_nll"], p.valid["valid_ppl"])
                self.run.log_metrics(p.valid, step=p.step)
            if stop or evaluated or p.step % max(cfg.log_every, 1) == 0:
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
                saved_at, last_save = p.step, time.monotonic()
            p.elapsed_seconds = time.monotonic() - start
        bar.close()
        if not p.valid:  # resumed at max_steps from a checkpoint written before any evaluation
            p.valid = evaluate(self.model, self.valid, cfg.label_smoothing, ctx, self.autocast)
        if saved_at != p.step:
            self.save()
        return self.metrics(len(order))

    def metrics(self, epoch_batches: int) -> dict:
        """metrics/train.json: flat, the DVC record of the run."""
        p, world = self.progress, self.ctx.world
        hours = p.elapsed_seconds / 3600
        return {
            "steps": p.step,
            "epochs": p.epoch + p.cursor / max(epoch_batches, 1),
            "train_tokens": p.train_tokens,  # real target tokens trained on
            "train_hours": hours,
            "step_seconds": p.step_seconds,
            "flops_analytic": p.flops,
            "flops_paper_estimate": flops_lib.paper_estimate_flops(hours, world, self.fp32_tflops),
            "mfu": flops_lib.mfu(p.flops, p.step_seconds, world, self.peak) if p.step_seconds and self.peak else 0.0,
            "peak_flops": self.peak,
            "tokens_per_second": p.train_tokens / p.step_seconds if p.step_seconds else 0.0,
            "device": self.device_name,
            "devices": world,
            "grad_accum": self.accum,
            "params_hash": self.phash,
            **p.valid,
        }


def main(argv: list[str] | None = None) -> None:
    parser = cli.stage_parser(__doc__, "tokenized", "batches", "checkpoints", "metrics", "plot")
    args = parser.parse_args(argv)
    model_cfg = config.load(args.params, "model", ModelConfig)
    cfg = config.load(args.params, "train", TrainConfig)
    max_tokens = config.load(args.params, "batch", BatchConfig).max_tokens
    ctx = distributed.setup(cfg.devices)
    cli.setup_logging(logging.INFO if ctx.is_main else logging.WARNING)
    try:
        with tracking.stage_run("train", args.params, enabled=ctx.is_main) as run, logging_redirect_tqdm():
            metrics = Trainer(args, model_cfg, cfg, max_tokens, ctx, run).fit()
            if ctx.is_main:
                write_json(args.metrics, metrics)
                run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["steps"])
                log.info("done: %s", {k: metrics[k] for k in ("steps", "train_tokens", "valid_ppl", "tokens_per_second", "mfu")})
    finally:
        distributed.teardown(ctx)


if __name__ == "__main__":
    main()
