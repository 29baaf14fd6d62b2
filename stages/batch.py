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

from dataclasses import asdict

from pipeline.core import cli, config, tracking
from pipeline.corpus import steps
from pipeline.corpus.batching import write_batches
from pipeline.core.config import BatchConfig, TrainConfig


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
