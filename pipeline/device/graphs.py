"""train.cuda_graphs: the compiled layers replayed as CUDA graphs, so a small step does not wait on launches.

    mode = graphs.mode(cfg.cuda_graphs)       # torch.compile's mode for compiled.compile_layers
    recorded, pool_bytes = graphs.totals(ctx.device)   # what the run recorded (metrics/train.json)

With train.cuda_graphs the encoder and decoder layers are compiled as with train.compile
(pipeline/device/compiled.py: rows and lengths dynamic, one compile per layer class), in torch.compile's
mode="reduce-overhead": inductor's CUDA-graph trees record each compiled graph once per distinct input shape and
replay it from then on (one launch for a layer's hundreds of kernels). The batch stage bounds a run's shapes
(metrics/batch.json: num_shapes; tests/test_graph_shapes.py), so the recordings are bounded too:
inductor's warning past its default of 8 shapes is lifted to that bound. The embedding, the loss and Adam stay
eager. A graph records only what runs on the device: the step reads nothing back from it (tests/training/test_step_syncs.py).

CUDA only: the train stage refuses it on a CPU (no CUDA graphs there); elsewhere (bench.gpu.check --tiny on a CPU,
a backend other than inductor in tests) the layers compile as with train.compile and nothing is recorded.
"""

from __future__ import annotations

import torch

from pipeline.device import compiled

MODE = "reduce-overhead"
MAX_SHAPES = 1024  # recordings before inductor warns: above the few hundred shapes of a WMT run


def mode(cuda_graphs: bool) -> str | None:
    """torch.compile's mode for the layers: reduce-overhead (CUDA graphs) where asked and inductor compiles."""
    if not cuda_graphs or compiled.backend() != "inductor":
        return None
    torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit = MAX_SHAPES
    return MODE


def step_begins() -> None:
    """Tell the CUDA-graph trees a training step begins: the last step's graphs (their backward run) are done with,
    so their replays may reuse the pool. Without it, each replay finds "pending, uninvoked backwards" and runs the
    slow path, copying its outputs out of the pool."""
    torch.compiler.cudagraph_mark_step_begin()


def totals(device: torch.device) -> tuple[int | None, int | None]:
    """(graphs recorded, bytes of their memory pool) by inductor's CUDA-graph trees on `device` so far; (None, None)
    off CUDA. Read from torch internals (torch._inductor.cudagraph_trees), so (None, None) where they differ."""
    if device.type != "cuda":
        return None, None
    try:
        from torch._inductor import cudagraph_trees as trees

        manager = trees.get_manager(device.index or 0, create_if_none_exists=False)
        if manager is None:
            return 0, 0
        recorded = sum(len(nodes) + sum(n.num_descendants() for n in nodes) for nodes in manager.roots.values())
        pool = sum(s["total_size"] for s in trees.get_cudagraph_segments(manager.cuda_graphs_thread_pool))
        return recorded, pool
    except (AttributeError, ImportError, KeyError, TypeError):
        return None, None
