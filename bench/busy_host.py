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
their waiting differs: tests/training/test_train.py). Printed: tokens/s per round and
setting, then each setting's median as a ratio of the default's, quiet and busy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


from pipeline.device import distributed

MODULE = "bench.busy_host"


def child(steps: int) -> None:
    """Time `steps` training steps of the default model; print target tokens per second."""
    import torch

    from bench.train_throughput import MAX_TOKENS, VOCAB, default_configs, our_step, synthetic_batches
    from model.transformer import Transformer

    torch.set_num_threads(distributed.available_cores())
    cfg, train_cfg = default_configs()
    data = synthetic_batches(MAX_TOKENS // 2, steps + 3)[-1]  # the default's 1250-token batches
    torch.manual_seed(0)
    step = our_step(Transformer(cfg, VOCAB), train_cfg)

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
