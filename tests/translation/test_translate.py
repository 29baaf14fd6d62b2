"""stages.translate: batched beam search over whole splits, outputs in source order, and the --stdin mode."""

from __future__ import annotations

import codecs
import logging
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipeline.translation import decoding
from stages import translate
from pipeline.core.config import TranslateConfig
from pipeline.core.files import InputError
from pipeline.corpus import rawtext
from pipeline.weights.checkpoint import load_model
from pipeline.corpus.formats import load_spm, load_split
from tests.fixtures.translation import TEST_EN, TRANSLATE, VALID_EN, make_corpus, save_model, write_params
from tests.fixtures.translation import one_thread, shared_store, store  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
CFG = TranslateConfig(**TRANSLATE)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(raw, tokenized, model_dir) shared by the module: the tokenizer takes seconds to train."""
    root = tmp_path_factory.mktemp("translate")
    raw, tokenized = make_corpus(root)
    return raw, tokenized, save_model(root / "model", tokenized)


def one_at_a_time(model_dir: Path, tokenized: Path, sources: list[np.ndarray]) -> list[str]:
    model = load_model(model_dir, torch.device("cpu"))
    sp = load_spm(tokenized, model.embedding.num_embeddings)
    return [translate.detokenize(sp, decoding.translate_ids(model, [s], CFG, progress=False))[0] for s in sources]


def run_main(tmp_path: Path, setup) -> Path:
    raw, tokenized, model_dir = setup
    out = tmp_path / "translations"
    translate.main(["--model", str(model_dir), "--tokenized", str(tokenized), "--raw", str(raw), "--out", str(out),
                    "--params", str(write_params(tmp_path / "params.yaml"))])
    return out


def test_batches_hold_at_most_max_tokens_and_cover_every_sentence():
    lengths = np.array([3, 9, 1, 4, 4, 12, 2, 7])
    batches = decoding.decoding_batches(lengths, max_tokens=12, max_sentences=3)
    assert sorted(np.concatenate(batches).tolist()) == list(range(8))
    for batch in batches:
        assert len(batch) <= 3 and len(batch) * lengths[batch].max() <= 12
    assert [lengths[b].tolist() for b in batches] == [[12], [9], [7], [4, 4, 3], [2, 1]]


def test_a_sentence_longer_than_max_tokens_gets_a_batch_of_its_own():
    assert [b.tolist() for b in decoding.decoding_batches(np.array([2, 50, 3]), 10, 8)] == [[1], [2, 0]]


def test_parallel_searches_split_every_batch_so_each_thread_gets_an_equal_share():
    batches = [np.arange(0, 4), np.arange(4, 9), np.arange(9, 10)]
    parts, workers, threads = decoding.parallel_searches(batches, threads=2, cuda=False)
    assert (workers, threads) == (2, 1)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5, 6], [7, 8], [9]]
    assert decoding.parallel_searches(batches, threads=1, cuda=False) == (batches, 1, 1)
    assert decoding.parallel_searches(batches, threads=2, cuda=True) == (batches, 1, 2)
    assert decoding.parallel_searches([np.arange(1)], threads=4, cuda=False)[1:] == (1, 4)  # one sentence


def test_translations_do_not_depend_on_the_number_of_threads(setup):
    _, tokenized, model_dir = setup
    model = load_model(model_dir, torch.device("cpu"))
    encoded = load_split(tokenized, "test", "en")
    sources = [encoded[i] for i in range(len(encoded))]
    outputs = []
    for threads in (1, 2, 3):
        with decoding.torch_threads(threads):
            outputs.append(decoding.translate_ids(model, sources, CFG, progress=False))
    assert outputs[0] == outputs[1] == outputs[2]


def test_main_writes_one_line_per_source_line_in_source_order(tmp_path, setup):
    raw, tokenized, model_dir = setup
    out = run_main(tmp_path, setup)
    for split, sources in (("test", TEST_EN), ("valid", VALID_EN)):
        lines = (out / f"{split}.de").read_text(encoding="utf-8").split("\n")
        assert lines[-1] == "" and len(lines) - 1 == len(sources)
        encoded = load_split(tokenized, split, "en")
        assert lines[:-1] == one_at_a_time(model_dir, tokenized, [encoded[i] for i in range(len(encoded))])
    test_lines = (out / "test.de").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(set(test_lines)) > 1  # the order check above can tell sentences apart


def test_the_stage_records_its_decoding_precision_fp32_on_a_cpu(tmp_path, setup, caplog):
    caplog.set_level(logging.INFO)
    run_main(tmp_path, setup)
    assert "decoding in float32" in [r.getMessage() for r in caplog.records]
    client = MlflowClient()
    runs = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
            if r.data.tags.get("stage") == "translate"]  # the module's store: other tests' runs of the stage too
    assert runs and all(r.data.params["decode_precision"] == "float32" for r in runs)


def test_a_translation_batch_matches_translating_sentences_alone(setup):
    """Padding and beam bookkeeping in a batch of different lengths change nothing."""
    _, tokenized, model_dir = setup
    model = load_model(model_dir, torch.device("cpu"))
    encoded = load_split(tokenized, "test", "en")
    sources = [encoded[i] for i in range(len(encoded))]
    batched = decoding.translate_ids(model, sources, TranslateConfig(**{**TRANSLATE, "max_tokens": 1000}), False)
    assert batched == [decoding.translate_ids(model, [s], CFG, progress=False)[0] for s in sources]


def test_an_encoded_split_that_no_longer_matches_the_raw_file_is_refused(tmp_path, setup):
    raw, tokenized, model_dir = setup
    stale_raw = tmp_path / "raw"
    stale_raw.mkdir()
    for f in raw.iterdir():
        (stale_raw / f.name).write_bytes(f.read_bytes())
    (stale_raw / "test.en").write_text("only one line\n")
    with pytest.raises(ValueError, match=r"test\.en holds 6 sentences but .*raw/test\.en has 1 lines"):
        translate.main(["--model", str(model_dir), "--tokenized", str(tokenized), "--raw", str(stale_raw),
                        "--out", str(tmp_path / "out"), "--params", str(write_params(tmp_path / "params.yaml"))])
    assert not (tmp_path / "out").exists()


def stdin_command(tmp_path: Path, setup) -> list[str]:
    _, tokenized, model_dir = setup
    return [sys.executable, "-m", "stages.translate", "--stdin", "--model", str(model_dir),
            "--tokenized", str(tokenized), "--params", str(write_params(tmp_path / "params.yaml"))]


def test_stdin_mode_prints_one_translation_per_piped_line(tmp_path, setup):
    _, tokenized, model_dir = setup
    lines = ["A man rides a bike.", "", "The child finds the red ball and two dogs watches a small boat.", "A girl."]
    done = subprocess.run(stdin_command(tmp_path, setup), input="\n".join(lines) + "\n", cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model = load_model(model_dir, torch.device("cpu"))
    sp = load_spm(tokenized, model.embedding.num_embeddings)
    expected = one_at_a_time(model_dir, tokenized, [np.array(ids) for ids in sp.encode(lines)])
    assert done.stdout.split("\n") == expected + [""]


def test_an_empty_source_line_gives_an_empty_line_in_the_files_and_on_stdin(tmp_path, setup):
    """A beam search over EOS alone would emit words; the module keeps empty lines empty instead."""
    empty = TEST_EN.index("")
    lines = (run_main(tmp_path, setup) / "test.de").read_text(encoding="utf-8").split("\n")
    assert lines[empty] == "" and all(lines[i] for i in range(len(TEST_EN)) if i != empty)
    piped = ["A man rides a bike.", "", "   ", "A girl."]
    done = subprocess.run(stdin_command(tmp_path, setup), input="\n".join(piped) + "\n", cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.split("\n")
    assert out[1] == out[2] == "" and out[0] and out[3] and out[4:] == [""]


def test_stdin_mode_answers_each_line_before_the_next_arrives(tmp_path, setup):
    proc = subprocess.Popen(stdin_command(tmp_path, setup), cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
    try:
        answers = []
        for sentence in ("A man rides a bike.", "Two dogs."):
            proc.stdin.write(sentence + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, f"no translation of {sentence!r} while stdin stays open"
            answers.append(proc.stdout.readline())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        assert proc.stdout.read() == ""
    finally:
        proc.kill()
    assert all(a.endswith("\n") for a in answers)


def stdin_translations(setup, lines: list[str]) -> list[str]:
    """What the --stdin mode should print for clean `lines`: each translated alone."""
    _, tokenized, model_dir = setup
    sp = load_spm(tokenized, load_model(model_dir, torch.device("cpu")).embedding.num_embeddings)
    return one_at_a_time(model_dir, tokenized, [np.array(ids) for ids in sp.encode(lines)])


def test_invalid_utf8_on_stdin_stops_after_translating_the_lines_before_it(tmp_path, setup):
    """Issue 27: the bad line arrives in the same group as a good one; the good one is still printed and flushed."""
    piped = b"A man rides a bike.\n\xff\xfe caf\xe9 bad bytes\nA girl.\n"
    done = subprocess.run(stdin_command(tmp_path, setup), input=piped, cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout.decode() == stdin_translations(setup, ["A man rides a bike."])[0] + "\n"
    assert done.stderr.decode().splitlines()[-1] == (
        r"translate: error: standard input, line 2: invalid UTF-8 at byte 0 (invalid start byte): "
        r"b'\xff\xfe caf\xe9 bad bytes'")


def test_invalid_utf8_on_stdin_is_named_by_its_line_counted_across_groups():
    read, write = os.pipe()
    with os.fdopen(write, "wb", buffering=0) as w, os.fdopen(read, "rb") as r:
        batches = translate.stdin_batches(r.fileno(), max_lines=13)
        w.write(b"A man rides a bike.\n")
        assert next(batches) == ["A man rides a bike."]
        w.write(b"Two dogs.\n\xe9t\xe9\r\nA girl.\n")  # one group: the line before the bad one comes first
        assert next(batches) == ["Two dogs."]
        with pytest.raises(InputError, match=r"^standard input, line 3: invalid UTF-8 at byte 0 \(invalid continuation "
                                             r"byte\): b'\\xe9t\\xe9'$"):
            next(batches)


def test_a_bom_and_crlf_on_stdin_are_read_as_in_files_and_translated_like_clean_input(tmp_path, setup):
    clean = ["A man rides a bike.", "A girl."]
    piped = codecs.BOM_UTF8 + b"".join(line.encode() + b"\r\n" for line in clean)
    (tmp_path / "file.en").write_bytes(piped)
    assert list(rawtext.read_raw_lines(tmp_path / "file.en", False, "file.en")) == clean
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(piped)
    with os.fdopen(read, "rb") as r:
        assert list(translate.stdin_batches(r.fileno(), max_lines=13)) == [clean]
    done = subprocess.run(stdin_command(tmp_path, setup), input=piped, cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split("\n") == stdin_translations(setup, clean) + [""]
