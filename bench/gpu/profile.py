"""Where the eager GPU step waits: a profiler read of the train stage's Trainer.step, per preset.

    python -m bench.gpu.profile [--models base big] [--steps 6] [--trace DIR]

Per preset (gpu-check's setting, bench/harness/gpu.py: the preset's model, batch config and Trainer in
a process group of one, eager, on a fresh WMT-shaped corpus), after WARMUP steps:
  timed    TIMED steps unprofiled, timed as gpu-check times them (bench.harness.steps.timed):
           milliseconds a step, target tokens/s; every preset is timed before any is profiled.
  busy     --steps steps under torch.profiler (a trainer of its own, after WARMUP steps): the share
           of the profiled span in which the GPU ran something (the union of its kernels, copies and
           memsets), and the GPU's own milliseconds a step; the profiler slows the host, so the
           unprofiled step time above is the rate.
  gaps     the GPU's idle gaps: how many last over 50 us and their sum; the largest, each with the
           host ops that spanned at least half of it (what the host did while the GPU waited).
  kinds    GPU milliseconds and operations a step per kind: gemm, attention, elementwise, reduction,
           optimizer, memset, copy (reduction: sums and layer norms).
  runtime  CUDA runtime calls a step (kernel launches, memsets...) and their host milliseconds.
--trace DIR keeps each preset's Chrome trace (DIR/<preset>.json, for chrome://tracing or Perfetto).
Without CUDA: one line, exit 0; --tiny runs it on a CPU with a tiny model (tests), where only the
timed line means anything.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import sync
from bench.harness.gpu import arguments as gpu_arguments
from bench.harness.gpu import parsed, preset, process_group, training_data
from bench.harness.steps import timed, trainer
from pipeline.device import distributed

WARMUP, TIMED = 6, 15
GAP_US = 50  # idle gaps shorter than this are launch latency, not a stall
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


def kind(event: dict) -> str:
    """The kind of one GPU event, from its profiler category and kernel name."""
    name = event["name"].lower()
    if event.get("cat") == "gpu_memset":
        return "memset"
    if event.get("cat") == "gpu_memcpy":
        return "copy"
    if "fmha" in name or "flash" in name or "attention" in name:
        return "attention"
    if "gemm" in name or "nvjet" in name or "cutlass" in name or "splitk" in name:
        return "gemm"
    if "adam" in name or "multi_tensor_apply" in name:
        return "optimizer"
    if "reduce" in name or "gammabeta" in name or "norm" in name:
        return "reduction"
    return "elementwise"


def merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The union of [start, end) intervals, sorted."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def read_trace(events: list[dict], steps: int, largest: int = 8) -> dict | None:
    """The GPU's busy share, idle gaps (with the host ops spanning each) and time per kind, from Chrome-trace
    `events` (microseconds) of `steps` steps; None where the trace holds no GPU event (a CPU run)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES]
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    span = busy[-1][1] - busy[0][0]
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])), reverse=True)
    stalls = [g for g in gaps if g[0] > GAP_US]

    def host_in(start: float, end: float) -> list[str]:
        """The innermost host ops that cover at least half of the gap [start, end)."""
        covering = [e for e in host if min(e["ts"] + e["dur"], end) - max(e["ts"], start) >= 0.5 * (end - start)]
        return [e["name"] for e in sorted(covering, key=lambda e: e["dur"])[:3]]

    ms, ops = Counter(), Counter()
    for e in gpu:
        ms[kind(e)] += e["dur"] / 1e3 / steps
        ops[kind(e)] += 1 / steps
    runtime = Counter(), Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[0][e["name"]] += 1 / steps
            runtime[1][e["name"]] += e["dur"] / 1e3 / steps
    return {"busy": sum(end - start for start, end in busy) / span, "gpu_ms_per_step": sum(ms.values()),
            "span_ms": span / 1e3, "stalls": len(stalls), "stall_ms": sum(g[0] for g in stalls) / 1e3,
            "largest": [(g / 1e3, (start - busy[0][0]) / 1e3, host_in(start, end)) for g, start, end in gaps[:largest]],
            "kinds": {k: (ms[k], ops[k]) for k, _ in ms.most_common()},
            "runtime": {k: (runtime[0][k], runtime[1][k]) for k, _ in runtime[1].most_common(6)}}


