"""train.compile: the encoder and decoder layers compiled with torch.compile, eager if compiling fails.

    layers = compile_layers(model)      # in place; [] when the backend cannot even be set up (warned)
    uncompile(layers)                   # back to eager (after a compile failure: fallback())

What is compiled: each EncoderLayer and DecoderLayer's forward (attention,
feed-forward, dropout, residuals and LayerNorms: the ~1000 small kernels of an
eager step), in place on the module (dynamic shapes: batches differ in length).
Not compiled: the embedding, the loss, DDP and Adam. So:
  - the model's parameters, their names and state_dict are its own (no
    `_orig_mod.` prefix of a torch.compile wrapper): a checkpoint is the same
    file whether trained compiled or not, and average / translate load it as is;
  - DDP wraps the same eager SmoothedLoss: no_sync() during gradient
    accumulation and its bucketed all-reduce work as in eager, and since each
    layer's backward is its own autograd node, gradients become ready layer by
    layer, so the all-reduce still overlaps the backward (one whole-model graph
    would hand DDP every gradient at once, at the end);
  - autocast is the trainer's, around the call: the compiled layers follow it.
torch.compile compiles on a layer's first call (and again for a new mode, e.g.
eval for validation); a failure there (no C++ compiler, an inductor bug) raises
torch._dynamo.exc.TorchDynamoException (COMPILE_FAILURES), and the trainer
repeats the step eager after fallback(): one warning, the rest of the run eager.

$TRANSFORMER_COMPILE_BACKEND picks torch.compile's backend (default inductor);
tests use aot_eager (dynamo and AOT autograd without inductor's C++ build) or
an invalid name (a real failure).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from model.transformer import Transformer

log = logging.getLogger(__name__)

BACKEND_ENV = "TRANSFORMER_COMPILE_BACKEND"
COMPILE_FAILURES: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)


def backend() -> str:
    return os.environ.get(BACKEND_ENV, "").strip() or "inductor"


def compile_layers(model: Transformer) -> list[nn.Module]:
    """Compile every encoder and decoder layer of `model` in place; the layers compiled ([] and a warning on failure)."""
    layers = [*model.encoder, *model.decoder]
    try:
        for layer in layers:
            # An instance attribute shadowing the class's forward: nn.Module.__call__ runs it, hooks and all.
            layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend())
    except COMPILE_FAILURES as e:
        fallback(layers, e)
        return []
    log.info("train.compile: %d encoder and decoder layers compiled (torch.compile, backend %s)", len(layers), backend())
    return layers


def uncompile(layers: list[nn.Module]) -> None:
    """Put the layers' own (eager) forward back."""
    for layer in layers:
        layer.__dict__.pop("forward", None)


def fallback(layers: list[nn.Module], error: BaseException) -> None:
    """Back to eager after a compile failure, with one warning saying why."""
    uncompile(layers)
    reason = " ".join(str(error).split())[:300] or type(error).__name__
    log.warning("train.compile: torch.compile (backend %s) failed, training eager instead: %s: %s",
                backend(), type(error).__name__, reason)
