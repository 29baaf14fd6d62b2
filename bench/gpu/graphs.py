"""train.compile and train.cuda_graphs over a run's stream of shapes: does compiling or recording each shape once pay
back in the steps after it? (Modes: bench.harness.steps; make gpu-graphs times all four against eager.)

    python -m bench.gpu.graphs [--models base big] [--steps 600] [--window 100] [--json FILE]

gpu-check times a few dozen steps of fresh shapes, where nearly every step records a graph; a run meets its
bounded set of shapes (metrics/batch.json: num_shapes) again and again. Per preset (gpu-check's setting,
bench/harness/gpu.py), the eager Trainer.step and the train.cuda_graphs one train the same fresh corpus, the same
batches in the same order, for gpu_setup's warm-up steps and then --steps steps timed in windows of --window:
each window's target tokens/s with its compiling and recording in it (a run pays them), the CUDA graphs recorded
so far and their pool's memory; then each mode's seconds for all the timed steps and the first window after
which the graphs mode is ahead in total. Without CUDA: one line, exit 0 (--tiny: a tiny model on a CPU, tests).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench.harness.kernels import Dynamo
from bench.harness import sync
from bench.harness.gpu import arguments as gpu_arguments
from bench.harness.gpu import (PRESETS, WARMUP_STEPS, Setup, fresh, parsed, preset, process_group,
                                training_data)
from bench.harness.steps import MODES, records_graphs, trainer
from pipeline.device import distributed, graphs
from pipeline.training.loader import TrainingData

def windows(s: Setup, data: TrainingData, ctx: distributed.Dist, mode: str, steps: int, window: int) -> list[dict]:
    """Trainer.step in `mode` over `data`'s epoch order: WARMUP_STEPS untimed, then `steps` in windows of `window`,
    each: its steps, seconds, target tokens, compile seconds, dynamo's graphs and recompiles (their reasons), CUDA
    graphs recorded so far and their pool's bytes."""
    fresh(s.device)
    t = trainer(s, data, ctx, mode, None)
    p, out = t.progress, []
    try:
        for _ in range(WARMUP_STEPS):
            t.step(t.epoch_order())
        sync(s.device)
        while p.step < WARMUP_STEPS + steps:
            first, tokens, compiling = p.step + 1, p.train_tokens, p.compile_seconds
            start = time.perf_counter()
            with Dynamo() as dynamo:
                for _ in range(min(window, WARMUP_STEPS + steps - p.step)):
                    t.step(t.epoch_order())
                sync(s.device)
            recorded, pool = graphs.totals(s.device)
            out.append({"steps": [first - WARMUP_STEPS, p.step - WARMUP_STEPS], "seconds": time.perf_counter() - start,
                        "tokens": p.train_tokens - tokens, "compile_seconds": p.compile_seconds - compiling,
                        "graphs": recorded, "pool_bytes": pool, "epoch": p.epoch,
                        "dynamo_graphs": dynamo.graphs, "recompiles": dynamo.recompiles})
            w = out[-1]
            print(f"  {s.name} {mode} steps {w['steps'][0]}-{w['steps'][1]}: {w['tokens'] / w['seconds']:,.0f} target "
                  f"tokens/s", flush=True)
    finally:
        t.close()
    return out


def ahead_after(eager: list[dict], other: list[dict]) -> int | None:
    """The last step of the first window after which `other`'s seconds so far are below eager's; None if never."""
    total_e = total_o = 0.0
    for e, o in zip(eager, other):
        total_e, total_o = total_e + e["seconds"], total_o + o["seconds"]
        if total_o < total_e:
            return o["steps"][1]
    return None


def report(name: str, runs: dict[str, list[dict]]) -> list[str]:
    """A line per window and mode other than eager (its tokens/s and eager's, compiling, dynamo's graphs and
    recompiles with up to three distinct reasons, CUDA graphs recorded and their pool), then each mode's totals
    against eager's."""
    lines, eager = [], runs["eager"]
    for mode in [m for m in runs if m != "eager"]:
        for e, o in zip(eager, runs[mode]):
            recorded = ("" if not records_graphs(mode) else "; n/a (not CUDA)" if o["graphs"] is None else
                        f"; {o['graphs']} CUDA graph(s) recorded so far, pool {o['pool_bytes'] / 2**30:.2f} GiB")
            rate_e, rate_o = e["tokens"] / e["seconds"], o["tokens"] / o["seconds"]
            lines.append(f"{name} steps {o['steps'][0]}-{o['steps'][1]}: eager {rate_e:,.0f}, {mode} {rate_o:,.0f} "
                         f"target tokens/s ({rate_o / rate_e:.2f}x; compiling {o['compile_seconds']:.1f} s, "
                         f"{o['dynamo_graphs']} graph(s), {len(o['recompiles'])} recompile(s)){recorded}")
            lines += [f"  recompiled: {reason[:300]}" for reason in sorted(set(o["recompiles"]))[:3]]
        total_e, total_o = sum(w["seconds"] for w in eager), sum(w["seconds"] for w in runs[mode])
        after = ahead_after(eager, runs[mode])
        lines.append(f"{name} all {eager[-1]['steps'][1]} timed steps: eager {total_e:.1f} s, {mode} {total_o:.1f} s "
                     f"({total_e / total_o:.2f}x); {mode} ahead in total " +
                     ("never" if after is None else f"after step {after}"))
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    parser = gpu_arguments(__doc__, "time")
    parser.add_argument("--modes", nargs="+", choices=MODES[1:], default=["graphs"], help="modes timed against eager")
    parser.add_argument("--steps", type=int, default=600, help="timed steps per preset and mode, after the warm-up")
    parser.add_argument("--window", type=int, default=100, help="steps per timed window")
    parser.add_argument("--json", type=Path, help="also write every window's figures to this file")
    args, device = parsed(parser, argv, "gpu-graphs", "time")
    if device is None:
        return None
    results: dict[str, dict] = {}
    with process_group(device) as ctx, tempfile.TemporaryDirectory(prefix="gpu-graphs-") as tmp:
        for name in args.models:
            s = preset(name, device, args.tiny)
            data = training_data(s, 1 + PRESETS.index(name), args.steps, Path(tmp) / name)
            used = max((Path(tmp) / name).glob("corpus*/batch.json"), key=lambda f: int(f.parent.name[len("corpus"):]))
            shapes = json.loads(used.read_text())["num_shapes"]  # training_data's last corpus is the one trained
            print(f"{name}: {args.steps} steps of one fresh corpus, {shapes} distinct batch shapes", flush=True)
            runs = {mode: windows(s, data, ctx, mode, args.steps, args.window) for mode in ["eager", *args.modes]}
            for line in report(name, runs):
                print(line, flush=True)
            results[name] = {"num_shapes": shapes, **runs}
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
