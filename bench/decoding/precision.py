"""Decoding precision: the translate stage's beam search in fp32 and in the training precision, same model, same BLEU?
Measures, per device, what translate.precision = auto chooses: fp32 unless another precision decodes faster here.

    python -m bench.decoding.precision --model data/model --tokenized data/tokenized --raw data/raw [--dtype bf16]

Decodes the test split (Multi30k test2016 for the default) with the stage's
own translate_ids and `translate` params twice on this machine's device: the
model in fp32, then cast once to the training precision (bf16 on GPUs that
have it; a CPU stays fp32 unless --dtype asks for another), and
prints each one's sentences/s, sacreBLEU and Multi30k lc.norm.tok BLEU, and the
differences (the translate stage may decode in the training precision only
where it loses at most 0.1 BLEU).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.harness.decoding import timed
from pipeline.core.config import TranslateConfig, compose, parse
from pipeline.corpus.formats import load_spm, load_split, read_meta
from pipeline.translation.scoring import multi30k_bleu, read_lines, score
from pipeline.weights.checkpoint import load_model
from model.flops import DTYPE_NAMES
from pipeline.device import precision as training_precision
from pipeline.corpus.formats import detokenize

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # --dtype


def decode(model, sources: list[np.ndarray], cfg: TranslateConfig, sp, refs: list[str], lang: str) -> dict:
    """translate_ids over `sources`: sentences/s and the scores of its detokenized output."""
    timed(model, sources[:8], cfg)  # warm-up: kernels, allocator
    outputs, seconds = timed(model, sources, cfg)
    hyps = detokenize(sp, outputs)
    s = score(hyps, refs, lang, "13a")
    return {"sentences_per_s": len(sources) / seconds, "bleu": s.bleu, "lc_norm_tok": multi30k_bleu(hyps, refs, lang),
            "hyps": hyps}


def compare(model_dir: Path, tokenized: Path, raw: Path, dtype: torch.dtype | None = None) -> dict[str, dict]:
    """{precision name: decode()} for fp32 and the decoding precision (`dtype` forces one)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    meta = read_meta(tokenized)
    encoded = load_split(tokenized, "test", meta["src_lang"])
    sources = [encoded[i] for i in range(len(encoded))]
    refs = read_lines(raw / f"test.{meta['tgt_lang']}")
    cfg = parse(compose([]), "translate", TranslateConfig)
    results = {}
    for name in ("fp32", "decoding"):
        model = load_model(model_dir, device).eval()
        if name == "decoding":
            chosen = training_precision.autocast_dtype(device) if dtype is None else dtype  # the training precision
            model.to(chosen)  # cast once, as the stage does with translate.precision
            name = DTYPE_NAMES[chosen]
            if name == "fp32":
                break  # this device decodes in fp32: nothing to compare
        sp = load_spm(tokenized, model.embedding.num_embeddings)
        results[name] = decode(model, sources, cfg, sp, refs, meta["tgt_lang"])
    return results


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--raw", type=Path, default=Path("data/raw"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="decode in this precision instead of the device's")
    args = parser.parse_args(argv)
    results = compare(args.model, args.tokenized, args.raw, DTYPES[args.dtype] if args.dtype else None)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    for name, r in results.items():
        print(f"{device}, {name}: {r['sentences_per_s']:.1f} sentences/s, sacreBLEU {r['bleu']:.2f}, "
              f"lc.norm.tok BLEU {r['lc_norm_tok']:.2f}")
    if len(results) == 2:
        (_, a), (low, b) = results.items()
        same = sum(x == y for x, y in zip(a["hyps"], b["hyps"]))
        print(f"{low} - fp32: sacreBLEU {b['bleu'] - a['bleu']:+.2f}, lc.norm.tok {b['lc_norm_tok'] - a['lc_norm_tok']:+.2f}; "
              f"{same} of {len(a['hyps'])} translations identical; {b['sentences_per_s'] / a['sentences_per_s']:.2f}x "
              "the sentences/s")
    else:
        print(f"{device} decodes in fp32, as it trains: nothing to compare (--dtype bf16 to try one)")
    return results


if __name__ == "__main__":
    main()
