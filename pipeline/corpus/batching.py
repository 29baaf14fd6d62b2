"""Length-bucketed batches of sentence pairs, at most `max_tokens` padded tokens per side (the batch stage's work).

Sec. 5.1: "Sentence pairs were batched together by approximate sequence
length"; a batch of n pairs is padded to n x (longest source) and n x (longest
target) tokens, and both must be <= max_tokens. Lengths are as the model sees
them: source + EOS, target + BOS/EOS (model_lengths).

How pairs are ordered, then cut greedily into the fullest batches that fit:
since both sides count against the same max_tokens, a batch's size is set by
L = max(source, target) of its longest pair. Pairs are sorted into shells of
equal L; within a shell by source - target, so one side of every pair stays
exactly L and the other side moves smoothly from short to L and back down
(target-heavy pairs, then balanced ones, then source-heavy ones); the direction
alternates from shell to shell (a snake) so a batch spanning two shells joins
pairs of similar shape. Along this order L never decreases, so a batch fits iff
n x L(last pair) <= max_tokens, and greedy filling gives the fewest batches.
Padding efficiency (real / padded tokens, both sides, train) measured on
Multi30k en-de (BPE 8000, 28998 pairs):

    max_tokens                                    2500    6000
    sort by (target, source), fill (naive)       0.954   0.916
    shells of L, then source - target, no snake  0.970   0.949
    shells of L, then source - target, snake     0.979   0.960   (this module)
    ... with batch boundaries by DP (at most     0.980   0.961
        as many batches), for comparison

On a WMT14-sized corpus every order is above 0.99: 4.5M pairs put hundreds of
pairs in each (source, target) length cell, so batches are nearly pure
(4.5M pairs, max_tokens 3125: 0.9993, naive 0.9986; measured by the retired
bench.data.scale: git checkout f0118e0 && python -m bench.data.scale).

Bounded shapes (batch.length_bucket_step > 1): each side of a batch is padded
to the smallest length of a geometric grid (1, 2, ..., then x step, rounded
up: bucket_grid) that holds its longest sentence, and pairs are ordered and cut
by those padded lengths, so a run's micro-batches take a few hundred distinct
shapes instead of nearly one each: a GPU pays a per-shape cost (attention
plans, compiled graphs) that many times only. Each side wastes less than
1 - 1/step of its padded length to the grid. 1.0 keeps exact lengths.

The seed only breaks ties between pairs of equal lengths (so which of them
share a batch is not corpus order); batches are stored in length order and
shuffled at training time.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import numpy as np

from pipeline.core.config import BatchConfig, ParamsError
from pipeline.core.files import InputError, atomic_dir, write_json
from pipeline.corpus import steps
from pipeline.corpus.formats import BATCHED_SPLITS, Ragged, batch_paths, load_split, read_meta

log = logging.getLogger(__name__)


def model_lengths(tokenized: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Source and target lengths as the model sees them: (S + 1 for EOS, T + 1 for BOS/EOS)."""
    meta = read_meta(tokenized)
    src, tgt = load_split(tokenized, split, meta["src_lang"]), load_split(tokenized, split, meta["tgt_lang"])
    if len(src) != len(tgt):
        raise InputError(f"{tokenized}: {split} has {len(src)} source but {len(tgt)} target sentences")
    return src.lengths + 1, tgt.lengths + 1


@functools.lru_cache(maxsize=1024)
def bucket_grid(longest: int, step: float) -> np.ndarray:
    """Padded lengths 1, 2, ..., b, ceil(b x step), ... up to the first >= `longest` (every length when step = 1).

    Read-only and cached: the loader pads every micro-batch through it, a few times a step."""
    grid = [1]
    while grid[-1] < longest:
        grid.append(max(grid[-1] + 1, math.ceil(grid[-1] * step - 1e-9)))
    out = np.asarray(grid, dtype=np.int64)
    out.flags.writeable = False
    return out


