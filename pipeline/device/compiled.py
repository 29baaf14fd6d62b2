"""train.compile: the encoder and decoder layers, or the whole step, compiled with torch.compile; eager if it fails.

    layers = compile_layers(model)      # train.compile_scope = layers: in place; [] when the backend cannot even be set up (warned)
    uncompile(layers)                   # back to eager (after a compile failure: fallback())
    forward = compile_step(loss_model)  # train.compile_scope = step: the loss model's whole forward, one graph

The whole step (compile_step, train.compile_scope = step): the loss model's forward (embedding, every layer,
the projection and the loss over the batch's positions, padding left out: model/loss.py SmoothedLoss(padded))
is one graph, and AOT autograd builds the backward with it, so forward, loss and backward are compiled
together; the module stays the eager one (its state_dict, DDP's no_sync), the compiled callable is apart.
Its inputs are the batch's tensors alone (src, tgt_in, labels: rows and lengths marked dynamic), no count of
real tokens, so one graph serves the run's shapes (a dimension of 1 aside, as below). Under DDP the callable
compiles the DDP module, and dynamo splits the graph at DDP's gradient buckets so that the all-reduce still
overlaps the backward. Adam stays the fused one (one multi-tensor kernel per device and dtype, its step count
on the device: pipeline/training/optimizer.py), outside the graph.
What recompiled and why: watch() (the trainer's metrics/train.json: compile_recompiles and their reasons).
dynamo's recompile limit is the run's (limited(): train.compile_recompile_limit); a hit, where dynamo would run the
function eager from then on with nothing but a log line, turns the run eager in the open (fallback: one warning;
train.json: compile_fallback, compile_fallback_step, compile_eager_steps) or stops it (train.compile_on_limit).
The caches: keep_cache() puts inductor's on disk beside the checkpoints, so a resumed run loads what the run
before built (metrics/train.json: compile_cache_hits, compile_cache_misses: cache_counts()).

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
Shapes: a run's micro-batches come in many shapes ([rows, source length] and
[rows, target length], one per length bucket and row count), so each layer's
batch and length dimensions are marked dynamic (DYNAMIC_DIMS, on every call:
torch._dynamo.maybe_mark_dynamic) and the rest stays static (d_model, the
mask's broadcast dimensions of 1). One graph per layer class (the encoder's
layers share one, the decoder's another) then serves every shape with at least
2 rows and lengths of at least 2; no graph is built per step. Not compiling with
dynamic=True: that makes every dimension duck-sized, and the first batch's
coincidences (rows = source length, source length = target length) became
guards, so the next shape without them built a second graph (tests/device/test_compile.py).
A dimension of exactly 1 is specialised by torch (a size-1 dimension may
broadcast): a micro-batch of 1 row (a step's last rows split over the GPUs),
a length of 1 (an empty validation line), is a graph of its own, built once:
at most one per layer class and combination of such dimensions.
Validation (eval mode, no_grad) builds its own graphs, once.
torch.compile compiles on a layer's first call with a new kind of shape or mode;
a failure there (no C++ compiler, an inductor bug) raises
torch._dynamo.exc.TorchDynamoException (COMPILE_FAILURES), and the trainer
repeats the step eager after fallback(): one warning, the rest of the run eager.

    seconds, graphs = compile_totals()  # this process's compiling so far: seconds (dynamo's and the backend's,
                                        # the lazily compiled backward's too), graphs dynamo built

The clock takes dynamo's compile callbacks as the installed torch calls them (one CallbackArgs on torch 2.13,
none on older torch: callback_arguments); a torch that calls them otherwise stops compile_layers with
CompileClockError, rather than failing inside every compile and passing for a compile failure.
The trainer counts the compiling inside its steps apart from the steps' time
(metrics/train.json: compile_seconds, compile_graphs; tokens_per_second and mfu
are over step_seconds less compile_seconds).

$TRANSFORMER_COMPILE_BACKEND picks torch.compile's backend (default inductor);
tests use aot_eager (dynamo and AOT autograd without inductor's C++ build) or
an invalid name (a real failure).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch._dynamo.callback
from torch import nn

from model.transformer import DecoderLayer, EncoderLayer, Transformer
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

BACKEND_ENV = "TRANSFORMER_COMPILE_BACKEND"
COMPILE_FAILURES: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)


# The dynamic dimensions of each layer's positional inputs: rows and lengths. EncoderLayer(x [B, S, D],
# src_mask [B, 1, 1, S]); DecoderLayer(y [B, T, D], memory [B, S, D], src_mask [B, 1, 1, S]).
DYNAMIC_DIMS: dict[type[nn.Module], tuple[tuple[int, ...], ...]] = {
    EncoderLayer: ((0, 1), (0, 3)),
    DecoderLayer: ((0, 1), (0, 1), (0, 3)),
}


# The loss model's inputs (src [B, S], tgt_in [B, T], labels [B, T]): rows and lengths dynamic (compile_step).
STEP_DIMS: tuple[tuple[int, ...], ...] = ((0, 1), (0, 1), (0, 1))


def backend() -> str:
    return os.environ.get(BACKEND_ENV, "").strip() or "inductor"


def compile_layers(model: Transformer, mode: str | None = None) -> list[nn.Module]:
    """Compile every encoder and decoder layer of `model` in place, in torch.compile's `mode` (train.cuda_graphs:
    pipeline/device/graphs.py); the layers compiled ([] and a warning on failure)."""
    layers = [*model.encoder, *model.decoder]
    _clock.install()
    try:
        for layer in layers:
            # An instance attribute shadowing the class's forward: nn.Module.__call__ runs it, hooks and all.
            layer.forward = marked(torch.compile(layer.forward, backend=backend(), mode=mode), DYNAMIC_DIMS[type(layer)])
    except COMPILE_FAILURES as e:
        fallback(layers, e)
        return []
    log.info("train.compile: %d encoder and decoder layers compiled (torch.compile, backend %s%s)", len(layers),
             backend(), f", mode {mode}" if mode else "")
    return layers


def compile_step(loss_model: nn.Module, mode: str | None = None):
    """The loss model's whole forward as one torch.compile (its backward built with it by AOT autograd), in
    torch.compile's `mode`: a callable taking the loss model's arguments. The module itself stays eager."""
    _clock.install()
    forward = marked(torch.compile(loss_model, backend=backend(), mode=mode), STEP_DIMS)
    log.info("train.compile: the whole step compiled (forward, loss and backward; torch.compile, backend %s%s)",
             backend(), f", mode {mode}" if mode else "")
    return forward


CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's on-disk caches (compiled graphs, AOT autograd's, Triton's kernels)


def keep_cache(directory: Path) -> str:
    """Inductor's caches kept in `directory` (the train stage: data/compile_cache, beside the checkpoints), so a
    resumed run, or the next run of the same shapes, loads its graphs instead of building them again; a
    $TORCHINDUCTOR_CACHE_DIR of the user's stays (torch sets it to its default, a per-user directory under /tmp,
    when it is imported: that one is replaced). Returns the directory used. Dynamo still traces in each process
    (seconds); what the cache spares is the backend's build (inductor: most of a compile's time)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(CACHE_ENV, "").strip()
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_ENV] = str(directory.resolve())
    return os.environ[CACHE_ENV]


