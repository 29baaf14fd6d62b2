"""Muon against Adam (train.optimizer): the step's cost and the steps to a training loss, as ratios of one run.

    python -m bench.cpu.optimizer [OVERRIDE ...] [--steps 300] [--chunk 10] [--window 20] [--target LOSS] [--threads N]
                                  [--data DIR]

The default model (conf/ composed with the OVERRIDEs, as `dvc exp run -S` takes them, e.g. train.warmup_steps=100;
with none, the `small` preset and its schedule) with an 8000-token vocabulary, trained twice from the same
initial weights on the same batches in the same order: train.optimizer = adam (the preset's: AdamW with its
weight decay) and muon (pipeline/training/optimizer.py MuonAdam: Muon for the layers' weight matrices, the same
AdamW for the rest; train.muon_* as composed). Each step is the train stage's (pipeline.training.optimizer
.train_step, the lr of the schedule, model/schedule.py), one batch of at most train.tokens_per_step padded tokens
(the default's step) of bench.harness.learnable_batches: Multi30k-like lengths, each target its source reversed
through a fixed permutation of the vocabulary, a language the model can learn (random targets teach nothing past
their unigram distribution). With `--data DIR` (a pipeline's data/, after `dvc repro batch`): the batch stage's
train batches of that corpus instead, the first --steps of them in one shuffled order (seed 0), and its vocabulary.

The two runs alternate (bench.harness.alternate), `--chunk` steps of one then of the other, so that load from other
programs hits both alike. Reported, from that one run:
  step time   each optimizer's seconds a step over all its steps, and Muon's / Adam's (the Newton-Schulz products'
              cost: train.muon_ns_steps iterations of bf16 matrix products per matrix and step);
  steps       the first step at which each run's training loss (label-smoothed, per target token), averaged over
              the last `--window` steps, reaches `--target` (default: Adam's average over its last window, so
              Adam needs about --steps), and Muon's / Adam's;
  time        the two multiplied: Muon's wall time to the loss against Adam's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch

from bench.harness import VOCAB, alternate, learnable_batches, on_this_cpu, our_step, stored_epoch, under_autocast
from model.schedule import lrate
from model.transformer import Transformer
from pipeline.device import distributed
from pipeline.training.loader import Batch

OPTIMIZERS = ("adam", "muon")


def first_step_at(losses: list[float], target: float, window: int) -> int | None:
    """The first step (counted from 1) whose mean loss over the last `window` steps is at most `target`; None: never."""
    means = np.convolve(losses, np.ones(window) / window, mode="valid")  # means[i]: steps i+1 .. i+window
    reached = np.flatnonzero(means <= target)
    return int(reached[0]) + window if len(reached) else None


def stored_batches(data: Path, count: int) -> tuple[list[Batch], int]:
    """The first `count` of the batch stage's train batches under data/ in one shuffled order, and the vocabulary."""
    vocab, epoch = stored_epoch(data / "tokenized", data / "batches")
    if len(epoch) < count:
        raise SystemExit(f"{data / 'batches'}: {len(epoch)} train batches, fewer than --steps {count}")
    return epoch[:count], vocab


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of conf/")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each optimizer")
    parser.add_argument("--chunk", type=int, default=10, help="steps of one optimizer before the other's")
    parser.add_argument("--window", type=int, default=20, help="steps the training loss is averaged over")
    parser.add_argument("--target", type=float, default=None, help="training loss to reach (default: Adam's last)")
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    parser.add_argument("--data", type=Path, default=None,
                        help="a pipeline's data/ (tokenized/, batches/): its batches")
    args = parser.parse_args(argv)
    cfg, train_cfg, precision = on_this_cpu(args.overrides, args.threads)
    batches, vocab = (stored_batches(args.data, args.steps) if args.data else
                      (learnable_batches(train_cfg.tokens_per_step, args.steps), VOCAB))
    print(f"{args.data or 'learnable batches'}: model {cfg}, vocab {vocab}, steps of <= {train_cfg.tokens_per_step} "
          f"padded tokens ({sum(b.tokens for b in batches) / len(batches):.0f} real target tokens on average), warmup "
          f"{train_cfg.warmup_steps}, lr_factor {train_cfg.lr_factor:g}, weight_decay {train_cfg.weight_decay:g}, "
          f"{torch.get_num_threads()} threads, {precision.label}; muon: lr_factor {train_cfg.muon_lr_factor:g}, "
          f"momentum {train_cfg.muon_momentum:g}, nesterov {train_cfg.muon_nesterov}, "
          f"ns_steps {train_cfg.muon_ns_steps}")

    losses: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}

    def trains(name: str):
        torch.manual_seed(0)  # the same initial weights for both
        model = Transformer(cfg, vocab)
        step = under_autocast(our_step(model, dataclasses.replace(train_cfg, optimizer=name)), precision)

        def chunk(r: int) -> None:
            for i in range(r * args.chunk, min((r + 1) * args.chunk, args.steps)):
                b: Batch = batches[i]
                lr = train_cfg.lr_factor * lrate(i + 1, cfg.d_model, train_cfg.warmup_steps)
                losses[name].append(float(step(b, lr)) / b.tokens)
        return chunk

    seconds = alternate({name: trains(name) for name in OPTIMIZERS}, -(-args.steps // args.chunk))
    per_step = {name: sum(times) / args.steps for name, times in seconds.items()}
    target = args.target if args.target is not None else float(np.mean(losses["adam"][-args.window:]))
    reached = {name: first_step_at(losses[name], target, args.window) for name in OPTIMIZERS}
    for name in OPTIMIZERS:
        last = np.mean(losses[name][-args.window:])
        print(f"{name:5s} {per_step[name] * 1e3:7.1f} ms a step; loss over its last {args.window} steps {last:.3f}; "
              f"reaches {target:.3f} at step {reached[name] or f'> {args.steps}'}")
    print(f"step time: muon / adam = {per_step['muon'] / per_step['adam']:.2f}x")
    if reached["muon"] and reached["adam"]:
        steps = reached["muon"] / reached["adam"]
        print(f"steps to loss {target:.3f}: muon / adam = {reached['muon']} / {reached['adam']} = {steps:.2f}x; "
              f"time to it: {steps * per_step['muon'] / per_step['adam']:.2f}x")
    else:
        print(f"steps to loss {target:.3f}: not reached by {'muon' if not reached['muon'] else 'adam'} in "
              f"{args.steps} steps")


if __name__ == "__main__":
    main()
