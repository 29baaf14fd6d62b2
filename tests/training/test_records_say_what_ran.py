"""Records say what ran: a setting that changes no arithmetic on the run's world does not discard the run, and a
run resumed with other kernels names the precision of each of its segments."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.device import distributed
from pipeline.device.precision import resolve
from tests.fixtures.train import run_stage, write_corpus, write_params


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, caplog, tmp_path_factory):
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path_factory.getbasetemp() / 'records.db'}")
    caplog.set_level(logging.INFO)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_grad_compression_on_one_process_resumes_the_run_and_a_blas_resume_names_both_precisions(tmp_path, caplog):
    """One process has no all-reduce: train.grad_compression = fp16 is not hashed there, so the finished run's
    checkpoints are resumed, not set aside; train.cpu_matmul = blas after oneDNN's products (the same key, other
    kernels) is resumed and train.json names both segments."""
    write_corpus(tmp_path)
    first = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=2, checkpoint_every=1))
    caplog.clear()
    again = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=3, checkpoint_every=1,
                                             grad_compression="fp16"))
    assert "resuming from step 2" in caplog.text and "starting afresh" not in caplog.text
    assert again["params_hash"] == first["params_hash"] and not list(tmp_path.glob("checkpoints.stale/*"))
    caplog.clear()
    resumed = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4, checkpoint_every=1,
                                               cpu_matmul="blas"))
    assert "resuming from step 3" in caplog.text and resumed["params_hash"] == first["params_hash"]
    onednn, blas = (resolve(setting, torch.device("cpu")).label for setting in ("fp32", "blas"))
    assert first["precision"] == onednn
    assert resumed["precision"] == (f"{onednn} from step 0, then {blas} from step 3" if onednn != blas else blas)
