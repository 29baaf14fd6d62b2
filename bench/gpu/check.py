"""GPU check: the paper's base and big models trained and decoded by the stages' own code, beside a reference step.

    make gpu-check     # python -m bench.gpu.check [--steps 50] [--sentences 400] [--no-compile] [--models base big]

Per preset (wmt14_en_de_base, _big with train.devices=1: its model, vocabulary
37000, batch config and train.tokens_per_step), each line runs WARMUP_STEPS
steps, and up to SETTLE_STEPS more until one compiles nothing new (compiling
falls there: their count, seconds and the graphs dynamo compiled are printed
apart), then --steps timed ones (the compiled modes: --compiled-steps at least,
so a late recompile shows), then one profiled, untimed: target tokens/s, MFU
(model.flops over pipeline.device.peak), peak memory.
  reference  the step at its simplest, printed first: a Trainer's model, loss
             (no DDP), Adam, autocast and attention kernels, the whole loss
             under one torch.compile, one fixed micro-batch of the step's
             tokens, [tokens_per_step // 32, 32], all real (bench/harness/reference.py).
  eager, compiled, graphs, step, step-graphs  the train stage's Trainer.step (train.compile off,
             on; train.cuda_graphs on; the same two with train.compile_scope = step, the
             whole step one graph; --modes picks) as a train.devices=1 run has it (no DDP; the
             prefetch thread) over its epoch order, each mode on a fresh synthetic corpus
             of its own (its own seed; WMT-like lengths, N(28, 14) tokens, at
             most 250; one epoch covers every step) written as the tokenize stage
             writes, batched by the batch stage's write_batches (pipeline/corpus/batching.py) with the preset's
             whole BatchConfig, read by TrainingData.load (bench/harness/gpu.py,
             bench/harness/steps.py). Each says "x of the reference" (its tokens/s
             over the reference's); the compiled modes also what dynamo did
             during the timed steps (graphs, graph breaks, recompiles and their
             reasons), the graphs modes the CUDA graphs recorded and their pool's memory.
  share      the eager step (and the step mode's: --share-modes) as one of --ranks processes (8: the
             paper's GPUs) trains it, alone: the
             row parts of each batch rank 0 takes (pipeline/corpus/steps.py), without the gradient
             all-reduce; tokens/s and MFU per GPU beside the whole step's, and the preset's
             train.max_steps on that many GPUs predicted from it (compute only), in DDP over
             a process group of one, as each rank has it. Under it, "communication
             (modelled)": DDP's buckets as it all-reduced them, a ring all-reduce of each at
             --busbw, the part hidden under backward, the exposed overflow and last bucket,
             the per-step flag broadcast (--flag-ms), the slowest rank's share: each part
             apart, and the step and hours with them (bench/harness/allreduce.py).
--summary FILE writes every line's figures as JSON after each preset (make gpu-day).
Under each line, what ran inside (bench/harness/kernels.py): the attention kernels
of the last warm-up step (profiler kernel names: flash, efficient, math, cudnn;
CUDA only), and the host syncs of the timed steps, each caught by
torch.cuda.set_sync_debug_mode("warn") (CUDA, all but graphs, whose recording
of each new shape synchronises): the steps run whole, and any sync fails the
line. Then one
Trainer.save's seconds, and beam-4 sentences/s of pipeline.translation.decoding.translate_ids
with the model cast as the translate stage casts it (decoding_precision: fp32
by default) and in the training precision (bf16 where the GPU has it), with bench.decoding.search's EOS bias (outputs end
near the source length) (bench/harness/decoding.py). A step that does not fit halves
batch.max_tokens, and the reference splits its micro-batch (both said).
Exits 1, after every line, where training ran the math attention kernel on a
GPU or a timed step synchronised. Without CUDA: one line, exit 0; --tiny runs it
all on a CPU with a tiny model (tests).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.harness.decoding import time_decoding
from bench.harness.reference import fitting_reference
from bench.harness.gpu import arguments as gpu_arguments
from bench.harness.gpu import (PRESETS, VALID_PAIRS, WMT_LONGEST, WMT_MEAN, WMT_SD, Setup, parsed,
                             preset, process_group, stream)
from bench.harness.steps import MODES, fitting_training, records_graphs
from bench.harness import allreduce, synthetic_corpus
from model import flops as flops_lib
from pipeline.core.files import write_json
from pipeline.device import distributed


def precision(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else f"{flops_lib.DTYPE_NAMES[dtype]} autocast"


def figures(r: dict) -> str:
    memory = "n/a" if r["memory"] is None else f"{r['memory'] / 2**30:.1f} GiB"
    return (f"{r['tokens_per_s']:,.0f} target tokens/s, {r['flops_per_s'] / r['peak'].flops:.1%} MFU, "
            f"{memory} peak")


def warmup(r: dict, compiled: bool) -> str:
    settled = "the last compiled nothing new" if r["warmup_settled"] else "the last still compiled: timed all the same"
    steps = f"{r['warmup_steps']} warm-up steps {r['warmup_seconds']:.1f} s ({settled})"
    return f"compile: {steps}, {r['warmup_graphs']} graph(s)" if compiled else steps


def reference_line(name: str, r: dict) -> str:
    p, (rows, length) = r["peak"], r["shape"]
    how = "under one torch.compile" if r["compiled"] else "eager (torch.compile failed, warning above)"
    return (f"{name} reference: {figures(r)} ({r['micro']} x [{rows}, {length}] micro-batch, the trainer's model and "
            f"loss {how}, its {r['adam']}, {precision(r['dtype'])}; {warmup(r, r['compiled'])}; MFU of {p.device}'s "
            f"{flops_lib.DTYPE_NAMES[r['dtype']]} peak, {p.source})")


def training_line(name: str, mode: str, r: dict, reference: dict, s: Setup) -> str:
    compiled = mode != "eager"
    if compiled and not r["compiled"]:
        mode = f"{mode} (torch.compile failed, warning above: trained eager)"
    new = f"; {r['new_graphs']} graph(s) compiled during the timed steps" if compiled or r["new_graphs"] else ""
    if r.get("timed_compile_seconds"):
        new += (f" in {r['timed_compile_seconds']:.1f} s, left out of the rate "
                f"({r['wall_tokens_per_s']:,.0f} target tokens/s with them)")
    steps = r["timed_steps"]
    return (f"{name} {mode}: {figures(r)}, {r['tokens_per_s'] / reference['tokens_per_s']:.2f}x of the reference "
            f"({warmup(r, compiled)}{new}; {steps} timed steps of a fresh corpus (seed {r['seed']}), "
            f"{r['tokens_per_step']:,.0f} target tokens/step in {r['accum']} batch(es) of batch.max_tokens "
            f"{s.max_tokens})")


def share_line(name: str, mode: str, r: dict, whole: dict, s: Setup) -> str:
    """The rank's share of the `mode` step beside the whole step in that mode, and the preset's steps on that many
    GPUs from it, compute only."""
    seconds = r["tokens_per_step"] / r["tokens_per_s"]  # a step's time on each GPU, the all-reduce left out
    hours = s.train_cfg.max_steps * seconds / 3600
    mode = "" if mode == "eager" else f" {mode}"
    return (f"{name} share{mode}: 1 of {r['ranks']} GPUs (DDP over a group of one): {figures(r)}, "
            f"{r['tokens_per_s'] / whole['tokens_per_s']:.2f}x the whole step's tokens/s per GPU; "
            f"{r['tokens_per_step']:,.0f} target tokens/step on this GPU (each batch cut into {r['parts']} row parts, "
            f"rank 0's), {seconds * 1e3:.1f} ms a step; train.max_steps {s.train_cfg.max_steps:,} on {r['ranks']} "
            f"GPUs: {hours:.2f} h predicted (compute only)")


def communication_line(name: str, mode: str, r: dict, s: Setup, busbw: float, flag_ms: float) -> str:
    """The share line's step with what its compute leaves out, modelled part by part (bench/harness/allreduce.py):
    each part printed apart, so that a GPU measurement can replace it."""
    seconds = r["tokens_per_step"] / r["tokens_per_s"]
    mode = "" if mode == "eager" else f" {mode}"
    if not r["buckets"]:
        return f"{name} share{mode} communication: n/a (train.grad_compression's hook: buckets not listed)"
    b, k = r["buckets"], r["ranks"]
    p = allreduce.predict(seconds, b, k, busbw, flag_ms, r["slowest"])
    ms = {key: value * 1e3 for key, value in p.items()}
    hours = s.train_cfg.max_steps * p["step"] / 3600
    return (f"{name} share{mode} communication (modelled): {len(b)} DDP buckets, {sum(b) / 2**20:,.1f} MiB, the last "
            f"{b[-1] / 2**20:,.1f} MiB; ring all-reduce at {busbw:g} GB/s bus bandwidth (--busbw) on {k} GPUs: "
            f"{ms['allreduce']:.1f} ms a step, {ms['hidden']:.1f} ms under backward (2/3 of compute), exposed "
            f"{ms['overflow']:.1f} ms overflow + {ms['tail']:.1f} ms last bucket; flag broadcast {ms['flags']:.2f} ms "
            f"(--flag-ms); slowest of {k} ranks x{r['slowest']:.3f} rank 0's padded tokens: compute "
            f"{ms['compute']:.1f} ms; a step {ms['step']:.1f} ms, train.max_steps {s.train_cfg.max_steps:,}: "
            f"{hours:.2f} h predicted")


def inside_line(name: str, mode: str, r: dict) -> str:
    """What ran inside the line's steps: attention kernels, dynamo's work, the CUDA graphs, the sync check."""
    kernels = ("kernel names are CUDA-only" if r["attention"] is None else
               ", ".join(f"{kind} x{calls}" for kind, calls in r["attention"].items()) or "none found")
    said = [f"attention kernels: {kernels}"]
    if mode != "eager":
        said.append(f"timed steps' {r['dynamo'].line()}")
    if records_graphs(mode):
        pool = "n/a" if r["cuda_graphs_pool"] is None else f"{r['cuda_graphs_pool'] / 2**30:.2f} GiB pool"
        said.append("CUDA graphs: n/a (not CUDA)" if r["cuda_graphs"] is None else
                    f"{r['cuda_graphs']} CUDA graph(s) recorded, {pool}")
    syncs = r.get("host_syncs") or []
    said.append((f"{len(syncs)} host sync(s) in the timed steps: {syncs[0]}" if syncs else
                 "no host sync in the timed steps (set_sync_debug_mode)") if r["syncs_checked"] else
                "host syncs not checked" + (" (graphs record at each new shape, which synchronises)"
                                            if records_graphs(mode) else " (CUDA only)"))
    return f"{name} {mode} inside: " + "; ".join(said)


def failures_of(name: str, mode: str, r: dict, device: torch.device) -> list[str]:
    """Why this line fails gpu-check: training ran the math attention kernel on a GPU, or a timed step
    synchronised the host with the GPU."""
    failed = []
    if device.type == "cuda" and r["attention"] is not None and "math" in r["attention"]:
        failed.append(f"{name} {mode} trained with the math attention kernel ({r['attention']}): flash / efficient "
                      "expected (pipeline/device/attention.py)")
    if r.get("host_syncs"):
        failed.append(f"{name} {mode}: {len(r['host_syncs'])} host sync(s) in the timed steps: {r['host_syncs'][0]}")
    return failed


def summary(results: dict, s: Setup, args: argparse.Namespace) -> dict:
    """One preset's lines as numbers (--summary): per training line its rate, MFU, memory and what compiled when;
    per share line its prediction, compute only and with communication modelled; decoding's sentences/s."""
    out = {}
    for line, r in results.items():
        if not isinstance(r, dict):
            out[line] = {"sentences_per_s": r}
            continue
        out[line] = {"tokens_per_s": r["tokens_per_s"], "mfu": r["flops_per_s"] / r["peak"].flops if r["peak"].flops
                     else None, "memory_gib": None if r["memory"] is None else r["memory"] / 2**30,
                     "warmup_steps": r["warmup_steps"], "warmup_settled": r["warmup_settled"],
                     "graphs_in_timed_steps": r["new_graphs"], "recompiles_in_timed_steps": len(r["dynamo"].recompiles)}
        if r.get("ranks", 1) > 1:
            seconds = r["tokens_per_step"] / r["tokens_per_s"]
            out[line]["hours_compute_only"] = s.train_cfg.max_steps * seconds / 3600
            if r["buckets"]:
                step = allreduce.predict(seconds, r["buckets"], r["ranks"], args.busbw, args.flag_ms, r["slowest"])
                out[line] |= {"hours_with_communication": s.train_cfg.max_steps * step["step"] / 3600,
                              "step_ms": {k: v * 1e3 for k, v in step.items()}, "bucket_bytes": r["buckets"]}
    return out


