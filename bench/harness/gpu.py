"""gpu-check's setting: a preset's model and training settings on this device, and fresh corpora through the batch
stage (bench/gpu/check.py)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.harness import synthetic_corpus
from model.config import ModelConfig
from pipeline.core import config
from pipeline.core.config import BatchConfig, TrainConfig, TranslateConfig
from pipeline.corpus import steps as steps_lib
from pipeline.corpus.formats import ID_DTYPE, OFFSET_DTYPE, Ragged, split_paths
from pipeline.device import distributed
from pipeline.training.loader import TrainingData
from pipeline.corpus.batching import write_batches

WMT_MEAN, WMT_SD, WMT_LONGEST = 28, 14, 250  # BPE tokens per WMT14 en-de sentence (approximate), tokenize.max_len
TINY = ["model=tiny", "tokenize.vocab_size=100", "batch.max_tokens=512", "train.tokens_per_step=1024"]  # --tiny: on a CPU
WARMUP_STEPS = 3  # compiling takes a few shapes' worth of steps; DDP sets its buckets up on the first
SETTLE_STEPS = 5  # warm-up steps more, at most, until one compiles nothing new (steps.timed)
VALID_PAIRS = 64  # Trainer builds its validation batches (not timed here)
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


def arguments(doc: str, verb: str) -> argparse.ArgumentParser:
    """A GPU bench's parser: its docstring's first line, --models (the presets to `verb`), the hidden --tiny."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=PRESETS, default=list(PRESETS), help=f"presets to {verb}")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: the code path on a CPU
    return parser


def gpu_or_tiny(tool: str, nothing: str, tiny: bool) -> torch.device | None:
    """The CUDA device a GPU bench runs on; the CPU for --tiny (tests); else None, having said there is no GPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if tiny:
        return torch.device("cpu")
    print(f"{tool}: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to {nothing}")
    return None


def parsed(parser: argparse.ArgumentParser, argv: list[str] | None, tool: str,
           nothing: str) -> tuple[argparse.Namespace, torch.device | None]:
    """A GPU bench's arguments and its device (gpu_or_tiny: None where it has nothing to `nothing`)."""
    args = parser.parse_args(argv)
    return args, gpu_or_tiny(tool, nothing, args.tiny)


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
    preset's whole BatchConfig (its metrics in directory/batch.json), then TrainingData.load."""
    src, tgt = synthetic_corpus(pairs, seed=seed, vocab=s.vocab, mean=WMT_MEAN, sd=WMT_SD, longest=WMT_LONGEST)
    tokenized = write_tokenized(directory / "tokenized", src, tgt, s.vocab)
    write_batches(tokenized, directory / "batches", directory / "batch.json", s.batch_cfg, s.batches_per_step,
                  s.train_cfg.seed)
    return TrainingData.load(tokenized, directory / "batches", s.batch_cfg.length_bucket_step)


def training_data(s: Setup, seed: int, steps: int, directory: Path) -> TrainingData:
    """stream() with pairs enough that the warm-up (settling included), the timed and the profiled steps (and the
    step prefetched after them) all come from its first epoch: no batch is trained on twice."""
    needed = (WARMUP_STEPS + SETTLE_STEPS + steps + 2) * s.batches_per_step
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
