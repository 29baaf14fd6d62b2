"""tools.inspect: each view on a tiny output made here, the numbers it prints, its pictures and its errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from mlflow import MlflowClient

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.weights.fingerprint import code_fingerprint, code_hash
from pipeline.weights.checkpoint import save_checkpoint
from pipeline.corpus.formats import batch_paths
from tests.fixtures.train import write_split
from tests.fixtures.translation import MODEL_CONFIG, TEST_EN, VALID_EN, save_model, tokenized_corpus, write_lines
from tools.inspect import main

PNG = b"\x89PNG\r\n\x1a\n"
DOUBLE_SPACE = "A man  rides a bike."  # sentencepiece collapses the two spaces: this line does not decode back
BAD_LINE, LONG_LINE = 3, 5  # test lines (1-based) whose hypotheses are wrong / run on for ever


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """root/data/raw and root/data/tokenized (the real tokenize stage, metrics in root/metrics), root/params.yaml."""
    root = tmp_path_factory.mktemp("corpus")
    extra = ((DOUBLE_SPACE, "Ein Mann fährt ein Fahrrad."), ("", "Ein Hund."))  # the last: dropped
    tokenized_corpus(root / "data" / "raw", root / "data" / "tokenized", extra, root / "metrics" / "tokenize.json")
    params = {"translate": dict(beam_size=2, length_penalty=0.6, max_len_a=1.0, max_len_b=20, max_tokens=40),
              "average": {"last_n": 2}, "batch": {"max_tokens": 30, "seed": 1}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


@pytest.fixture
def run(corpus, tmp_path) -> Path:
    """A copy of the corpus with translations: test line BAD_LINE wrong, LONG_LINE far too long, the rest right."""
    root = tmp_path / "run"
    shutil.copytree(corpus, root)
    hyps = [f"Referenz {i}." for i in range(len(TEST_EN))]
    hyps[BAD_LINE - 1] = "Xxx Yyy"  # not one character of "Referenz 2."
    hyps[LONG_LINE - 1] = "Referenz " * 30 + "."
    write_lines(root / "data" / "translations" / "test.de", hyps)
    write_lines(root / "data" / "translations" / "valid.de", [f"Referenz {i}." for i in range(len(VALID_EN))])
    return root


def inspect(capsys, path: Path, out: Path, *args: str) -> str:
    """Run the tool, which must succeed; its stdout."""
    code = main([str(path), "--out", str(out), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def fails(capsys, path: Path, *args: str) -> str:
    """Run the tool, which must fail with exit status 1 and exactly one line on stderr; that line."""
    code = main([str(path), *args])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG


def test_raw_counts_lines_shows_aligned_pairs_and_draws_words_per_line(corpus, tmp_path, capsys):
    out = inspect(capsys, corpus / "data" / "raw", tmp_path / "out", "-n", "2")
    assert re.search(r"train\s+152\s+152\s+1\s+0", out)  # 152 lines a side; one empty English line
    assert re.search(r"test\s+6\s+6\s+1\s+0", out)
    assert "line 1\n    en: A man rides a bike.\n    de: Ein Mann fährt ein Fahrrad." in out
    assert "line 152\n    en: \n    de: Ein Hund." in out  # the last pair: misalignment would show here
    assert "test.en: min 0, median 5.5, mean 5.8, max 15" in out
    assert_png(tmp_path / "out" / "words.png")


def test_raw_with_misaligned_sides_says_which_files_disagree(corpus, tmp_path, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(corpus / "data" / "raw", raw)
    with open(raw / "train.de", "a", encoding="utf-8") as f:
        f.write("Eine Zeile zu viel.\n")
    err = fails(capsys, raw, "--out", str(tmp_path / "out"))
    assert "train.en has 152 lines but train.de has 153" in err


def test_tokenized_reports_vocabulary_drops_and_the_lines_that_do_not_round_trip(corpus, tmp_path, capsys):
    out = inspect(capsys, corpus / "data" / "tokenized", tmp_path / "out")
    metrics = json.loads((corpus / "metrics" / "tokenize.json").read_text())
    assert "shared vocabulary of 60 pieces" in out
    assert f"both sides, {metrics['train_src_tokens'] + metrics['train_tgt_tokens']:,} tokens" in out
    assert "1 of 152 (empty 1, too_long 0, ratio 0)" in out
    assert "train: 152 raw pairs, 151 stored; 1 not stored; every stored pair equals the raw text re-encoded" in out
    assert "first pair not stored (dropped), line 152" in out
    assert f"en: 1 of 151 lines do not decode back to the raw line; e.g. line 151: raw {DOUBLE_SPACE!r}" in out
    assert "de: 0 of 151 lines" in out
    assert "test: 6 raw pairs, 6 stored; 0 not stored" in out
    assert_png(tmp_path / "out" / "tokens.png")


def test_raw_read_in_chunks_shows_the_same_and_names_a_bad_line_past_the_first_chunk(corpus, tmp_path, capsys,
                                                                                     monkeypatch):
    whole = inspect(capsys, corpus / "data" / "raw", tmp_path / "whole", "-n", "3")
    monkeypatch.setattr("tools.inspect.common.CHUNK_LINES", 7)  # 152 lines: 22 chunks, the samples in three
    assert inspect(capsys, corpus / "data" / "raw", tmp_path / "chunks", "-n", "3") == whole.replace("whole", "chunks")
    raw = tmp_path / "raw"
    shutil.copytree(corpus / "data" / "raw", raw)
    lines = (raw / "train.de").read_bytes().split(b"\n")
    lines[19] = b"Ein \xff Hund."  # line 20, in the third chunk
    (raw / "train.de").write_bytes(b"\n".join(lines))
    err = fails(capsys, raw, "--out", str(tmp_path / "out"))
    assert "train.de:20: not valid UTF-8" in err


def test_tokenized_checks_the_first_pairs_of_a_split_over_the_limit_and_counts_pieces_in_slices(corpus, tmp_path,
                                                                                                 capsys, monkeypatch):
    def pieces(out: str) -> str:
        return out[out.index("most frequent pieces") : out.index("sample train pairs")]

    whole = inspect(capsys, corpus / "data" / "tokenized", tmp_path / "whole")
    monkeypatch.setattr("tools.inspect.tokens.CHUNK_IDS", 7)
    monkeypatch.setattr("tools.inspect.tokens.ROUND_TRIP_PAIRS", 151)  # train has 152 raw pairs; the 152nd: dropped
    out = inspect(capsys, corpus / "data" / "tokenized", tmp_path / "out")
    assert pieces(out) == pieces(whole)
    assert ("train: the first 151 of 152 raw pairs (at most 151 a split are re-encoded), 151 stored; 0 not stored; "
            "every stored pair equals the raw text re-encoded") in out
    assert "test: 6 raw pairs, 6 stored; 0 not stored" in out  # under the limit: whole
    # The dropped pair inside the pairs checked, a raw pair past them never read:
    root = tmp_path / "more"
    shutil.copytree(corpus / "data", root)
    for lang, text in (("en", "One more line."), ("de", "Noch eine Zeile.")):
        with open(root / "raw" / f"train.{lang}", "a", encoding="utf-8") as f:
            f.write(text + "\n")
    monkeypatch.setattr("tools.inspect.tokens.ROUND_TRIP_PAIRS", 152)
    out = inspect(capsys, root / "tokenized", tmp_path / "out2")
    assert ("train: the first 152 of 153 raw pairs (at most 152 a split are re-encoded), 151 stored; 1 not stored; "
            "every stored pair equals the raw text re-encoded") in out
    assert "first pair not stored (dropped), line 152" in out


def test_tokenized_with_an_id_past_the_vocabulary_names_the_file_and_the_id(corpus, tmp_path, capsys, monkeypatch):
    tokenized = tmp_path / "data" / "tokenized"
    shutil.copytree(corpus / "data" / "tokenized", tokenized)
    ids = np.fromfile(tokenized / "train.de.ids", dtype=np.uint16)
    ids[-1] = 999  # the vocabulary has 60 pieces; the id is in the last of several slices
    ids.tofile(tokenized / "train.de.ids")
    monkeypatch.setattr("tools.inspect.tokens.CHUNK_IDS", 100)
    err = fails(capsys, tokenized)
    assert "train.de.ids: holds id 999; expected ids below the vocabulary size 60" in err


def test_tokenized_with_stale_ids_or_a_missing_model_names_the_file(corpus, tmp_path, capsys):
    tokenized = tmp_path / "data" / "tokenized"
    shutil.copytree(corpus / "data" / "tokenized", tokenized)
    offsets = tokenized / "valid.en.offsets"
    offsets.write_bytes(offsets.read_bytes()[:-8])  # one sentence short: the offsets no longer end at the ids' end
    assert "valid.en.offsets: offsets do not describe" in fails(capsys, tokenized)
    (tokenized / "spm.model").unlink()
    assert "spm.model: missing; run the tokenize stage first" in fails(capsys, tokenized)


def write_tokenized(tokenized: Path, lengths: dict[str, list[int]]) -> None:
    """Both sides of each split with the given lengths (the same on both sides), and meta.json."""
    tokenized.mkdir(parents=True)
    for split, lens in lengths.items():
        for lang in ("en", "de"):
            write_split(tokenized, split, [np.full(n, 5) for n in lens], lang)
    meta = {"vocab_size": 24, "src_lang": "en", "tgt_lang": "de", "lines": {s: len(v) for s, v in lengths.items()}}
    (tokenized / "meta.json").write_text(json.dumps(meta))


def write_batches(batches: Path, split: str, groups: list[list[int]]) -> None:
    batches.mkdir(parents=True, exist_ok=True)
    index_path, bounds_path = batch_paths(batches, split)
    np.save(index_path, np.array([i for g in groups for i in g], dtype=np.int64))
    np.save(bounds_path, np.cumsum([0, *map(len, groups)]).astype(np.int64))


def test_batches_padding_efficiency_overall_and_per_length_bucket(corpus, tmp_path, capsys):
    # Model lengths (+1): 3, 6, 10, 20 on both sides. Batch [0, 1] pads 3 to 6: 9 real of 12 tokens a side.
    data = tmp_path / "data"
    write_tokenized(data / "tokenized", {"train": [2, 5, 9, 19], "valid": [4], "test": [4]})
    write_batches(data / "batches", "train", [[0, 1], [2], [3]])
    write_batches(data / "batches", "valid", [[0]])
    out = inspect(capsys, data / "batches", tmp_path / "out", "--params", str(corpus / "params.yaml"))
    train = out.split("\nvalid:")[0]
    assert "train: 3 batches; all 4 pairs batched, each once" in train
    assert "sentences per batch:    min 1, median 1, mean 1.3, max 2" in train
    assert "source tokens per batch: min 9, median 10, mean 13.0, max 20" in train
    assert f"padding efficiency (real / padded tokens): {39 / 42:.4f}" in train
    assert re.search(rf"1-10\s+2\s+3\s+{19 / 22:.4f}", train)  # batches of longest 6 and 10
    assert re.search(r"11-20\s+1\s+1\s+1\.0000", train)
    assert "batch.max_tokens = 30" in out
    assert_png(tmp_path / "out" / "batches.png")


def test_batches_that_miss_a_pair_or_point_past_the_corpus(tmp_path, capsys):
    data = tmp_path / "data"
    write_tokenized(data / "tokenized", {"train": [2, 5, 9], "valid": [4], "test": [4]})
    write_batches(data / "batches", "train", [[0, 1]])
    write_batches(data / "batches", "valid", [[0]])
    assert main([str(data / "batches"), "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "train: 1 batches; 2 of 3 pairs batched (1 missing, 0 more than once)" in captured.out
    assert captured.err.count("\n") == 1 and "train.index.npy: 2 of 3 pairs batched" in captured.err
    write_batches(data / "batches", "train", [[0, 1], [7]])
    err = fails(capsys, data / "batches")
    assert "train.index.npy: holds pair 7" in err and "has 3 pairs" in err


def make_checkpoints(directory: Path, steps: list[int], code: dict[str, str] | None = None) -> None:
    for step in steps:
        payload = {"step": step, "model": {"w": torch.full((4,), float(step))}, "elapsed_seconds": 60.0 * step,
                   "train_tokens": 1000 * step, "progress": {"valid": {"valid_ppl": 100.0 / step}},
                   "params_hash": "h", "model_config": MODEL_CONFIG, "vocab_size": 30,
                   **({"code": code} if code is not None else {})}
        save_checkpoint(directory, payload, keep=10)


def test_checkpoints_table_and_the_ones_average_would_take(corpus, tmp_path, capsys):
    current = code_fingerprint("stages.train")
    older = {**current, "pipeline/training/trainer.py": "0" * 64}
    make_checkpoints(tmp_path / "checkpoints", [2, 4], older)
    make_checkpoints(tmp_path / "checkpoints", [6, 8], current)
    out = inspect(capsys, tmp_path / "checkpoints", tmp_path / "out", "--params", str(corpus / "params.yaml"))
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d:", line)}
    assert rows[4] == ["4", "0:04:00", "4,000", "25.00", "0.0", "h", code_hash(older)[:8],
                       "differs:", "pipeline/training/trainer.py", "sealed"]
    assert rows[8] == ["8", "0:08:00", "8,000", "12.50", "0.0", "h", code_hash(current)[:8], "same", "yes", "sealed"]
    assert "yes" not in rows[4] and "yes" in rows[6]
    assert "would take the last 2 complete" in out and "step_00000006.pt, step_00000008.pt" in out
    out = inspect(capsys, tmp_path / "checkpoints", tmp_path / "out", "--params", str(tmp_path / "none.yaml"))
    assert "would take: unknown, params unreadable" in out


def test_a_corrupt_checkpoint_is_shown_then_named_on_one_line(corpus, tmp_path, capsys):
    make_checkpoints(tmp_path / "checkpoints", [2, 4, 6])
    path = tmp_path / "checkpoints" / "step_00000004.pt"
    path.write_bytes(path.read_bytes()[:-20])  # truncated
    assert main([str(tmp_path / "checkpoints"), "--params", str(corpus / "params.yaml")]) == 1
    captured = capsys.readouterr()
    assert re.search(r"^\s*4 .* unreadable", captured.out, re.M)  # the table shows it, then stderr names it
    assert re.search(r"^\s*6 .* yes\s+sealed", captured.out, re.M)  # average skips it: 2 and 6
    assert captured.err.count("\n") == 1
    assert "step_00000004.pt" in captured.err and "expected a sealed checkpoint" in captured.err


def test_model_counts_parameters_by_component_and_names_its_checkpoints(tmp_path, capsys):
    tokenized = tmp_path / "tokenized"
    tokenized.mkdir()
    (tokenized / "meta.json").write_text(json.dumps({"vocab_size": 30}))
    model = save_model(tmp_path / "model", tokenized)
    (model / "averaged.json").write_text(json.dumps({"steps": [1], "checkpoints": ["step_00000001.pt"]}))
    out = inspect(capsys, model, tmp_path / "out")
    expected = sum(p.numel() for p in Transformer(ModelConfig(**MODEL_CONFIG), 30).parameters())
    assert f"{expected:,} parameters" in out
    assert "averages 1 checkpoint(s)" in out and "step_00000001.pt; steps [1]" in out
    assert "built from: vocab_size 30, n_layers 2, d_model 16" in out
    rows = re.findall(r"^(embedding|encoder layer \d|decoder layer \d)\s+([\d,]+)", out, re.M)
    assert [name for name, _ in rows] == ["embedding", "encoder layer 0", "encoder layer 1", "decoder layer 0",
                                          "decoder layer 1"]
    assert sum(int(n.replace(",", "")) for _, n in rows) == expected
    (model / "model.pt").write_bytes((model / "model.pt").read_bytes()[:1000])
    err = fails(capsys, model)
    assert "model.pt: cannot load" in err


def test_translations_side_by_side_worst_chrf_and_length_limit(run, tmp_path, capsys):
    out = inspect(capsys, run / "data" / "translations", tmp_path / "out", "--params", str(run / "params.yaml"))
    worst = out.split("the worst 5 by sentence chrF:\n")[1]
    assert worst.splitlines()[0].startswith(f"  line {BAD_LINE}  (chrF 0.0")
    assert "source     en: Two dogs watches the house on the hill" in worst.splitlines()[1]
    assert "1 of 6 sentences" in out
    limit = out.split("sentences\n")[-1].splitlines()
    assert limit[1].split()[0] == str(LONG_LINE)
    assert_png(tmp_path / "out" / "length_ratio.png")


def test_translations_that_do_not_align_with_the_references(run, capsys):
    write_lines(run / "data" / "translations" / "test.de", ["Eine Zeile."])
    err = fails(capsys, run / "data" / "translations")
    assert "test.de has 1 lines" in err and "test.en has 6" in err


def test_eval_prints_metrics_and_writes_one_csv_row_per_sentence(run, tmp_path, capsys):
    metrics = {"bleu": 12.345, "chrf": 40.0, "bleu_tokenized": 13.0, "signature": "nrefs:1|tok:13a|smooth:exp",
               "chrf_signature": "nrefs:1|nc:6", "valid_bleu": 10.0}
    (run / "metrics" / "eval.json").write_text(json.dumps(metrics))
    out = inspect(capsys, run / "metrics" / "eval.json", tmp_path / "out")
    assert re.search(r"bleu\s+12\.35", out) and "signature: nrefs:1|tok:13a|smooth:exp" in out
    table = pd.read_csv(tmp_path / "out" / "sentences.csv", keep_default_na=False)
    assert list(table.columns) == ["split", "line", "source", "reference", "hypothesis", "bleu", "chrf",
                                   "hyp_words", "ref_words"]
    assert len(table) == len(TEST_EN) + len(VALID_EN)
    test = table[table.split == "test"]
    assert test.sort_values("chrf").line.iloc[0] == BAD_LINE
    assert test[~test.line.isin([BAD_LINE, LONG_LINE])].bleu.tolist() == pytest.approx([100.0] * 4)
    assert_png(tmp_path / "out" / "sentence_chrf.png")


def test_eval_json_corrupt_or_missing(run, capsys):
    eval_json = run / "metrics" / "eval.json"
    assert "eval.json: missing; expected the evaluate stage's metrics" in fails(capsys, eval_json)
    eval_json.write_text("{not json")
    assert "eval.json: not valid JSON" in fails(capsys, eval_json)


def test_an_unknown_path_lists_the_layouts_it_knows(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    err = fails(capsys, tmp_path)
    assert "not a stage output this tool knows" in err and "raw:" in err and "checkpoints:" in err
    assert "not found" in fails(capsys, tmp_path / "nothing")
    write_lines(tmp_path / "raw" / "train.en", ["A line."])
    assert f"holds the stage outputs {tmp_path / 'raw'};" in fails(capsys, tmp_path)


def test_mlflow_run_gets_the_view_text_pictures_and_the_sentences_as_a_table(run, tmp_path, capsys):
    client = MlflowClient()  # the test's own sqlite store (conftest)
    experiment = client.create_experiment("views", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    (run / "metrics" / "eval.json").write_text(json.dumps({"bleu": 12.345, "signature": "nrefs:1|tok:13a"}))
    printed = inspect(capsys, run / "metrics" / "eval.json", tmp_path / "out", "--mlflow-run", run_id)
    logged = {a.path for a in client.list_artifacts(run_id, "inspect/eval")}
    assert logged == {f"inspect/eval/{name}" for name in
                      ("view.txt", "sentence_chrf.png", "sentences.csv", "sentences.json")}
    view = (tmp_path / "artifacts" / run_id / "artifacts" / "inspect" / "eval" / "view.txt").read_text()
    assert view == printed and "signature: nrefs:1|tok:13a" in view
    table = client.load_table(experiment, "inspect/eval/sentences.json", run_ids=[run_id])
    assert len(table) == len(TEST_EN) + len(VALID_EN)
    worst = table[table.split == "test"].sort_values("chrf").iloc[0]
    assert (worst.line, worst.hypothesis) == (BAD_LINE, "Xxx Yyy")


def test_mlflow_run_that_does_not_exist_is_one_line(run, capsys):
    (run / "metrics" / "eval.json").write_text(json.dumps({"bleu": 1.0}))
    err = fails(capsys, run / "metrics" / "eval.json", "--out", str(run / "out"), "--mlflow-run", "no-such-run")
    assert err.startswith("inspect: could not log the eval view to MLflow run no-such-run: ")
