"""The tokenize stage: a shared, deterministic sentencepiece model; ids on disk; filtering; clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import yaml

from stages import tokenize
from pipeline.core.config import ParamsError
from pipeline.core.files import InputError, read_chunks
from pipeline.corpus.formats import SPLITS, UNK_ID, load_split, read_meta
from tests.fixtures.translation import shared_store, store  # noqa: F401 (fixtures: one MLflow store per module)

EN = "a the man woman dog child red blue runs sits near under street park ball water big small green".split()
DE = "ein der mann frau hund kind rot blau läuft sitzt neben unter straße park ball wasser groß klein grün".split()


def sentence_pair(rng: random.Random, words: int) -> tuple[str, str]:
    """A word-by-word 'translation', so both sides have the same number of words."""
    picks = [rng.randrange(len(EN)) for _ in range(words)]
    return " ".join(EN[i] for i in picks).capitalize() + ".", " ".join(DE[i] for i in picks).capitalize() + "."


def make_corpus(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return [sentence_pair(rng, rng.randint(2, 9)) for _ in range(n)]


def write_raw(raw: Path, splits: dict[str, list[tuple[str, str]]]) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for side, lang in enumerate(("en", "de")):
            (raw / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")


def write_params(path: Path, **tokenize_overrides) -> Path:
    cfg = {"model_type": "bpe", "vocab_size": 120, "character_coverage": 1.0, "input_sentence_size": 0,
           "max_len": 64, "max_len_ratio": 3.0, "seed": 1} | tokenize_overrides
    source = {"url": "https://example.org/unused", "member": None, "sha256": None}  # the tokenize stage reads no URL
    corpus = [{"name": "tiny", "src": source, "tgt": source}]
    params = {"data": {"name": "tiny", "src_lang": "en", "tgt_lang": "de", "train": corpus, "valid": corpus,
                       "test": corpus}, "tokenize": cfg}
    path.write_text(yaml.safe_dump(params), encoding="utf-8")
    return path


def run(tmp_path: Path, raw: Path, out_name: str = "tokenized", **overrides) -> tuple[Path, dict]:
    out, metrics = tmp_path / out_name, tmp_path / f"{out_name}.json"
    params = write_params(tmp_path / f"{out_name}.params.yaml", **overrides)
    tokenize.main(["--raw", str(raw), "--out", str(out), "--metrics", str(metrics), "--params", str(params)])
    return out, json.loads(metrics.read_text())


@pytest.fixture
def corpus() -> dict[str, list[tuple[str, str]]]:
    rng = random.Random(0)
    return {"train": make_corpus(rng, 400), "valid": make_corpus(rng, 30), "test": make_corpus(rng, 30)}


def decode_split(out: Path, split: str, lang: str) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    encoded = load_split(out, split, lang)
    return [sp.decode(encoded[i].tolist()) for i in range(len(encoded))]


def test_ids_round_trip_to_the_raw_text_through_load_split(tmp_path, corpus):
    write_raw(tmp_path / "raw", corpus)
    out, metrics = run(tmp_path, tmp_path / "raw")
    meta = read_meta(out)
    assert meta == {"vocab_size": 120, "src_lang": "en", "tgt_lang": "de",
                    "lines": {"train": 400, "valid": 30, "test": 30}}
    for split in SPLITS:
        for side, lang in enumerate(("en", "de")):
            assert decode_split(out, split, lang) == [p[side] for p in corpus[split]]
            encoded = load_split(out, split, lang)
            assert encoded.values.dtype == np.dtype("<u2") and encoded.offsets.dtype == np.dtype("<i8")
            assert metrics[f"{split}_{'src' if side == 0 else 'tgt'}_tokens"] == len(encoded.values)
    assert metrics["vocab_size"] == 120 and metrics["train_pairs"] == 400


def test_one_vocabulary_covers_both_languages(tmp_path, corpus):
    write_raw(tmp_path / "raw", corpus)
    out, metrics = run(tmp_path, tmp_path / "raw")
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    # Characters seen only in German (ä, ß, ü) and only in English (h of "the") are both in the one model.
    for word in ("straße", "läuft", "grün", "the"):
        assert UNK_ID not in sp.encode(word)
    train_ids = {lang: set(load_split(out, "train", lang).values.tolist()) for lang in ("en", "de")}
    assert train_ids["en"] & train_ids["de"], "the languages share pieces (punctuation, the capital letters)"
    assert train_ids["en"] ^ train_ids["de"], "and each has pieces of its own, in the same id space"
    assert metrics["train_unk_rate"] == 0


def random_words_corpus(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Sentences of made-up words, so which sentences train the tokenizer changes its pieces."""
    def sentence() -> str:
        return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 8))) for _ in range(6))
    return [(sentence(), sentence()) for _ in range(n)]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_training_is_deterministic_and_follows_the_seed(tmp_path, model_type):
    rng = random.Random(3)
    write_raw(tmp_path / "raw", {split: random_words_corpus(rng, n) for split, n in (("train", 2000), ("valid", 20),
                                                                                   ("test", 20))})
    # 500 of the 4000 training sentences: the sample, and so the model, depends on the seed alone.
    runs = [run(tmp_path, tmp_path / "raw", name, input_sentence_size=500, model_type=model_type, vocab_size=300,
                seed=seed)[0] for name, seed in (("first", 1), ("second", 1), ("other_seed", 2))]
    for name in ("spm.model", "spm.vocab", "train.en.ids", "train.de.offsets", "test.de.ids"):
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    assert (runs[0] / "spm.vocab").read_bytes() != (runs[2] / "spm.vocab").read_bytes()


