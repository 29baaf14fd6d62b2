"""Bad input: a clear error naming the file and line or the params key, and no partial output.

This file holds the cases the stages' own tests do not. Covered there:
- test_download.py: truncated archive, truncated gzip, sha256 mismatch (file and archive member), source and
  target of different line counts, invalid UTF-8, BOM and CRLF (stripped, not an error), empty corpus, SGML
  with mismatched or reordered segment ids, bad data sources (six params keys), plain http without sha256.
- test_tokenize.py: missing raw file, misaligned sides, invalid UTF-8 (file:line), an empty training set
  after filtering, over-long training pairs (dropped and counted), bad tokenize params, vocabulary too large.
- test_batch.py: a pair longer than batch.max_tokens. test_config.py: unknown preset, missing, unknown and
  mistyped keys, unknown section. test_presets.py: averaging window larger than the checkpoints kept.
- test_average.py: too few checkpoints for last_n, other model shapes, tensors, params, corrupt files.
- test_train.py: more devices than processes, changed params start afresh, a corrupt newest checkpoint.
- test_checkpoint.py: broken checkpoints skipped by name. test_translate.py: tokenized data stale against raw.
- test_evaluate.py: an empty hypothesis file, line count mismatch, missing translation file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.device import distributed
from pipeline.corpus import fetch, sources
from pipeline.translation import scoring
from pipeline.core import tracking
from stages import average, batch, download, evaluate, train, translate
from pipeline.weights.checkpoint import (CheckpointError, load_checkpoint, load_model, save_checkpoint, save_sealed,
                                         sidecar)
from pipeline.core.config import DataConfig, ParamsError, TokenizeConfig, TrainConfig, compose, load
from pipeline.core.files import InputError
from stages.tokenize import tokenize
from tests.fixtures.files_server import FileServer
from tests.fixtures.pipeline_repo import ROOT
from tests.fixtures.train import TRAIN, stage_args
from tests.fixtures.train import write_corpus as write_train_corpus
from tests.fixtures.train import write_params as write_train_params
from tests.fixtures.translation import MODEL_CONFIG, save_model, sentence_pairs, write_lines
from tests.fixtures.translation import one_thread, shared_store, store  # noqa: F401 (fixtures)
from tests.fixtures.translation import write_params as write_translate_params


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setattr(tracking, "_disabled", False)  # a tracking failure turns it off for the rest of a process
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.001)
    monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)


def nothing_written(tmp_path: Path, *names: str) -> bool:
    """None of the outputs, and no temporaries (pipeline.core.files names them .<name>.*.tmp), exist."""
    return not any((tmp_path / n).exists() for n in names) and not list(tmp_path.glob(".*.tmp"))


# --- download: SGML test sets ------------------------------------------------------------------------------

PLAIN = {"train": ("A dog runs.\nA cat sits.\n", "Ein Hund läuft.\nEine Katze sitzt.\n"),
         "valid": ("Two men talk.\n", "Zwei Männer reden.\n")}


def sgm(tag: str, attrs: str, segs: list[str]) -> bytes:
    lines = [f"<{tag} setid=\"toy\" {attrs}>", '<doc docid="d1" genre="news">', *segs, "</doc>", f"</{tag}>"]
    return ("\n".join(lines) + "\n").encode()


SRC_SGM = sgm("srcset", 'srclang="any"', ['<seg id="1">A first line.</seg>', '<seg id="2">A second line.</seg>'])
REF_SGM = sgm("refset", 'srclang="any" trglang="de"', ['<seg id="1">Eine erste Zeile.</seg>',
                                                       '<seg id="2">Eine zweite Zeile.</seg>'])


# The served file of each split and side.
NAMES = {("train", "src"): "train.src", ("train", "tgt"): "train.tgt", ("valid", "src"): "valid.src",
         ("valid", "tgt"): "valid.tgt", ("test", "src"): "test.src.sgm", ("test", "tgt"): "test.ref.sgm"}
CONTENT = {"train.src": PLAIN["train"][0].encode(), "train.tgt": PLAIN["train"][1].encode(),
           "valid.src": PLAIN["valid"][0].encode(), "valid.tgt": PLAIN["valid"][1].encode(),
           "test.src.sgm": SRC_SGM, "test.ref.sgm": REF_SGM}


def run_download(tmp_path: Path, files: dict[str, bytes] | None = None, names: dict | None = None,
                 edit=None, asked: list | None = None) -> Path:
    """Serve the files (CONTENT, with `files` replacing some) from 127.0.0.1 and run the download stage on them.

    `names` renames the file of a (split, side); `edit` may change the params `data` section before the run;
    `asked` receives the paths the server was asked for.
    """
    www = tmp_path / "www"
    www.mkdir(exist_ok=True)
    files, names = {**CONTENT, **(files or {})}, {**NAMES, **(names or {})}
    with FileServer(www) as server:
        data = {"name": "toy", "src_lang": "en", "tgt_lang": "de"}
        for (split, side), name in names.items():
            (www / name).write_bytes(files[name])
            source = {"url": server.url(name), "member": None, "sha256": hashlib.sha256(files[name]).hexdigest()}
            data.setdefault(split, [{"name": f"toy-{split}"}])[0][side] = source
        if edit is not None:
            edit(data)
        params = compose([])
        params["data"] = data
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        try:
            download.main(["--out", str(tmp_path / "raw"), "--metrics", str(tmp_path / "raw.json"),
                           "--params", str(tmp_path / "params.yaml"), "--cache", str(tmp_path / "cache")])
        finally:
            (asked if asked is not None else []).extend(server.paths_requested())
        return tmp_path / "raw"


def test_sgml_declaring_the_right_languages_is_accepted(tmp_path):
    raw = run_download(tmp_path)
    assert (raw / "test.de").read_text(encoding="utf-8") == "Eine erste Zeile.\nEine zweite Zeile.\n"


def test_a_reference_in_another_language_is_refused_naming_file_and_key(tmp_path):
    wrong = REF_SGM.replace(b'trglang="de"', b'trglang="fr"')
    with pytest.raises(sources.DownloadError, match=r'test\.ref\.sgm: line 1: <refset> declares trglang="fr" but '
                                                     r"data\.test\[0\]\.tgt is the data\.tgt_lang = 'de' side"):
        run_download(tmp_path, {"test.ref.sgm": wrong})
    assert nothing_written(tmp_path, "raw", "raw.json")


def test_a_source_in_another_language_is_refused_naming_file_and_key(tmp_path):
    wrong = SRC_SGM.replace(b'srclang="any"', b'srclang="cs"')
    with pytest.raises(sources.DownloadError, match=r'test\.src\.sgm: line 1: <srcset> declares srclang="cs" but '
                                                     r"data\.test\[0\]\.src is the data\.src_lang = 'en' side"):
        run_download(tmp_path, {"test.src.sgm": wrong})
    assert nothing_written(tmp_path, "raw", "raw.json")


@pytest.mark.parametrize("file, old, new, message", [
    ("test.ref.sgm", b'<seg id="2">', b"<seg>", r"test\.ref\.sgm: line 4: expected <seg id=N>text</seg>"),  # no id
    ("test.src.sgm", b'<seg id="1">A first line.</seg>', b'<seg id="1">A first\nline.</seg>',  # over two lines
     r"test\.src\.sgm: line 3: expected <seg id=N>text</seg> on one"),
    ("test.ref.sgm", b'<seg id="2">', b'<seg id="1">', r"test\.ref\.sgm: segment docid='d1' segid=1 appears twice"),
])
def test_a_malformed_segment_is_refused_naming_file_and_line(tmp_path, file, old, new, message):
    broken = (REF_SGM if file == "test.ref.sgm" else SRC_SGM).replace(old, new)
    assert broken != (REF_SGM if file == "test.ref.sgm" else SRC_SGM)
    with pytest.raises(sources.DownloadError, match=message):
        run_download(tmp_path, {file: broken})
    assert nothing_written(tmp_path, "raw", "raw.json")


# --- download: what the server sends -------------------------------------------------------------------------


def test_a_url_that_is_not_there_is_named_and_not_retried(tmp_path):
    def gone(data: dict) -> None:
        data["valid"][0]["src"]["url"] += ".gone"

    asked = []
    with pytest.raises(fetch.DownloadError, match=r"http://127\.0\.0\.1:\d+/valid\.src\.gone: HTTP 404"):
        run_download(tmp_path, edit=gone, asked=asked)
    assert asked.count("/valid.src.gone") == 1
    assert nothing_written(tmp_path, "raw", "raw.json")


def test_a_file_named_gz_that_is_not_gzip_is_refused_naming_it(tmp_path):
    with pytest.raises(fetch.DownloadError, match=r"/train\.src\.gz: corrupt or truncated gzip"):
        run_download(tmp_path, {"train.src.gz": CONTENT["train.src"]}, {("train", "src"): "train.src.gz"})
    assert nothing_written(tmp_path, "raw", "raw.json")


def test_an_archive_without_the_member_is_refused_naming_both(tmp_path):
    import io
    import tarfile

    archive = tmp_path / "dev.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("dev/other.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(fetch.DownloadError, match=r"dev\.tgz \(archive\): no member\(s\) \['dev/valid\.en'\]"):
        fetch.extract_members(archive, ["dev/valid.en"], tmp_path / "out", "dev.tgz (archive)")
    assert not (tmp_path / "out").exists()


# --- params ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("", r"expected a mapping of sections at the top level"),
    ("train: [1, 2\n", r"not valid YAML"),
    ("- train\n", r"expected a mapping of sections at the top level"),
    ("model: {}\n", r"missing section 'train'"),
])
def test_an_unreadable_params_file_is_named(tmp_path, text, message):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError, match=rf"{path}: {message}"):
        load(path, "train", TrainConfig)


def test_a_bool_where_an_int_is_expected_names_the_key(tmp_path):
    params = compose([])
    params["train"]["devices"] = True
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match=r"train\.devices: expected int, got bool True"):
        load(tmp_path / "params.yaml", "train", TrainConfig)


def test_an_override_of_a_key_that_does_not_exist_is_refused_naming_it():
    with pytest.raises(ParamsError, match=r"train\.warmup_step"):
        compose(["train.warmup_step=8000"])


# --- devices, checkpoints, models --------------------------------------------------------------------------


def test_more_devices_than_gpus_is_a_clear_error(monkeypatch):
    """On a CPU machine train.devices=2 runs two gloo processes (test_train.py); with GPUs it needs two GPUs."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"train\.devices=2 but this machine has 1 GPU\(s\)"):
        distributed.setup(2, 10.0)