def cache_counts() -> tuple[int, int]:
    """(hits, misses) of the compile caches in this process so far: inductor's FX graph cache and AOT autograd's
    (torch._dynamo's counters; 0, 0 with a backend that caches nothing, aot_eager)."""
    counters = torch._dynamo.utils.counters
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return int(hits), int(misses)


class Recompiles:
    """The recompiles dynamo did inside a `with` block and their reasons (watch())."""

    def __init__(self):
        self.reasons: list[str] = []


@contextlib.contextmanager
def watch() -> Iterator[Recompiles]:
    """Record every recompile inside the block with its reasons (the guards that failed), read where dynamo decides
    to recompile (torch._dynamo.convert_frame's get_and_maybe_log_recompilation_reasons; on a torch without that
    hook, nothing is recorded)."""
    from torch._dynamo import convert_frame

    seen, original = Recompiles(), getattr(convert_frame, "get_and_maybe_log_recompilation_reasons", None)
    if original is None:
        yield seen
        return

    def reasons(*args, **kwargs):
        found = original(*args, **kwargs)
        seen.reasons += [" ".join(str(r).split()) for r in found] or ["(no reason given)"]
        return found

    convert_frame.get_and_maybe_log_recompilation_reasons = reasons
    try:
        yield seen
    finally:
        convert_frame.get_and_maybe_log_recompilation_reasons = original