def padded(lengths: np.ndarray, step: float) -> np.ndarray:
    """Each length rounded up to bucket_grid(step): the length a batch holding it is padded to (itself at step 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if step == 1.0 or len(lengths) == 0:
        return lengths
    grid = bucket_grid(int(lengths.max()), step)
    return grid[np.searchsorted(grid, lengths)]


def check_fits(S: np.ndarray, T: np.ndarray, max_tokens: int, split: str) -> None:
    """Raise naming the first pair that alone exceeds max_tokens on either side."""
    too_long = np.flatnonzero(np.maximum(S, T) > max_tokens)
    if len(too_long):
        i = int(too_long[0])
        raise ParamsError(
            f"{split} pair {i} ({S[i]} source, {T[i]} target tokens with EOS/BOS) is longer than "
            f"batch.max_tokens = {max_tokens} by itself ({len(too_long)} such pairs): raise batch.max_tokens "
            "or lower tokenize.max_len"
        )


def order_by_length(S: np.ndarray, T: np.ndarray, seed: int) -> np.ndarray:
    """Pair indices in shells of L = max(S, T), within a shell by S - T, snaking from shell to shell."""
    L = np.maximum(S, T)
    shape = np.where(L % 2 == 0, S - T, T - S)  # the snake: odd shells run backwards
    ties = np.random.default_rng(seed).permutation(len(S))  # a seeded order among equal lengths
    return ties[np.lexsort((shape[ties], L[ties]))]


def fill(L: np.ndarray, max_tokens: int) -> np.ndarray:
    """Greedy batch bounds over L = max(S, T) in nondecreasing order: each batch as large as fits.

    # Paper: batches of ~25000 real tokens a side per step (Sec. 5.1); the cap is on padded tokens
    # (n x L), and the presets set it by measuring the real figure (metrics: *_tokens_per_step_*).
    """
    bounds, i, n = [0], 0, len(L)
    while i < n:
        # L never decreases, so batch [i, i + k) fits iff k * L[i + k - 1] <= max_tokens.
        window = L[i : i + max_tokens // int(L[i])]
        k = int(np.searchsorted(np.arange(1, len(window) + 1) * window, max_tokens, side="right"))
        if k == 0:
            raise ValueError(f"pair {i} in length order ({L[i]} tokens) is longer than max_tokens = {max_tokens}")
        i += k
        bounds.append(i)
    return np.asarray(bounds, dtype=np.int64)


def make_batches(S: np.ndarray, T: np.ndarray, max_tokens: int, seed: int, split: str = "train",
                 length_bucket_step: float = 1.0) -> Ragged:
    """Length-bucketed batches with n x padded(max S) <= max_tokens and n x padded(max T) <= max_tokens each."""
    S, T = padded(S, length_bucket_step), padded(T, length_bucket_step)
    check_fits(S, T, max_tokens, split)
    index = order_by_length(S, T, seed)
    return Ragged(index.astype(np.int64), fill(np.maximum(S, T)[index], max_tokens))


def shapes(S: np.ndarray, T: np.ndarray, batches: Ragged, length_bucket_step: float = 1.0) -> np.ndarray:
    """The padded shape of every batch: [num_batches, 3] (rows, source length, target length)."""
    starts, n = batches.offsets[:-1], np.diff(batches.offsets)
    if len(n) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    longest = [padded(np.maximum.reduceat(side[batches.values], starts), length_bucket_step) for side in (S, T)]
    return np.stack([n, *longest], axis=1)


def padding_stats(S: np.ndarray, T: np.ndarray, batches: Ragged, length_bucket_step: float = 1.0) -> dict[str, float]:
    """Real / padded tokens (both sides and each), real tokens per batch, and distinct padded shapes of one split."""
    starts, n = batches.offsets[:-1], np.diff(batches.offsets)
    if len(n) == 0:
        return {}
    shape = shapes(S, T, batches, length_bucket_step)
    stats: dict[str, float] = {"num_shapes": len(np.unique(shape, axis=0))}
    real, total = 0, 0
    for column, side, lengths in ((1, "src", S[batches.values]), (2, "tgt", T[batches.values])):
        side_real, per_batch = int(lengths.sum()), np.add.reduceat(lengths, starts)
        side_padded = int((n * shape[:, column]).sum())
        stats[f"{side}_padding_efficiency"] = side_real / side_padded
        stats[f"{side}_tokens_per_batch_mean"] = float(per_batch.mean())
        stats[f"{side}_tokens_per_batch_min"] = int(per_batch.min())
        stats[f"{side}_tokens_per_batch_max"] = int(per_batch.max())
        real, total = real + side_real, total + side_padded
    stats["padding_efficiency"] = real / total
    stats["sentences_per_batch_mean"] = float(n.mean())
    return stats


def step_stats(S: np.ndarray, T: np.ndarray, batches: Ragged, batches_per_step: int, seed: int) -> dict[str, float]:
    """Real source and target tokens per optimizer step over the first epoch, in the train stage's batch order."""
    order, starts = steps.epoch_order(len(batches), seed, 0), batches.offsets[:-1]
    stats: dict[str, float] = {"batches_per_step": batches_per_step}
    for side, lengths in (("src", S), ("tgt", T)):
        per_step = steps.epoch_step_tokens(np.add.reduceat(lengths[batches.values], starts), order, batches_per_step)
        stats |= steps.per_step_metrics(side, int(per_step.sum()), len(per_step), int(per_step.min()),
                                        int(per_step.max()))
    return stats


def write_batches(tokenized: Path, out: Path, metrics_path: Path, cfg: BatchConfig, batches_per_step: int,
                  seed: int) -> dict[str, float]:
    """Batch the train and valid splits into `out` and write their metrics (both atomically); return the metrics."""
    metrics: dict[str, float] = {"max_tokens": cfg.max_tokens}
    lengths = {split: model_lengths(tokenized, split) for split in BATCHED_SPLITS}  # a missing input: nothing made
    with atomic_dir(out) as tmp:
        for split in BATCHED_SPLITS:
            S, T = lengths[split]
            batches = make_batches(S, T, cfg.max_tokens, cfg.seed, split, cfg.length_bucket_step)
            index_path, bounds_path = batch_paths(tmp, split)
            np.save(index_path, batches.values)
            np.save(bounds_path, batches.offsets)
            stats = padding_stats(S, T, batches, cfg.length_bucket_step)  # empty for an empty split
            log.info("%s: %d pairs in %d batches of %s distinct shapes, padding efficiency %s", split, len(S),
                     len(batches), stats.get("num_shapes"), stats.get("padding_efficiency"))
            if split == "train":
                metrics |= stats | {"num_batches": len(batches)}
                metrics |= step_stats(S, T, batches, batches_per_step, seed)
                log.info("train: %d batches a step, real tokens a step: source %.0f, target %.0f (mean)",
                         batches_per_step, metrics["src_tokens_per_step_mean"], metrics["tgt_tokens_per_step_mean"])
            else:
                metrics[f"{split}_num_batches"] = len(batches)
                if stats:
                    metrics[f"{split}_padding_efficiency"] = stats["padding_efficiency"]
                    metrics[f"{split}_num_shapes"] = stats["num_shapes"]
        write_json(metrics_path, metrics)  # inside atomic_dir: a failure here keeps the old batches too
    return metrics
