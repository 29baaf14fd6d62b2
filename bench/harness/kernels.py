"""What ran inside gpu-check's steps: the attention kernels (profiler kernel names), dynamo's graphs, graph breaks
and recompiles, and host syncs (bench/gpu/check.py).

    kinds = attention_kernels(names)   # {"flash": 48, "efficient": 96, ...} from CUDA kernel names
    with profiled(device) as names: step()     # the CUDA kernels one step ran (None off CUDA)
    with Dynamo() as d: ...; d.graphs, d.graph_breaks, d.recompiles
    with no_host_syncs(device) as seen: steps()  # torch.cuda.set_sync_debug_mode("warn") on CUDA; seen.syncs
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from pipeline.device import compiled

ATTENTION = ("cudnn", "flash", "efficient", "math")
MATH_OP = "aten::_scaled_dot_product_attention_math"  # the math backend: composite ops, no kernel of its own


def attention_kernel(name: str) -> str | None:
    """Which scaled_dot_product_attention backend a CUDA kernel named `name` belongs to, or None.

    cudnn: cuDNN's fused attention ("cudnn_generated_fort_native_sdpa_sm90_flash_..." names flash too, so first);
    flash: "pytorch_flash::flash_fwd_kernel", "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", ...; efficient:
    the memory-efficient (xformers' CUTLASS) kernels, "fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "fmha_cutlassB_...",
    "mem_efficient"; math: the aten op "aten::_scaled_dot_product_attention_math" (profiled() adds the CPU ops
    naming a backend: math runs no kernel of its own, and a softmax kernel may be the loss's, whose fused chunk
    inductor names after the softmax it computes).
    """
    n = name.lower()
    if "cudnn" in n:
        return "cudnn"
    if "flash" in n:
        return "flash"
    if "fmha" in n or "mem_eff" in n or "efficient_attention" in n:
        return "efficient"
    if "attention_math" in n:
        return "math"
    return None


def attention_kernels(names: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Calls per backend over (kernel name, calls) pairs, backends that ran only."""
    found: Counter[str] = Counter()
    for name, calls in names:
        if kind := attention_kernel(name):
            found[kind] += calls
    return {kind: found[kind] for kind in ATTENTION if found[kind]}


@contextlib.contextmanager
def profiled(device: torch.device) -> Iterator[list[tuple[str, int]] | None]:
    """The block under torch.profiler on CUDA: the list yielded is filled, on exit, with (kernel name, calls) of
    every CUDA kernel the block ran, and of the math attention's aten op (MATH_OP, which has no kernel of its
    own). None off CUDA (kernel names are CUDA-only)."""
    if device.type != "cuda":
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    names: list[tuple[str, int]] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield names
        torch.cuda.synchronize(device)
    names += [(e.key, e.count) for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CUDA or e.key == MATH_OP]


class Dynamo:
    """What dynamo did inside a block: graphs compiled, graph breaks, and the reasons of each recompile (the
    train stage's own record of them: pipeline/device/compiled.py watch)."""

    def __init__(self):
        self.graphs = self.graph_breaks = 0
        self.recompiles: list[str] = []

    def __enter__(self) -> Dynamo:
        self._start = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        self._watch = compiled.watch()
        self.recompiles = self._watch.__enter__().reasons
        return self

    def __exit__(self, *exc) -> None:
        self._watch.__exit__(*exc)
        self.graphs = counters["stats"]["unique_graphs"] - self._start[0]
        self.graph_breaks = sum(counters["graph_break"].values()) - self._start[1]

    def line(self) -> str:
        said = f"dynamo: {self.graphs} graph(s), {self.graph_breaks} graph break(s), {len(self.recompiles)} recompile(s)"
        return said + (f" ({'; '.join(r[:200] for r in self.recompiles[:3])})" if self.recompiles else "")


@dataclass
class SyncCheck:
    """What no_host_syncs saw: whether it watched (CUDA only), and each synchronising call's warning."""

    checked: bool = False
    syncs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def no_host_syncs(device: torch.device, on: bool = True) -> Iterator[SyncCheck]:
    """The block with torch.cuda.set_sync_debug_mode("warn") on CUDA (where `on`): every synchronising call is
    recorded (SyncCheck.syncs), so the steps still run whole and their timing stands; the caller fails the line
    where any was seen."""
    seen = SyncCheck()
    if device.type != "cuda" or not on:
        yield seen
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    seen.checked = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
    finally:
        torch.cuda.set_sync_debug_mode(before)
    seen.syncs = [" ".join(str(w.message).split())[:200] for w in caught if "synchroniz" in str(w.message)]
