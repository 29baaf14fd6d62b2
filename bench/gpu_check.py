"""GPU check: the paper's base and big models trained and decoded by the stages' own code, beside a reference step.

    make gpu-check     # python -m bench.gpu_check [--steps 50] [--sentences 400] [--no-compile] [--models base big]

Per preset (wmt14_en_de_base, _big with train.devices=1: its model, vocabulary
37000, batch config and train.tokens_per_step), each line runs WARMUP_STEPS
steps (compiling falls there: their seconds and the graphs dynamo compiled are
printed apart), then --steps timed ones: target tokens/s, MFU (model.flops
over pipeline.training.peak), peak memory.
  reference  the step at its simplest, printed first: a Trainer's model, loss
             (no DDP), Adam, autocast and attention kernels, the whole loss
             under one torch.compile, one fixed micro-batch of the step's
             tokens, [tokens_per_step // 32, 32], all real.
  eager, compiled  the train stage's Trainer.step (train.compile off, on) in a
             process group of one (DDP, prefetch thread) over its epoch order,
             each mode on a fresh synthetic corpus of its own (its own seed;
             WMT-like lengths, N(28, 14) tokens, at most 250; one epoch covers
             every step) written as the tokenize stage writes, batched by the
             batch stage's write_batches with the preset's whole BatchConfig,
             read by TrainingData.load. Each says "x of the reference" (its
             tokens/s over the reference's) and the graphs dynamo compiled
             during its timed steps.
Then one Trainer.save's seconds, and beam-4 sentences/s of
stages.translate.translate_ids under the training precision's autocast
(distributed.autocast_dtype: bf16 where the GPU has it) and in fp32, with
bench.decode's EOS bias (outputs end near the source length). A step that does
not fit halves batch.max_tokens, and the reference splits its micro-batch (both
said). Without CUDA: one line, exit 0; --tiny runs it all on a CPU with a tiny
model (tests).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._dynamo.utils import counters

from bench.decode import EosNearSourceLength
from bench.train_throughput import synthetic_corpus
from model import flops as flops_lib
from model.config import ModelConfig
from model.schedule import lrate
from model.transformer import DecoderState, Transformer
from pipeline.core import config
from pipeline.core.config import BatchConfig, TrainConfig, TranslateConfig
from pipeline.core.tracking import StageRun
from pipeline.corpus import steps as steps_lib
from pipeline.corpus.formats import BOS_ID, EOS_ID, ID_DTYPE, OFFSET_DTYPE, Ragged, split_paths
from pipeline.training import compiled as compiled_lib
from pipeline.training import distributed
from pipeline.training.loader import Batch, TrainingData
from pipeline.training.optimizer import train_step
from pipeline.training.trainer import Trainer
from stages.batch import write_batches
from stages.translate import translate_ids

WMT_MEAN, WMT_SD, WMT_LONGEST = 28, 14, 250  # BPE tokens per WMT14 en-de sentence (approximate), tokenize.max_len
TINY = ["model=tiny", "tokenize.vocab_size=100", "batch.max_tokens=512", "train.tokens_per_step=1024"]  # --tiny: on a CPU
WARMUP_STEPS = 3  # compiling takes a few shapes' worth of steps; DDP sets its buckets up on the first
VALID_PAIRS = 64  # Trainer builds its validation batches (not timed here)
REFERENCE_LENGTH = 32  # the reference micro-batch: [tokens_per_step // 32, 32], every position a real token
MODES = ("eager", "compiled")
PRESETS = ("base", "big")


@dataclass
class Setup:
    """One preset's model and training settings on this device."""

    name: str
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    batch_cfg: BatchConfig
    translate_cfg: TranslateConfig
    vocab: int
    device: torch.device

    @property
    def max_tokens(self) -> int:
        return self.batch_cfg.max_tokens

    @property
    def batches_per_step(self) -> int:
        return steps_lib.batches_per_step(self.train_cfg.tokens_per_step, self.max_tokens)


