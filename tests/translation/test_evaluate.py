"""stages.evaluate: sacreBLEU and chrF as the sacrebleu command line gives them, and the paper's tokenized BLEU."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from pipeline.translation import scoring
from stages import evaluate
from tests.fixtures.evaluate import ABSENT, HYPS, REFS, run
from tests.fixtures.translation import shared_store, store  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
SACREBLEU = Path(sys.executable).parent / "sacrebleu"


def cli(ref: Path, hyp: Path, *args: str) -> str:
    done = subprocess.run([str(SACREBLEU), str(ref), "-i", str(hyp), *args], capture_output=True, text=True,
                          check=True, timeout=120)
    return done.stdout


def test_bleu_and_chrf_equal_the_sacrebleu_command_line(tmp_path, capsys):
    metrics = json.loads(run(tmp_path).read_text())
    for split, prefix in (("test", ""), ("valid", "valid_")):
        ref, hyp = tmp_path / "raw" / f"{split}.de", tmp_path / "translations" / f"{split}.de"
        assert metrics[f"{prefix}bleu"] == float(cli(ref, hyp, "-m", "bleu", "-b", "-w", "2"))
        assert metrics[f"{prefix}chrf"] == float(cli(ref, hyp, "-m", "chrf", "-b", "-w", "2"))
    ref, hyp = tmp_path / "raw" / "test.de", tmp_path / "translations" / "test.de"
    assert metrics["signature"] == json.loads(cli(ref, hyp, "-m", "bleu"))["signature"]
    assert metrics["chrf_signature"] == json.loads(cli(ref, hyp, "-m", "chrf"))["signature"]
    assert "tok:13a" in metrics["signature"] and "case:mixed" in metrics["signature"]
    assert 0 < metrics["bleu"] < 100 and metrics["bleu"] != metrics["valid_bleu"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"BLEU = {metrics['bleu']:.1f} (sacreBLEU signature: {metrics['signature']})"


def test_the_metrics_are_logged_to_mlflow(tmp_path):
    metrics = json.loads(run(tmp_path).read_text())
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.stage = 'evaluate'",
                              order_by=["attributes.start_time DESC"])
    latest = runs.iloc[0]
    for key in ("bleu", "chrf", "bleu_tokenized", "valid_bleu", "valid_chrf", "valid_bleu_tokenized"):
        assert latest[f"metrics.{key}"] == pytest.approx(metrics[key])
    assert latest["params.evaluate.tokenize"] == "13a"


def test_tokenized_bleu_by_hand_with_a_split_compound(tmp_path):
    """Moses + ATAT turn the pair into 8 and 10 tokens:

    hyp: Der Hals ##AT##-##AT## Nasen ##AT##-##AT## Arzt kommt .
    ref: Der Hals ##AT##-##AT## Nasen ##AT##-##AT## Ohren ##AT##-##AT## Arzt kommt .

    n-gram matches (clipped): 8/8, 7/7, 5/6 (not "Nasen @ Arzt"), 3/5 (not "@ Nasen @ Arzt",
    "Nasen @ Arzt kommt"); brevity penalty exp(1 - 10/8). BLEU = exp(-1/4) (5/6 * 3/5)^(1/4).
    Without compound splitting, both sides would be 4 tokens and BLEU 0 (no 4-gram matches).
    """
    metrics = json.loads(run(tmp_path, {"test": ["Der Hals-Nasen-Arzt kommt."], "valid": HYPS["valid"]},
                             {"test": ["Der Hals-Nasen-Ohren-Arzt kommt."], "valid": REFS["valid"]}).read_text())
    assert metrics["bleu_tokenized"] == float(f"{100 * math.exp(-0.25) * 0.5**0.25:.2f}") == 65.49


def test_a_perfect_translation_scores_exactly_100_as_sacrebleu_prints_it(tmp_path):
    metrics = run(tmp_path, REFS, REFS)
    text = metrics.read_text()
    for key in ("bleu", "chrf", "bleu_tokenized", "valid_bleu", "valid_chrf", "valid_bleu_tokenized"):
        assert json.loads(text)[key] == 100.0, key
    assert "100.0000" not in text  # sacreBLEU's own score here is 100.00000000000004


def test_tokenized_bleu_does_not_warn_about_its_own_tokenization():
    """The paper's BLEU scores Moses-tokenized text on purpose: sacreBLEU must not say "forgot to detokenize"."""
    lines = ["Ein Mann fährt Rad."] * 120  # > 100 lines ending in " ." once tokenized
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # sacreBLEU's logger does not propagate to pytest's caplog
    logger = logging.getLogger("sacrebleu")
    logger.addHandler(handler)
    try:
        assert scoring.tokenized_bleu(lines, lines, "de") == pytest.approx(100.0)
        scoring.score(lines, lines, "de", "13a")  # detokenized input: no warning either
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