def marked(forward, dims: tuple[tuple[int, ...], ...]):
    """`forward` with the dimensions `dims` of its positional tensor arguments marked dynamic before each call
    (a new tensor each call; a few microseconds). maybe_: a dimension torch specialises anyway (a size of 1)
    is no error."""
    def forward_marked(*args, **kwargs):
        for arg, arg_dims in zip(args, dims):
            torch._dynamo.maybe_mark_dynamic(arg, arg_dims)
        return forward(*args, **kwargs)

    return forward_marked


RecompileLimitHit = torch._dynamo.exc.FailOnRecompileLimitHit


class RecompileLimitError(PipelineError):
    """A compiled run passed dynamo's recompile limit and train.compile_on_limit = fail asked to stop there."""


@contextlib.contextmanager
def limited(limit: int) -> Iterator[None]:
    """dynamo's recompile limit (graphs per function, train.compile_recompile_limit) inside the block, and a hit
    raised (RecompileLimitHit) where dynamo would otherwise run that function eager from then on, silently."""
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        yield


def limit_reason(limit: int, reasons: list[str]) -> str:
    """One line saying why the compiled steps stopped: the limit and the last guard that failed (watch())."""
    return f"dynamo's recompile limit ({limit} graphs) hit; last guard failed: {reasons[-1] if reasons else '(none given)'}"


class CompileClockError(PipelineError):
    """The installed torch calls dynamo's compile callbacks in a way CompileClock does not know."""


def callback_arguments(handler: object) -> int:
    """Arguments dynamo's `handler` passes each compile callback: what its run_start_callbacks and
    run_end_callbacks take and hand on (torch 2.13, torch/_dynamo/callback.py: one, a CallbackArgs; older torch:
    none). Anything else raises CompileClockError, before any compiling: a callback that dynamo calls wrongly
    raises inside the compile, where it would pass for a compile failure (eager, with a misleading warning)."""
    counts = {len(inspect.signature(getattr(handler, f"run_{when}_callbacks")).parameters) for when in ("start", "end")}
    if len(counts) != 1 or not counts <= {0, 1}:
        raise CompileClockError(
            f"train.compile: this torch ({torch.__version__}) calls dynamo's compile callbacks with "
            f"{' and '.join(map(str, sorted(counts)))} argument(s) (torch._dynamo.callback: run_start_callbacks, "
            "run_end_callbacks); CompileClock (pipeline/device/compiled.py) takes none or one: teach it this "
            "torch's callbacks, or set train.compile false")
    return counts.pop()


class CompileClock:
    """Seconds spent compiling in this process: from each compile's start to its end (dynamo's callbacks, which
    enclose the tracing, the backend's build and a backward compiled lazily on its first call; nested compiles
    count once). The callbacks take dynamo's one CallbackArgs (torch 2.13) or nothing (older torch)."""

    def __init__(self):
        self.seconds, self.started, self.lock = 0.0, None, threading.Lock()

    def install(self) -> None:
        """Register the callbacks, again after a torch._dynamo.reset() (which drops them); raises
        CompileClockError where the installed torch calls them with other arguments (callback_arguments)."""
        handler = torch._dynamo.callback.callback_handler
        callback_arguments(handler)
        with self.lock:
            if self.start not in handler.start_callbacks:
                handler.register_start_callback(self.start)
            if self.end not in handler.end_callbacks:
                handler.register_end_callback(self.end)

    def start(self, _args: object = None) -> None:
        self.started = time.perf_counter()

    def end(self, _args: object = None) -> None:
        if self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.started = None


_clock = CompileClock()


def compile_totals() -> tuple[float, int]:
    """(seconds compiling, graphs dynamo built) in this process so far: the trainer takes their growth over a step.
    The graphs are dynamo's own count (torch._dynamo.reset() keeps it)."""
    _clock.install()  # a reset since compile_layers dropped the callbacks
    return _clock.seconds, int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def uncompile(layers: list[nn.Module]) -> None:
    """Put the layers' own (eager) forward back."""
    for layer in layers:
        layer.__dict__.pop("forward", None)


def fallback(layers: list[nn.Module], error: BaseException | str) -> str:
    """Back to eager after a compile failure (or a recompile limit hit: its reason, a string), with one warning
    saying why; returns the reason."""
    uncompile(layers)
    if isinstance(error, str):
        log.warning("train.compile: %s; training eager from here (train.compile_on_limit=fail stops instead)", error)
        return error
    reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    log.warning("train.compile: torch.compile (backend %s) failed, training eager instead: %s", backend(), reason)
    return reason
