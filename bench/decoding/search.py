"""Decoding speed: what the translate stage runs against the same search recomputing the whole prefix each step.

    python -m bench.decoding.search [--model data/model --tokenized data/tokenized [--raw data/raw]] [--sentences N]
                           [--rounds 2] [--threads N]

Both sides call pipeline.translation.decoding.translate_ids, the translate stage's own
function, with the preset's `translate` params (beam 4, alpha 0.6, max length
source + 50, max_tokens): once as the stage runs it (key/value cache, batches
decoded side by side on the torch threads) and once with use_cache=False
(every step re-runs the decoder over the whole prefix; same tokens). Rounds
alternate, cached then uncached, so that load from other programs hits both
alike; each side's best round is reported as sentences/s, with the ratio and
whether both found the same tokens.

Data: with --model and --tokenized, the trained model and the test split
(Multi30k test2016: 1000 sentences) when both exist; with --raw too, each
side's sacreBLEU against the test references (as the evaluate stage scores
it). Otherwise the default
preset's model (`pipeline.core.config.compose([])`), randomly initialised, on
random Multi30k-like sources of 8 to 30 tokens. An untrained model almost
never emits EOS, so every sentence would run to its maximum length (source +
50) and the uncached search, quadratic in the output length, would look far
worse than on real translations. The random model is therefore wrapped so
EOS's logit gets slope x (t - S_i) at output position t for a source of S_i
tokens: outputs end near the source length, as Multi30k translations do, while
every step still runs the full model (the bias costs one addition per row).

Threads: as the stage, all cores (`--threads` to choose; OMP_NUM_THREADS is
not read here).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
from sacrebleu.metrics import BLEU

from model.config import ModelConfig
from bench.harness import alternate
from bench.harness.decoding import EosNearSourceLength, multi30k_like_sources, timed
from model.transformer import Transformer
from pipeline.weights.checkpoint import load_model
from pipeline.core.config import TranslateConfig, compose, parse
from pipeline.corpus.formats import load_spm, load_split, read_meta
from pipeline.translation.scoring import printed, read_lines
from pipeline.corpus.formats import detokenize

log = logging.getLogger("bench.decoding.search")


def real_data(model_dir: Path | None, tokenized: Path | None) -> tuple[Transformer, list[np.ndarray]] | None:
    """The trained model and the test split's source ids, if both are there."""
    if model_dir is None or tokenized is None or not (model_dir / "model.pt").exists():
        return None
    if not (tokenized / "meta.json").exists():
        return None
    encoded = load_split(tokenized, "test", read_meta(tokenized)["src_lang"])
    return load_model(model_dir, torch.device("cpu")), [encoded[i] for i in range(len(encoded))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a trained model (the average stage's output)")
    parser.add_argument("--tokenized", type=Path, help="the tokenize stage's output: its test split is decoded")
    parser.add_argument("--raw", type=Path, help="the download stage's output: BLEU against its test references")
    parser.add_argument("--sentences", type=int, default=0, help="decode only the first N sources (0: all; random: 100)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slope", type=float, default=2.0, help="random model: EOS logit bias per position past S")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    preset = compose([])
    cfg = parse(preset, "translate", TranslateConfig)
    if found := real_data(args.model, args.tokenized):
        model, sources = found
        what = f"{args.model} on the test split of {args.tokenized}"
    else:
        torch.manual_seed(args.seed)
        vocab = preset["tokenize"]["vocab_size"]
        model = EosNearSourceLength(Transformer(parse(preset, "model", ModelConfig), vocab), args.slope).eval()
        sources = multi30k_like_sources(args.sentences or 100, vocab, torch.Generator().manual_seed(args.seed))
        what = f"the default preset's model, randomly initialised (EOS near the source length), vocab {vocab}"
    sources = sources[: args.sentences] if args.sentences else sources
    n = len(sources)
    log.info("%s: %d sentences, beam %d, %d threads", what, n, cfg.beam_size, args.threads)

    timed(model, sources[:8], cfg, use_cache=True)  # warm-up: allocator, threads
    outputs: dict[bool, list[list[int]]] = {}

    def way(use_cache: bool):
        def run(_: int) -> float:
            outputs[use_cache], s = timed(model, sources, cfg, use_cache)
            return s
        return run

    said = lambda r, name, s: log.info("round %d, %s: %.1f sentences/s (load average %.1f)", r + 1,  # noqa: E731
                                       "cached" if name else "recompute", n / s, os.getloadavg()[0])
    seconds = alternate({True: way(True), False: way(False)}, args.rounds, said)
    cached, uncached = min(seconds[True]), min(seconds[False])
    src_len = np.mean([len(s) + 1 for s in sources])
    out_len = np.mean([len(o) + 1 for o in outputs[True]])
    print(f"beam {cfg.beam_size}, {n} sentences, mean source {src_len:.1f} tokens, mean output {out_len:.1f} tokens "
          f"(EOS included), {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"cached (translate stage): {n / cached:8.1f} sentences/s ({cached:.2f} s, best of {args.rounds})")
    print(f"recompute the prefix:     {n / uncached:8.1f} sentences/s ({uncached:.2f} s)")
    print(f"speedup: {uncached / cached:.2f}x; identical tokens: {outputs[True] == outputs[False]}")
    if found and args.raw:
        sp, lang = load_spm(args.tokenized, model.embedding.num_embeddings), read_meta(args.tokenized)["tgt_lang"]
        refs = read_lines(args.raw / f"test.{lang}")[:n]
        bleu = [printed(BLEU().corpus_score(detokenize(sp, outputs[c]), [refs])) for c in (True, False)]
        print(f"sacreBLEU (test.{lang}): cached {bleu[0]}, recompute {bleu[1]}")


if __name__ == "__main__":
    main()