def test_paper_tokenization_escapes_like_tokenizer_perl_and_splits_compounds_like_perl():
    assert scoring.paper_tokenize(['Ein "E-Mail"-Konto kostet 5 & mehr.'], "de") == [
        "Ein &quot; E ##AT##-##AT## Mail &quot; -Konto kostet 5 &amp; mehr ."
    ]
    # s{(\S)-(\S)}{...}g resumes after each match: the middle letter of "a-b-c" is used up.
    assert scoring.split_compounds("a-b-c rich-text -x y-") == "a ##AT##-##AT## b-c rich ##AT##-##AT## text -x y-"


def test_an_empty_hypothesis_file_is_refused_and_no_metrics_are_written(tmp_path):
    with pytest.raises(scoring.ScoringError, match=r"test\.de has 0 lines but the reference .*test\.de has 4"):
        run(tmp_path, {"test": [], "valid": HYPS["valid"]})
    assert not (tmp_path / "metrics" / "eval.json").exists()


def test_a_line_count_mismatch_is_refused_and_the_old_metrics_stay(tmp_path):
    metrics = run(tmp_path)
    before = metrics.read_text()
    with pytest.raises(scoring.ScoringError, match=r"valid\.de has 1 lines but the reference .*valid\.de has 2"):
        run(tmp_path, {"test": HYPS["test"], "valid": HYPS["valid"][:1]})
    assert metrics.read_text() == before


def test_a_missing_translation_file_is_named(tmp_path):
    with pytest.raises(scoring.ScoringError, match=r"translations/valid\.de: missing"):
        run(tmp_path, {"test": HYPS["test"]})


def test_tokenized_bleu_replaces_unicode_punctuation_in_the_hypotheses_only():
    """get_ende_bleu.sh runs replace-unicode-punctuation.perl on the hypotheses, not on its reference: a
    hypothesis that copies the reference's typographic quotes, apostrophe and ellipsis loses those matches;
    the en dash is not in the script's list and still matches."""
    ref = ["Er sagte gestern: “Das ist Peter’s Haus in der Stadt” – und ging dann … langsam nach Hause."]
    assert scoring.replace_unicode_punctuation(ref, "de") == [
        'Er sagte gestern: "Das ist Peter\'s Haus in der Stadt" – und ging dann ... langsam nach Hause.']
    hyp_tokens = scoring.paper_tokenize(scoring.replace_unicode_punctuation(ref, "de"), "de")[0].split()
    ref_tokens = scoring.paper_tokenize(ref, "de")[0].split()
    assert "–" in hyp_tokens and "–" in ref_tokens and "&quot;" in hyp_tokens and "“" in ref_tokens
    assert 0 < scoring.tokenized_bleu(ref, ref, "de") < 60  # the same text, scored as the paper's script scores it
    ascii_ref = scoring.replace_unicode_punctuation(ref, "de")
    assert scoring.tokenized_bleu(ascii_ref, ascii_ref, "de") == pytest.approx(100.0)
    assert scoring.tokenized_bleu(ascii_ref, ref, "de") == scoring.tokenized_bleu(ref, ref, "de")


# Multi30k's lc.norm.tok form of each line, as task1-tokenize.sh (lowercase.perl | normalize-punctuation.perl -l de |
# tokenizer.perl -l de -a) with ` @-@ ` joined back writes it: compounds stay whole, quotes and apostrophes are split
# off and escaped, typographic punctuation is normalised first.
LC_NORM_TOK = {
    "Ein Boston Terrier läuft über saftig-grünes Gras vor einem weißen Zaun.":
        "ein boston terrier läuft über saftig-grünes gras vor einem weißen zaun .",
    "Zwei Jungen essen ihr McDonald's-Menü im Außenbereich, umgeben von vielen Anderen.":
        "zwei jungen essen ihr mcdonald &apos; s-menü im außenbereich , umgeben von vielen anderen .",
    "Eine Frau hält einen großen Scheck für „Kids Food Basket“.":
        "eine frau hält einen großen scheck für &quot; kids food basket &quot; .",
    "Ein Mann – mit Hut – spielt Hals-Nasen-Ohren-Arzt.": "ein mann - mit hut - spielt hals-nasen-ohren-arzt .",
    "Das ist Peter’s Fahrrad…": "das ist peter &apos; s fahrrad ...",
}


