"""The GPU path's code on a CPU: autocast through the model and both losses, the gradient scaler, prefetching.

A CPU trains in fp32 (precision.autocast_dtype); here autocast is forced to
CPU bf16 / fp16 so that every line a GPU runs under autocast runs too. What
needs CUDA itself (pinned memory, the GPU's capability) is tested at the end
and skipped without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch

from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.transformer import Transformer
from pipeline.device import distributed, precision
from pipeline.core.config import TrainConfig
from pipeline.training.loader import Prefetcher, TrainingData, collate
from pipeline.training.optimizer import build_optimizer, train_step
from stages import train
from tests.fixtures.train import MODEL, TRAIN, VOCAB, last_checkpoint, stage_args, write_corpus, write_params

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def step_gradients(data: TrainingData, chunked: bool, autocast) -> tuple[float, dict[str, torch.Tensor]]:
    """One train_step on two micro-batches from fixed weights: (summed loss, the gradient of every parameter)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    loss_model = SmoothedLoss(model, 0.1, chunked=chunked)
    optimizer = build_optimizer(model, TrainConfig(**TRAIN))
    micro = data.micro_batches([(0, 0), (1, 0)], 2, 0, CPU)
    grads = {}
    for name, p in model.named_parameters():  # keep each gradient as the optimizer sees it
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    loss = train_step(loss_model, optimizer, micro, sum(b.tokens for b, _ in micro), 0.0, distributed.Dist(0, 1, 0, CPU),
                      autocast, torch.amp.GradScaler("cpu", enabled=False))
    return float(loss), grads


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked loss", "whole logits"])
def test_a_step_under_cpu_bf16_autocast_gives_fp32_gradients_close_to_fp32s(tmp_path, chunked):
    data = TrainingData.load(*write_corpus(tmp_path))
    want_loss, want = step_gradients(data, chunked, contextlib.nullcontext())
    loss, grads = step_gradients(data, chunked, torch.autocast("cpu", dtype=torch.bfloat16))
    assert loss == pytest.approx(want_loss, rel=2e-2)
    assert grads.keys() == want.keys()
    for name, g in grads.items():
        assert g.dtype == torch.float32, name  # the parameters' dtype: Adam updates fp32 weights
        cosine = torch.nn.functional.cosine_similarity(g.flatten(), want[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_train_stage_trains_and_resumes_under_autocast(tmp_path, monkeypatch, caplog, dtype):
    """bf16 as on an H100; fp16 with the gradient scaler as on a V100 (its state is checkpointed and resumed)."""
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: dtype)
    write_corpus(tmp_path)
    with caplog.at_level(logging.INFO):
        train.main(stage_args(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4)))
    assert {torch.bfloat16: "precision: bf16 autocast", torch.float16: "precision: fp16 autocast with a gradient "
            "scaler"}[dtype] in caplog.text
    state = last_checkpoint(tmp_path)
    assert ("scaler" in state) == (dtype == torch.float16)
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train.main(stage_args(tmp_path, write_params(tmp_path / "params.yaml", max_steps=6)))
    assert "resuming from step 4" in caplog.text
    state = last_checkpoint(tmp_path)
    assert state["step"] == 6 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_the_prefetcher_builds_the_next_key_in_the_background_and_returns_what_build_returns():
    threads = {}

    def build(key: int) -> int:
        threads[key] = threading.current_thread().name
        if key == 7:
            raise ValueError("no batch 7")
        return key * 10

    prefetch = Prefetcher(build, CPU)
    assert prefetch.get(1, 2) == 10  # nothing ahead yet: built here
    assert prefetch.get(2, 3) == 20  # built ahead
    assert prefetch.get(5, 7) == 50  # not the one built ahead (3): built here
    with pytest.raises(ValueError, match="no batch 7"):
        prefetch.get(7, 8)  # the background build's error, where its value is needed
    assert threads[1] == threads[5] == threading.current_thread().name
    assert threads[2].startswith("prefetch") and threads[3].startswith("prefetch")


# --- CUDA itself ----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_batches_reach_the_gpu_through_pinned_memory_from_the_prefetch_thread(tmp_path, monkeypatch):
    data = TrainingData.load(*write_corpus(tmp_path))
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    pinned = []
    real_pin = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pinned.append(t.shape) or real_pin(t, *a))
    seen = {}

    def build(rows: tuple[int, ...]):
        seen[rows] = torch.cuda.current_device()
        return data.micro_batches([(b, 0) for b in rows], len(rows), 0, device)

    prefetch = Prefetcher(build, device)
    prefetch.get((0,), (1, 2))
    (b, _), _ = prefetch.get((1, 2), (3,))
    torch.cuda.synchronize(device)
    assert b.src.device == device and len(pinned) >= 6
    assert seen[(1, 2)] == device.index  # the background thread copies to this process's GPU, not GPU 0
    cpu = collate(data.train_src, data.train_tgt, data.train_batches[1], CPU)
    assert torch.equal(b.src.cpu(), cpu.src) and torch.equal(b.labels.cpu(), cpu.labels)


@cuda
def test_this_gpu_gets_the_precision_its_capability_allows():
    major, _ = torch.cuda.get_device_capability(0)
    expected = torch.bfloat16 if major >= 8 else torch.float16 if major >= 7 else torch.float32
    assert precision.autocast_dtype(torch.device("cuda", 0)) == expected
    if expected == torch.bfloat16:
        assert torch.cuda.is_bf16_supported()
