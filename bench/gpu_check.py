"""GPU check: the paper's base and big models, trained and decoded on this GPU by the stages' own code.

    make gpu-check              # python -m bench.gpu_check [--steps 8] [--sentences 400] [--no-compile]

For each of the wmt14_en_de_base and wmt14_en_de_big presets (composed with
train.devices=1: vocabulary 37000, batch.max_tokens 3300, gradient
accumulation 8, so ~26400 padded target tokens per step on one GPU, as the
presets say), on synthetic data shaped like WMT14 en-de's
(bench.train_throughput's synthetic_corpus: source ~ N(28, 14) tokens, at most
250, bucketed by pipeline.corpus.batching.make_batches, all built before any
timing), it times the train stage's own step: Trainer.step
(pipeline/training/trainer.py) in a process group of one (NCCL on a GPU, gloo
on a CPU), so with DDP around the loss as each of the presets' 8 processes has
it, the prefetch thread building the next step's micro-batches, the autocast
and gradient scaler the trainer picks (bf16 where the GPU has it), eager and
then with train.compile (as the presets set it). It prints per model and mode:
target tokens/s, MFU (analytic FLOPs, model.flops, over the device's peak at
that precision, pipeline.training.peak), peak memory, and which mode is
faster; then the seconds to save one checkpoint (Trainer.save: weights, Adam,
RNGs, sealed) and beam-4 sentences/s of stages.translate.translate_ids (the
translate stage's search, fp32, with bench.decode's EOS bias so that outputs
end near the source length as trained models' do). If a step does not fit,
batch.max_tokens is halved (and the accumulation doubled) until it does, and
the line says so. Without CUDA it prints one line and exits 0; --tiny runs the
same code on a CPU with a tiny model (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.decode import EosNearSourceLength
from bench.train_throughput import synthetic_corpus
from model import flops as flops_lib
from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core import config
from pipeline.core.config import TrainConfig, TranslateConfig
from pipeline.core.tracking import StageRun
from pipeline.corpus.batching import make_batches
from pipeline.corpus.formats import Ragged
from pipeline.training import distributed
from pipeline.training.loader import TrainingData
from pipeline.training.trainer import Trainer
from stages.translate import translate_ids

WMT_MEAN, WMT_SD, WMT_LONGEST = 28, 14, 250  # BPE tokens per WMT14 en-de sentence (approximate), tokenize.max_len
TINY = ["model=tiny", "tokenize.vocab_size=100", "batch.max_tokens=512", "train.tokens_per_step=1024"]  # --tiny: on a CPU
WARMUP_STEPS = 3  # compiling takes a few shapes' worth of steps; DDP sets its buckets up on the first
VALID_PAIRS = 64  # Trainer builds its validation batches (not timed here)


@dataclass
class Setup:
    """One preset's model and training settings on this device."""

    name: str
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    translate_cfg: TranslateConfig
    vocab: int
    max_tokens: int
    device: torch.device


def preset(name: str, device: torch.device, tiny: bool) -> Setup:
    params = config.compose([f"experiment=wmt14_en_de_{name}", "train.devices=1", *(TINY if tiny else [])])
    return Setup(name, config.parse(params, "model", ModelConfig), config.parse(params, "train", TrainConfig),
                 config.parse(params, "translate", TranslateConfig), params["tokenize"]["vocab_size"],
                 params["batch"]["max_tokens"], device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[distributed.Dist]:
    """A process group of one, as torchrun gives each rank (NCCL on a GPU, gloo on a CPU): the Trainer wraps DDP."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        yield distributed.Dist(0, 1, 0, device)
    finally:
        dist.destroy_process_group()


def training_data(src: Ragged, tgt: Ragged, vocab: int, max_tokens: int) -> TrainingData:
    """The train stage's inputs from a synthetic corpus: batches of `max_tokens`; the first pairs as valid."""
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, max_tokens, seed=1)
    n = min(VALID_PAIRS, len(src))
    valid = [Ragged(s.values[: s.offsets[n]], s.offsets[: n + 1]) for s in (src, tgt)]
    return TrainingData(vocab, src, tgt, valid[0], valid[1], batches,
                        make_batches(valid[0].lengths + 1, valid[1].lengths + 1, max_tokens, seed=1, split="valid"))


def trainer(s: Setup, data: TrainingData, ctx: distributed.Dist, compiled: bool, checkpoints: Path | None) -> Trainer:
    """The train stage's Trainer for this preset (train.compile = `compiled`), writing checkpoints to `checkpoints`."""
    cfg = replace(s.train_cfg, compile=compiled)
    return Trainer(data, s.model_cfg, cfg, s.max_tokens, ctx, StageRun(), phash="gpu-check", checkpoints=checkpoints)


