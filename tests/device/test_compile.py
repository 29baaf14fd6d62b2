"""train.compile: compiled layers train like eager ones, keep the checkpoint format, resume, and fall back to eager.

Compiled here with backend aot_eager (the aot_eager fixture, tests/conftest.py). The fallback is made to happen for
real: an unknown backend (torch.compile refuses it) and a backend whose compiler raises (dynamo's own failure).
Shapes: over a stream of bucketed micro-batch shapes the layers build one graph per layer class, once (dynamo's
counters), and a dimension of 1 a bounded few more.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.device import compiled
from pipeline.training.loader import TrainingData
from pipeline.weights.checkpoint import load_model
from stages import average
from tests.fixtures.train import (FIRST_ID, MODEL, VOCAB, final_weights, last_checkpoint, run_stage, write_corpus,
                                  write_params)
from tests.fixtures.trainer_steps import trained_steps
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread", "aot_eager")


def test_compiled_and_eager_steps_give_the_same_losses_gradients_and_weights(tmp_path):
    data = TrainingData.load(*write_corpus(tmp_path))
    eager = trained_steps(data, False, 4)
    torch._dynamo.reset()
    comp = trained_steps(data, True, 4)
    assert comp.losses == pytest.approx(eager.losses, rel=1e-5)
    for want, got in zip(eager.grads, comp.grads):
        assert got.keys() == want.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert comp.weights.keys() == eager.weights.keys()  # no `_orig_mod.` prefix: the module is the eager one
    for name in eager.weights:
        torch.testing.assert_close(comp.weights[name], eager.weights[name], rtol=1e-4, atol=1e-6, msg=name)


def graphs() -> int:
    """Graphs dynamo has built in this test (the fixture clears its counters)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compiled_tiny() -> Transformer:
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    assert len(compiled.compile_layers(model)) == 2 * MODEL["n_layers"]
    return model


def bucketed_shapes() -> list[tuple[int, int, int]]:
    """30 distinct (rows, source length, target length) of ~64 padded tokens, rows and lengths >= 2, in a shuffled
    order as an epoch of bucketed batches comes. The first has rows = source = target length: a shape-specialising
    compile (dynamic=True's duck sizing) would make that a guard of its first graph."""
    shapes = sorted({(max(2, 64 // max(s, t)), s, t) for s in range(2, 16) for t in (s - 1, s + 1, s + 2) if t >= 2})
    assert len(shapes) >= 30 and (4, 4, 4) not in shapes
    order = np.random.default_rng(0).permutation(len(shapes))
    return [(4, 4, 4)] + [shapes[i] for i in order[:29]]


def train_on(model: Transformer, shapes: list[tuple[int, int, int]], most_graphs: int | None = None) -> None:
    """Forward and backward of `model` on a batch of each shape (padding in the first row's source); with
    `most_graphs`, fails as soon as dynamo has built more graphs than that."""
    rng = torch.Generator().manual_seed(0)
    for rows, s, t in shapes:
        src = torch.randint(FIRST_ID, VOCAB, (rows, s), generator=rng)
        src[0, -1] = 0
        tgt_in = torch.randint(FIRST_ID, VOCAB, (rows, t), generator=rng)
        model(src, tgt_in).logsumexp(-1).sum().backward()
        assert most_graphs is None or graphs() <= most_graphs, f"graph {graphs()} built at shape {(rows, s, t)}"


def test_shapes_build_one_graph_per_layer_class_once_and_a_dimension_of_1_a_few_more_that_train_as_eager():
    """Two epochs of 30 bucketed shapes: the first builds one graph for the encoder's layers and one for the
    decoder's (rows and lengths dynamic: compiled.DYNAMIC_DIMS), the second none. A compile that specialises
    on shapes (dynamic=False; dynamic=True's duck sizing) fails here on its second shape.
    Then a dimension of 1, which torch specialises (a size of 1 may broadcast), so it has graphs of its own: rows = 1
    (a step's last rows split over the GPUs) one more per layer class, a target length of 1 (an empty line:
    validation only, training drops empty pairs) one more for the decoder's layers (a source length of 1: one
    more each, measured but not run here, ~3 s a graph). Built once, whatever the other dimensions: at most one
    graph per layer class and combination of dimensions equal to 1, never one per shape."""
    model, shapes = compiled_tiny(), bucketed_shapes()
    train_on(model, shapes, most_graphs=2)
    assert graphs() == 2
    train_on(model, shapes[::-1])
    assert graphs() == 2  # the second epoch compiled nothing
    train_on(model, [(4, 5, 6)])
    assert graphs() == 2
    ones = [(1, 5, 6), (1, 3, 2), (1, 8, 9), (3, 4, 1), (5, 2, 1)]
    train_on(model, ones)
    assert graphs() <= 2 + 2 + 1  # rows 1: encoder and decoder; target length 1: decoder
    built = graphs()
    train_on(model, ones[::-1] + [(6, 7, 3), (1, 6, 4), (7, 3, 1)])
    assert graphs() == built  # built once
    src, tgt_in = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 8, 9]])  # one row, through its own graphs
    got = model(src, tgt_in)
    compiled.uncompile([*model.encoder, *model.decoder])
    torch.testing.assert_close(got, model(src, tgt_in), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_run_writes_eager_checkpoints_resumes_and_switching_compile_does_not_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    write_corpus(tmp_path)
    keys = dict(max_steps=4, checkpoint_every=2, eval_every=2)
    metrics = run_stage(tmp_path, write_params(tmp_path / "p.yaml", compile=True, **keys))
    assert metrics["steps"] == 4
    assert "layers compiled" in caplog.text and "training eager instead" not in caplog.text
    # Compiling is reported apart: the steps' graphs (one per layer class, whatever their batches' shapes) and
    # their seconds, which the rate leaves out (validation's own graphs are neither).
    assert metrics["compile_graphs"] == 2 and 0 < metrics["compile_seconds"] < metrics["step_seconds"]
    assert metrics["tokens_per_second"] == pytest.approx(
        metrics["train_tokens"] / (metrics["step_seconds"] - metrics["compile_seconds"]))
    state = last_checkpoint(tmp_path)
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


def test_a_compile_failure_falls_back_to_eager_with_one_warning_and_eager_weights(tmp_path, caplog, monkeypatch):
    """Each way to fail, against one eager run: torch.compile refuses the backend (no_such_backend), and the
    compiler fails on the first step (failing_for_tests)."""
    if "failing_for_tests" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(failing_compiler, name="failing_for_tests")
    caplog.set_level(logging.INFO)
    keys = dict(max_steps=4, checkpoint_every=2, eval_every=2, model={"dropout": 0.1})
    eager = tmp_path / "eager"
    write_corpus(eager)
    assert run_stage(eager, write_params(eager / "p.yaml", compile=False, **keys))["steps"] == 4
    want = final_weights(eager)
    for backend in ("no_such_backend", "failing_for_tests"):
        root = tmp_path / backend
        write_corpus(root)
        monkeypatch.setenv(compiled.BACKEND_ENV, backend)
        caplog.clear()
        assert run_stage(root, write_params(root / "p.yaml", compile=True, **keys))["steps"] == 4
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "train.compile" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert "training eager instead" in warnings[0].getMessage() and backend in warnings[0].getMessage()
        got = final_weights(root)
        for name in want:  # the failed step was repeated eager, dropout masks and all
            assert torch.equal(got[name], want[name]), (backend, name)
