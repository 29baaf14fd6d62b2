"""Group sentence pairs into length-bucketed batches of at most `max_tokens` padded tokens per side.

    python -m stages.batch --tokenized data/tokenized --out data/batches --metrics metrics/batch.json [--params params.yaml]

Reads params `batch` (BatchConfig) and, to report the steps the train stage
will run, `train.tokens_per_step` and `train.seed` (a step's batches do not
depend on the number of processes: pipeline/corpus/steps.py). Batches the
train and valid splits (test is decoded by the translate stage with its own
batching). How pairs are ordered and cut into batches, and the padding
efficiency that gives: pipeline/corpus/batching.py.

metrics/batch.json: padding_efficiency of the train batches (both sides) and
src_/tgt_padding_efficiency; num_batches; {src,tgt}_tokens_per_batch_{mean,min,max}
(real tokens of a train batch, with EOS / BOS); sentences_per_batch_mean;
num_shapes: the distinct padded (rows, source length, target length) of the train
batches, what a GPU pays per-shape setup for (batch.length_bucket_step bounds it);
valid_num_batches, valid_padding_efficiency, valid_num_shapes; max_tokens; batches_per_step
(ceil(train.tokens_per_step / max_tokens), on any number of processes) and
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

from pipeline.core import cli, config, tracking
from pipeline.corpus import steps
from pipeline.corpus.batching import make_batches, model_lengths, padding_stats
from pipeline.core.config import BatchConfig, TrainConfig
from pipeline.corpus.formats import BATCHED_SPLITS, Ragged, batch_paths
from pipeline.core.files import atomic_dir, write_json

log = logging.getLogger(__name__)


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


def main(argv: list[str] | None = None) -> None:
    args = cli.start(__doc__, argv, "tokenized", "out", "metrics")
    cfg = config.load(args.params, "batch", BatchConfig)
    train = config.load(args.params, "train", TrainConfig)
    batches_per_step = steps.batches_per_step(train.tokens_per_step, cfg.max_tokens)
    with tracking.stage_run("batch", args) as run:
        run.log_params({"batch": asdict(cfg), "train": {"tokens_per_step": train.tokens_per_step, "seed": train.seed}})
        run.log_results(write_batches(args.tokenized, args.out, args.metrics, cfg, batches_per_step, train.seed))


if __name__ == "__main__":
    cli.run(main)
