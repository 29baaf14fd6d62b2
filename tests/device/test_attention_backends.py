"""pipeline/device/attention.py: the SDPA backends chosen on CUDA, their override, and the train log's line.

No GPU here: the backend flags and priority order are process-wide settings that exist on a CPU build too, so
entering the CUDA choice shows what it sets; on a CPU nothing is set.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.core.config import ParamsError
from pipeline.device import attention, distributed
from stages import train
from tests.fixtures.train import stage_args, write_corpus, write_params

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def flags() -> tuple:
    """The SDPA settings in force: which backends are enabled, and their priority order."""
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled(),
            tuple(torch._C._get_sdp_priority_order()))


@pytest.fixture(autouse=True)
def _restore_process_choice(monkeypatch):
    """attention.use sets the process's flags: each test starts from torch's and leaves them so."""
    monkeypatch.delenv(attention.ENV, raising=False)
    before = flags()
    yield
    attention._process.close()
    monkeypatch.setattr(attention, "_process_choice", None)
    assert flags() == before


def test_cuda_gets_flash_efficient_math_and_a_cpu_torchs_default():
    assert attention.choice(CUDA) == ("flash", "efficient", "math")
    assert attention.choice(CPU) is None
    assert attention.describe(attention.choice(CUDA)) == (
        "scaled_dot_product_attention backends flash, efficient, math in that order (cuDNN off: it builds a plan "
        "per new shape; TRANSFORMER_SDPA_BACKENDS overrides)")
    assert attention.describe(None) == "torch's default CPU kernels"


def test_the_variable_overrides_the_list_in_its_order_and_a_bad_name_fails_in_one_line(monkeypatch):
    monkeypatch.setenv(attention.ENV, " cuDNN, flash ,math")
    assert attention.choice(CUDA) == ("cudnn", "flash", "math")
    assert attention.describe(attention.choice(CUDA)).endswith("in that order (from TRANSFORMER_SDPA_BACKENDS)")
    assert attention.choice(CPU) is None  # a CPU keeps torch's kernels, and says so
    assert attention.describe(None) == "torch's default CPU kernels (TRANSFORMER_SDPA_BACKENDS applies to CUDA GPUs only)"
    monkeypatch.setenv(attention.ENV, "flash,fast")
    for device in (CUDA, CPU):  # checked on a CPU too: the typo shows before the GPU run
        with pytest.raises(ParamsError) as e:
            attention.choice(device)
        assert str(e.value) == ("TRANSFORMER_SDPA_BACKENDS='flash,fast': 'fast' is not a backend; set it to a comma "
                                "list of cudnn, flash, efficient, math in priority order (e.g. flash,efficient,math), "
                                "or unset it")


def test_the_cuda_choice_sets_the_backends_and_their_priority_and_a_cpu_changes_nothing(monkeypatch):
    torchs = flags()
    with attention.kernels(CPU) as line:
        assert flags() == torchs and line == attention.CPU
    with attention.kernels(CUDA):
        flash, efficient, math, cudnn, order = flags()
        assert (flash, efficient, math, cudnn) == (True, True, True, False)
        wanted = [int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)]
        assert list(order[:3]) == wanted
    assert flags() == torchs
    monkeypatch.setenv(attention.ENV, "math,cudnn")  # an order unlike torch's own: the priority is really set
    with attention.kernels(CUDA):
        flash, efficient, math, cudnn, order = flags()
        assert (flash, efficient, math, cudnn) == (False, False, True, True)
        assert list(order[:2]) == [int(SDPBackend.MATH), int(SDPBackend.CUDNN_ATTENTION)]
    assert flags() == torchs


def test_without_set_priority_the_backends_are_still_chosen_and_the_line_says_the_order_is_torchs(monkeypatch):
    @contextlib.contextmanager
    def old_sdpa_kernel(backends):  # sdpa_kernel before set_priority (torch < 2.6)
        with sdpa_kernel(backends):
            yield

    monkeypatch.setattr(attention, "sdpa_kernel", old_sdpa_kernel)
    torchs = flags()
    with attention.kernels(CUDA) as line:
        assert flags() == (True, True, True, False, torchs[-1])
    assert "enabled, in torch's own order" in line


def test_use_holds_the_choice_for_the_process_once():
    assert attention.use(CPU) == attention.CPU and attention._process_choice is None
    torchs = flags()
    attention.use(CUDA)
    held = flags()
    assert held[3] is False and held != torchs
    attention.use(CUDA)  # a second Trainer in the process (bench.gpu.check): the same, entered once
    assert flags() == held and len(attention._process._exit_callbacks) == 1


def test_the_train_log_names_the_kernels_once_and_mlflow_records_them(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    caplog.set_level(logging.INFO)
    write_corpus(tmp_path, n_train=8, n_valid=4)
    params = write_params(tmp_path / "params.yaml", max_steps=1, eval_every=1, checkpoint_every=0,
                          cpu_matmul="blas")  # torch's BLAS on any CPU: oneDNN's products would change the kernels
    threads = torch.get_num_threads()
    try:
        train.main(stage_args(tmp_path, params))
    finally:
        torch.set_num_threads(threads)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
    assert said == ["attention: torch's default CPU kernels"]
    client = MlflowClient()
    (run,) = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
              if r.data.tags.get("stage") == "train"]
    assert run.data.params["attention"] == "cpu-default"
