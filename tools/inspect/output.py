"""The views of the decoding outputs: the translations (data/translations) and the scores (metrics/eval.json)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from textwrap import indent

import numpy as np
import pandas as pd
from sacrebleu.metrics import BLEU, CHRF

from pipeline.core import config
from pipeline.core.config import TranslateConfig
from pipeline.corpus.formats import DECODED_SPLITS, load_spm, load_split, read_meta
from pipeline.core.files import write_text
from pipeline.corpus.subwords import encode
from tools.inspect.common import (InspectError, Options, figure, params_or_reason, read_json, save_png, shown,
                                  sibling, summary, table, text_languages, text_lines)

log = logging.getLogger(__name__)

LIMIT_TOLERANCE = 2  # pieces: re-encoding a detokenized output may not give back exactly the pieces decoded


@dataclass(frozen=True)
class Translated:
    """One split's sources, references and hypotheses, line by line."""

    split: str
    src_lang: str
    tgt_lang: str
    sources: list[str]
    references: list[str]
    hypotheses: list[str]


def load_translated(translations: Path, raw: Path, split: str) -> Translated:
    """The hypotheses of `split` beside their raw sources and references; they must align line by line."""
    found = text_languages(translations, split)
    if len(found) != 1:
        raise FileNotFoundError(f"{shown(translations / f'{split}.<lang>')}: expected one translated {split} file "
                                f"(translate stage), found {[f'{split}.{lang}' for lang in found]}")
    tgt = found[0]
    src = [lang for lang in text_languages(raw, split) if lang != tgt]
    if len(src) != 1:
        raise FileNotFoundError(f"{shown(raw)}: expected {split}.<source> and {split}.{tgt}, the raw corpus the "
                                f"translations come from (--raw DIR); found languages {text_languages(raw, split)}")
    src_path, ref_path, hyp_path = raw / f"{split}.{src[0]}", raw / f"{split}.{tgt}", translations / f"{split}.{tgt}"
    sources = text_lines(src_path, "the raw source of the translations")
    references = text_lines(ref_path, "the raw references of the translations")
    hypotheses = text_lines(hyp_path, "one translation per source line (translate stage)")
    if not len(sources) == len(references) == len(hypotheses):
        raise InspectError(f"{shown(hyp_path)} has {len(hypotheses)} lines but {shown(src_path)} has {len(sources)} "
                           f"and {shown(ref_path)} {len(references)}: expected one translation per line")
    return Translated(split, src[0], tgt, sources, references, hypotheses)


def sentence_scores(t: Translated, tokenize: str = "13a") -> pd.DataFrame:
    """One row per sentence: its text, sentence BLEU and chrF (sacreBLEU), and word counts."""
    log.info("scoring %d %s sentences", len(t.hypotheses), t.split)
    bleu, chrf = BLEU(tokenize=tokenize, effective_order=True), CHRF()
    pairs = list(zip(t.hypotheses, t.references))
    return pd.DataFrame({
        "split": t.split, "line": np.arange(1, len(pairs) + 1), "source": t.sources, "reference": t.references,
        "hypothesis": t.hypotheses,
        "bleu": [bleu.sentence_score(h, [r]).score for h, r in pairs],
        "chrf": [chrf.sentence_score(h, [r]).score for h, r in pairs],
        "hyp_words": [len(h.split()) for h in t.hypotheses], "ref_words": [len(r.split()) for r in t.references],
    })


def print_sentence(row: pd.Series, t: Translated) -> None:
    """One sentence's source, reference and hypothesis, one above the other, under its line number and scores."""
    print(f"  line {row.line}  (chrF {row.chrf:.1f}, BLEU {row.bleu:.1f})")
    print(f"    source     {t.src_lang}: {row.source}\n    reference  {t.tgt_lang}: {row.reference}\n"
          f"    hypothesis {t.tgt_lang}: {row.hypothesis}")


def show_translations(path: Path, opts: Options) -> None:
    """Sources, references and hypotheses side by side, the worst by chrF, length ratios, length-limit hits."""
    raw, tokenized = sibling(path, "raw", opts.raw), sibling(path, "tokenized", opts.tokenized)
    t = load_translated(path, raw, opts.split)
    scores = sentence_scores(t)
    ratio = (scores.hyp_words / scores.ref_words.where(scores.ref_words > 0)).dropna()
    print(f"translations {shown(path / f'{t.split}.{t.tgt_lang}')} ({t.src_lang} -> {t.tgt_lang}, sources and "
          f"references from {shown(raw)}): {len(scores):,} sentences, {int((scores.hyp_words == 0).sum())} empty")
    print(f"words: hypotheses {int(scores.hyp_words.sum()):,}, references {int(scores.ref_words.sum()):,}; "
          f"per sentence hypothesis / reference: {summary(ratio.round(2).to_numpy())}")
    print(f"\nthe first {opts.n}:")
    for _, row in scores.head(opts.n).iterrows():
        print_sentence(row, t)
    print(f"\nthe worst {opts.n} by sentence chrF:")
    for _, row in scores.sort_values(["chrf", "line"]).head(opts.n).iterrows():
        print_sentence(row, t)
    show_length_limit(t, tokenized, opts)
    fig, axes = figure(1)
    axes[0].hist(ratio.clip(upper=3.0), bins=np.arange(0, 3.05, 0.1))
    axes[0].axvline(1.0, color="black", linewidth=0.8)
    axes[0].set(title=f"{t.split}: length ratio", xlabel="hypothesis / reference words (3: 3 or more)",
                ylabel="sentences")
    save_png(fig, opts.out, "length_ratio.png")


