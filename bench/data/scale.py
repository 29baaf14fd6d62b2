"""Data-scale benchmark: the tokenize and batch stages on a WMT14-sized corpus, and batching on Multi30k.

    python -m bench.data.scale [--pairs 4500000] [--mirror DIR (default: $CORPUS_MIRROR, else ../shared/mirror)] [--work DIR]
                               [--input-sentence-size N (default: the preset's)] [--experiment wmt14_en_de_base]

    python -m bench.data.scale --pairs 36000000 --experiment wmt14_en_fr_big   # the en-fr size

1. Synthesizes `--pairs` aligned pairs from the mirror's real text (Multi30k
   train, newstest2013, newstest2014: about 35k pairs). Each synthetic pair
   joins m random pool pairs, both sides in the same order so the pair stays a
   translation, with m ~ Geometric(0.55) (m = 1 for 55%, mean 1.8, m >= 7 for
   ~1%): lengths then resemble WMT14's, about 27 tokens a side on average with
   a long tail past 100 (the figures are printed). valid = newstest2013, test =
   newstest2014, as in the paper. The files are the download stage's output
   (data/raw/{split}.{src_lang,tgt_lang}) for the `--experiment` preset; the
   mirror has no French, so for wmt14_en_fr_big the German side stands in for
   French (train.fr holds German: the lengths and the work are alike).
2. Runs `python -m stages.tokenize` with the `--experiment` preset's tokenizer
   (wmt14_en_de_base: BPE 37000; wmt14_en_fr_big: unigram 32000, Sec. 5.1;
   sentencepiece trained on the preset's sample of sentences, 10M for en-de
   (all 9M at 4.5M pairs), 2M for en-fr, unless --input-sentence-size) and
   `python -m stages.batch` with the preset's batch and train params
   (max_tokens 3300 a GPU, 8 GPUs, unless --max-tokens), each as its own process, exactly as DVC
   calls them, printing wall time and peak memory (maxrss from wait4) per phase,
   the padding efficiency and the real source and target tokens per step.
3. Tokenizes Multi30k as the default preset does and prints the padding
   efficiency of pipeline.corpus.batching at max_tokens 2500 and 6000 beside the naive
   baseline (sort by (target, source) length, fill greedily), measured here.

Targets on a 2-core machine: tokenize + batch of 4.5M pairs (en-de) under 15
minutes and 6 GiB, of 36M pairs (en-fr) within 30 minutes and 8 GiB; padding
efficiency >= 0.97 at 4.5M pairs, and on Multi30k >= 0.97 (2500) and >= 0.95
(6000).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from pipeline.corpus.batching import make_batches, model_lengths, padding_stats
from pipeline.core.config import compose
from pipeline.corpus.formats import Ragged
from pipeline.corpus.rawtext import read_raw_lines, read_sgm

ROOT = Path(__file__).resolve().parent.parent
MULTI30K = "raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
NEWSTEST2013 = "statmt.org/wmt14/dev.tgz/dev/newstest2013"
NEWSTEST2014 = "statmt.org/wmt14/test-full.tgz/test-full/newstest2014-deen-{}.{}.sgm"
LANGS = ("en", "de")
CHUNK = 100_000
EXPERIMENTS = ("wmt14_en_de_base", "wmt14_en_de_big", "wmt14_en_fr_big")
TARGETS = {"wmt14_en_fr": (30, 8), "wmt14_en_de": (15, 6)}  # minutes, GiB for tokenize + batch, by data preset


def read_gz(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def sgml_texts(path: Path) -> list[str]:
    """The <seg> texts of a WMT SGML file, in order, as the download stage reads them."""
    return [s.text for s in read_sgm(read_raw_lines(path, False, str(path)), str(path))]


def read_pool(mirror: Path) -> dict[str, dict[str, list[str]]]:
    """Aligned real pairs from the mirror: {corpus: {lang: lines}}."""
    pool = {
        "multi30k": {lang: read_gz(mirror / MULTI30K / f"train.{lang}.gz") for lang in LANGS},
        "newstest2013": {lang: (mirror / f"{NEWSTEST2013}.{lang}").read_text(encoding="utf-8").splitlines()
                         for lang in LANGS},
        "newstest2014": {"en": sgml_texts(mirror / NEWSTEST2014.format("src", "en")),
                         "de": sgml_texts(mirror / NEWSTEST2014.format("ref", "de"))},
    }
    for name, sides in pool.items():
        if len(sides["en"]) != len(sides["de"]):
            raise SystemExit(f"{mirror}: {name} has {len(sides['en'])} en but {len(sides['de'])} de segments")
    return pool


def synthesize(pool: dict, pairs: int, raw: Path, seed: int = 0, langs: tuple[str, str] = LANGS) -> None:
    """Write raw/{train,valid,test}.{langs}: `pairs` joined pool pairs for train (see the docstring); the pool's
    English and German text go into the files of langs[0] and langs[1]."""
    raw.mkdir(parents=True, exist_ok=True)
    src = [s for corpus in pool.values() for s in corpus["en"]]
    tgt = [t for corpus in pool.values() for t in corpus["de"]]
    rng = np.random.default_rng(seed)
    with (open(raw / f"train.{langs[0]}", "w", encoding="utf-8") as fs,
          open(raw / f"train.{langs[1]}", "w", encoding="utf-8") as ft):
        for start in range(0, pairs, CHUNK):
            m = rng.geometric(0.55, size=min(CHUNK, pairs - start))
            picks = rng.integers(0, len(src), size=int(m.sum())).tolist()
            ends = np.cumsum(m).tolist()
            spans = [picks[a:b] for a, b in zip([0] + ends[:-1], ends)]
            fs.write("".join(" ".join(src[j] for j in span) + "\n" for span in spans))
            ft.write("".join(" ".join(tgt[j] for j in span) + "\n" for span in spans))
    for split, corpus in (("valid", "newstest2013"), ("test", "newstest2014")):
        for pool_lang, lang in zip(LANGS, langs):
            (raw / f"{split}.{lang}").write_text("\n".join(pool[corpus][pool_lang]) + "\n", encoding="utf-8")


def write_params(path: Path, vocab_size: int | None, input_sentence_size: int | None, max_tokens: int | None = None,
                 experiment: str = "wmt14_en_de_base") -> dict:
    """The preset's params with these knobs (None: the preset's); a max_tokens given also sets one batch per GPU a
    step. Returns them."""
    params = compose([f"experiment={experiment}"])
    if input_sentence_size is not None:
        params["tokenize"]["input_sentence_size"] = input_sentence_size
    if vocab_size is not None:
        params["tokenize"]["vocab_size"] = vocab_size
    if max_tokens is not None:
        params["batch"]["max_tokens"] = max_tokens
        params["train"]["tokens_per_step"] = max_tokens * params["train"]["devices"]
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return params


def run_stage(args: list[str]) -> tuple[float, float, float]:
    """Run `python -m stages...` from the repo root; returns its (wall s, CPU s, peak RSS GiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed with exit code {proc.returncode}")
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - start, cpu, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def naive_batches(S: np.ndarray, T: np.ndarray, max_tokens: int) -> Ragged:
    """The baseline: sort by (target, source) length, then fill each batch as far as it fits."""
    index = np.lexsort((S, T))
    bounds, i = [0], 0
    while i < len(index):
        window = index[i : i + max_tokens]
        n = np.arange(1, len(window) + 1)
        longest = np.maximum.accumulate(np.maximum(S[window], T[window]))
        fits = n * longest <= max_tokens
        i += len(window) if fits.all() else int(np.argmin(fits))
        bounds.append(i)
    return Ragged(index, np.asarray(bounds))


def multi30k_efficiency(mirror: Path, work: Path) -> None:
    """Tokenize Multi30k as the default preset does; print ours vs the naive baseline at 2500 and 6000 tokens."""
    raw = work / "multi30k" / "raw"
    raw.mkdir(parents=True)
    splits = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
    for split, name in splits.items():
        for lang in LANGS:
            (raw / f"{split}.{lang}").write_text("\n".join(read_gz(mirror / MULTI30K / f"{name}.{lang}.gz")) + "\n",
                                                 encoding="utf-8")
    params, tok = work / "multi30k" / "params.yaml", work / "multi30k" / "tokenized"
    write_params(params, vocab_size=8000, input_sentence_size=0, max_tokens=2500)
    run_stage(["stages.tokenize", "--raw", str(raw), "--out", str(tok), "--metrics", str(work / "m30k.json"),
               "--params", str(params)])
    S, T = model_lengths(tok, "train")
    print(f"\nMulti30k train, {len(S)} pairs, padding efficiency (real / padded tokens, both sides):")
    print(f"{'max_tokens':>10} {'stages.batch':>13} {'naive':>8} {'ratio':>7} {'batches':>9} {'naive':>6}")
    for max_tokens in (2500, 6000):
        ours, naive = make_batches(S, T, max_tokens, seed=1), naive_batches(S, T, max_tokens)
        e, e0 = padding_stats(S, T, ours)["padding_efficiency"], padding_stats(S, T, naive)["padding_efficiency"]
        print(f"{max_tokens:>10} {e:>13.4f} {e0:>8.4f} {e / e0:>7.4f} {len(ours):>9} {len(naive):>6}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4_500_000)
    default_mirror = os.environ.get("CORPUS_MIRROR") or Path(__file__).resolve().parents[2] / "shared" / "mirror"
    parser.add_argument("--mirror", type=Path, default=Path(default_mirror))
    parser.add_argument("--work", type=Path, default=None, help="kept if given; else a temporary directory")
    parser.add_argument("--input-sentence-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the preset's batch.max_tokens")
    parser.add_argument("--experiment", choices=EXPERIMENTS, default="wmt14_en_de_base",
                        help="the preset whose languages, tokenizer and batching run (default: wmt14_en_de_base)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="data_scale."))
    try:
        work.mkdir(parents=True, exist_ok=True)
        params = work / "params.yaml"
        preset = write_params(params, None, args.input_sentence_size, args.max_tokens, args.experiment)
        langs = (preset["data"]["src_lang"], preset["data"]["tgt_lang"])
        start = time.perf_counter()
        synthesize(read_pool(args.mirror), args.pairs, work / "raw", langs=langs)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"synthesize {args.pairs} pairs ({args.experiment}: {langs[0]}-{langs[1]}): "
              f"{time.perf_counter() - start:.0f} s, peak {rss:.2f} GiB", flush=True)
        tok_s, tok_cpu, tok_gib = run_stage(["stages.tokenize", "--raw", str(work / "raw"), "--out",
                                             str(work / "tokenized"), "--metrics", str(work / "tokenize.json"),
                                             "--params", str(params)])
        bat_s, bat_cpu, bat_gib = run_stage(["stages.batch", "--tokenized", str(work / "tokenized"), "--out",
                                             str(work / "batches"), "--metrics", str(work / "batch.json"),
                                             "--params", str(params)])
        tm = json.loads((work / "tokenize.json").read_text())
        bm = json.loads((work / "batch.json").read_text())
        S, T = model_lengths(work / "tokenized", "train")
        print(f"\n{args.pairs} pairs, {preset['tokenize']['model_type']} vocab {tm['vocab_size']}, sentencepiece on "
              f"{preset['tokenize']['input_sentence_size'] or 'all'} sentences:")
        print(f"  kept {tm['train_pairs']}, dropped empty {tm['dropped_empty']}, too long {tm['dropped_too_long']}, "
              f"ratio {tm['dropped_ratio']}")
        for side, L in (("src", S - 1), ("tgt", T - 1)):
            p50, p99, p999 = np.percentile(L, [50, 99, 99.9])
            print(f"  {side} tokens: mean {L.mean():.1f}, median {p50:.0f}, p99 {p99:.0f}, p99.9 {p999:.0f}, "
                  f"max {L.max()}")
        print(f"  tokenize: {tok_s / 60:.1f} min wall, {tok_cpu / 60:.1f} min CPU, peak {tok_gib:.2f} GiB")
        print(f"  batch:    {bat_s / 60:.1f} min wall, {bat_cpu / 60:.1f} min CPU, peak {bat_gib:.2f} GiB")
        minutes, gib = TARGETS[preset["data"]["name"]]
        print(f"  tokenize + batch: {(tok_s + bat_s) / 60:.1f} min (target <= {minutes}), peak "
              f"{max(tok_gib, bat_gib):.2f} GiB (target <= {gib})")
        naive = padding_stats(S, T, naive_batches(S, T, bm["max_tokens"]))["padding_efficiency"]
        print(f"  padding efficiency at max_tokens {bm['max_tokens']}: {bm['padding_efficiency']:.4f} (target >= 0.97; "
              f"naive {naive:.4f}), {bm['num_batches']} batches of {bm['sentences_per_batch_mean']:.1f} pairs")
        for side in ("src", "tgt"):
            print(f"  real {side} tokens per step ({bm['batches_per_step']} batches): "
                  f"mean {bm[f'{side}_tokens_per_step_mean']:.0f}, min {bm[f'{side}_tokens_per_step_min']}, "
                  f"max {bm[f'{side}_tokens_per_step_max']} (Sec. 5.1: ~25000)")
        multi30k_efficiency(args.mirror, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