def preset(name: str, device: torch.device, tiny: bool) -> Setup:
    params = config.compose([f"experiment=wmt14_en_de_{name}", "train.devices=1", *(TINY if tiny else [])])
    return Setup(name, config.parse(params, "model", ModelConfig), config.parse(params, "train", TrainConfig),
                 config.parse(params, "batch", BatchConfig), config.parse(params, "translate", TranslateConfig),
                 params["tokenize"]["vocab_size"], device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh(device: torch.device) -> None:
    """Before each line: dynamo's graphs dropped (each compile falls in its own warm-up) and the previous line's
    tensors freed (its peak memory is its own)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[distributed.Dist]:
    """A process group of one, as torchrun gives each rank (NCCL on a GPU, gloo on a CPU): the Trainer wraps DDP."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        yield distributed.Dist(0, 1, 0, device)
    finally:
        dist.destroy_process_group()


# --- the stream: a fresh corpus through the batch stage ---------------------------------------------------------


def write_tokenized(directory: Path, src: Ragged, tgt: Ragged, vocab: int) -> Path:
    """`src`, `tgt` in the tokenize stage's format (pipeline.corpus.formats): train, and its first pairs as valid."""
    directory.mkdir(parents=True)
    lines = {"train": len(src), "valid": min(VALID_PAIRS, len(src))}
    for split, n in lines.items():
        for lang, side in (("en", src), ("de", tgt)):
            ids_path, offsets_path = split_paths(directory, split, lang)
            np.asarray(side.values[: side.offsets[n]], dtype=ID_DTYPE).tofile(ids_path)
            np.asarray(side.offsets[: n + 1], dtype=OFFSET_DTYPE).tofile(offsets_path)
    (directory / "meta.json").write_text(json.dumps({"vocab_size": vocab, "src_lang": "en", "tgt_lang": "de",
                                                     "lines": lines}))
    return directory


def stream(s: Setup, seed: int, pairs: int, directory: Path) -> TrainingData:
    """A fresh synthetic corpus (`seed`) as the train stage reads it: the batch stage's write_batches with the
    preset's whole BatchConfig, then TrainingData.load."""
    src, tgt = synthetic_corpus(pairs, seed=seed, vocab=s.vocab, mean=WMT_MEAN, sd=WMT_SD, longest=WMT_LONGEST)
    tokenized = write_tokenized(directory / "tokenized", src, tgt, s.vocab)
    write_batches(tokenized, directory / "batches", directory / "batch.json", s.batch_cfg, s.batches_per_step,
                  s.train_cfg.seed)
    return TrainingData.load(tokenized, directory / "batches", s.batch_cfg.length_bucket_step)


def training_data(s: Setup, seed: int, steps: int, directory: Path) -> TrainingData:
    """stream() with pairs enough that the warm-up and timed steps (and the step prefetched after them) all come
    from its first epoch: no batch is trained on twice."""
    needed = (WARMUP_STEPS + steps + 1) * s.batches_per_step
    pairs, attempt = needed * s.max_tokens // WMT_MEAN, 0
    while True:
        data = stream(s, seed, pairs, directory / f"corpus{attempt}")
        if len(data.train_batches) >= needed:
            return data
        pairs, attempt = int(pairs * 1.2 * needed / max(len(data.train_batches), 1)) + 1, attempt + 1


def digest(data: TrainingData) -> str:
    """Which corpus: a hash of its train token ids."""
    return hashlib.sha256(np.ascontiguousarray(data.train_src.values).tobytes()
                          + np.ascontiguousarray(data.train_tgt.values).tobytes()).hexdigest()[:16]


# --- timing ------------------------------------------------------------------------------------------------------


def graphs() -> int:
    """Graphs dynamo has compiled in this process (since the last torch._dynamo.reset)."""
    return counters["stats"]["unique_graphs"]


def timed(step: Callable[[], object], count: Callable[[], tuple[float, float]], steps: int,
          device: torch.device) -> dict:
    """WARMUP_STEPS calls of `step` (compiling falls here), then `steps` timed ones; `count`: (target tokens, FLOPs)
    trained so far. Seconds and dynamo graphs of each part apart; tokens/s, FLOP/s and peak memory of the timed part."""
    g0, start = graphs(), time.perf_counter()
    for _ in range(WARMUP_STEPS):
        step()
    sync(device)
    warmup_seconds, g1 = time.perf_counter() - start, graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, flops = count()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = time.perf_counter() - start
    tokens, flops = count()[0] - tokens, count()[1] - flops
    return {"tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds, "tokens_per_step": tokens / steps,
            "memory": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "warmup_seconds": warmup_seconds, "warmup_graphs": g1 - g0, "new_graphs": graphs() - g1}


def trainer(s: Setup, data: TrainingData, ctx: distributed.Dist, compiled: bool, checkpoints: Path | None) -> Trainer:
    """The train stage's Trainer for this preset (train.compile = `compiled`), writing checkpoints to `checkpoints`."""
    cfg = replace(s.train_cfg, compile=compiled)
    return Trainer(data, s.model_cfg, cfg, s.max_tokens, ctx, StageRun(), phash="gpu-check", checkpoints=checkpoints)


def time_training(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int, compiled: bool,
                  checkpoints: Path | None = None) -> dict:
    """Trainer.step over its epoch order: timed() (the trainer's own token and FLOP counts), the batches each step
    took and their shapes; with `checkpoints`, then the seconds Trainer.save takes."""
    fresh(s.device)
    t = trainer(s, data, ctx, compiled, checkpoints)
    p, taken = t.progress, []

    def step() -> None:
        order = t.epoch_order()
        start = p.cursor
        t.step(order)
        taken.append([int(b) for b in order[start : p.cursor]])

    r = timed(step, lambda: (p.train_tokens, p.flops), steps, s.device)
    timed_batches = [b for ids in taken[WARMUP_STEPS:] for b in ids]
    r |= {"accum": t.accum, "peak": t.peak, "trainer": t, "compiled": bool(t.compiled), "epochs": p.epoch + 1,
          "dtype": distributed.autocast_dtype(s.device), "batches": taken, "corpus": digest(data),
          # (pairs, longest source, longest target) with EOS / BOS, before any length-bucket padding
          "batch_shapes": [(len(data.train_batches[b]), *(int(x.max()) for x in data.lengths(np.array([b]))))
                           for b in timed_batches]}
    if checkpoints is not None:
        start = time.perf_counter()
        t.save()
        r["save_seconds"] = time.perf_counter() - start
    return r


def fitting_training(s: Setup, seed: int, ctx: distributed.Dist, steps: int, compiled: bool, directory: Path,
                     checkpoints: Path | None = None) -> tuple[dict, Setup]:
    """time_training on a fresh corpus (`seed`) at the preset's batch size, or halved (accumulation doubled) until a
    step fits in memory."""
    while True:
        data = training_data(s, seed, steps, directory / f"max_tokens{s.max_tokens}")
        try:
            return time_training(s, data, ctx, steps, compiled, checkpoints) | {"seed": seed}, s
        except torch.OutOfMemoryError:
            if s.max_tokens < 256:
                raise
        torch.cuda.empty_cache()  # out of the except block: the failed attempt's tensors are garbage now
        s = replace(s, batch_cfg=replace(s.batch_cfg, max_tokens=s.max_tokens // 2))  # the Trainer doubles accum
        print(f"  {s.name}: out of memory; batch.max_tokens -> {s.max_tokens}", flush=True)


# --- the reference step ------------------------------------------------------------------------------------------


def reference_batch(vocab: int, rows: int, device: torch.device, seed: int) -> Batch:
    """[rows, REFERENCE_LENGTH] on every side, no padding: source + EOS, BOS + target, target + EOS."""
    g = torch.Generator().manual_seed(seed)
    src, tgt = (torch.randint(4, vocab, (rows, REFERENCE_LENGTH - 1), generator=g) for _ in range(2))
    eos, bos = torch.full((rows, 1), EOS_ID), torch.full((rows, 1), BOS_ID)
    tensors = (torch.cat([src, eos], 1), torch.cat([bos, tgt], 1), torch.cat([tgt, eos], 1))
    return Batch(*(x.to(device) for x in tensors), tokens=rows * REFERENCE_LENGTH)


def time_reference(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int, micro: int = 1) -> dict:
    """The train stage's step at its simplest: a Trainer's model, loss module (without DDP), Adam, autocast and
    gradient scaler (so its attention kernels too), the whole loss under one torch.compile, train_step over
    `micro` fixed-shape micro-batches of the step's tokens. `data` only builds the Trainer: nothing trains on it."""
    fresh(s.device)
    t = trainer(s, data, ctx, False, None)
    loss_module = t.loss_model.module if hasattr(t.loss_model, "module") else t.loss_model
    t.close()  # its DDP is not used here
    rows = s.train_cfg.tokens_per_step // REFERENCE_LENGTH // micro
    batch = reference_batch(s.vocab, rows, s.device, s.train_cfg.seed)
    batches, step_tokens = [(batch, True)] * micro, micro * batch.tokens
    loss = torch.compile(loss_module, backend=compiled_lib.backend())
    state = {"step": 0, "compiled": True}
    step_flops = flops_lib.training_flops(s.model_cfg, s.vocab, [REFERENCE_LENGTH] * rows * micro,
                                          [REFERENCE_LENGTH] * rows * micro)

    def step() -> None:
        nonlocal loss
        lr = s.train_cfg.lr_factor * lrate(state["step"] + 1, s.model_cfg.d_model, s.train_cfg.warmup_steps)
        try:
            train_step(loss, t.optimizer, batches, step_tokens, lr, ctx, t.autocast, t.scaler)
        except compiled_lib.COMPILE_FAILURES as e:  # as the trainer: one warning, eager from here
            compiled_lib.fallback([], e)
            loss, state["compiled"] = loss_module, False
            t.optimizer.zero_grad(set_to_none=True)
            train_step(loss, t.optimizer, batches, step_tokens, lr, ctx, t.autocast, t.scaler)
        state["step"] += 1

    r = timed(step, lambda: (state["step"] * step_tokens, state["step"] * step_flops), steps, s.device)
    return r | {"peak": t.peak, "dtype": distributed.autocast_dtype(s.device), "compiled": state["compiled"],
                "shape": (rows, REFERENCE_LENGTH), "micro": micro,
                "adam": "fused Adam" if t.optimizer.defaults.get("fused") else "Adam"}


def fitting_reference(s: Setup, data: TrainingData, ctx: distributed.Dist, steps: int) -> dict:
    """time_reference in one micro-batch, or in 2, 4, ... of the same shape (the step's tokens) until it fits."""
    micro = 1
    while True:
        try:
            return time_reference(s, data, ctx, steps, micro)
        except torch.OutOfMemoryError:
            if micro >= 64:
                raise
        torch.cuda.empty_cache()
        micro *= 2
        print(f"  {s.name} reference: out of memory; {micro} micro-batches", flush=True)


# --- decoding ----------------------------------------------------------------------------------------------------


class Autocast(nn.Module):
    """A decoding model whose every call runs under torch.autocast(`dtype`).

    translate_ids runs its searches in worker threads and autocast is per thread: an autocast block around the
    call would not reach them, so each call of the model's decoding API enters it where it runs."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype
        self.pad_id, self.max_positions, self.embedding = model.pad_id, model.max_positions, model.embedding

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.embedding.weight.device.type, dtype=self.dtype)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        with self.autocast():
            return self.model.encode(src)

    def init_state(self, memory: Tensor, src_mask: Tensor, beams: int) -> DecoderState:
        with self.autocast():
            return self.model.init_state(memory, src_mask, beams)

    def decode_step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        with self.autocast():
            return self.model.decode_step(tokens, state)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        with self.autocast():
            return self.model.decode(tgt_in, memory, src_mask)

    def project(self, hidden: Tensor) -> Tensor:
        with self.autocast():
            return self.model.project(hidden)


def precision(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else f"{flops_lib.DTYPE_NAMES[dtype]} autocast"


def decoding_model(s: Setup, dtype: torch.dtype) -> nn.Module:
    """The preset's Transformer (seeded, untrained) with bench.decode's EOS bias, under `dtype` autocast unless fp32."""
    torch.manual_seed(s.train_cfg.seed)
    model = EosNearSourceLength(Transformer(s.model_cfg, s.vocab), slope=2.0).to(s.device)
    return (model if dtype == torch.float32 else Autocast(model, dtype)).eval()


def time_decoding(s: Setup, sources: list[np.ndarray], dtype: torch.dtype = torch.float32) -> float:
    """Sentences per second of translate_ids (beam 4, the preset's length penalty and limits) under `dtype`."""
    model = decoding_model(s, dtype)
    translate_ids(model, sources[: max(1, len(sources) // 20)], s.translate_cfg, progress=False)  # warm-up
    sync(s.device)
    start = time.perf_counter()
    translate_ids(model, sources, s.translate_cfg, progress=False)
    sync(s.device)
    return len(sources) / (time.perf_counter() - start)


# --- the lines ---------------------------------------------------------------------------------------------------


def figures(r: dict) -> str:
    memory = "n/a" if r["memory"] is None else f"{r['memory'] / 2**30:.1f} GiB"
    return (f"{r['tokens_per_s']:,.0f} target tokens/s, {r['flops_per_s'] / r['peak'].flops:.1%} MFU, "
            f"{memory} peak")


def warmup(r: dict, compiled: bool) -> str:
    if not compiled:
        return f"warm-up {WARMUP_STEPS} steps {r['warmup_seconds']:.1f} s"
    return f"compile: {WARMUP_STEPS} warm-up steps {r['warmup_seconds']:.1f} s, {r['warmup_graphs']} graph(s)"


def reference_line(name: str, r: dict) -> str:
    p, (rows, length) = r["peak"], r["shape"]
    how = "under one torch.compile" if r["compiled"] else "eager (torch.compile failed, warning above)"
    return (f"{name} reference: {figures(r)} ({r['micro']} x [{rows}, {length}] micro-batch, the trainer's model and "
            f"loss {how}, its {r['adam']}, {precision(r['dtype'])}; {warmup(r, r['compiled'])}; MFU of {p.device}'s "
            f"{flops_lib.DTYPE_NAMES[r['dtype']]} peak, {p.source})")


def training_line(name: str, mode: str, r: dict, reference: dict, s: Setup) -> str:
    compiled = mode == "compiled"
    if compiled and not r["compiled"]:
        mode = "compiled (torch.compile failed, warning above: trained eager)"
    new = f"; {r['new_graphs']} graph(s) compiled during the timed steps" if compiled or r["new_graphs"] else ""
    steps = len(r["batches"]) - WARMUP_STEPS
    return (f"{name} {mode}: {figures(r)}, {r['tokens_per_s'] / reference['tokens_per_s']:.2f}x of the reference "
            f"({warmup(r, compiled)}{new}; {steps} timed steps of a fresh corpus (seed {r['seed']}), "
            f"{r['tokens_per_step']:,.0f} target tokens/step in {r['accum']} batch(es) of batch.max_tokens "
            f"{s.max_tokens})")


def check(name: str, device: torch.device, args: argparse.Namespace, ctx: distributed.Dist) -> dict:
    """Every line of one preset: the reference, training eager (and compiled), a checkpoint's save, decoding.
    Returns what each line measured (tests)."""
    s = preset(name, device, args.tiny)
    modes = MODES[:1] if args.no_compile else MODES
    seeds = {mode: 1 + len(MODES) * PRESETS.index(name) + i for i, mode in enumerate(modes)}  # a corpus per mode
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        ref_data = stream(s, 0, VALID_PAIRS, tmp / "reference")  # builds the reference's Trainer; never trained on
        results["reference"] = reference = fitting_reference(s, ref_data, ctx, args.steps)
        print(reference_line(name, reference), flush=True)
        for mode in modes:
            checkpoints = tmp / "checkpoints" if mode == "eager" else None
            r, s = fitting_training(s, seeds[mode], ctx, args.steps, mode == "compiled", tmp / mode, checkpoints)
            r.pop("trainer").close()
            results[mode] = r
            print(training_line(name, mode, r, reference, s), flush=True)
            if "save_seconds" in r:
                [saved] = checkpoints.glob("step_*.pt")
                print(f"{name}: checkpoint {saved.stat().st_size / 2**20:,.1f} MiB saved in {r['save_seconds']:.1f} s "
                      "(Trainer.save: weights, Adam, RNGs, sha256 sidecar)", flush=True)
    sources, _ = synthetic_corpus(args.sentences, seed=100 + PRESETS.index(name), vocab=s.vocab, mean=WMT_MEAN,
                                  sd=WMT_SD, longest=WMT_LONGEST)
    sources = [np.asarray(sources[i], dtype=np.int64) for i in range(len(sources))]
    trained = distributed.autocast_dtype(device)
    for dtype, what in ((trained, f"training precision, {precision(trained)}"), (torch.float32, "fp32")):
        results[f"decode {what}"] = rate = time_decoding(s, sources, dtype)
        print(f"{name}: beam {s.translate_cfg.beam_size}, {what}: {rate:.1f} sentences/s (translate_ids)", flush=True)
    return results


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per model and mode, after the warm-up")
    parser.add_argument("--sentences", type=int, default=400, help="sentences decoded per model and precision")
    parser.add_argument("--no-compile", action="store_true", help="skip the train.compile runs")
    parser.add_argument("--models", nargs="+", choices=PRESETS, default=list(PRESETS), help="presets to check")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: the code path on a CPU
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    """Print every line; return what they measured, per preset (tests), or None without CUDA."""
    args = arguments().parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check")
        return None
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with process_group(device) as ctx:
        return {name: check(name, device, args, ctx) for name in args.models}


if __name__ == "__main__":
    main()
