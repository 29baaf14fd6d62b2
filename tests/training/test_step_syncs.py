"""A training step never makes the host wait for the device: no tensor value read, no device tensor of host data.

On a GPU each of these is a synchronous copy (a host scalar to the device:
`torch.tensor(x, device=...)`, `t.new_tensor(x)`; a value to the host:
`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `.numpy()`): the host
stops queueing kernels until the device has caught up, and the step cannot be
captured as a CUDA graph. On a CPU host and device are one, so HostTraffic
watches the operations themselves: aten's _local_scalar_dense (every read of a
tensor's value), lift_fresh (a tensor made from Python data: on a GPU followed
by its copy to the device) and the Python methods that read a whole tensor to
the host. Allowed: a tensor filled on the device (torch.full, zeros, and
aten.scalar_tensor, which SDPA uses for its mask: a fill there, no copy) and
Python numbers given to an op (a kernel argument, no copy).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import loss as loss_lib
from model.config import ModelConfig
from pipeline.core.config import TrainConfig
from pipeline.core.tracking import StageRun
from pipeline.device import distributed
from pipeline.device.precision import resolve
from pipeline.training.loader import TrainingData
from pipeline.training.optimizer import build_optimizer, train_step
from pipeline.training.trainer import Trainer
from tests.fixtures.train import MODEL, TRAIN, VOCAB, write_corpus

CPU = torch.device("cpu")
READS = {"_local_scalar_dense"}  # .item(), float(t), int(t), bool(t), `if t:`
MADE_FROM_HOST = {"lift_fresh", "lift_fresh_copy"}  # torch.tensor(x), t.new_tensor(x), torch.as_tensor(x)
HOST_METHODS = ("tolist", "cpu", "numpy", "__array__")  # whole tensors read to the host (no aten op on a CPU)

pytestmark = pytest.mark.usefixtures("one_thread")


class HostTraffic(TorchDispatchMode):
    """Records, on this thread (the prefetch thread's host tensors are its own business), every operation above."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        super().__init__()
        self.seen: list[str] = []
        self.thread = threading.get_ident()
        for name in HOST_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self.watched(name, getattr(torch.Tensor, name)))

    def watched(self, name: str, method):
        def method_watched(tensor, *args, **kwargs):
            if threading.get_ident() == self.thread:
                self.seen.append(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)

        return method_watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS | MADE_FROM_HOST:
            self.seen.append(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[(0.0, 1.0), (5.0, 1.0), (5.0, 0.5)], ids=["plain", "rdrop", "rdrop_half"])
def trainer(tmp_path, request):
    """The train stage's Trainer, with the paper's loss and with R-Drop's (each pair twice, or half the rows
    drawn each step, a KL term)."""
    data = TrainingData.load(*write_corpus(tmp_path))
    alpha, fraction = request.param
    cfg = TrainConfig(**{**TRAIN, "rdrop_alpha": alpha, "rdrop_fraction": fraction})
    return Trainer(data, ModelConfig(**MODEL), cfg, 24, distributed.Dist(0, 1, 0, CPU), StageRun(), phash="",
                   precision=resolve(cfg.cpu_matmul, CPU))


@pytest.mark.parametrize("action", [
    lambda t: t.sum().item(), lambda t: float(t[0]), lambda t: bool(t.any()), lambda t: t.tolist(),
    lambda t: t.cpu(), lambda t: t.numpy(), lambda t: t.new_tensor(0.5) * t, lambda t: torch.tensor(2.0) + t,
], ids=["item", "float", "bool", "tolist", "cpu", "numpy", "new_tensor", "torch.tensor"])
def test_the_recorder_sees_every_kind_of_host_traffic(monkeypatch, action):
    t = torch.ones(3)
    with HostTraffic(monkeypatch) as traffic:
        action(t)
    assert traffic.seen


def test_the_recorder_lets_device_fills_and_python_numbers_pass(monkeypatch):
    t = torch.ones(3)
    with HostTraffic(monkeypatch) as traffic:
        (t * 0.5 + torch.full((), 2.0) + torch.zeros(3)).add_(3).clamp(min=1.0)
    assert traffic.seen == []


def test_training_steps_neither_read_the_device_nor_copy_host_numbers_to_it(trainer, monkeypatch):
    trainer.step(trainer.epoch_order())  # the first step builds its batches here; the next ones are prefetched
    with HostTraffic(monkeypatch) as traffic:
        for _ in range(3):
            loss_sum, _, _ = trainer.step(trainer.epoch_order())
    assert traffic.seen == []
    assert torch.isfinite(loss_sum)  # read after the steps, as the logging step does


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mixed_precision_step_and_its_grad_scaler_do_neither(trainer, monkeypatch, dtype):
    """GPUs train under autocast, fp16 with a gradient scaler: the same step, on a CPU."""
    optimizer = build_optimizer(trainer.model, trainer.cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    micro = trainer.data.micro_batches(((0, 0),), 1, 0, CPU)
    run = lambda: train_step(trainer.loss_model, optimizer, micro, micro[0][0].tokens, 1e-3, trainer.ctx,
                             torch.autocast("cpu", dtype=dtype), scaler)
    run()  # Adam's state and the scaler's made
    with HostTraffic(monkeypatch) as traffic:
        run()
    assert traffic.seen == []
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_fused_chunk_gpus_compile_does_neither(monkeypatch, dtype):
    """The function torch.compile traces on GPUs (model/loss.py fused_chunk), run as written."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(16, 8, generator=g), torch.randn(VOCAB, 8, generator=g)
    y = torch.randint(0, VOCAB, (16,), generator=g)
    h, w = (h, w) if dtype is None else (h.to(dtype), w.to(dtype))
    with HostTraffic(monkeypatch) as traffic:
        loss_lib.fused_chunk(h @ w.t(), y, 0.1, dtype, h, w)
    assert traffic.seen == []
