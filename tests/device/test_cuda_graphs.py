"""train.cuda_graphs (pipeline/device/graphs.py) on a CPU: what a CPU can show of a CUDA-only setting.

A CUDA graph replays one recorded shape: the stream of micro-batches must come in a bounded set of shapes, the one
the batch stage counts (metrics/batch.json: num_shapes), each recorded once. The step's freedom from host syncs is
tests/training/test_step_syncs.py's; the recording itself needs a GPU (make gpu-check, its "graphs" line).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bench.harness import gpu as gpu_setup
from pipeline.core.config import ParamsError
from pipeline.core.tracking import StageRun
from pipeline.device import compiled, distributed, graphs
from pipeline.device.precision import resolve
from pipeline.training.trainer import Trainer
from stages import train
from tests.fixtures.train import stage_args, write_corpus, write_params

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_shapes_fed_to_the_model_over_an_epoch_are_the_batch_stages_num_shapes(tmp_path):
    """The base preset's batching (length_bucket_step 1.1) on a fresh WMT-like corpus: every micro-batch of an
    epoch, through the Trainer's own prefetch and collate, has one of the shapes batch.json counts, and all of them
    occur."""
    s = gpu_setup.preset("base", CPU, tiny=True)
    assert s.batch_cfg.length_bucket_step > 1  # padded lengths on a grid: the bound under test
    data = gpu_setup.stream(s, seed=7, pairs=600, directory=tmp_path)
    stats = json.loads((tmp_path / "batch.json").read_text())
    t = Trainer(data, s.model_cfg, s.train_cfg, s.max_tokens, distributed.Dist(0, 1, 0, CPU), StageRun(), phash="",
                precision=resolve(s.train_cfg.cpu_matmul, CPU))
    seen = []  # (rows, source length, target length) of each micro-batch, as the layers receive it
    t.model.encoder[0].register_forward_pre_hook(lambda layer, args: seen.append(tuple(args[0].shape[:2])))
    t.model.decoder[0].register_forward_pre_hook(lambda layer, args: seen.append(seen.pop() + (args[0].shape[1],)))
    steps = len(data.train_batches) // s.batches_per_step
    for _ in range(steps):
        t.step(t.epoch_order())
    assert len(seen) == steps * s.batches_per_step  # one micro-batch a stored batch on a CPU
    assert len(set(seen)) == stats["num_shapes"] < len(seen), (len(set(seen)), stats)


def test_cuda_graphs_on_a_machine_without_cuda_is_refused_naming_the_key(tmp_path):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", cuda_graphs=True)
    with pytest.raises(ParamsError, match=r"train\.cuda_graphs = true: CUDA graphs need a CUDA GPU"):
        train.main(stage_args(tmp_path, params))
    assert not (tmp_path / "checkpoints").exists()  # refused before any work


def test_the_layers_compile_in_reduce_overhead_mode_with_inductor_only(monkeypatch):
    monkeypatch.delenv(compiled.BACKEND_ENV, raising=False)
    assert graphs.mode(True) == "reduce-overhead" and graphs.mode(False) is None
    assert torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit >= graphs.MAX_SHAPES
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")  # a backend without modes: compiled as train.compile
    assert graphs.mode(True) is None
    assert graphs.totals(CPU) == (None, None)


def test_each_training_step_tells_the_cuda_graph_trees_a_new_step_begins(monkeypatch, tmp_path):
    """Without cudagraph_mark_step_begin, every replay finds the last step's backward pending and runs the slow
    path (seen on an H200: "Unable to hit fast path of CUDAGraphs because of pending, uninvoked backwards")."""
    calls = []
    monkeypatch.setattr(graphs, "step_begins", lambda: calls.append(1))
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")
    s = gpu_setup.preset("base", CPU, tiny=True)
    data = gpu_setup.stream(s, seed=7, pairs=200, directory=tmp_path)
    cfg = replace(s.train_cfg, cuda_graphs=True)  # on a CPU the layers compile as train.compile (no recording)
    t = Trainer(data, s.model_cfg, cfg, s.max_tokens, distributed.Dist(0, 1, 0, CPU), StageRun(), phash="",
                precision=resolve(cfg.cpu_matmul, CPU))
    assert t.compiled
    for _ in range(3):
        t.step(t.epoch_order())
    t.close()
    assert len(calls) == 3