def show_length_limit(t: Translated, tokenized: Path, opts: Options) -> None:
    """The sentences whose output reached the search's length limit (or came within LIMIT_TOLERANCE of it)."""
    cfg, why = params_or_reason(lambda: config.load(opts.params, "translate", TranslateConfig))
    if cfg is None or not (tokenized / "spm.model").is_file():
        why = why or f"no {shown(tokenized / 'spm.model')} to count pieces with; give --tokenized DIR"
        print(f"\nlength limit: not checked ({why})")
        return
    S = load_split(tokenized, t.split, t.src_lang).lengths + 1  # + EOS, as the search sees the source
    out = encode(load_spm(tokenized, read_meta(tokenized)["vocab_size"]), t.hypotheses)[1]
    if len(S) != len(out):
        raise InspectError(f"{shown(tokenized)}: {t.split}.{t.src_lang} holds {len(S)} sentences, the translations "
                           f"{len(out)}: expected the tokenized corpus the translations were made from")
    limit = np.floor(cfg.max_len_a * S + cfg.max_len_b).astype(np.int64) - 1  # model/beam_search.max_lengths, - EOS
    hit = np.flatnonzero(out >= limit - LIMIT_TOLERANCE)
    print(f"\nlength limit: an output may have floor({cfg.max_len_a:g} x (source pieces + EOS) + {cfg.max_len_b}) "
          f"tokens, EOS included (translate.max_len_a/b, {shown(opts.params)}). Outputs re-encoded with "
          f"{shown(tokenized / 'spm.model')}; counted as hitting it when within {LIMIT_TOLERANCE} pieces: "
          f"{len(hit):,} of {len(out):,} sentences")
    rows = [[int(i) + 1, int(S[i]) - 1, int(out[i]), int(limit[i]), t.hypotheses[i][:80]] for i in hit[: opts.n]]
    if rows:
        print(indent(table(["line", "source pieces", "output pieces", "limit", "hypothesis"], rows), "  "))


def bleu_tokenizer(metrics: dict) -> str:
    """The sacreBLEU tokenizer the metrics were computed with (tok: of their signature), 13a if not given."""
    fields = dict(part.split(":", 1) for part in str(metrics.get("signature", "")).split("|") if ":" in part)
    return fields.get("tok", "13a")


def show_eval(path: Path, opts: Options) -> None:
    """The metrics with their signatures, and every sentence's BLEU and chrF as a CSV (sentences.csv)."""
    file = path / "eval.json" if path.is_dir() else path
    metrics = read_json(file, "the evaluate stage's metrics (bleu, chrf, bleu_tokenized, signature...)")
    print(f"metrics {shown(file)}:")
    numbers = [[key, f"{value:.2f}"] for key, value in metrics.items() if isinstance(value, (int, float))]
    print(indent(table(["metric", "value"], numbers), "  "))
    for key in ("signature", "chrf_signature"):
        print(f"  {key}: {metrics.get(key, '(none)')}")
    root = file.absolute().parent.parent
    translations = opts.translations or root / "data" / "translations"
    raw = opts.raw or root / "data" / "raw"
    tables = {split: sentence_scores(load_translated(translations, raw, split), bleu_tokenizer(metrics))
              for split in DECODED_SPLITS}
    print(f"\nper sentence ({shown(translations)} against {shown(raw)}):")
    for split, scores in tables.items():
        print(f"  {split}: {len(scores):,} sentences; BLEU {summary(scores.bleu.round(1).to_numpy())}; "
              f"chrF {summary(scores.chrf.round(1).to_numpy())}; {int((scores.bleu == 0).sum())} with BLEU 0")
    csv = opts.out / "sentences.csv"
    opts.out.mkdir(parents=True, exist_ok=True)
    write_text(csv, pd.concat(tables.values()).to_csv(index=False))
    print(f"table: {shown(csv)} (one row per sentence: split, line, source, reference, hypothesis, bleu, chrf, "
          f"hyp_words, ref_words; e.g. pandas.read_csv(...).sort_values('chrf'))")
    fig, axes = figure(1)
    axes[0].hist([s.chrf for s in tables.values()], bins=np.arange(0, 101, 5), histtype="step",
                 label=list(tables))
    axes[0].set(title="sentence chrF", xlabel="chrF", ylabel="sentences")
    axes[0].legend()
    save_png(fig, opts.out, "sentence_chrf.png")
