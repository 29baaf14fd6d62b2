"""compiled.CompileClock against dynamo's real compile callbacks: it counts compiling with the installed torch's
callback arguments (one, torch 2.13) and with older torch's (none), and a torch that calls them otherwise stops the
run with CompileClockError instead of every compile failing and the run training eager."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch._dynamo.callback as dynamo_callback

from model.config import ModelConfig
from pipeline.core.config import TrainConfig
from pipeline.core.tracking import StageRun
from pipeline.device import compiled, distributed
from pipeline.device.precision import resolve
from pipeline.training.loader import TrainingData
from pipeline.training.trainer import Trainer
from tests.fixtures.train import MODEL, TRAIN, write_corpus

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class ArgumentsHandler(dynamo_callback.CompilationCallbackHandler):
    """dynamo's callback handler calling each callback with `arguments` arguments (0: older torch's convention)."""

    def __init__(self, arguments: int):
        super().__init__()
        self.arguments = arguments
        run = {0: lambda callbacks: (lambda: [c() for c in callbacks]),
               2: lambda callbacks: (lambda args, extra: [c(args, extra) for c in callbacks])}[arguments]
        self.run_start_callbacks, self.run_end_callbacks = run(self.start_callbacks), run(self.end_callbacks)

    @contextlib.contextmanager
    def install_callbacks(self, trigger, compile_id):
        args = (dynamo_callback.CallbackArgs(trigger, compile_id), None)[: self.arguments]
        self.run_start_callbacks(*args)
        try:
            yield
        finally:
            self.run_end_callbacks(*args)


def use_handler(monkeypatch, handler) -> None:
    """Make `handler` the one dynamo's compiles run (torch._dynamo.callback_handler, read at each compile)."""
    monkeypatch.setattr(dynamo_callback, "callback_handler", handler)
    monkeypatch.setattr(torch._dynamo, "callback_handler", handler)


def compile_once() -> torch.Tensor:
    """Compile and run a tiny function with the test backend: dynamo's start and end callbacks run once."""
    return torch.compile(lambda x: torch.sin(x) * 2 + 1, backend=compiled.backend())(torch.ones(4))


@pytest.mark.parametrize("arguments", [1, 0], ids=["installed-torch-one-argument", "older-torch-no-argument"])
def test_the_clock_counts_compiling_through_dynamos_callbacks(monkeypatch, arguments):
    handler = dynamo_callback.callback_handler if arguments == 1 else ArgumentsHandler(0)
    use_handler(monkeypatch, handler)
    clock = compiled.CompileClock()
    clock.install()
    try:
        torch.testing.assert_close(compile_once(), torch.sin(torch.ones(4)) * 2 + 1)  # compiled, no failure
    finally:
        handler.remove_start_callback(clock.start)
        handler.remove_end_callback(clock.end)
    assert clock.seconds > 0 and clock.started is None
    assert compiled.callback_arguments(handler) == arguments


def test_callbacks_called_with_arguments_the_clock_does_not_take_stop_the_run_instead_of_training_eager(
        tmp_path, monkeypatch, caplog):
    use_handler(monkeypatch, ArgumentsHandler(2))
    data = TrainingData.load(*write_corpus(tmp_path, n_train=8, n_valid=4))
    cfg = TrainConfig(**{**TRAIN, "compile": True})
    with caplog.at_level(logging.WARNING), pytest.raises(compiled.CompileClockError, match="2 argument"):
        trainer = Trainer(data, ModelConfig(**MODEL), cfg, 24, distributed.Dist(0, 1, 0, CPU), StageRun(), phash="",
                          precision=resolve(cfg.cpu_matmul, CPU))
        trainer.step(trainer.epoch_order())
    assert "training eager instead" not in caplog.text
