"""A scheduler's signal during training (SLURM's SIGUSR1 before the time limit, SIGTERM to requeue or preempt): the
step in flight ends, is checkpointed aside, the run stops; the restart resumes there and ends as an uninterrupted run.

The train stage runs in this process as one srun task would (SLURM's task variables, pipeline/device/slurm.py);
tests/cluster/test_slurm.py does it through a real sbatch and requeue.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pipeline.core import signals
from pipeline.weights import faults
from pipeline.weights.checkpoint import step_files
from tests.fixtures.train import final_weights, run_stage, write_corpus, write_params
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)

TASK = {"TRANSFORMER_SLURM": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}


def signal_in_step(monkeypatch, sig: int, at: int) -> None:
    """`sig` arrives while training step `at` runs (where TRANSFORMER_FAULT's step point is)."""
    def inject(point: str, step: int) -> None:
        if point == "step" and step == at:
            os.kill(os.getpid(), sig)
    monkeypatch.setattr(faults, "inject", inject)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_checkpoints_the_step_aside_and_the_restart_ends_as_an_uninterrupted_run(tmp_path, monkeypatch,
                                                                                         one_thread, sig):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for root in (whole, cut):
        write_corpus(root)
        write_params(root / "params.yaml", max_steps=6, checkpoint_every=2, eval_every=3)
    run_stage(whole, whole / "params.yaml")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # adopt() sets them: undone after the test
        monkeypatch.delenv(key, raising=False)
    for key, value in TASK.items():
        monkeypatch.setenv(key, value)
    with monkeypatch.context() as during:
        signal_in_step(during, sig, at=3)
        with pytest.raises(signals.Preempted) as stopped:
            run_stage(cut, cut / "params.yaml")
    assert stopped.value.code == 128 + sig and "at step 3, checkpointed in" in stopped.value.line
    assert [s for s, _ in step_files(cut / "checkpoints")] == [2]  # step 3 aside: not one the average stage takes
    assert [s for s, _ in step_files(cut / "checkpoints" / "preempted")] == [3]
    assert signal.getsignal(sig) is not None and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL

    metrics = run_stage(cut, cut / "params.yaml")  # the requeued job: resumes at step 3, its data position
    assert metrics["steps"] == 6
    assert not (cut / "checkpoints" / "preempted").exists()
    assert [s for s, _ in step_files(cut / "checkpoints")] == [s for s, _ in step_files(whole / "checkpoints")]
    a, b = final_weights(cut), final_weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_an_aside_checkpoint_older_than_the_newest_regular_one_is_deleted_not_resumed(tmp_path, one_thread):
    """A run that went on past its aside checkpoint (the same params, a larger max_steps) resumes the regular one."""
    root = tmp_path / "run"
    write_corpus(root)
    write_params(root / "params.yaml", max_steps=4, checkpoint_every=2)
    run_stage(root, root / "params.yaml")
    aside = root / "checkpoints" / "preempted"
    aside.mkdir()
    oldest = step_files(root / "checkpoints")[0][1]  # step 2
    for f in (oldest, oldest.with_name(oldest.name + ".sha256")):
        (aside / f.name).write_bytes(f.read_bytes())
    write_params(root / "params.yaml", max_steps=6, checkpoint_every=2)  # max_steps is not in params_hash
    metrics = run_stage(root, root / "params.yaml")
    assert metrics["steps"] == 6 and not aside.exists()
    assert [s for s, _ in step_files(root / "checkpoints")] == [2, 4, 6]
