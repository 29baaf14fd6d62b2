"""Train stage: the Transformer on the stored batches, 1 to 8 processes (pipeline/training/trainer.py).

    python -m stages.train --tokenized data/tokenized --batches data/batches --checkpoints data/checkpoints \
        --metrics metrics/train.json --plot plots/train.csv [--params params.yaml]

Reads params `model` (ModelConfig), `train` (TrainConfig) and `batch.max_tokens`.
With train.devices > 1 the command checks the params and inputs, then starts
that many processes as `torchrun --standalone --nproc_per_node=<devices> -m
stages.train ...` does (pipeline.device.distributed.launch), so that a failure ends
with the failing process's message rather than torchrun's report; running that
torchrun command directly works too, and so does torchrun on each of N nodes:

    torchrun --nnodes=N --nproc_per_node=<devices> --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT \
        --rdzv_id=RUN -m stages.train ...          # docs/multi_node.md, "Running it"

With TRANSFORMER_SLURM=1, inside a SLURM allocation, the command starts one srun task per device on every
node instead (pipeline/device/slurm.py; cluster/slurm/pipeline.sbatch runs the pipeline so), and SIGTERM or
SIGUSR1 checkpoint the step in flight and stop the run with the signal's exit status (docs/multi_node.md, "SLURM").

Before training it logs the precision this machine resolves (pipeline/device/precision.py: the
CPU's class or the GPU, and how train.cpu_matmul forces another). Every rank checks that it holds
rank 0's params, data and precision (params_hash); a
collective that fails or waits past train.timeout_minutes (a node died or
froze) stops every rank with one line saying so; restarting resumes.
Resumes from the newest complete checkpoint with the same params_hash and code
fingerprint (a checkpoint of other code is set aside, as one of other params,
unless RESUME_ACROSS_CODE_CHANGE=1, which metrics/train.json records); stops
at train.max_steps (train.max_minutes is a safety stop, recorded when it
fires); Ctrl-C says at which step it stopped.
Outputs (rank 0 only): checkpoints, metrics/train.json, plots/train.csv and an
MLflow child run (pipeline/core/tracking.py). With train.compile, the compiled graphs are kept in
compile_cache/ beside the checkpoints (not a DVC output: a cache, no record), so a resumed run loads them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from pathlib import Path

from model.config import ModelConfig
from pipeline.core import cli, config, signals, tracking
from pipeline.device import checks, compiled, distributed, slurm
from pipeline.core.config import BatchConfig, TrainConfig
from pipeline.core.files import write_json
from pipeline.training.loader import TrainingData
from pipeline.training.params import params_hash
from pipeline.device.precision import resolve
from pipeline.training.trainer import Trainer

log = logging.getLogger(__name__)

COMPILE_CACHE = "compile_cache"  # train.compile's graphs on disk, beside the checkpoints (compiled.keep_cache)


def main(argv: list[str] | None = None) -> None:
    parser = cli.stage_parser(__doc__, "tokenized", "batches", "checkpoints", "metrics", "plot")
    args = parser.parse_args(argv)
    model_cfg = config.load(args.params, "model", ModelConfig)
    cfg = config.load(args.params, "train", TrainConfig)
    batch = config.load(args.params, "batch", BatchConfig)
    max_tokens = batch.max_tokens
    checks.train(cfg)
    if cfg.compile or cfg.cuda_graphs:  # the compiled graphs kept beside the checkpoints: a resume loads them
        compiled.keep_cache(Path(args.checkpoints).parent / COMPILE_CACHE)
    if slurm.requested() and not slurm.in_task():  # TRANSFORMER_SLURM=1 in a batch job: srun tasks on every node
        TrainingData.load(args.tokenized, args.batches)
        slurm.launch(cfg.devices, "stages.train", sys.argv[1:] if argv is None else argv,
                     [str(args.tokenized), str(args.batches)])
    if slurm.requested():
        slurm.adopt()
    elif cfg.devices > 1 and not distributed.launched_by_torchrun():
        TrainingData.load(args.tokenized, args.batches)  # a missing input fails here, before any process starts
        distributed.launch(cfg.devices, "stages.train", sys.argv[1:] if argv is None else argv)
        return
    ctx = distributed.setup(cfg.devices, cfg.timeout_minutes)
    cli.setup_logging(logging.INFO if ctx.is_main else logging.WARNING)
    trainer = None
    try:
        with tracking.stage_run("train", args, enabled=ctx.is_main) as run:
            data = TrainingData.load(args.tokenized, args.batches, batch.length_bucket_step)
            precision = resolve(cfg.cpu_matmul, ctx.device)  # once, for the hash, the trainer and the records
            log.info("%s", precision.line())
            phash = params_hash(model_cfg, cfg, batch, args.tokenized, args.batches, precision.key, ctx.world)
            distributed.check_same(phash, "params_hash (model, train, batch.max_tokens, the data and the precision)",
                                   ctx)
            trainer = Trainer(data, model_cfg, cfg, max_tokens, ctx, run, phash, args.checkpoints, args.plot,
                              precision=precision)
            try:
                with preemptible(trainer, run):
                    metrics = trainer.fit()
            except signals.Preempted as e:  # checkpointed: one line from rank 0, the signal's exit status
                if ctx.is_main:
                    print(f"train: {e.line}", file=sys.stderr, flush=True)
                raise
            except KeyboardInterrupt:  # Ctrl-C: one line, from rank 0, instead of each process's traceback
                if not ctx.is_main:
                    raise SystemExit(cli.EXIT_INTERRUPTED) from None
                raise KeyboardInterrupt(trainer.interrupted()) from None
            if ctx.is_main:
                write_json(args.metrics, metrics)
                run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["steps"])
                log.info("done: %s", {k: metrics[k] for k in ("steps", "train_tokens", "valid_ppl", "tokens_per_second", "mfu")})
    except BaseException as e:
        # The failed step's frames hold the DDP model until the error is printed at exit: freed then, its reducer
        # would end the process group while holding the interpreter lock that a gloo thread may be waiting for (a
        # rank hung so). Their locals are dropped here, so that trainer.close() drops the model (Trainer.close).
        traceback.clear_frames(e.__traceback__)
        if isinstance(e, RuntimeError) and distributed.lost_peers(e, ctx):
            raise distributed.DistributedError(
                f"rank {ctx.rank} of {ctx.world}: {distributed.LOST_PEERS} ({e}); a node died, froze or was slower "
                f"than train.timeout_minutes = {cfg.timeout_minutes:g}. Restart every node: training resumes from the "
                f"newest checkpoint in {args.checkpoints}") from e
        raise
    finally:
        if trainer is not None:
            trainer.close()
        distributed.teardown(ctx)


@contextlib.contextmanager
def preemptible(trainer: Trainer, run: tracking.StageRun):
    """Under SLURM (pipeline/device/slurm.py): SIGTERM and SIGUSR1 checkpoint the step and stop (signals.deferred),
    and the MLflow run is tagged with the job and restart it trains (the segments of one requeued job)."""
    if not slurm.requested():
        yield
        return
    run.set_tags(slurm.tags())
    with signals.deferred() as asked:
        trainer.preemption = asked
        yield


if __name__ == "__main__":
    cli.run(main)