def check(name: str, device: torch.device, args: argparse.Namespace, ctx: distributed.Dist,
          failures: list[str]) -> dict:
    """Every line of one preset: the reference, training per mode, a checkpoint's save, decoding; appends to
    `failures` why a line failed. Returns what each line measured (tests)."""
    s = preset(name, device, args.tiny)
    modes = MODES[:1] if args.no_compile else [mode for mode in MODES if mode in args.modes]
    seeds = {mode: 1 + len(MODES) * PRESETS.index(name) + MODES.index(mode) for mode in MODES}  # a corpus per mode
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        ref_data = stream(s, 0, VALID_PAIRS, tmp / "reference")  # builds the reference's Trainer; never trained on
        results["reference"] = reference = fitting_reference(s, ref_data, ctx, args.steps)
        print(reference_line(name, reference), flush=True)
        print(inside_line(name, "reference", reference), flush=True)
        failures += failures_of(name, "reference", reference, device)
        for mode in modes:
            checkpoints = tmp / "checkpoints" if mode == "eager" else None
            steps = args.steps if mode == "eager" else max(args.steps, args.compiled_steps)
            r, s = fitting_training(s, seeds[mode], ctx, steps, mode, tmp / mode, checkpoints)
            r.pop("trainer").close()
            results[mode] = r
            print(training_line(name, mode, r, reference, s), flush=True)
            print(inside_line(name, mode, r), flush=True)
            failures += failures_of(name, mode, r, device)
            if "save_seconds" in r:
                [saved] = checkpoints.glob("step_*.pt")
                print(f"{name}: checkpoint {saved.stat().st_size / 2**20:,.1f} MiB saved in {r['save_seconds']:.1f} s "
                      "(Trainer.save: weights, Adam, RNGs, sha256 sidecar)", flush=True)
        for mode in [m for m in args.share_modes if m in results] if args.ranks > 1 else []:
            # the step as one of --ranks processes trains it, on a corpus of its own
            r, s = fitting_training(s, seeds[mode] + len(MODES) * len(PRESETS), ctx, args.steps, mode,
                                    tmp / f"share-{mode}", ranks=args.ranks)
            r.pop("trainer").close()
            results["share" if mode == "eager" else f"share {mode}"] = r
            print(share_line(name, mode, r, results[mode], s), flush=True)
            print(communication_line(name, mode, r, s, args.busbw, args.flag_ms), flush=True)
            failures += failures_of(name, "share", r, device)
    sources, _ = synthetic_corpus(args.sentences, seed=100 + PRESETS.index(name), vocab=s.vocab, mean=WMT_MEAN,
                                  sd=WMT_SD, longest=WMT_LONGEST)
    sources = [np.asarray(sources[i], dtype=np.int64) for i in range(len(sources))]
    for stage_precision, what in ((True, "the translate stage's precision"), (False, "the training precision")):
        rate, dtype = time_decoding(s, sources, stage_precision)
        results[f"decode {what}"] = rate
        print(f"{name}: beam {s.translate_cfg.beam_size}, {what}, {dtype} weights: {rate:.1f} sentences/s "
              "(translate_ids)", flush=True)
    return results


