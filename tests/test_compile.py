"""train.compile: compiled layers train like eager ones, keep the checkpoint format, resume, and fall back to eager.

Compiled here with backend aot_eager ($TRANSFORMER_COMPILE_BACKEND, pipeline/training/compiled.py): dynamo
captures the layers and AOT autograd builds their forward and backward graphs, as with inductor, but runs them
with aten kernels instead of building C++ (minutes on a shared 2-core CPU). The fallback is made to happen for
real: an unknown backend (torch.compile refuses it) and a backend whose compiler raises (dynamo's own failure).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core.config import TrainConfig
from pipeline.core.tracking import StageRun
from pipeline.training import compiled, distributed
from pipeline.training.loader import TrainingData
from pipeline.training.trainer import Trainer
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint, load_model
from stages import average, train
from tests.train_fixtures import MODEL, TRAIN, VOCAB, stage_args, write_corpus, write_params

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch, tmp_path):
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def trained_steps(data: TrainingData, compile_: bool, steps: int) -> tuple[list[float], list[dict], dict]:
    """`steps` steps of the trainer's own step: each step's loss, each step's gradients, the final weights."""
    cfg = TrainConfig(**{**TRAIN, "compile": compile_})
    trainer = Trainer(data, ModelConfig(**MODEL), cfg, 24, distributed.Dist(0, 1, 0, CPU), StageRun(), phash="")
    assert bool(trainer.compiled) == compile_
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    grads: dict[str, torch.Tensor] = {}
    for name, p in trainer.model.named_parameters():  # each gradient as Adam sees it
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    losses, step_grads = [], []
    for _ in range(steps):
        loss, _, _ = trainer.step(trainer.epoch_order())
        losses.append(float(loss))
        step_grads.append(dict(grads))
    assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs) == compile_  # compiled ran, or none
    return losses, step_grads, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_compiled_and_eager_steps_give_the_same_losses_gradients_and_weights(tmp_path):
    data = TrainingData.load(*write_corpus(tmp_path))
    eager = trained_steps(data, False, 4)
    torch._dynamo.reset()
    comp = trained_steps(data, True, 4)
    assert comp[0] == pytest.approx(eager[0], rel=1e-5)
    for want, got in zip(eager[1], comp[1]):
        assert got.keys() == want.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert comp[2].keys() == eager[2].keys()  # no `_orig_mod.` prefix: the module is the eager one
    for name in eager[2]:
        torch.testing.assert_close(comp[2][name], eager[2][name], rtol=1e-4, atol=1e-6, msg=name)


def run_stage(root: Path, params: Path) -> dict:
    train.main(stage_args(root, params))
    return json.loads((root / "metrics" / "train.json").read_text())


def test_a_compiled_run_writes_eager_checkpoints_resumes_and_switching_compile_does_not_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    write_corpus(tmp_path)
    keys = dict(max_steps=4, checkpoint_every=2, eval_every=2)
    assert run_stage(tmp_path, write_params(tmp_path / "p.yaml", compile=True, **keys))["steps"] == 4
    assert "layers compiled" in caplog.text and "training eager instead" not in caplog.text
    state = load_checkpoint(complete_checkpoints(tmp_path / "checkpoints")[-1])
    eager_keys = set(load_model_keys())
    assert set(state["model"]) == eager_keys  # the checkpoint format of an eager run
    caplog.clear()
    run_stage(tmp_path, write_params(tmp_path / "p.yaml", compile=True, **{**keys, "max_steps": 6}))
    assert "resuming from step 4" in caplog.text
    caplog.clear()
    metrics = run_stage(tmp_path, write_params(tmp_path / "p.yaml", compile=False, **{**keys, "max_steps": 8}))
    assert "resuming from step 6" in caplog.text and metrics["steps"] == 8  # compile shapes no weights
    (tmp_path / "average.yaml").write_text("average:\n  last_n: 2\n")
    average.main(["--checkpoints", str(tmp_path / "checkpoints"), "--out", str(tmp_path / "model"),
                  "--params", str(tmp_path / "average.yaml")])
    model = load_model(tmp_path / "model", CPU)  # the averaged compiled-and-eager checkpoints load as a model
    assert set(model.state_dict()) == eager_keys


def load_model_keys() -> list[str]:
    return list(Transformer(ModelConfig(**MODEL), VOCAB).state_dict())


def failing_compiler(gm, example_inputs):
    raise RuntimeError("injected compiler failure")


@pytest.mark.parametrize("backend", ["no_such_backend", "failing_for_tests"],
                         ids=["torch.compile refuses the backend", "the compiler fails on the first step"])
def test_a_compile_failure_falls_back_to_eager_with_one_warning_and_eager_weights(tmp_path, caplog, monkeypatch,
                                                                                   backend):
    if backend == "failing_for_tests" and backend not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(failing_compiler, name=backend)
    caplog.set_level(logging.INFO)
    eager_root, compiled_root = tmp_path / "eager", tmp_path / "compiled"
    keys = dict(max_steps=4, checkpoint_every=2, eval_every=2, model={"dropout": 0.1})
    for root, compile_ in ((eager_root, False), (compiled_root, True)):
        write_corpus(root)
        monkeypatch.setenv(compiled.BACKEND_ENV, backend)
        caplog.clear()
        assert run_stage(root, write_params(root / "p.yaml", compile=compile_, **keys))["steps"] == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "train.compile" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "training eager instead" in warnings[0].getMessage() and backend in warnings[0].getMessage()
    want = load_checkpoint(complete_checkpoints(eager_root / "checkpoints")[-1])["model"]
    got = load_checkpoint(complete_checkpoints(compiled_root / "checkpoints")[-1])["model"]
    for name in want:  # the failed step was repeated eager, dropout masks and all
        assert torch.equal(got[name], want[name]), name

