"""The Trainer's checkpoints: what a run saves, and the checkpoint it resumes from.

    class Trainer(RunCheckpoints)      # pipeline/training/trainer.py
    trainer.save()                     # every rank gathers its RNGs to rank 0, which writes the checkpoint
    progress = trainer.resume()        # in the constructor: the newest matching checkpoint, else Progress()

Checkpoints (pipeline/weights/checkpoint.py: the files, sealed) are written every
checkpoint_every steps and at the end, never by the clock, so the checkpoints
average takes are the same on any hardware; on start the newest complete checkpoint
with the same params_hash (pipeline/training/params.py) and made by the same code
(pipeline/weights/fingerprint.py: every project file train imports) is resumed
exactly (weights, the optimizer's state, RNGs, data position, counters): an interrupted run ends
with the same weights as an uninterrupted one. A checkpoint of other code is set
aside like one of other params, unless RESUME_ACROSS_CODE_CHANGE=1: then it is
resumed and the crossing recorded (metrics code_changes, code_changed_at_step,
code_changed_files). A checkpoint trained in another precision than this machine resolves
(pipeline/device/precision.py) stops the run with one line naming both and how to force
one, moving nothing. Only rank 0 reads and writes checkpoints; it sends the one
it resumes to every rank (other nodes need not see them), on another world size
too when a step keeps its batches (params_hash; RNGs: restore_rank_rng).
A run stopped by a scheduler's signal (Trainer.preemption, SLURM) checkpoints the step it stopped at into
`<checkpoints>/preempted/` (one file, outside the rotation and the average stage's choice); a restart resumes it
when it is newer than the newest regular checkpoint, and the next regular checkpoint deletes it, so the kept
checkpoints are those of an uninterrupted run.
"""

from __future__ import annotations

import logging
import shutil
import signal
from dataclasses import asdict

from pipeline.core import signals
from pipeline.core.switches import switch
from pipeline.core.config import ParamsError
from pipeline.device import distributed
from pipeline.device.precision import force_hint
from pipeline.training.records import Progress
from pipeline.weights import checkpoint as ckpt

log = logging.getLogger(__name__)

PREEMPTED = "preempted"  # <checkpoints>/preempted/: the step a signalled run stopped at, until the next regular one


