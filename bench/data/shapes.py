"""Distinct batch shapes and padding by length bucket, on the default corpus and a WMT-sized stand-in; the
micro-batch plan of the paper's presets for an 80 GB and a 16 GB GPU.

    python -m bench.data.shapes [--tokenized data/tokenized] [--pairs 4500000]

A GPU pays some costs once per distinct micro-batch shape (cuDNN attention
plans, compiled graphs, CUDA graphs): batch.length_bucket_step pads lengths to
a geometric grid so that a run sees a few hundred shapes, not thousands
(pipeline/corpus/batching.py). This prints, for bucket steps 1.0 (exact), 1.05,
1.1 and 1.2: batches, distinct (rows, source, target) shapes and padding
efficiency of one epoch, and the real source / target tokens a stored batch
holds, for
  - the default preset's train split (`--tokenized`, the tokenize stage's
    output: run `dvc repro tokenize` first) at its batch.max_tokens, and
  - a WMT14-sized stand-in of `--pairs` pairs whose lengths are sums of
    m ~ Geometric(0.55) Multi30k pairs (as bench/data/scale.py joins sentences:
    mean ~28 tokens a side, a long tail), at 8 x 3300 exact-length batches (the
    real tokens a step the presets aim at) and at the presets' one batch a step.
Targets (issue figures): a few hundred shapes at most, padding efficiency >= 0.95.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from model.config import ModelConfig
from pipeline.core.config import compose, parse
from pipeline.corpus.batching import make_batches, model_lengths, padding_stats
from pipeline.training import plan

STEPS = (1.0, 1.05, 1.1, 1.2)
GB = 1e9


def stand_in(S: np.ndarray, T: np.ndarray, pairs: int, seed: int = 0, longest: int = 257) -> tuple[np.ndarray, ...]:
    """WMT-like model lengths: each pair joins m ~ Geometric(0.55) pairs of (S, T) (one EOS / BOS kept)."""
    rng = np.random.default_rng(seed)
    m = rng.geometric(0.55, size=pairs)
    joined, group = rng.integers(0, len(S), size=int(m.sum())), np.repeat(np.arange(pairs), m)
    s, t = (np.bincount(group, weights=L[joined] - 1, minlength=pairs).astype(np.int64) + 1 for L in (S, T))
    keep = np.maximum(s, t) <= longest  # tokenize.max_len 256, with EOS / BOS
    return s[keep], t[keep]


def report(name: str, S: np.ndarray, T: np.ndarray, max_tokens: int, steps=STEPS) -> None:
    print(f"{name}: {len(S):,} pairs, mean {S.mean():.1f} source / {T.mean():.1f} target tokens, max_tokens {max_tokens}")
    for step in steps:
        batches = make_batches(S, T, max_tokens, seed=1, length_bucket_step=step)
        stats = padding_stats(S, T, batches, step)
        print(f"  step {step:<4}: {len(batches):7,} batches, {stats['num_shapes']:5,} shapes, padding efficiency "
              f"{stats['padding_efficiency']:.4f}, real tokens a batch {stats['src_tokens_per_batch_mean']:.0f} / "
              f"{stats['tgt_tokens_per_batch_mean']:.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--pairs", type=int, default=4_500_000)
    args = parser.parse_args(argv)
    if not (args.tokenized / "meta.json").exists():
        raise SystemExit(f"shapes: error: {args.tokenized}/meta.json: missing; run `dvc repro tokenize` first")
    S, T = model_lengths(args.tokenized, "train")
    report("default preset train split", S, T, compose([])["batch"]["max_tokens"])
    s, t = stand_in(S, T, args.pairs)
    base = compose(["experiment=wmt14_en_de_base"])
    report("WMT-sized stand-in, 8 exact-length batches of 3300 a step", s, t, 3300, steps=(1.0,))
    print("  (x 8 for a step)")
    report("WMT-sized stand-in, the presets' one batch a step", s, t, base["batch"]["max_tokens"])
    for experiment in ("wmt14_en_de_base", "wmt14_en_de_big"):
        params = compose([f"experiment={experiment}"])
        cfg, vocab, step = parse(params, "model", ModelConfig), params["tokenize"]["vocab_size"], params["train"]["tokens_per_step"]
        for memory in (80, 16):
            budget = plan.tokens_for_memory(cfg, vocab, memory * GB)
            print(f"{experiment} on a {memory} GB GPU: micro-batches of <= {budget:,} padded tokens, a step of "
                  f"{step:,} in {-(-step // budget)} ({plan.activation_bytes(cfg) / 2**20:.2f} MiB a token)")


if __name__ == "__main__":
    main()
