"""Group sentence pairs into length-bucketed batches of at most `max_tokens` padded tokens per side.

    python -m stages.batch --tokenized data/tokenized --out data/batches --metrics metrics/batch.json [--params params.yaml]

Reads params `batch` (BatchConfig) and, to report the steps the train stage
will run, `train.devices`, `train.tokens_per_step` and `train.seed`. Batches the
train and valid splits (test is decoded by the translate stage with its own
batching). Sec. 5.1: "Sentence pairs were batched together by approximate
sequence length"; a batch of n pairs is
padded to n x (longest source) and n x (longest target) tokens, and both must be
<= max_tokens. Lengths are as the model sees them: source + EOS, target + BOS/EOS.

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
(bench/data_scale.py, 4.5M pairs, max_tokens 3125: 0.9993, naive 0.9986).

The seed only breaks ties between pairs of equal lengths (so which of them
share a batch is not corpus order); batches are stored in length order and
shuffled at training time.

metrics/batch.json: padding_efficiency of the train batches (both sides) and
src_/tgt_padding_efficiency; num_batches; {src,tgt}_tokens_per_batch_{mean,min,max}
(real tokens of a train batch, with EOS / BOS); sentences_per_batch_mean;
valid_num_batches, valid_padding_efficiency; max_tokens; batches_per_step
(train.devices x gradient accumulation, pipeline/steps.py) and
{src,tgt}_tokens_per_step_{mean,min,max}: the real tokens of each optimizer step
of the first epoch, in the order the train stage takes them (its
metrics/train.json records the same over the steps it ran). Sec. 5.1 asks for
~25000 real source and 25000 real target tokens a step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline import cli, config, steps, tracking
from pipeline.config import BatchConfig, ParamsError, TrainConfig
from pipeline.formats import BATCHED_SPLITS, Ragged, batch_paths, load_split, read_meta
from pipeline.files import InputError, atomic_dir, write_json

log = logging.getLogger(__name__)

def model_lengths(tokenized: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Source and target lengths as the model sees them: (S + 1 for EOS, T + 1 for BOS/EOS)."""
    meta = read_meta(tokenized)
    src, tgt = load_split(tokenized, split, meta["src_lang"]), load_split(tokenized, split, meta["tgt_lang"])
    if len(src) != len(tgt):
        raise InputError(f"{tokenized}: {split} has {len(src)} source but {len(tgt)} target sentences")
    return src.lengths + 1, tgt.lengths + 1


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


def make_batches(S: np.ndarray, T: np.ndarray, max_tokens: int, seed: int, split: str = "train") -> Ragged:
    """Length-bucketed batches with n x max(S) <= max_tokens and n x max(T) <= max_tokens each."""
    check_fits(S, T, max_tokens, split)
    index = order_by_length(S, T, seed)
    return Ragged(index.astype(np.int64), fill(np.maximum(S, T)[index], max_tokens))


def padding_stats(S: np.ndarray, T: np.ndarray, batches: Ragged) -> dict[str, float]:
    """Real / padded tokens (both sides and each), and real tokens per batch, of one split."""
    starts, n = batches.offsets[:-1], np.diff(batches.offsets)
    if len(n) == 0:
        return {}
    stats: dict[str, float] = {}
    real, padded = 0, 0
    for side, lengths in (("src", S[batches.values]), ("tgt", T[batches.values])):
        side_real, per_batch = int(lengths.sum()), np.add.reduceat(lengths, starts)
        side_padded = int((n * np.maximum.reduceat(lengths, starts)).sum())
        stats[f"{side}_padding_efficiency"] = side_real / side_padded
        stats[f"{side}_tokens_per_batch_mean"] = float(per_batch.mean())
        stats[f"{side}_tokens_per_batch_min"] = int(per_batch.min())
        stats[f"{side}_tokens_per_batch_max"] = int(per_batch.max())
        real, padded = real + side_real, padded + side_padded
    stats["padding_efficiency"] = real / padded
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
            batches = make_batches(S, T, cfg.max_tokens, cfg.seed, split)
            index_path, bounds_path = batch_paths(tmp, split)
            np.save(index_path, batches.values)
            np.save(bounds_path, batches.offsets)
            stats = padding_stats(S, T, batches)  # empty for an empty split
            log.info("%s: %d pairs in %d batches, padding efficiency %s", split, len(S), len(batches),
                     stats.get("padding_efficiency"))
            if split == "train":
                metrics |= stats | {"num_batches": len(batches)}
                metrics |= step_stats(S, T, batches, batches_per_step, seed)
                log.info("train: %d batches a step, real tokens a step: source %.0f, target %.0f (mean)",
                         batches_per_step, metrics["src_tokens_per_step_mean"], metrics["tgt_tokens_per_step_mean"])
            else:
                metrics[f"{split}_num_batches"] = len(batches)
                if stats:
                    metrics[f"{split}_padding_efficiency"] = stats["padding_efficiency"]
        write_json(metrics_path, metrics)  # inside atomic_dir: a failure here keeps the old batches too
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = cli.start(__doc__, argv, "tokenized", "out", "metrics")
    cfg = config.load(args.params, "batch", BatchConfig)
    train = config.load(args.params, "train", TrainConfig)
    batches_per_step = train.devices * steps.grad_accumulation(train.tokens_per_step, cfg.max_tokens, train.devices)
    with tracking.stage_run("batch", args) as run:
        run.log_params({"batch": asdict(cfg), "train": {"devices": train.devices, "tokens_per_step":
                        train.tokens_per_step, "seed": train.seed}})
        run.log_results(write_batches(args.tokenized, args.out, args.metrics, cfg, batches_per_step, train.seed))


if __name__ == "__main__":
    cli.run(main)