def test_a_changed_model_config_starts_training_afresh_and_says_so(tmp_path, caplog):
    write_train_corpus(tmp_path)
    train.main(stage_args(tmp_path, write_train_params(tmp_path / "params.yaml", max_steps=2)))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train.main(stage_args(tmp_path, write_train_params(tmp_path / "params.yaml", max_steps=2, model={"d_ff": 48})))
    assert "params changed" in caplog.text and "starting afresh" in caplog.text and "resuming" not in caplog.text
    newest = load_checkpoint(sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1])
    assert newest["model_config"]["d_ff"] == 48 and newest["model"]["encoder.0.ffn.w_1.weight"].shape[0] == 48


def test_a_valid_pair_longer_than_the_model_is_left_out_of_validation_not_a_crash(tmp_path, caplog):
    """Valid is never length-filtered (stages.tokenize): a pair beyond model.max_positions must not stop training."""
    from pipeline.corpus.formats import batch_paths
    from tests.fixtures.train import bucket, target_of, write_split

    write_train_corpus(tmp_path)
    rng = np.random.default_rng(1)
    src = [rng.integers(4, 24, size=5) for _ in range(7)] + [rng.integers(4, 24, size=100)]  # max_positions is 64
    tgt = [target_of(s) for s in src]
    write_split(tmp_path / "tokenized", "valid", src, "en")
    write_split(tmp_path / "tokenized", "valid", tgt, "de")
    for path, array in zip(batch_paths(tmp_path / "batches", "valid"),
                           bucket(np.array([len(s) for s in src]), np.array([len(t) for t in tgt]), 200)):
        np.save(path, array)
    with caplog.at_level(logging.WARNING):
        train.main(stage_args(tmp_path, write_train_params(tmp_path / "params.yaml", max_steps=2, eval_every=1)))
    assert "1 valid pair(s) longer than model.max_positions = 64 are left out of validation" in caplog.text
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["valid_ppl"] > 1


