"""How stored batches make optimizer steps: gradient accumulation, each epoch's order, each rank's share,
and the real tokens a step holds.

A step is batches_per_step() stored batches, taken in the epoch's shuffled order
(the last step of an epoch takes what is left), whatever the world size; rank r
of a world of n processes trains on every n-th of them, or, where n does not
divide them, on every n-th row part of them (parts_per_batch). The batch stage uses it
to report what the train stage will run, and the trainer to run it.

Sec. 5.1: "Each training batch contained a set of sentence pairs containing
approximately 25000 source tokens and 25000 target tokens." Those are real
tokens; batch.max_tokens caps *padded* tokens (n x the longest side of the
longest pair), so both stages record the real figure per step.
"""

from __future__ import annotations

import math

import numpy as np



def batches_per_step(tokens_per_step: int, max_tokens: int) -> int:
    """Stored batches an optimizer step takes: ceil(tokens_per_step / max_tokens), on any number of processes.

    tokens_per_step is in batch.max_tokens' units (padded tokens). The world size
    does not enter: 8 GPUs, 2 nodes of 4 or 1 GPU accumulating 8 train on the
    same batches a step, so the step is what params say and the batch stage's
    metrics hold for any world (grad_accumulation checks that the world can share it).
    """
    return max(1, math.ceil(tokens_per_step / max_tokens))


def parts_per_batch(batches: int, world: int) -> int:
    """Row parts each stored batch of a step is cut into so that `world` processes share the step equally.

    world / gcd(batches, world): 1 when the world divides the step's batches (each
    process takes whole batches), 8 for a step of one batch on 8 GPUs (each takes
    every 8th row of it). The step's pairs are the same on any world.
    """
    return world // math.gcd(batches, world)


def grad_accumulation(tokens_per_step: int, max_tokens: int, world: int) -> int:
    """Pieces (a stored batch, or a row part of one) per process per step: lcm(batches, world) / world.

    Each piece is then one micro-batch, or several where the device's memory asks
    for it (pipeline/training/plan.py).
    """
    batches = batches_per_step(tokens_per_step, max_tokens)
    return batches * parts_per_batch(batches, world) // world


def epoch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled batch order of one epoch; the same in every process (seeded by seed + epoch)."""
    return np.random.default_rng(seed + epoch).permutation(num_batches)


def next_step(order: np.ndarray, cursor: int, epoch: int, batches_per_step: int, seed: int) -> np.ndarray:
    """The batches of the step starting at `cursor` of epoch `epoch`'s `order`, or the next epoch's first step
    when `order` is used up (what the trainer prefetches while a step trains)."""
    if cursor >= len(order):
        order, cursor = epoch_order(len(order), seed, epoch + 1), 0
    return order[cursor : cursor + batches_per_step]


def rank_share(step_batches: np.ndarray, rank: int, world: int, parts: int = 1) -> tuple[list[tuple[int, int]], int]:
    """This rank's pieces of one step, (batch, part) pairs, and the piece count every rank runs.

    The step's batches, each cut into `parts` row parts (part p: rows p, p + parts, ...
    of the batch, so every part spans the batch's lengths), are dealt out every
    world-th from `rank`. At an epoch's tail the step holds fewer than
    batches_per_step() batches; ranks left short run zero-weighted micro-batches so
    every rank joins every gradient all-reduce.
    """
    pieces = [(int(b), p) for b in step_batches for p in range(parts)]
    return pieces[rank::world], math.ceil(len(pieces) / world)


def epoch_step_tokens(per_batch: np.ndarray, order: np.ndarray, batches_per_step: int) -> np.ndarray:
    """Tokens of each step of one epoch: `per_batch` summed over runs of `batches_per_step` batches of `order`."""
    return np.add.reduceat(per_batch[order], np.arange(0, len(order), batches_per_step))


def per_step_metrics(side: str, total: int, steps: int, least: int, most: int) -> dict[str, float]:
    """{side}_tokens_per_step_{mean,min,max}: real tokens (with EOS / BOS) of one optimizer step, all devices."""
    return {f"{side}_tokens_per_step_mean": total / max(steps, 1), f"{side}_tokens_per_step_min": least,
            f"{side}_tokens_per_step_max": most}
