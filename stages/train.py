"""Train stage: the Transformer on the stored batches, 1 to 8 processes with torchrun (pipeline/trainer.py).

    torchrun --standalone --nproc_per_node=${train.devices} -m stages.train --tokenized data/tokenized \
        --batches data/batches --checkpoints data/checkpoints --metrics metrics/train.json \
        --plot plots/train.csv [--params params.yaml]
    python -m stages.train ...                      # the same with one process (train.devices: 1)

Reads params `model` (ModelConfig), `train` (TrainConfig) and `batch.max_tokens`.
Resumes from the newest complete checkpoint with the same params_hash; stops at
train.max_steps (train.max_minutes is a safety stop, recorded when it fires). Outputs (rank 0 only): checkpoints,
metrics/train.json, plots/train.csv and an MLflow child run (pipeline/tracking.py).
"""

from __future__ import annotations

import logging

from tqdm.contrib.logging import logging_redirect_tqdm

from model.config import ModelConfig
from pipeline import cli, config, distributed, tracking
from pipeline.config import BatchConfig, TrainConfig
from pipeline.files import write_json
from pipeline.loader import TrainingData
from pipeline.trainer import Trainer, params_hash

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = cli.stage_parser(__doc__, "tokenized", "batches", "checkpoints", "metrics", "plot")
    args = parser.parse_args(argv)
    model_cfg = config.load(args.params, "model", ModelConfig)
    cfg = config.load(args.params, "train", TrainConfig)
    max_tokens = config.load(args.params, "batch", BatchConfig).max_tokens
    if cfg.keep_checkpoints < 1:
        raise config.ParamsError(f"{args.params}: train.keep_checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    ctx = distributed.setup(cfg.devices)
    cli.setup_logging(logging.INFO if ctx.is_main else logging.WARNING)
    try:
        with tracking.stage_run("train", args, enabled=ctx.is_main) as run, logging_redirect_tqdm():
            data = TrainingData.load(args.tokenized, args.batches)
            phash = params_hash(model_cfg, cfg, max_tokens, args.tokenized, args.batches)
            metrics = Trainer(data, model_cfg, cfg, max_tokens, ctx, run, phash, args.checkpoints, args.plot).fit()
            if ctx.is_main:
                write_json(args.metrics, metrics)
                run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["steps"])
                log.info("done: %s", {k: metrics[k] for k in ("steps", "train_tokens", "valid_ppl", "tokens_per_second", "mfu")})
    finally:
        distributed.teardown(ctx)


if __name__ == "__main__":
    main()