class Payload:
    """Not a tensor: what a malicious checkpoint would smuggle in; loading it must not run anything."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_a_pickled_object_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    state = Transformer(ModelConfig(**MODEL_CONFIG), 20).state_dict()
    payload = {"step": 1, "model": state, "model_config": MODEL_CONFIG, "vocab_size": 20, "params_hash": "h",
               "extra": Payload(marker)}
    path = save_checkpoint(tmp_path / "ckpt", payload, keep=5)  # sealed: its sha256 sidecar matches
    assert sidecar(path).exists()
    with pytest.raises(CheckpointError, match=rf"{path}: cannot load checkpoint: .*[Ww]eights only load failed"):
        load_checkpoint(path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"average": {"last_n": 1}}))
    with pytest.raises(CheckpointError, match=str(path)):
        average.main(["--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model"),
                      "--params", str(tmp_path / "params.yaml")])
    (tmp_path / "model_dir").mkdir()
    save_sealed(tmp_path / "model_dir" / "model.pt",  # sealed: the seal passes, torch.load refuses
                {"model": state, "model_config": MODEL_CONFIG, "vocab_size": 20, "evil": Payload(marker)})
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'model_dir' / 'model.pt'}: .*[Ww]eights only load failed"):
        load_model(tmp_path / "model_dir", torch.device("cpu"))
    assert not marker.exists() and not (tmp_path / "model").exists()


# --- tokenized data, translation, evaluation --------------------------------------------------------------


def test_truncated_token_ids_are_refused_by_the_batch_stage_naming_the_file(tmp_path):
    tokenized, _ = write_train_corpus(tmp_path / "corpus")
    ids = tokenized / "train.en.ids"
    ids.write_bytes(ids.read_bytes()[:-6])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"batch": {"max_tokens": 24, "seed": 1}, "train": TRAIN}))
    with pytest.raises(ValueError, match=r"train\.en\.offsets: offsets do not describe .*train\.en\.ids"):
        batch.main(["--tokenized", str(tokenized), "--out", str(tmp_path / "batches"),
                    "--metrics", str(tmp_path / "batch.json"), "--params", str(tmp_path / "params.yaml")])
    assert nothing_written(tmp_path, "batches", "batch.json")


@pytest.fixture(scope="module")
def long_lines(tmp_path_factory) -> tuple[Path, Path, Path]:
    """raw, tokenized and a tiny model (max_positions 128) where one test and one valid source run to ~600 tokens."""
    root = tmp_path_factory.mktemp("long")
    pairs = sentence_pairs()
    endless = " ".join(en for en, _ in pairs[:60])  # 60 sentences in one line
    sources = {"test": ["A man rides a bike.", endless, "A girl."], "valid": [endless, "Two dogs."]}
    write_lines(root / "raw" / "train.en", [en for en, _ in pairs])
    write_lines(root / "raw" / "train.de", [de for _, de in pairs])
    for split, lines in sources.items():
        write_lines(root / "raw" / f"{split}.en", lines)
        write_lines(root / "raw" / f"{split}.de", [f"Referenz {i}." for i in range(len(lines))])
    cfg = TokenizeConfig(model_type="bpe", vocab_size=60, character_coverage=1.0, input_sentence_size=0,
                         max_len=64, max_len_ratio=3.0, seed=1)
    tokenize(root / "raw", root / "tokenized", ("en", "de"), cfg)
    return root / "raw", root / "tokenized", save_model(root / "model", root / "tokenized")


def test_test_and_valid_lines_far_longer_than_the_model_are_translated_cut_not_crashing(tmp_path, long_lines, caplog):
    raw, tokenized, model = long_lines
    with caplog.at_level(logging.WARNING):
        translate.main(["--model", str(model), "--tokenized", str(tokenized), "--raw", str(raw),
                        "--out", str(tmp_path / "out"), "--params", str(write_translate_params(tmp_path / "p.yaml"))])
    assert "source sentence(s) longer than" in caplog.text and "cut to fit model.max_positions" in caplog.text
    assert len((tmp_path / "out" / "test.de").read_text(encoding="utf-8").splitlines()) == 3
    assert len((tmp_path / "out" / "valid.de").read_text(encoding="utf-8").splitlines()) == 2


def test_a_tokenizer_from_another_run_is_refused_naming_it(tmp_path, long_lines):
    raw, tokenized, _ = long_lines
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_sealed(model_dir / "model.pt", {"model": Transformer(ModelConfig(**MODEL_CONFIG), 99).state_dict(),
                                         "model_config": MODEL_CONFIG, "vocab_size": 99})
    with pytest.raises(ValueError, match=r"spm\.model has 60 pieces but the model has a vocabulary of 99"):
        translate.main(["--model", str(model_dir), "--tokenized", str(tokenized), "--raw", str(raw),
                        "--out", str(tmp_path / "out"), "--params", str(write_translate_params(tmp_path / "p.yaml"))])
    assert nothing_written(tmp_path, "out")


def test_a_missing_model_is_named(tmp_path, long_lines):
    raw, tokenized, _ = long_lines
    with pytest.raises(InputError, match=r"nowhere/model\.pt: missing; run the average stage first"):
        translate.main(["--model", str(tmp_path / "nowhere"), "--tokenized", str(tokenized), "--raw", str(raw),
                        "--out", str(tmp_path / "out"), "--params", str(write_translate_params(tmp_path / "p.yaml"))])
    assert nothing_written(tmp_path, "out")


def test_a_hypothesis_file_with_invalid_utf8_names_file_and_line(tmp_path):
    for directory, text in (("translations", b"Ein Hund.\nEin \xff Kind.\n"), ("raw", b"Ein Hund.\nEin Kind.\n")):
        for split in ("test", "valid"):
            (tmp_path / directory).mkdir(exist_ok=True)
            (tmp_path / directory / f"{split}.de").write_bytes(text)
    params = compose([])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(scoring.ScoringError, match=r"translations/test\.de:2: not valid UTF-8"):
        evaluate.main(["--translations", str(tmp_path / "translations"), "--raw", str(tmp_path / "raw"),
                       "--metrics", str(tmp_path / "eval.json"), "--params", str(tmp_path / "params.yaml")])
    assert nothing_written(tmp_path, "eval.json")


# --- security ------------------------------------------------------------------------------------------------
# Also: archive members that escape the target directory, absolute paths and links are refused
# (test_download.py::test_path_traversal_member_is_refused, ::test_extraction_refuses_members_outside_the_target_dir,
# ::test_link_member_is_refused); plain http without a pinned sha256 is refused before any request
# (::test_plain_http_without_sha256_is_refused_before_any_request); every file's sha256 is checked
# (::test_checksum_mismatch_is_refused_and_the_file_deleted).


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml")))
def test_every_data_preset_downloads_over_https_or_with_a_pinned_checksum(tmp_path, preset):
    params = compose([f"data={preset}"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    data = load(tmp_path / "params.yaml", "data", DataConfig)
    sources.check_params(data)
    for key, _, _, source in sources.iter_sources(data):
        assert source.url.startswith("https://") or source.sha256 is not None, key


def test_the_tracking_ui_binds_to_localhost_only():
    recipe = (ROOT / "Makefile").read_text().split("\nui:", 1)[1]
    assert "mlflow ui" in recipe and "--host 127.0.0.1" in recipe
