"""Decoding speed and BLEU: the CTranslate2 export, float32 and int8, against the project's decoder, in one run.

    python -m bench.decoding.export [--model data/model --tokenized data/tokenized --raw data/raw] [--split test]
                           [--sentences N] [--rounds 1] [--threads N] [--penalties]

The same averaged model, the same sources (the split's encoded lines, the first N with --sentences) and the
preset's `translate` params (beam 4 and its length limits; the length penalty mapped for CTranslate2 as
pipeline/translation/engine.py says). The model is exported twice into a temporary directory (quantization none and
int8, as the export stage writes it); then each round decodes the sources with the project's decoder
(pipeline/translation/decoding.py, as the translate stage runs it), CTranslate2 float32 and CTranslate2 int8, in turn, so that
load from other programs hits all three alike. Each engine's best round is reported as sentences/s and as a ratio to
the project's, with its sacreBLEU against the split's references, the share of outputs identical to the project's,
and each model's size. --penalties also decodes with CTranslate2 float32 at beta 0 and beta = alpha (instead of
the mapped beta), to show what the mapping gives. Threads: every core (or --threads), for every engine.

CTranslate2 decodes in a process of its own (started once, spawned): once it has run in a process, the project's
decoder runs slower in that process (129 against 85 sentences/s measured on 2 cores of an AMD EPYC), which would
flatter CTranslate2. The project's decoder keeps this process, where no CTranslate2 model is ever loaded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU

from bench.harness import alternate
from pipeline.core.config import TranslateConfig, compose, parse
from pipeline.device import cpu
from pipeline.corpus.formats import load_spm, load_split, read_meta
from pipeline.corpus.formats import detokenize
from pipeline.translation.decoding import translate_ids
from pipeline.translation.engine import Ctranslate2Engine
from pipeline.export.spec import write_ctranslate2
from pipeline.translation.scoring import read_lines
from pipeline.weights.checkpoint import load_model


_ENGINES: dict[str, Ctranslate2Engine] = {}  # in the CTranslate2 process: name -> engine


def _load_engines(directories: dict[str, str], threads: int) -> None:
    _ENGINES.update({name: Ctranslate2Engine(Path(d), threads) for name, d in directories.items()})


def _ct2_decode(name: str, sources: list, cfg: TranslateConfig, beta: float | None) -> tuple[list[list[int]], float]:
    """In the CTranslate2 process: (outputs, seconds) of one engine over `sources`."""
    start = time.perf_counter()
    outputs = _ENGINES[name].translate_ids(sources, cfg, beta=beta)
    return outputs, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"))
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"))
    parser.add_argument("--raw", type=Path, default=Path("data/raw"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--split", default="test", choices=("test", "valid"))
    parser.add_argument("--sentences", type=int, default=0, help="decode only the first N sources (0: all)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--penalties", action="store_true", help="also CTranslate2 at beta 0 and beta = alpha")
    args = parser.parse_args(argv)
    import yaml

    raw_params = yaml.safe_load(args.params.read_text()) if args.params.exists() else compose([])
    cfg = parse(raw_params, "translate", TranslateConfig)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, torch.device("cpu"))
    meta = read_meta(args.tokenized)
    encoded = load_split(args.tokenized, args.split, meta["src_lang"])
    n = len(encoded) if args.sentences <= 0 else min(args.sentences, len(encoded))
    sources = [encoded[i] for i in range(n)]
    references = read_lines(args.raw / f"{args.split}.{meta['tgt_lang']}")[:n]
    bleu = BLEU()
    with tempfile.TemporaryDirectory() as tmp:
        directories, sizes = {}, {"project": (args.model / "model.pt").stat().st_size}
        for name, quantization in (("ctranslate2 fp32", "none"), ("ctranslate2 int8", "int8")):
            directories[name] = str(Path(tmp) / quantization)
            write_ctranslate2(model, args.tokenized, Path(directories[name]), quantization, {})
            sizes[name] = (Path(directories[name]) / "model.bin").stat().st_size
        runs = {name: (name, None) for name in directories}
        if args.penalties:
            runs["ctranslate2 fp32, beta 0"] = ("ctranslate2 fp32", 0.0)
            runs[f"ctranslate2 fp32, beta {cfg.length_penalty:g}"] = ("ctranslate2 fp32", cfg.length_penalty)
        with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _load_engines,
                                 (directories, args.threads)) as ct2:
            warm = sources[:16]  # each engine's first call sets itself up: not timed
            translate_ids(model, warm, cfg, progress=False)
            for name in directories:
                ct2.submit(_ct2_decode, name, warm, cfg, None).result()
            outputs = {}

            def project(_: int) -> None:
                outputs["project"] = translate_ids(model, sources, cfg, progress=False)

            def engine_run(name: str, engine: str, beta: float | None):
                def run(_: int) -> float:  # timed in the CTranslate2 process
                    outputs[name], seconds = ct2.submit(_ct2_decode, engine, sources, cfg, beta).result()
                    return seconds
                return run

            ways = {"project": project} | {name: engine_run(name, *run) for name, run in runs.items()}
            best = {name: min(seconds) for name, seconds in alternate(ways, args.rounds).items()}
        sp = load_spm(args.tokenized, model.embedding.num_embeddings)
    print(f"{cpu.name()}, {args.threads} threads; {args.split}: {n} sentences, beam {cfg.beam_size}, "
          f"alpha {cfg.length_penalty:g} (CTranslate2: mapped beta unless named), "
          f"max length {cfg.max_len_a:g} x source + {cfg.max_len_b}; best of {args.rounds} round(s)")
    print(f"{'decoder':<28} {'sentences/s':>12} {'ratio':>7} {'BLEU':>7} {'identical':>10} {'model MB':>9}")
    for name, out in outputs.items():
        identical = sum(a == b for a, b in zip(out, outputs["project"])) / max(n, 1)
        size = sizes.get(name.split(",")[0])
        print(f"{name:<28} {n / best[name]:12.1f} {best['project'] / best[name]:6.2f}x "
              f"{bleu.corpus_score(detokenize(sp, out), [references]).score:7.2f} {identical:10.1%} "
              f"{'' if size is None else f'{size / 1e6:9.1f}'}")


if __name__ == "__main__":
    main()
