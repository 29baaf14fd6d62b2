"""What the benchmarks share: the default's model, data and training step built as the train stage builds them, and
one way to time ways against each other (bench/harness/: this module; decoding.py, the decoding models and timing;
gpu.py, steps.py, kernels.py, reference.py, the GPU benches' setting and lines). No bench imports another bench.

    seconds = alternate({"ours": run_a, "theirs": run_b}, rounds=3)   # each way once a round, in turn
    model_cfg, train_cfg = default_configs(["train.rdrop_alpha=5"])  # conf/ composed, as dvc exp run -S takes it
    model_cfg, train_cfg, precision = on_this_cpu([], threads=2)     # the same, its precision and threads in use
    *_, batches = synthetic_batches(1250, 12)                        # Multi30k-like batches, collated on the CPU
    batches = learnable_batches(1250, 300)                           # the same lengths, targets a function of sources
    step = under_autocast(our_step(Transformer(model_cfg, VOCAB), train_cfg), precision)
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np
import torch

from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.transformer import Transformer
from pipeline.core import config
from pipeline.core.config import TrainConfig
from pipeline.corpus.batching import make_batches
from pipeline.corpus.formats import Ragged
from pipeline.device import attention, distributed
from pipeline.device.precision import Precision, resolve
from pipeline.training.loader import Batch, TrainingData, collate
from pipeline.training.optimizer import build_optimizer, train_step

VOCAB = 8000


MAX_TOKENS = 2500


def synthetic_corpus(pairs: int, seed: int = 0, vocab: int = VOCAB, mean: float = 14, sd: float = 5,
                     longest: int = 60) -> tuple[Ragged, Ragged]:
    """Random token ids with Multi30k-like lengths (the defaults): source ~ N(14, 5), target ~ 1.04 x source + N(0, 2.5).

    The target length follows the source's as in real translation pairs
    (Multi30k en-de, BPE 8000: 14.3 +- 4.7 and 14.8 +- 5.4 tokens), which sets
    how tightly length bucketing packs the batches. Other corpora: their mean,
    sd and longest sentence (bench.gpu.check: WMT14's).
    """
    rng = np.random.default_rng(seed)
    S = np.clip(np.rint(rng.normal(mean, sd, pairs)), 1, longest).astype(np.int64)
    T = np.clip(np.rint(1.04 * S + rng.normal(0, sd / 2, pairs)), 1, longest).astype(np.int64)
    out = []
    for lengths in (S, T):
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        out.append(Ragged(rng.integers(4, vocab, size=int(offsets[-1])).astype(np.uint16), offsets))
    return out[0], out[1]


def stored_epoch(tokenized, batches, seed: int = 0) -> tuple[int, list[Batch]]:
    """(vocabulary, every train batch the batch stage stored, in one seeded order, on the CPU)."""
    data = TrainingData.load(tokenized, batches)
    order = np.random.default_rng(seed).permutation(len(data.train_batches))
    return data.vocab_size, [data.collate_train(data.train_batches[i], torch.device("cpu")) for i in order]


def learnable_batches(max_tokens: int, count: int, vocab: int = VOCAB, seed: int = 0) -> list[Batch]:
    """`count` training batches (epochs in a seeded order) of a synthetic language a model can learn, unlike
    synthetic_corpus's unrelated sides: each target is its source reversed, every id mapped through one fixed
    random permutation of the vocabulary; sources of Multi30k-like lengths, collated on the CPU."""
    src, _ = synthetic_corpus(29000, seed=seed, vocab=vocab)
    rng = np.random.default_rng(seed + 1)
    table = np.arange(vocab)
    table[4:] = 4 + rng.permutation(vocab - 4)  # the ids past PAD, UNK, BOS and EOS
    row = np.repeat(np.arange(len(src)), src.lengths)  # each token's sentence
    reversed_at = src.offsets[row + 1] - 1 - (np.arange(len(src.values)) - src.offsets[row])
    tgt = Ragged(table[src.values[reversed_at]].astype(src.values.dtype), src.offsets)
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, max_tokens, seed=seed)
    order = np.concatenate([rng.permutation(len(batches)) for _ in range(-(-count // len(batches)))])[:count]
    return [collate(src, tgt, batches[b], torch.device("cpu")) for b in order]


def default_configs(overrides: list[str] | tuple[str, ...] = ()) -> tuple[ModelConfig, TrainConfig]:
    """The default preset's model and train sections (conf/ composed with `overrides`, none by default)."""
    params = config.compose(list(overrides))
    return config.parse(params, "model", ModelConfig), config.parse(params, "train", TrainConfig)


def on_this_cpu(overrides: list[str], threads: int) -> tuple[ModelConfig, TrainConfig, Precision]:
    """The default's configs (default_configs) on `threads` threads, in the precision its train.cpu_matmul resolves
    to on this CPU, with the attention kernels that go with it, as the train stage sets them."""
    torch.set_num_threads(threads)
    model_cfg, train_cfg = default_configs(overrides)
    precision = resolve(train_cfg.cpu_matmul, torch.device("cpu"))
    precision.use()
    attention.use(torch.device("cpu"))
    return model_cfg, train_cfg, precision


def synthetic_batches(max_tokens: int, count: int, vocab: int = VOCAB) -> tuple[Ragged, Ragged, list, np.ndarray,
                                                                               list[Batch]]:
    """`count` batches of at most max_tokens drawn (seeded) from the synthetic Multi30k-like corpus of ids < vocab:
    (src, tgt, all batches' rows, the drawn batch ids, the drawn batches collated on the CPU)."""
    src, tgt = synthetic_corpus(29000, vocab=vocab)
    batches = make_batches(src.lengths + 1, tgt.lengths + 1, max_tokens, seed=1)
    order = np.random.default_rng(0).permutation(len(batches))[:count]
    return src, tgt, batches, order, [collate(src, tgt, batches[b], torch.device("cpu")) for b in order]


def our_step(model: Transformer, train_cfg: TrainConfig, lr: float = 1e-4) -> Callable[..., torch.Tensor]:
    """One training step of `model` as the train stage runs it on a CPU (chunked loss, train.optimizer: fused Adam
    in the presets, fp32; R-Drop as train_cfg sets it): step(batch) at `lr`, or step(batch, lr); the summed loss."""
    loss_model = SmoothedLoss(model, train_cfg.label_smoothing, chunked=True, rdrop_alpha=train_cfg.rdrop_alpha,
                              rdrop_fraction=train_cfg.rdrop_fraction)
    optimizer = build_optimizer(model, train_cfg)
    ctx, scaler = distributed.Dist(0, 1, 0, torch.device("cpu")), torch.amp.GradScaler("cpu", enabled=False)
    return lambda b, at=lr: train_step(loss_model, optimizer, [(b, True)], b.tokens, at, ctx, contextlib.nullcontext(),
                                       scaler)


def under_autocast(step: Callable[..., object], precision: Precision) -> Callable[..., object]:
    """`step` run in the `precision`'s autocast (none for fp32), as the trainer runs it; what it returns."""
    def run(*args: object) -> object:
        with precision.autocast():
            return step(*args)
    return run


def sync(device: torch.device) -> None:
    """Wait for a GPU's queued work (a CPU's is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def over(step: Callable[[Batch], object], batches: list[Batch]) -> Callable[[int], None]:
    """One way for alternate(): `step` on each of `batches`, whatever the round."""
    def run(_: int) -> None:
        for batch in batches:
            step(batch)
    return run


def alternate(ways: dict[str, Callable[[int], float | None]], rounds: int,
              said: Callable[[int, str, float], None] | None = None) -> dict[str, list[float]]:
    """Each way called once a round, in turn, for `rounds` rounds, so that load from other programs hits every way
    alike: the seconds of each call, per way. Each way is called with the round's index; a way that times itself
    (work in another process) returns its own seconds, else its call is timed here. `said(round, way, seconds)` after
    each call."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, run in ways.items():
            start = time.perf_counter()
            own = run(r)
            seconds[name].append(own if own is not None else time.perf_counter() - start)
            if said is not None:
                said(r, name, seconds[name][-1])
    return seconds