def test_training_pairs_are_filtered_and_counted_by_reason(tmp_path, corpus):
    rng = random.Random(1)
    long_pair, (_, wordy) = sentence_pair(rng, 60), sentence_pair(rng, 16)
    train = corpus["train"] + [("", "Ein hund."), ("A dog.", ""), ("", ""), long_pair, ("A dog.", wordy),
                               (wordy, "Ein hund.")]
    write_raw(tmp_path / "raw", {**corpus, "train": train})
    out, metrics = run(tmp_path, tmp_path / "raw", max_len=40, max_len_ratio=2.5)

    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    expected, kept = {"empty": 0, "too_long": 0, "ratio": 0}, []
    for src, tgt in train:
        a, b = len(sp.encode(src)), len(sp.encode(tgt))
        if min(a, b) == 0:
            expected["empty"] += 1
        elif max(a, b) > 40:
            expected["too_long"] += 1
        elif max(a, b) > 2.5 * min(a, b):
            expected["ratio"] += 1
        else:
            kept.append((src, tgt))
    assert expected["empty"] == 3 and expected["too_long"] >= 1 and expected["ratio"] >= 2
    assert {k: metrics[f"dropped_{k}"] for k in expected} == expected
    assert metrics["train_pairs"] == len(kept) == read_meta(out)["lines"]["train"]
    assert metrics["train_pairs_raw"] == len(train)
    assert decode_split(out, "train", "en") == [s for s, _ in kept]
    assert decode_split(out, "train", "de") == [t for _, t in kept]


def test_valid_and_test_are_never_filtered(tmp_path, corpus):
    rng = random.Random(2)
    odd = [("", ""), ("A dog.", ""), sentence_pair(rng, 60), ("A dog.", sentence_pair(rng, 16)[1])]
    splits = {**corpus, "valid": corpus["valid"] + odd, "test": odd + corpus["test"]}
    write_raw(tmp_path / "raw", splits)
    out, metrics = run(tmp_path, tmp_path / "raw", max_len=40, max_len_ratio=2.5)
    for split in ("valid", "test"):
        assert metrics[f"{split}_pairs"] == len(splits[split]) == read_meta(out)["lines"][split]
        for side, lang in enumerate(("en", "de")):
            assert decode_split(out, split, lang) == [p[side] for p in splits[split]]
    assert len(load_split(out, "test", "en")[0]) == 0  # the empty line stays, as an empty sequence


def assert_fails_cleanly(tmp_path: Path, raw: Path, error: type, match: str, **overrides) -> None:
    """The stage raises `error` matching `match` and leaves the previous output exactly as it was."""
    out = tmp_path / "tokenized"
    out.mkdir(exist_ok=True)
    (out / "previous").write_text("kept")
    with pytest.raises(error, match=match):
        run(tmp_path, raw, **overrides)
    assert [p.name for p in out.iterdir()] == ["previous"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert not (tmp_path / "tokenized.json").exists()


def test_missing_raw_file_is_a_clear_error(tmp_path, corpus):
    write_raw(tmp_path / "raw", corpus)
    (tmp_path / "raw" / "test.de").unlink()
    assert_fails_cleanly(tmp_path, tmp_path / "raw", InputError, r"missing raw file\(s\): .*test\.de")


def test_misaligned_sides_are_a_clear_error(tmp_path, corpus):
    write_raw(tmp_path / "raw", {**corpus, "valid": corpus["valid"]})
    with open(tmp_path / "raw" / "valid.de", "a", encoding="utf-8") as f:
        f.write("Ein hund.\n")
    assert_fails_cleanly(tmp_path, tmp_path / "raw", InputError,
                         r"valid\.en has 30 lines but .*valid\.de has 31")


@pytest.mark.parametrize("line, bad", [(7, b"Ein \xff hund."), (400, b"Ein hund \xc3")])  # \xc3: cut off at the end
def test_invalid_utf8_names_file_and_line(tmp_path, corpus, line, bad):
    write_raw(tmp_path / "raw", corpus)
    lines = (tmp_path / "raw" / "train.de").read_bytes().split(b"\n")[:400]
    lines[line - 1] = bad
    (tmp_path / "raw" / "train.de").write_bytes(b"\n".join(lines))
    assert_fails_cleanly(tmp_path, tmp_path / "raw", InputError, rf"train\.de:{line}: not valid UTF-8")


def test_empty_training_set_after_filtering_is_a_clear_error(tmp_path, corpus):
    write_raw(tmp_path / "raw", corpus)  # every sentence has at least two words, so more than one token
    assert_fails_cleanly(tmp_path, tmp_path / "raw", InputError,
                         r"all 400 training pairs were dropped \(0 empty, 400 too_long, 0 ratio\)",
                         max_len=1)


def test_vocabulary_too_large_for_the_corpus_names_the_key(tmp_path, corpus):
    write_raw(tmp_path / "raw", corpus)
    assert_fails_cleanly(tmp_path, tmp_path / "raw", ParamsError, r"tokenize\.vocab_size = 5000", vocab_size=5000)


def test_read_chunks_splits_at_newlines_only_stops_at_the_limit_and_names_a_bad_line(tmp_path):
    path = tmp_path / "train.en"
    lines = [f"line {i}\u2028with a separator" if i % 5 == 0 else f"line {i}" for i in range(23)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert [len(c) for c in read_chunks(path, 10)] == [10, 10, 3]
    assert [line for c in read_chunks(path, 10) for line in c] == lines  # U+2028 is not a line end here
    assert [line for c in read_chunks(path, 4, limit=9) for line in c] == lines[:9]
    with open(path, "ab") as f:
        f.write(b"ok\nbad \xff byte\n")
    with pytest.raises(InputError, match=r"train\.en:25: not valid UTF-8 \(invalid start byte\)"):
        for _ in read_chunks(path, 10):
            pass