def time_training(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int, compiled: bool,
                  checkpoints: Path | None = None) -> dict:
    """Warm-up steps, then `steps` timed Trainer.step calls (eager and compiled: the same steps): tokens/s, FLOP/s,
    peak memory; with `checkpoints`, then the seconds Trainer.save takes."""
    torch._dynamo.reset()  # each compiled run compiles afresh, in its warm-up: not another model's graphs
    t = trainer(s, data, ctx, compiled, checkpoints)
    for _ in range(WARMUP_STEPS):
        t.step(t.epoch_order())
    sync(s.device)
    p = t.progress
    tokens, flops = p.train_tokens, p.flops
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    start = time.perf_counter()
    for _ in range(steps):
        t.step(t.epoch_order())
    sync(s.device)
    seconds = time.perf_counter() - start
    r = {"tokens_per_s": (p.train_tokens - tokens) / seconds, "flops_per_s": (p.flops - flops) / seconds,
         "memory": torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else None,
         "tokens_per_step": (p.train_tokens - tokens) / steps, "accum": t.accum, "peak": t.peak, "trainer": t,
         "compiled": bool(t.compiled), "dtype": distributed.autocast_dtype(s.device)}
    if checkpoints is not None:
        start = time.perf_counter()
        t.save()
        r["save_seconds"] = time.perf_counter() - start
    return r


def fitting_training(s: Setup, corpus: tuple[Ragged, Ragged], ctx: distributed.Dist, steps: int, compiled: bool,
                     checkpoints: Path | None = None) -> tuple[dict, Setup]:
    """time_training at the preset's batch size, or halved (accumulation doubled) until a step fits in memory."""
    while True:
        data = training_data(*corpus, s.vocab, s.max_tokens)
        try:
            return time_training(s, data, ctx, steps, compiled, checkpoints), s
        except torch.OutOfMemoryError:
            if s.max_tokens < 256:
                raise
        torch.cuda.empty_cache()  # out of the except block: the failed attempt's tensors are garbage now
        s = replace(s, max_tokens=s.max_tokens // 2)  # the Trainer doubles the accumulation
        print(f"  {s.name}: out of memory; batch.max_tokens -> {s.max_tokens}", flush=True)


def time_decoding(s: Setup, src: Ragged, sentences: int) -> float:
    """Sentences per second of translate_ids (beam 4, the preset's length penalty and limits)."""
    torch.manual_seed(s.train_cfg.seed)
    model = EosNearSourceLength(Transformer(s.model_cfg, s.vocab), slope=2.0).to(s.device).eval()
    sources = [np.asarray(src[i], dtype=np.int64) for i in range(sentences)]
    translate_ids(model, sources[: max(1, sentences // 20)], s.translate_cfg, progress=False)  # warm-up
    sync(s.device)
    start = time.perf_counter()
    translate_ids(model, sources, s.translate_cfg, progress=False)
    sync(s.device)
    return sentences / (time.perf_counter() - start)


def training_line(name: str, r: dict, s: Setup) -> str:
    p = r["peak"]
    memory = "n/a" if r["memory"] is None else f"{r['memory'] / 2**30:.1f} GiB"
    mode = " compiled" if r["compiled"] else ""
    return (f"{name}{mode}: {r['tokens_per_s']:,.0f} target tokens/s, MFU {r['flops_per_s'] / p.flops:.1%} "
            f"({p.device}, {flops_lib.DTYPE_NAMES[r['dtype']]} peak {p.source}), peak memory {memory}, "
            f"{r['tokens_per_step']:,.0f} target tokens/step in {r['accum']} x batch.max_tokens {s.max_tokens}")


def check(name: str, device: torch.device, args: argparse.Namespace, ctx: distributed.Dist) -> None:
    """Every line of one preset: training eager (and compiled), a checkpoint's save, decoding."""
    s = preset(name, device, args.tiny)
    corpus = synthetic_corpus(20_000 if not args.tiny else 300, seed=0, vocab=s.vocab, mean=WMT_MEAN, sd=WMT_SD,
                              longest=WMT_LONGEST)
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for compiled in ([False] if args.no_compile else [False, True]):
            r, s = fitting_training(s, corpus, ctx, args.steps, compiled, None if compiled else Path(tmp))
            if compiled and not r["compiled"]:
                print(f"{name} compiled: torch.compile failed (warning above); trained eager", flush=True)
            results[compiled] = r
            print(training_line(name, r, s), flush=True)
            if "save_seconds" in r:
                [saved] = Path(tmp).glob("step_*.pt")
                print(f"{name}: checkpoint {saved.stat().st_size / 2**20:,.1f} MiB saved in {r['save_seconds']:.1f} s "
                      "(Trainer.save: weights, Adam, RNGs, sha256 sidecar)", flush=True)
            del r["trainer"]
    if True in results:
        ratio = results[True]["tokens_per_s"] / results[False]["tokens_per_s"]
        print(f"{name}: train.compile x{ratio:.2f}: {'compiled' if ratio > 1 else 'eager'} is faster", flush=True)
    print(f"{name}: beam {s.translate_cfg.beam_size}: {time_decoding(s, corpus[0], args.sentences):.1f} sentences/s "
          f"(translate_ids, fp32)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per model and mode")
    parser.add_argument("--sentences", type=int, default=400, help="sentences decoded per model")
    parser.add_argument("--no-compile", action="store_true", help="skip the train.compile runs")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: the code path on a CPU
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check")
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with process_group(device) as ctx:
        for name in ("base", "big"):
            check(name, device, args, ctx)


if __name__ == "__main__":
    main()