class RunCheckpoints:
    """Trainer.save and Trainer.resume. They use the Trainer's attributes: checkpoints (None: neither reads nor
    writes), ctx, cfg, run, phash, code, code_hash, precision, model, model_cfg, data, optimizer, scaler, progress, and set
    saved_step (the newest checkpoint written or resumed from)."""

    def resume(self) -> Progress:
        """Load the newest matching checkpoint (rank 0 reads it and sends it to every rank), else start afresh."""
        if self.checkpoints is None:
            return Progress()
        across = switch(ckpt.ACROSS_CODE_CHANGE_ENV)
        found, refused = None, ""
        if self.ctx.is_main:
            try:
                found = ckpt.resume_point(self.checkpoints, self.phash, self.code, across, self.precision.key,
                                          self.cfg.optimizer)
                found = self.newer_preempted(found)
            except ckpt.OtherPrecision as e:
                refused = self.other_precision(e)
        path, state, changed, refused = distributed.broadcast_object((*(found or (None, None, [])), refused), self.ctx)
        if refused:
            raise ParamsError(refused)
        if path is None:
            return Progress()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        progress = Progress(**state["progress"])
        before = (state.get("precision") or {}).get("label", self.precision.label)
        progress.precisions = progress.precisions or [{"step": 0, "label": before}]
        if progress.precisions[-1]["label"] != self.precision.label:  # the same key (hashed), other kernels
            log.warning("resuming %s, trained in %s, in %s: metrics/train.json's precision names both", path.name,
                        progress.precisions[-1]["label"], self.precision.label)
            progress.precisions.append({"step": progress.step, "label": self.precision.label})
        if not ckpt.restore_rank_rng(state["rng"], self.ctx.rank, self.ctx.world, self.cfg.seed, progress.step):
            log.warning("checkpoint of %d process(es) resumed by %d: dropout RNGs seeded afresh from (train.seed, "
                        "step, rank); the weights equal an uninterrupted run's only without dropout",
                        len(state["rng"]), self.ctx.world)
        log.info("resuming from step %d (%s)", progress.step, path)
        if changed:
            log.warning("resuming %s across a code change (%s=1): %s differ; recorded in metrics and MLflow",
                        path.name, ckpt.ACROSS_CODE_CHANGE_ENV, ", ".join(changed))
            progress.code_changes.append({"step": progress.step, "files": changed})
            self.run.set_tags({f"code_change_at_step_{progress.step}": ", ".join(changed)})
        self.saved_step = progress.step
        self.run.set_tags({"resumed_from_step": progress.step})
        return progress

    def other_precision(self, e: ckpt.OtherPrecision) -> str:
        """The line that stops a run whose newest checkpoint was trained in another precision than this machine's."""
        p = self.precision
        return (f"{e.path} was trained in {e.label}, and this machine computes in {p.label} ({p.machine}, "
                f"train.cpu_matmul = {p.setting}): resume it where it computes in {e.key} ({force_hint(e.key)}), "
                f"or move {self.checkpoints} away to train afresh in {p.key}")

    def newer_preempted(self, regular: ckpt.Resume | None) -> ckpt.Resume | None:
        """The checkpoint in PREEMPTED if it is of this run (params, code, precision) and newer than `regular`;
        else `regular`, and PREEMPTED is deleted."""
        folder = self.checkpoints / PREEMPTED
        found = ckpt.newest_complete(folder)
        if found is None:
            return regular
        path, payload = found
        same = (payload.get("params_hash") == self.phash and not ckpt.changed_files(payload.get("code"), self.code)
                and (payload.get("precision") or {}).get("key") == self.precision.key)
        if same and (regular is None or payload["step"] > regular.payload["step"]):
            return ckpt.Resume(path, payload, [])
        log.warning("deleting %s: %s", path, "older than the newest checkpoint" if same else "of other params or code")
        shutil.rmtree(folder, ignore_errors=True)
        return regular

    def preempted_here(self) -> signals.Preempted:
        """The exception that ends a run stopped by a scheduler's signal, once checkpointed (every rank)."""
        signum = distributed.broadcast_object(self.preemption.signum, self.ctx)
        name = signal.Signals(signum).name
        self.run.set_tags({"preempted_at_step": self.progress.step, "preempted_by": name})
        return signals.Preempted(signum, f"stopped by {name} at step {self.progress.step}, checkpointed in "
                                         f"{self.saved_path}; the requeued job (or the same command) resumes there")

    def save(self, aside: bool = False) -> None:
        """Checkpoint the run now: every rank's RNGs gathered, rank 0 writes (none when checkpoints is None); `aside`:
        into PREEMPTED (a step between regular checkpoints), else a regular one, which deletes PREEMPTED."""
        rngs = distributed.gather_objects(ckpt.capture_rng(), self.ctx)
        if self.ctx.is_main and self.checkpoints is not None:
            p = self.progress
            state = {  # weights_only-loadable: see pipeline/weights/checkpoint.py and the average stage
                "step": p.step, "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "model_config": asdict(self.model_cfg), "vocab_size": self.data.vocab_size,
                "params_hash": self.phash, "code": self.code, "code_hash": self.code_hash,
                "precision": {"key": self.precision.key, "label": self.precision.label},
                "optimizer": self.optimizer.state_dict(), "optimizer_name": self.cfg.optimizer, "rng": rngs,
                **({"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {}),
                "data_position": {"epoch": p.epoch, "cursor": p.cursor}, "elapsed_seconds": p.elapsed_seconds,
                "train_tokens": p.train_tokens, "progress": asdict(p),
            }
            with signals.held():  # a Ctrl-C while saving is raised once saved_step names the checkpoint on disk
                if aside:
                    saved = ckpt.save_checkpoint(self.checkpoints / PREEMPTED, state, 1)
                else:
                    saved = ckpt.save_checkpoint(self.checkpoints, state, self.cfg.keep_checkpoints)
                    shutil.rmtree(self.checkpoints / PREEMPTED, ignore_errors=True)
                self.saved_step, self.saved_path = p.step, saved
            log.info("step %d: saved %s", p.step, saved)
