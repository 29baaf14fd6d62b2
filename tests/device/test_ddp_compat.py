"""distributed.ddp on the torch installed (2.13) and on torch 2.11 (a GPU machine's own build), whose
DistributedDataParallel has no forward_sync_buffers: the keywords are chosen from DDP.__init__'s parameters, and
gradients stay views of DDP's all-reduce buckets from step to step."""

from __future__ import annotations

import gc
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from bench.gpu import check as gpu_check
from model.config import ModelConfig
from pipeline.core.config import TrainConfig
from pipeline.core.tracking import StageRun
from pipeline.device import distributed
from pipeline.device.precision import resolve
from pipeline.training.loader import TrainingData
from pipeline.training.optimizer import zero_grads
from pipeline.training.trainer import Trainer
from tests.fixtures.train import MODEL, TRAIN, write_corpus

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")

# DistributedDataParallel.__init__'s parameters as torch's source has them: 2.13 (torch/nn/parallel/distributed.py,
# installed here; broadcast_buffers deprecated, default None), and 2.11: the same but no forward_sync_buffers, and
# broadcast_buffers (default True) not deprecated.
TORCH_2_13 = ("self", "module", "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync",
              "process_group", "bucket_cap_mb", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view",
              "static_graph", "delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
              "device_mesh", "skip_all_reduce_unused_params", "bucket_cap_mb_list", "batched_grad_copy",
              "forward_sync_buffers")
TORCH_2_11 = tuple(name for name in TORCH_2_13 if name != "forward_sync_buffers")


def signature(names: tuple[str, ...]) -> inspect.Signature:
    """DDP.__init__'s signature of that torch: self and module positional, the rest keywords with defaults."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, **({} if n in ("self", "module") else {"default": None}))
                              for n in names])


class Torch211DDP(DistributedDataParallel):
    """The real DDP behind torch 2.11's parameters: a keyword 2.11 lacks is a TypeError, as there."""

    def __init__(self, *args, **kwargs):
        signature(TORCH_2_11).bind(self, *args, **kwargs)
        with warnings.catch_warnings():  # 2.13 deprecates broadcast_buffers; 2.11 does not
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(*args, **kwargs)

    __init__.__signature__ = signature(TORCH_2_11)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("table", torch.arange(3.0), persistent=False)  # as the positional table

    def forward(self, x):
        return self.lin(x + self.table)


@pytest.mark.parametrize("names, no_sync", [(TORCH_2_13, "forward_sync_buffers"), (TORCH_2_11, "broadcast_buffers")],
                         ids=["torch-2.13", "torch-2.11"])
def test_the_keywords_chosen_for_each_torchs_ddp_bind_to_its_signature(names, no_sync):
    sig = signature(names)
    keywords = distributed.ddp_keywords(sig.parameters, distributed.Dist(0, 1, 0, CPU), bucket_mb=25.0,
                                        static_graph=False)
    assert keywords == {"device_ids": None, "gradient_as_bucket_view": True, "bucket_cap_mb": 25.0,
                        "static_graph": False, no_sync: False}
    sig.bind(None, nn.Linear(1, 1), **keywords)  # a keyword this torch lacks: TypeError
    tuned = distributed.ddp_keywords(sig.parameters, distributed.Dist(0, 1, 0, CPU), bucket_mb=4.0, static_graph=True)
    assert (tuned["bucket_cap_mb"], tuned["static_graph"]) == (4.0, True)
    sig.bind(None, nn.Linear(1, 1), **tuned)


def test_the_installed_torch_is_2_13s_ddp_and_the_helper_takes_its_path():
    assert tuple(inspect.signature(DistributedDataParallel.__init__).parameters) == TORCH_2_13
    with gpu_check.process_group(CPU) as ctx, warnings.catch_warnings():
        warnings.simplefilter("error")  # broadcast_buffers would draw 2.13's deprecation warning
        model = distributed.ddp(WithBuffer(), ctx)
        assert model.forward_sync_buffers is False and model.gradient_as_bucket_view is True
        del model  # before the group ends (Trainer.close)


@pytest.mark.parametrize("ddp_class", [DistributedDataParallel, Torch211DDP], ids=["installed", "torch-2.11"])
def test_ddp_skips_the_per_forward_buffer_sync_and_views_gradients_in_buckets_on_either_torch(monkeypatch, ddp_class):
    monkeypatch.setattr(distributed, "DistributedDataParallel", ddp_class)
    torch.manual_seed(0)
    with gpu_check.process_group(CPU) as ctx:
        model = distributed.ddp(WithBuffer(), ctx)
        assert type(model) is ddp_class
        assert model.broadcast_buffers is False and model.gradient_as_bucket_view is True
        model(torch.ones(4, 3)).sum().backward()  # a step through the reducer
        assert model.module.lin.weight.grad is not None
        del model


