"""How stored batches make optimizer steps: gradient accumulation, each epoch's order, each rank's share,
and the real tokens a step holds.

A step is batches_per_step() stored batches, taken in the epoch's shuffled order
(the last step of an epoch takes what is left), whatever the world size; rank r
of a world of n processes trains on every n-th of them. The batch stage uses it
to report what the train stage will run, and the trainer to run it.

Sec. 5.1: "Each training batch contained a set of sentence pairs containing
approximately 25000 source tokens and 25000 target tokens." Those are real
tokens; batch.max_tokens caps *padded* tokens (n x the longest side of the
longest pair), so both stages record the real figure per step.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.core.config import ParamsError


def batches_per_step(tokens_per_step: int, max_tokens: int) -> int:
    """Stored batches an optimizer step takes: ceil(tokens_per_step / max_tokens), on any number of processes.

    tokens_per_step is in batch.max_tokens' units (padded tokens). The world size
    does not enter: 8 GPUs, 2 nodes of 4 or 1 GPU accumulating 8 train on the
    same batches a step, so the step is what params say and the batch stage's
    metrics hold for any world (grad_accumulation checks that the world can share it).
    """
    return max(1, math.ceil(tokens_per_step / max_tokens))


def grad_accumulation(tokens_per_step: int, max_tokens: int, world: int) -> int:
    """Micro-batches per process per step: batches_per_step() / world, which the world must divide.

    A world that cannot share the step's batches equally (6 or 16 processes for 8
    batches) would either train on a step of another size or leave processes
    idle: it fails, naming the worlds that fit and the batch.max_tokens that keeps
    the step's tokens on this one.
    """
    batches = batches_per_step(tokens_per_step, max_tokens)
    if batches % world == 0:
        return batches // world
    fits = [n for n in range(1, batches + 1) if batches % n == 0]
    per_process = math.ceil(batches / world)
    keep = math.ceil(tokens_per_step / (world * per_process))
    raise ParamsError(
        f"{world} processes cannot share the {batches} batches of a step (train.tokens_per_step {tokens_per_step} / "
        f"batch.max_tokens {max_tokens}, rounded up) equally: run {', '.join(map(str, fits[:-1]))} or {fits[-1]} "
        f"processes in all, or keep {world} and set batch.max_tokens={keep} ({world} x {per_process} batches of "
        f'<= {keep} tokens a step; docs/paper_scale.md, "Tokens per step")')


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled batch order of one epoch; the same in every process (seeded by seed + epoch)."""
    return np.random.default_rng(seed + epoch).permutation(num_batches)


def next_step(order: np.ndarray, cursor: int, epoch: int, batches_per_step: int, seed: int) -> np.ndarray:
    """The batches of the step starting at `cursor` of epoch `epoch`'s `order`, or the next epoch's first step
    when `order` is used up (what the trainer prefetches while a step trains)."""
    if cursor >= len(order):
        order, cursor = epoch_order(len(order), seed, epoch + 1), 0
    return order[cursor : cursor + batches_per_step]


def rank_share(step_batches: np.ndarray, rank: int, world: int) -> tuple[list[int], int]:
    """This rank's batches of one step (every world-th, from `rank`) and the micro-batch count all ranks run.

    At an epoch's tail the step holds fewer than batches_per_step() batches;
    ranks left short run zero-weighted micro-batches so every rank joins every
    gradient all-reduce.
    """
    return [int(b) for b in step_batches[rank::world]], math.ceil(len(step_batches) / world)


def epoch_step_tokens(per_batch: np.ndarray, order: np.ndarray, batches_per_step: int) -> np.ndarray:
    """Tokens of each step of one epoch: `per_batch` summed over runs of `batches_per_step` batches of `order`."""
    return np.add.reduceat(per_batch[order], np.arange(0, len(order), batches_per_step))


def per_step_metrics(side: str, total: int, steps: int, least: int, most: int) -> dict[str, float]:
    """{side}_tokens_per_step_{mean,min,max}: real tokens (with EOS / BOS) of one optimizer step, all devices."""
    return {f"{side}_tokens_per_step_mean": total / max(steps, 1), f"{side}_tokens_per_step_min": least,
            f"{side}_tokens_per_step_max": most}
