"""Scoring translations: sacreBLEU and chrF, and the paper's tokenized BLEU (the evaluate stage's, tools' and benches').

    s = score(hyps, refs, lang, tokenize)    # Scores: bleu, chrf, bleu_tokenized, signature, chrf_signature

- `bleu`, `chrf`: sacreBLEU on detokenized text (tokenizer `evaluate.tokenize`,
  mixed case), with its signature: the numbers to compare across papers.
- `bleu_tokenized`: the paper's number (Sec. 6.1 used tensor2tensor's
  get_ende_bleu.sh): the hypotheses through `replace-unicode-punctuation.perl`
  (typographic quotes, apostrophes, ellipses and CJK punctuation to ASCII; not
  the en and em dashes), then both sides Moses-tokenized as
  `tokenizer.perl -l {tgt}` does by default (escaping & < > ' " [ ] |),
  hyphenated compounds split with `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`, then
  multi-bleu.perl (BLEU on whitespace tokens, no smoothing).
- `bleu_lc_norm_tok` (Multi30k only, multi30k_bleu): the convention of the
  multimodal-MT papers that publish Multi30k results, not sacreBLEU. Both sides
  as the dataset's `scripts/task1-tokenize.sh` makes its `*.lc.norm.tok.*`
  files: `lowercase.perl`, `normalize-punctuation.perl -l {tgt}`,
  `tokenizer.perl -l {tgt} -a` (hyphens split as ` @-@ `), then ` @-@ ` joined
  back to `-`; then BLEU on whitespace tokens, no smoothing (multi-bleu). On
  test2016 the references hold 12,103 tokens that way, the count those papers
  were scored against.

Each score is as sacreBLEU prints it (2 decimals: 100.0 when hypothesis and
reference agree, not 100.00000000000004). read_pair refuses a hypothesis file
that is empty or whose line count differs from its reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.base import Score
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from pipeline.core.errors import PipelineError

# get_ende_bleu.sh runs `perl -ple` on bytes: \S is "not ASCII whitespace" (re.ASCII),
# and /g, like re.sub, resumes after each match, so "a-b-c" -> "a ##AT##-##AT## b-c".
COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)


class ScoringError(PipelineError):
    """Translations and references cannot be read or do not line up; the message names the files."""


@dataclass(frozen=True)
class Scores:
    """The scores of one split."""

    bleu: float
    chrf: float
    bleu_tokenized: float
    signature: str
    chrf_signature: str


def read_lines(path: Path, written_by: str | None = None) -> list[str]:
    """The lines of a UTF-8 file without their newlines; a missing file is an error naming it (and the stage
    `written_by` that writes it, if given)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScoringError(f"{path}: missing" + (f"; run the {written_by} stage first" if written_by else "")) from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ScoringError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
    lines = text.split("\n")  # not splitlines(): U+2028 and friends are not line breaks here
    return lines[:-1] if lines[-1] == "" else lines


def read_pair(hyp_path: Path, ref_path: Path) -> tuple[list[str], list[str]]:
    """Hypotheses and references, after checking that there are some and that they align."""
    hyps, refs = read_lines(hyp_path, "translate"), read_lines(ref_path, "download")
    if not hyps or len(hyps) != len(refs):
        raise ScoringError(
            f"{hyp_path} has {len(hyps)} lines but the reference {ref_path} has {len(refs)}: "
            "expected one translation per reference line"
        )
    return hyps, refs


def split_compounds(tokenized: str) -> str:
    """tensor2tensor's ATAT convention: "rich-text" -> "rich ##AT##-##AT## text"."""
    return COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_tokenize(lines: list[str], lang: str) -> list[str]:
    """`tokenizer.perl -l lang` (default escaping) then compound splitting, line by line."""
    moses = MosesTokenizer(lang=lang)  # Paper: tokenizer.perl itself; sacremoses is its Python port
    return [split_compounds(moses.tokenize(line, return_str=True, escape=True)) for line in lines]


def replace_unicode_punctuation(lines: list[str], lang: str) -> list[str]:
    """Moses' replace-unicode-punctuation.perl, line by line: “ ” ’ … 「 」 （ ） ... to ASCII forms."""
    normalizer = MosesPunctNormalizer(lang=lang)
    return [normalizer.replace_unicode_punct(line) for line in lines]


def printed(score: Score) -> float:
    """A score as sacreBLEU prints it (Score.format's default width: 2 decimals): 100.0, not 100.00000000000004."""
    return float(score.format(score_only=True))


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str) -> float:
    """get_ende_bleu.sh: unicode punctuation replaced, Moses tokenization, ATAT compounds, multi-bleu.perl."""
    # Only the hypotheses, as get_ende_bleu.sh does: its reference (newstest.tok.de) was Moses-tokenized
    # without the replacement, so a typographic quote copied from the source no longer matches one there.
    hyps = replace_unicode_punctuation(hyps, lang)
    # force: the input is tokenized on purpose; without it sacreBLEU warns "you forgot to detokenize"
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    return printed(bleu.corpus_score(paper_tokenize(hyps, lang), [paper_tokenize(refs, lang)]))


def lc_norm_tok(lines: list[str], lang: str) -> list[str]:
    """Multi30k's lc.norm.tok form: lowercased, punctuation normalised, Moses-tokenized with hyphens split
    aggressively, then the split hyphens (` @-@ `) joined back: "Saftig-grünes Gras." -> "saftig-grünes gras ."."""
    normalizer, moses = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [moses.tokenize(normalizer.normalize(line.lower()), aggressive_dash_splits=True, return_str=True,
                           escape=True).replace(" @-@ ", "-") for line in lines]


def multi30k_bleu(hyps: list[str], refs: list[str], lang: str) -> float:
    """BLEU on both sides' lc_norm_tok tokens, no further tokenization and no smoothing (multi-bleu)."""
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    return printed(bleu.corpus_score(lc_norm_tok(hyps, lang), [lc_norm_tok(refs, lang)]))


def score(hyps: list[str], refs: list[str], lang: str, tokenize: str) -> Scores:
    """sacreBLEU BLEU and chrF with their signatures, and the paper's tokenized BLEU."""
    bleu, chrf = BLEU(tokenize=tokenize), CHRF()
    bleu_score, chrf_score = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return Scores(
        bleu=printed(bleu_score),
        chrf=printed(chrf_score),
        bleu_tokenized=tokenized_bleu(hyps, refs, lang),
        signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )
