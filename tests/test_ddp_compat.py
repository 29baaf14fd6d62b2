"""distributed.ddp on the torch installed and on an older one: torch 2.11 (a GPU machine's own build) has no
forward_sync_buffers in DistributedDataParallel, so the helper says the same with broadcast_buffers=False there."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench import gpu_check
from model.config import ModelConfig
from pipeline.core.config import TrainConfig
from pipeline.core.tracking import StageRun
from pipeline.training import distributed
from pipeline.training.loader import TrainingData
from pipeline.training.trainer import Trainer
from tests.train_fixtures import MODEL, TRAIN, write_corpus

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


class Torch211DDP(DistributedDataParallel):
    """The real DDP behind torch 2.11's keywords: no forward_sync_buffers (a TypeError, as there)."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
        with warnings.catch_warnings():  # 2.13 deprecates broadcast_buffers; 2.11 does not
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(module, device_ids=device_ids, broadcast_buffers=broadcast_buffers,
                             gradient_as_bucket_view=gradient_as_bucket_view)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("table", torch.arange(3.0), persistent=False)  # as the positional table

    def forward(self, x):
        return self.lin(x + self.table)


def test_the_installed_torchs_ddp_has_the_keywords_the_helper_relies_on():
    keywords = inspect.signature(DistributedDataParallel.__init__).parameters
    assert {"broadcast_buffers", "gradient_as_bucket_view"} <= set(keywords)
    with pytest.raises(TypeError):
        Torch211DDP(nn.Linear(1, 1), forward_sync_buffers=False)


@pytest.mark.parametrize("ddp_class", [DistributedDataParallel, Torch211DDP], ids=["installed", "torch-2.11"])
def test_ddp_skips_the_per_forward_buffer_sync_and_views_gradients_in_buckets_on_either_torch(monkeypatch, ddp_class):
    monkeypatch.setattr(distributed, "DistributedDataParallel", ddp_class)
    torch.manual_seed(0)
    with gpu_check.process_group(CPU) as ctx, warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed torch's path draws no deprecation warning
        model = distributed.ddp(WithBuffer(), ctx)
        assert type(model) is ddp_class
        assert model.broadcast_buffers is False and model.gradient_as_bucket_view is True
        model(torch.ones(4, 3)).sum().backward()  # a step through the reducer
        assert model.module.lin.weight.grad is not None
        del model  # before the group ends (Trainer.close)


def test_the_helper_passes_broadcast_buffers_where_ddp_lacks_forward_sync_buffers(monkeypatch):
    seen = {}

    class Old:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
            seen.update(device_ids=device_ids, broadcast_buffers=broadcast_buffers,
                        gradient_as_bucket_view=gradient_as_bucket_view)

    monkeypatch.setattr(distributed, "DistributedDataParallel", Old)
    distributed.ddp(nn.Linear(1, 1), distributed.Dist(0, 1, 0, CPU))
    assert seen == {"device_ids": None, "broadcast_buffers": False, "gradient_as_bucket_view": True}


def test_the_trainer_builds_its_ddp_and_steps_on_torch_2_11s_keywords(tmp_path, monkeypatch):
    """What `make gpu-check` met on the GPU machine's torch: the Trainer's DDP in a group of one."""
    monkeypatch.setattr(distributed, "DistributedDataParallel", Torch211DDP)
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    with gpu_check.process_group(CPU) as ctx:
        trainer = Trainer(data, ModelConfig(**MODEL), TrainConfig(**TRAIN), 24, ctx, StageRun(), phash="")
        assert type(trainer.loss_model) is Torch211DDP and trainer.loss_model.broadcast_buffers is False
        trainer.step(trainer.epoch_order())
        trainer.close()
