"""GPU check: the paper's base and big models, training steps and beam-4 decoding on this GPU, as the stages run them.

    make gpu-check              # python -m bench.gpu_check [--steps 8] [--sentences 400] [--no-compile]

For each of the wmt14_en_de_base and wmt14_en_de_big presets (composed with
train.devices=1: vocabulary 37000, batch.max_tokens 3125, gradient
accumulation 8, so ~25000 target tokens per step on one GPU, as the presets
say), on synthetic batches shaped like WMT14 en-de's (bench.train_throughput's
synthetic_corpus: source ~ N(28, 14) tokens, at most 250, bucketed by
pipeline.corpus.batching.make_batches), it times pipeline.training.optimizer.train_step (with
build_optimizer, model.loss.SmoothedLoss and the autocast and gradient scaler
the trainer picks: bf16 where the GPU has it) and prints per model: target
tokens/s, MFU (analytic FLOPs, model.flops, over the device's peak at that
precision as training takes it, pipeline.training.peak: model.flops.PEAK_TFLOPS, or
measured when the GPU is not in the table), peak memory, and beam-4 sentences/s of stages.translate.translate_ids
(the translate stage's decoding, fp32, with bench.decode's EOS bias so that
outputs end near the source length as trained models' do). If a step does not
fit, batch.max_tokens is halved (and the accumulation doubled) until it does,
and the line says so. Then the same training steps with torch.compile(dynamic
shapes), and which is faster. Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench.decode import EosNearSourceLength
from bench.train_throughput import synthetic_corpus
from model import flops as flops_lib
from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.transformer import Transformer
from pipeline.core import config
from pipeline.training import distributed, peak
from pipeline.core.config import TrainConfig, TranslateConfig
from pipeline.corpus.formats import Ragged
from pipeline.training.loader import collate
from pipeline.corpus.steps import grad_accumulation
from pipeline.training.optimizer import build_optimizer, train_step
from pipeline.corpus.batching import make_batches
from stages.translate import translate_ids

WMT_MEAN, WMT_SD, WMT_LONGEST = 28, 14, 250  # BPE tokens per WMT14 en-de sentence (approximate), tokenize.max_len
TINY = ["model=tiny", "tokenize.vocab_size=100", "batch.max_tokens=512", "train.tokens_per_step=1024"]  # --tiny: on a CPU


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


def time_training(s: Setup, src: Ragged, tgt: Ragged, steps: int, compiled: bool) -> dict[str, float]:
    """Warm-up steps, then `steps` timed steps of train_step: tokens/s, FLOP/s, peak memory."""
    ctx = distributed.Dist(0, 1, 0, s.device)
    torch.manual_seed(s.train_cfg.seed)
    model = Transformer(s.model_cfg, s.vocab).to(s.device)
    optimizer = build_optimizer(model, s.train_cfg)
    loss_model = SmoothedLoss(model, s.train_cfg.label_smoothing, chunked=s.device.type == "cpu")
    if compiled:
        loss_model = torch.compile(loss_model, dynamic=True)
    autocast, scaler = distributed.mixed_precision(s.device)
    accum = grad_accumulation(s.train_cfg.tokens_per_step, s.max_tokens, 1)
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, s.max_tokens, seed=1)
    order = np.random.default_rng(0).permutation(len(batches))
    warmup = 3 if compiled else 1  # compiling takes a few shapes' worth of steps
    tokens = flops = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync(s.device)
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(s.device)
            start = time.perf_counter()
        at = ((i - warmup) % steps) * accum % len(order)  # warm-up on the timed steps' batches: eager and compiled
        ids = order[at : at + accum]                          # time the same steps
        micro = [(collate(src, tgt, batches[b], s.device), True) for b in ids]
        step_tokens = sum(b.tokens for b, _ in micro)
        train_step(loss_model, optimizer, micro, step_tokens, 1e-4, ctx, autocast, scaler)
        if i >= warmup:
            rows = np.concatenate([batches[b] for b in ids])
            tokens += step_tokens
            flops += flops_lib.training_flops(s.model_cfg, s.vocab, src.lengths[rows] + 1, tgt.lengths[rows] + 1)
    sync(s.device)
    seconds = time.perf_counter() - start
    memory = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else None
    return {"tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds, "memory": memory,
            "tokens_per_step": tokens / steps, "accum": accum, "dtype": distributed.autocast_dtype(s.device)}


def fitting_training(s: Setup, src: Ragged, tgt: Ragged, steps: int, compiled: bool) -> tuple[dict, Setup]:
    """time_training at the preset's batch size, or halved (accumulation doubled) until a step fits in memory."""
    while True:
        try:
            return time_training(s, src, tgt, steps, compiled), s
        except torch.OutOfMemoryError:
            if s.max_tokens < 256:
                raise
        torch.cuda.empty_cache()  # out of the except block: the failed attempt's tensors are garbage now
        s = replace(s, max_tokens=s.max_tokens // 2)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per model and mode")
    parser.add_argument("--sentences", type=int, default=400, help="sentences decoded per model")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile runs")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: the code path on a CPU
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check")
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    for name in ("base", "big"):
        s = preset(name, device, args.tiny)
        src, tgt = synthetic_corpus(20_000 if not args.tiny else 300, seed=0, vocab=s.vocab, mean=WMT_MEAN,
                                    sd=WMT_SD, longest=WMT_LONGEST)
        results = {}
        for compiled in ([False] if args.no_compile else [False, True]):
            r, s = fitting_training(s, src, tgt, args.steps, compiled)
            p = peak.peak_flops(distributed.Dist(0, 1, 0, device))
            where = f"{p.device}, {flops_lib.DTYPE_NAMES[r['dtype']]} peak {p.source}"
            results[compiled] = r
            memory = "n/a" if r["memory"] is None else f"{r['memory'] / 2**30:.1f} GiB"
            print(f"{name}{' compiled' if compiled else ''}: {r['tokens_per_s']:,.0f} target tokens/s, "
                  f"MFU {r['flops_per_s'] / p.flops:.1%} ({where}), peak memory {memory}, "
                  f"{r['tokens_per_step']:,.0f} target tokens/step = {r['accum']} x batch.max_tokens {s.max_tokens}",
                  flush=True)
        print(f"{name}: beam {s.translate_cfg.beam_size}: {time_decoding(s, src, args.sentences):.1f} sentences/s "
              f"(translate_ids, fp32)", flush=True)
        if True in results:
            faster = max(results, key=lambda c: results[c]["tokens_per_s"])
            ratio = results[True]["tokens_per_s"] / results[False]["tokens_per_s"]
            print(f"{name}: torch.compile x{ratio:.2f}: {'compiled' if faster else 'eager'} is faster", flush=True)


if __name__ == "__main__":
    main()