def test_the_trainer_hands_its_ddp_params_to_ddp(tmp_path):
    """train.ddp_bucket_mb, ddp_static_graph and grad_compression reach the DDP the trainer steps with."""
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    cfg = TrainConfig(**{**TRAIN, "ddp_bucket_mb": 0.5, "ddp_static_graph": True, "grad_compression": "fp16"})
    with gpu_check.process_group(CPU) as ctx:
        trainer = Trainer(data, ModelConfig(**MODEL), cfg, 24, ctx, StageRun(), phash="", precision=resolve(cfg.cpu_matmul, CPU), ddp=True)
        ddp = trainer.loss_model
        assert ddp.bucket_bytes_cap == int(0.5 * 2**20) and ddp.static_graph
        assert ddp._comm_hooks[0][0] is distributed.COMPRESSION_HOOKS["fp16"]
        trainer.step(trainer.epoch_order())
        trainer.close()
        del trainer, ddp
        gc.collect()  # DDP's reducer freed while the group lives: never the group's last holder


def test_the_trainer_builds_its_ddp_and_steps_on_torch_2_11s_keywords(tmp_path, monkeypatch):
    """What `make gpu-check` met on the GPU machine's torch: the Trainer's DDP in a group of one."""
    monkeypatch.setattr(distributed, "DistributedDataParallel", Torch211DDP)
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    with gpu_check.process_group(CPU) as ctx:
        trainer = Trainer(data, ModelConfig(**MODEL), TrainConfig(**TRAIN), 24, ctx, StageRun(), phash="",
                          precision=resolve("fp32", CPU), ddp=True)
        assert type(trainer.loss_model) is Torch211DDP and trainer.loss_model.broadcast_buffers is False
        trainer.step(trainer.epoch_order())
        trainer.close()
        del trainer
        gc.collect()  # DDP's reducer freed while the group lives: never the group's last holder


def test_gradients_stay_views_of_ddps_buckets_from_step_to_step(tmp_path):
    """Zeroed in place between steps (optimizer.zero_grads), not set to None: the reducer never copies a gradient
    into its bucket again, and a gradient's memory is its bucket's. The buckets are seen through a comm hook (the default all-reduce, recording them)."""
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    with gpu_check.process_group(CPU) as ctx:
        trainer = Trainer(data, ModelConfig(**MODEL), TrainConfig(**TRAIN), 24, ctx, StageRun(), phash="",
                          precision=resolve("fp32", CPU), ddp=True)
        buckets: dict[int, int] = {}  # storage pointer -> bytes, of every bucket the reducer all-reduced

        def hook(group, bucket):
            storage = bucket.buffer().untyped_storage()
            buckets[storage.data_ptr()] = storage.nbytes()
            return allreduce_hook(group, bucket)

        trainer.loss_model.register_comm_hook(None, hook)
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        seen = []
        for _ in range(3):  # DDP rebuilds its buckets once, after the first step (in the order gradients came)
            buckets.clear()
            trainer.step(trainer.epoch_order())
            assert all(p.grad is not None for p in params), "gradients dropped between steps"
            seen.append([p.grad.untyped_storage().data_ptr() for p in params])
            assert set(seen[-1]) <= set(buckets) and len(buckets) < len(params)  # each gradient inside a bucket
            assert all(float(p.grad.abs().sum()) == 0.0 for p in params)  # zeroed for the next step
        assert seen[1] == seen[2]  # the same memory, step after step
        trainer.close()
        del trainer
        gc.collect()  # DDP's reducer freed while the group lives: never the group's last holder


def test_ddps_gradients_are_zeroed_by_one_multi_tensor_call_not_one_each(tmp_path):
    """optimizer.zero_grads under DDP: one _foreach_zero_ for all the gradients (one device, one dtype); no zero_ of
    a single gradient outside it (on a GPU each would be a memset launched while the GPU idles)."""
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    with gpu_check.process_group(CPU) as ctx:
        trainer = Trainer(data, ModelConfig(**MODEL), TrainConfig(**TRAIN), 24, ctx, StageRun(), phash="",
                          precision=resolve("fp32", CPU), ddp=True)
        trainer.step(trainer.epoch_order())
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        for p in params:
            p.grad.fill_(1.0)
        with torch.profiler.profile() as prof:
            zero_grads(trainer.optimizer, trainer.loss_model)
        events = prof.events()
        assert [e.name for e in events].count("aten::_foreach_zero_") == 1
        outside = [e for e in events if e.name == "aten::zero_" and e.cpu_parent is not None
                   and e.cpu_parent.name != "aten::_foreach_zero_"]  # on a CPU, _foreach_zero_ loops over zero_
        assert not outside and not any(e.name == "aten::zero_" and e.cpu_parent is None for e in events)
        assert all(float(p.grad.abs().sum()) == 0.0 for p in params)
        trainer.close()
        del trainer
        gc.collect()  # DDP's reducer freed while the group lives: never the group's last holder
