"""Dropout on this CPU: model/dropout.py's masks against torch's nn.Dropout, alone and in the training step.

    python -m bench.dropout [--steps 12] [--rounds 4] [--threads 2]

Two measurements, each alternating the two ways in the same rounds so that
load from other programs hits both alike:
  - op: forward + backward of one dropout (p 0.1) on the default's
    activations, [20, 60, 256] (after a sublayer) and [20, 60, 1024] (the
    feed-forward's hidden units, where model.activation_dropout acts);
  - step: the default's training step as bench.train_throughput times it
    (pipeline.training.optimizer.train_step, synthetic 1250-token batches),
    the same model with its Dropout modules and with nn.Dropout in their
    place, at model.activation_dropout 0 (the default) and 0.1.
Prints ms (op, median) and target tokens/s (step, best round), and each as
model/dropout.py's speed over torch's. Target: the step faster, not slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from torch import nn

from bench.train_throughput import VOCAB, default_configs, our_step, synthetic_batches
from model.dropout import Dropout
from model.transformer import Transformer

OP_SHAPES = ((20, 60, 256), (20, 60, 1024))
P = 0.1


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with every model/dropout.py module replaced by nn.Dropout of the same rate."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))
    return model


def op_seconds(drop: nn.Module, x: torch.Tensor, reps: int = 20) -> float:
    """Seconds of one forward + backward, the mean of `reps`."""
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    for _ in range(reps):
        drop(x).backward(torch.ones_like(x))
    return (time.perf_counter() - start) / reps


def bench_op(rounds: int) -> None:
    for shape in OP_SHAPES:
        x = torch.randn(shape)
        ways = {"torch": nn.Dropout(P).train(), "ours": Dropout(P).train()}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(rounds):
            for k, drop in ways.items():
                times[k].append(op_seconds(drop, x))
        torch_ms, ours_ms = (statistics.median(times[k]) * 1e3 for k in ("torch", "ours"))
        print(f"op {list(shape)}: torch {torch_ms:.2f} ms, ours {ours_ms:.2f} ms, ours / torch speed "
              f"{torch_ms / ours_ms:.2f}x")


def bench_step(steps: int, rounds: int) -> None:
    cfg, train_cfg = default_configs()
    *_, batches = synthetic_batches(1250, steps + 1)
    tokens = sum(b.tokens for b in batches[1:])
    runs = {}
    for act in (0.0, P):
        for way in ("torch", "ours"):
            torch.manual_seed(0)
            model = Transformer(dataclasses.replace(cfg, activation_dropout=act), VOCAB)
            runs[(act, way)] = our_step(with_torch_dropout(model) if way == "torch" else model, train_cfg)
            runs[(act, way)](batches[0])  # warm-up
    best = {k: float("inf") for k in runs}
    for _ in range(rounds):
        for k, step in runs.items():
            start = time.perf_counter()
            for batch in batches[1:]:
                step(batch)
            best[k] = min(best[k], time.perf_counter() - start)
    for act in (0.0, P):
        torch_tps, ours_tps = (tokens / best[(act, way)] for way in ("torch", "ours"))
        print(f"step, activation dropout {act}: torch {torch_tps:.0f}, ours {ours_tps:.0f} target tokens/s, "
              f"ours / torch {ours_tps / torch_tps:.2f}x")
    print(f"activation dropout 0.1 (ours) against the default's 0 (torch): "
          f"{best[(0.0, 'torch')] / best[(P, 'ours')]:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, p {P}")
    bench_op(args.rounds)
    bench_step(args.steps, args.rounds)


if __name__ == "__main__":
    main()