def test_multi30k_lc_norm_tok_is_the_datasets_own_tokenized_form():
    assert scoring.lc_norm_tok(list(LC_NORM_TOK), "de") == list(LC_NORM_TOK.values())


def test_multi30k_bleu_is_scored_on_lowercased_tokens_and_printed_apart_from_sacrebleu(tmp_path, capsys):
    # Case and a split-off full stop are all that differ: lc.norm.tok BLEU is 100, sacreBLEU (mixed case) is not.
    refs = {"test": ["Ein Mann fährt Mountain-Bike.", "Zwei Kinder spielen im Garten."],
            "valid": ["Ein Hund springt über den Zaun."]}
    hyps = {"test": ["ein mann fährt mountain-bike .", "zwei Kinder spielen im Garten ."],
            "valid": ["Ein Hund springt über einen Zaun."]}
    metrics = json.loads(run(tmp_path, hyps, refs).read_text())
    assert metrics["bleu_lc_norm_tok"] == 100.0 and metrics["bleu"] < 100
    # valid: 7 tokens a side, one wrong: n-gram precisions 6/7, 4/6, 2/5, 1/4, no brevity penalty
    assert metrics["valid_bleu_lc_norm_tok"] == float(f"{100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25:.2f}") == 48.89
    *_, multi30k, last = capsys.readouterr().out.strip().splitlines()
    assert multi30k.startswith("Multi30k lc.norm.tok BLEU = 100.00 (") and "not sacreBLEU" in multi30k
    assert last.startswith("BLEU = ")


def test_a_corpus_other_than_multi30k_has_no_lc_norm_tok_bleu(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "MULTI30K", "not-this-corpus")
    metrics = json.loads(run(tmp_path).read_text())
    assert not any("lc_norm_tok" in key for key in metrics) and "bleu_tokenized" in metrics


def test_a_run_the_safety_stop_cut_short_is_printed_and_recorded_beside_its_scores(tmp_path, capsys):
    metrics = json.loads(run(tmp_path, train={"steps": 3100, "stopped_by": "max_minutes", "train_hours": 2.0}).read_text())
    assert metrics["stopped_by"] == "max_minutes" and metrics["train_steps"] == 3100 and 0 < metrics["bleu"] < 100
    *_, cut, multi30k, last = capsys.readouterr().out.strip().splitlines()
    assert cut.startswith("Not the recipe's result: training stopped by the safety stop train.max_minutes at step 3100")
    assert "dvc exp run -S train.max_minutes=0" in cut and last.startswith("BLEU = ")
    run_tags = mlflow.search_runs(search_all_experiments=True, filter_string="tags.stage = 'evaluate'")
    assert run_tags["tags.stopped_by"].iloc[0] == "max_minutes"  # the newest evaluate run, this one


def test_a_run_that_reached_max_steps_prints_no_warning(tmp_path, capsys):
    metrics = json.loads(run(tmp_path, train={"steps": 4600, "stopped_by": "max_steps"}).read_text())
    assert metrics["stopped_by"] == "max_steps" and metrics["train_steps"] == 4600
    assert "Not the recipe's result" not in capsys.readouterr().out


@pytest.mark.parametrize("train, found", [({"steps": 10}, "stopped_by None, steps 10"),
                                          ({"steps": 1.5, "stopped_by": "max_steps"}, "steps 1.5"),
                                          ("{not json", "not the train stage's JSON metrics")])
def test_a_train_record_without_its_end_fails_in_one_line_naming_it(tmp_path, train, found):
    with pytest.raises(evaluate.PipelineError, match="train.json: ") as raised:
        run(tmp_path, train=train)
    assert found in str(raised.value) and "dvc repro train" in str(raised.value)
    assert not (tmp_path / "metrics" / "eval.json").exists()



def test_a_missing_train_record_names_the_stage_that_writes_it(tmp_path):
    with pytest.raises(evaluate.PipelineError, match=r"train\.json: missing; run the train stage first"):
        run(tmp_path, train=ABSENT)
    assert not (tmp_path / "metrics" / "eval.json").exists()