def lines(name: str, r: dict) -> list[str]:
    """The printed read of one preset."""
    out = [f"{name} timed: {r['ms_per_step']:.1f} ms a step, {r['tokens_per_s']:,.0f} target tokens/s "
           f"({TIMED} steps after {WARMUP}, unprofiled)"]
    g = r["gpu"]
    if g is None:
        return out + [f"{name}: no GPU events (not CUDA): no busy share, gaps or kinds"]
    out.append(f"{name} busy: the GPU ran {g['busy']:.1%} of {g['span_ms']:.1f} ms ({r['steps']} profiled steps); "
               f"{g['gpu_ms_per_step']:.1f} GPU ms a step")
    out.append(f"{name} gaps: {g['stalls']} idle gaps over {GAP_US} us, {g['stall_ms']:.1f} ms in all; the largest:")
    out += [f"  {ms:.2f} ms at +{at:.1f} ms, host in {', '.join(host) or 'no op'}" for ms, at, host in g["largest"]]
    out.append(f"{name} kinds: " + "; ".join(f"{k} {ms:.2f} ms x{ops:.0f}" for k, (ms, ops) in g["kinds"].items())
               + " (a step)")
    out.append(f"{name} runtime: " + "; ".join(f"{k} x{n:.3g} {ms:.2f} ms" for k, (n, ms) in g["runtime"].items())
               + " (host, a step)")
    return out


def time_preset(name: str, ctx: distributed.Dist, tiny: bool, work: Path) -> dict:
    """One preset's eager Trainer.step timed, unprofiled: WARMUP steps, then TIMED (module docstring)."""
    s = preset(name, ctx.device, tiny)
    t = trainer(s, training_data(s, 7, WARMUP + TIMED, work / name), ctx, "eager", None)
    try:
        r = timed(lambda: t.step(t.epoch_order()), lambda: (t.progress.train_tokens, 0.0), TIMED, ctx.device,
                  check_syncs=False, warmup=WARMUP, kernels=False)
    finally:
        t.close()
    return {"ms_per_step": r["tokens_per_step"] / r["tokens_per_s"] * 1e3, "tokens_per_s": r["tokens_per_s"]}


def profile_preset(name: str, ctx: distributed.Dist, steps: int, tiny: bool, work: Path, trace: Path | None) -> dict:
    """One preset's eager Trainer.step under torch.profiler, `steps` steps after WARMUP: the read of its trace."""
    s = preset(name, ctx.device, tiny)
    t = trainer(s, training_data(s, 7, WARMUP + steps, work / f"{name}-profiled"), ctx, "eager", None)
    try:
        for _ in range(WARMUP):
            t.step(t.epoch_order())
        sync(ctx.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                t.step(t.epoch_order())
            sync(ctx.device)
    finally:
        t.close()
    path = (trace or work) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    return {"steps": steps, "gpu": read_trace(events, steps)}


def main(argv: list[str] | None = None) -> dict | None:
    parser = gpu_arguments(__doc__, "read")
    parser.add_argument("--steps", type=int, default=6, help="profiled steps per preset")
    parser.add_argument("--trace", type=Path, help="keep each preset's Chrome trace in this folder")
    args, device = parsed(parser, argv, "gpu-profile", "read")
    if device is None:
        return None
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as work, process_group(device) as ctx:
        # Every preset timed before any is profiled: a profiler session can leave the CUDA profiling interface
        # (CUPTI) attached to the process, which slows each kernel launch after it (pytorch/pytorch#144455).
        for name in args.models:
            results[name] = time_preset(name, ctx, args.tiny, Path(work))
        for name in args.models:
            results[name] |= profile_preset(name, ctx, args.steps, args.tiny, Path(work), args.trace)
            print("\n".join(lines(name, results[name])), flush=True)
    return results


if __name__ == "__main__":
    main()
