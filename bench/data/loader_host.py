"""The loader's host time a step at two corpus sizes: a step's data work must not grow with the corpus.

    python -m bench.data.loader_host [--pairs 300000 4500000] [--steps 200] [--world 8]

For each size, a synthetic corpus of that many pairs with WMT14-like lengths
(bench.cpu.train_throughput.synthetic_corpus: source ~ N(28, 14), at most 256
tokens) is cut into the presets' batches (batch.max_tokens 27400,
length_bucket_step 1.1: one stored batch a step, every `--world`-th row of it
per GPU), and rank 0's data work of `--steps` steps is timed as the trainer
does it (pipeline/training/trainer.py, Trainer.step): the step's batches and
the next step's (pipeline/corpus/steps.py), this rank's micro-batches
(TrainingData.micro_batches: rows padded into tensors, cut within an 8,000-token
budget) and the step's real lengths (TrainingData.lengths). Printed: the mean
host milliseconds a step at each size (best of 3 rounds) and the ratio of the largest to the
smallest. Target (issue 31): the ratio within 2.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import synthetic_corpus
from pipeline.corpus import steps
from pipeline.corpus.batching import make_batches
from pipeline.training.loader import TrainingData

MAX_TOKENS = 27400  # conf/experiment/wmt14_en_de_base.yaml: batch.max_tokens = train.tokens_per_step
BUCKET_STEP = 1.1
BUDGET = 8000  # padded tokens a micro-batch: each rank's piece cut in one or two
VOCAB = 37000
CPU = torch.device("cpu")
ROUNDS = 3  # the best round of each size: a shared machine's load hits rounds, not the work


def corpus(pairs: int) -> TrainingData:
    """A WMT14-like synthetic corpus of `pairs` pairs and its presets' batches (train and valid alike)."""
    src, tgt = synthetic_corpus(pairs, vocab=VOCAB, mean=28, sd=14, longest=256)
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, MAX_TOKENS, seed=1, length_bucket_step=BUCKET_STEP)
    return TrainingData(VOCAB, src, tgt, src, tgt, batches, batches, BUCKET_STEP)


def host_seconds(data: TrainingData, n_steps: int, world: int, seed: int = 1) -> float:
    """Mean seconds of rank 0's host data work a step, over `n_steps` steps (into the next epochs if need be)."""
    per_step = steps.batches_per_step(MAX_TOKENS, MAX_TOKENS)
    parts = steps.parts_per_batch(per_step, world)
    epoch, cursor, order = 0, 0, steps.epoch_order(len(data.train_batches), seed, 0)
    start = time.perf_counter()
    for _ in range(n_steps):
        if cursor >= len(order):  # as Trainer.epoch_order
            epoch, cursor = epoch + 1, 0
            order = steps.epoch_order(len(order), seed, epoch)
        step_ids = order[cursor : cursor + per_step]
        cursor += len(step_ids)
        mine, n_micro = steps.rank_share(step_ids, 0, world, parts)
        steps.next_step(order, cursor, epoch, per_step, seed)
        data.micro_batches(mine, n_micro, int(step_ids[0]), CPU, parts, BUDGET)
        data.lengths(step_ids)
    return (time.perf_counter() - start) / n_steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[300_000, 4_500_000])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, default=8)
    args = parser.parse_args(argv)
    times = []
    for pairs in args.pairs:
        data = corpus(pairs)
        host_seconds(data, 5, args.world)  # warm-up: first touches of the arrays
        times.append(min(host_seconds(data, args.steps, args.world) for _ in range(ROUNDS)))
        print(f"{pairs:>10,} pairs, {len(data.train_batches):,} batches: {times[-1] * 1e3:.3f} ms of host work a step "
              f"(rank 0 of {args.world})")
    print(f"ratio, largest corpus to smallest: {max(times) / min(times):.2f} (target: within 2)")


if __name__ == "__main__":
    main()
