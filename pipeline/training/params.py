"""The train stage's params_hash: what shapes the weights, apart from the code (pipeline/weights/fingerprint.py).

    phash = params_hash(model_cfg, train_cfg, batch_cfg, tokenized, batches, precision.key)

A checkpoint is resumed only by a run of the same params_hash (pipeline/weights/checkpoint.py, resume_point);
the params in NOT_WEIGHT_SHAPING are left out, so changing one resumes the old run instead of restarting it.
The precision the device resolved (pipeline/device/precision.py, its key) is in: a machine that computes
in another precision does not resume the run (pipeline/training/run_checkpoints.py says so and how to force one).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from model.config import ModelConfig
from pipeline.core.config import BatchConfig, TrainConfig
from pipeline.corpus import steps
from pipeline.corpus.formats import batch_paths
from pipeline.weights import checkpoint as ckpt

# Train params that do not change the weights of a given step: changing them
# resumes the old run instead of restarting it (e.g. a larger max_steps continues).
# devices: a step's batches do not depend on it (pipeline/corpus/steps.py).
# compile, compile_scope, compile_recompile_limit, compile_on_limit: the same function of the same weights, rounded otherwise (as on another GPU); a run that falls
# back to eager (compiled.py) must resume its own checkpoints, and switching it should not cost the run.
# micro_batch_tokens: how a process cuts its share into micro-batches; the gradient is summed over them all the same.
# cpu_matmul: the setting as written; what it resolves to on this machine (the Precision's key) is hashed instead.
# ddp_bucket_mb, ddp_static_graph: how DDP groups and schedules the same all-reduce (grad_compression rounds: hashed,
# but as none on one process: hashed_train).
# The muon_* keys are hashed with train.optimizer = muon only (hashed_train): Adam never reads them.
NOT_WEIGHT_SHAPING = ("max_steps", "max_minutes", "eval_every", "log_every", "checkpoint_every", "keep_checkpoints",
                      "devices", "timeout_minutes", "compile", "compile_scope", "compile_recompile_limit",
                      "compile_on_limit", "cuda_graphs", "micro_batch_tokens", "cpu_matmul",
                      "ddp_bucket_mb", "ddp_static_graph")


def hashed_train(train_cfg: TrainConfig, world: int | None = None) -> dict:
    """The train params params_hash holds: less NOT_WEIGHT_SHAPING, less the muon_* keys under Adam, and
    grad_compression as none on a `world` of one process (no all-reduce to round: the setting changes no
    arithmetic, so it does not discard a run there)."""
    train = {k: v for k, v in asdict(train_cfg).items() if k not in NOT_WEIGHT_SHAPING
             and not (k.startswith("muon_") and train_cfg.optimizer == "adam")}
    if world == 1:
        train["grad_compression"] = "none"
    return train


def params_hash(model_cfg: ModelConfig, train_cfg: TrainConfig, batch: BatchConfig, tokenized: Path,
                batches: Path, precision: str, world: int | None = None) -> str:
    """sha256 of what shapes the weights: model, train (hashed_train), batch.max_tokens and
    length_bucket_step (how batches are padded), the data, the stored batches per step, which the world size
    does not change (2 processes x 1 batch resume 1 process x 2, and the reverse), and the resolved `precision`
    (Precision.key). `world`: the run's processes (None: not known, grad_compression hashed as set)."""
    train = hashed_train(train_cfg, world)
    step_batches = steps.batches_per_step(train_cfg.tokens_per_step, batch.max_tokens)
    files = [p for p in (tokenized / "meta.json", tokenized / "spm.model", *batch_paths(batches, "train")) if p.exists()]
    return ckpt.fingerprint({"model": asdict(model_cfg), "train": train, "batch.max_tokens": batch.max_tokens,
                             "batch.length_bucket_step": batch.length_bucket_step, "batches_per_step": step_batches,
                             "precision": precision},
                            files)
