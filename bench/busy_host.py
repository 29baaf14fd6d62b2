"""Training speed on a busy host: the default's training step, quiet and beside a CPU-bound program, per thread setting.

    python -m bench.busy_host [--steps 40] [--rounds 2] [--threads N] [--spincount 10000]

Each measurement is a fresh process (libgomp reads its settings when torch
loads) that trains the default model (conf/ with no overrides) for `--steps`
timed steps after 3 warm-up steps, on the synthetic Multi30k-like batches of
bench.train_throughput, with `--threads` threads (default: this machine's
cores). "busy" starts one CPU-bound program beside it (a Python loop, as a
browser tab or another job would take a core) and stops it after.

  default    libgomp as torch ships it: a thread that finishes its share of a
             parallel region spins (GOMP_SPINCOUNT 300000) before sleeping,
             waiting for the others. Quiet, that is the fastest; beside another
             program, a spinning thread takes the core that the thread it waits
             for needs, and every matrix product waits on the slowest thread.
  spincount  GOMP_SPINCOUNT=<--spincount>, as dvc.yaml sets it for the train and
             translate stages: shorter spins, then sleep.
  passive    OMP_WAIT_POLICY=PASSIVE: no spinning at all.

Same weights in every setting (the threads split the work the same way; only
their waiting differs: tests/test_train.py). Printed: tokens/s per round and
setting, then each setting's median as a ratio of the default's, quiet and busy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from pipeline.training import distributed

MODULE = "bench.busy_host"


def child(steps: int) -> None:
    """Time `steps` training steps of the default model; print target tokens per second."""
    import torch

    from bench.train_throughput import MAX_TOKENS, VOCAB, synthetic_corpus
    from model.config import ModelConfig
    from model.loss import SmoothedLoss
    from model.transformer import Transformer
    from pipeline.core import config
    from pipeline.core.config import TrainConfig
    from pipeline.corpus.batching import make_batches
    from pipeline.training.loader import collate
    from pipeline.training.optimizer import build_optimizer, train_step

    torch.set_num_threads(distributed.available_cores())
    params = config.compose([])
    cfg, train_cfg = config.parse(params, "model", ModelConfig), config.parse(params, "train", TrainConfig)
    src, tgt = synthetic_corpus(29000)
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, MAX_TOKENS // 2, seed=1)  # the default's 1250
    order = np.random.default_rng(0).permutation(len(batches))[: steps + 3]
    data = [collate(src, tgt, batches[b], torch.device("cpu")) for b in order]
    torch.manual_seed(0)
    model = Transformer(cfg, VOCAB)
    loss_model = SmoothedLoss(model, train_cfg.label_smoothing, chunked=True)
    optimizer = build_optimizer(model, train_cfg)
    ctx, scaler = distributed.Dist(0, 1, 0, torch.device("cpu")), torch.amp.GradScaler("cpu", enabled=False)

    def step(b) -> None:
        train_step(loss_model, optimizer, [(b, True)], b.tokens, 1e-4, ctx, contextlib.nullcontext(), scaler)

    for b in data[:3]:
        step(b)
    start = time.perf_counter()
    for b in data[3:]:
        step(b)
    print(f"{sum(b.tokens for b in data[3:]) / (time.perf_counter() - start):.1f}")


def measure(steps: int, threads: int, extra: dict[str, str], busy: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(OMP_NUM_THREADS=str(threads), **extra)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, "-m", MODULE, "--child", str(steps)], env=env, capture_output=True,
                             text=True, check=False)
    finally:
        if hog:
            hog.kill()
            hog.wait()
    if out.returncode != 0:
        raise SystemExit(f"busy_host: the measuring process failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    parser.add_argument("--spincount", type=int, default=10000)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child(args.child)
    settings = {"default": {}, f"spincount {args.spincount}": {"GOMP_SPINCOUNT": str(args.spincount)},
                "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    rates: dict[tuple[str, str], list[float]] = {}
    print(f"the default model, {args.steps} steps of ~1250-token batches, {args.threads} threads")
    for r in range(args.rounds):
        for load in ("quiet", "busy"):
            for name, extra in settings.items():
                rates.setdefault((load, name), []).append(measure(args.steps, args.threads, extra, load == "busy"))
                print(f"  round {r + 1} {load:5s} {name:16s} {rates[load, name][-1]:8.0f} tok/s", flush=True)
    for load in ("quiet", "busy"):
        base = statistics.median(rates[load, "default"])
        print(f"{load}: " + ", ".join(f"{name} {statistics.median(rates[load, name]) / base:.2f}x"
                                      for name in settings) + f" (default {base:.0f} tok/s)")


if __name__ == "__main__":
    main()