def arguments() -> argparse.ArgumentParser:
    parser = gpu_arguments(__doc__, "check")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per model and mode, after the warm-up")
    parser.add_argument("--sentences", type=int, default=400, help="sentences decoded per model and precision")
    parser.add_argument("--no-compile", action="store_true", help="skip the train.compile and train.cuda_graphs runs")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="training modes timed")
    parser.add_argument("--ranks", type=int, default=8, help="the share lines' processes (1: no share line)")
    parser.add_argument("--share-modes", nargs="+", choices=MODES, default=["eager", "step"],
                        help="modes whose rank's share is timed (of those in --modes)")
    parser.add_argument("--summary", type=Path, help="a JSON file the lines' figures are written to, after each "
                        "preset (a run cut short keeps those done)")
    parser.add_argument("--compiled-steps", type=int, default=100,
                        help="timed steps of the compiled modes at least: a late recompile shows in the line")
    parser.add_argument("--busbw", type=float, default=allreduce.NVLINK_BUSBW_GBS,
                        help="all-reduce bus bandwidth, GB/s, of the share lines' communication model")
    parser.add_argument("--flag-ms", type=float, default=allreduce.FLAG_BROADCAST_MS,
                        help="the per-step flag broadcast's milliseconds in that model")
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    """Print every line; return what they measured, per preset (tests), or None without CUDA. Exits 1 after the
    last line where a line failed (the math attention kernel in training, a host sync in a timed step)."""
    args, device = parsed(arguments(), argv, "gpu-check", "check")
    if device is None:
        return None
    failures: list[str] = []
    results, figures_of = {}, {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    with process_group(device) as ctx:
        for name in args.models:
            results[name] = check(name, device, args, ctx, failures)
            if args.summary:
                figures_of[name] = summary(results[name], preset(name, device, args.tiny), args)
                write_json(args.summary, figures_of)
    if failures:
        for failure in failures:
            print(f"gpu-check FAILED: {failure}", flush=True)
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
