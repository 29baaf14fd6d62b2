"""The export stage and the ctranslate2 engine: every weight mapped (greedy outputs of a tiny trained model identical,
log-probabilities equal to rounding), quantised exports, refusals, the stage's check and the torch-free --stdin."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.core.config import ExportConfig, ParamsError, TranslateConfig, load
from pipeline.corpus.formats import load_spm
from pipeline.export import spec
from pipeline.export.check import compare, project_log_probs
from pipeline.translation.engine import Ctranslate2Engine, mapped_length_penalty
from pipeline.export.spec import ExportError, write_ctranslate2
from pipeline.weights.checkpoint import load_model
from stages import export as export_stage
from pipeline.translation import decoding
from stages import translate
from tests.fixtures.export import trained_model
from tests.fixtures.translation import TEST_EN, TRANSLATE, make_corpus, sentence_pairs
from tests.fixtures.translation import one_thread, shared_store, store  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = TranslateConfig(**{**TRANSLATE, "beam_size": 1, "length_penalty": 0.0})
EXPORT = {"enabled": True, "quantization": "none", "check_lines": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("export"))


@pytest.fixture(scope="module", params=["sinusoidal", "rotary"])
def trained(request, corpus, tmp_path_factory):
    """(model directory, tokenized) of a tiny model trained for a few seconds, with either kind of positions."""
    torch.set_num_threads(1)
    return trained_model(tmp_path_factory.mktemp(request.param) / "model", corpus[1], request.param), corpus[1]


def sources_and_references(tokenized: Path, vocab_size: int) -> tuple[list[np.ndarray], list[str]]:
    """Every third training sentence and the test sentences (an empty one among them), encoded."""
    pairs = sentence_pairs()[::3]
    lines, refs = [en for en, _ in pairs] + TEST_EN, [de for _, de in pairs] + TEST_EN
    sp = load_spm(tokenized, vocab_size)
    return [np.asarray(ids, dtype=np.int64) for ids in sp.encode(lines)], refs


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_greedy_outputs_of_a_trained_model_are_identical_in_both_engines(trained, tmp_path, quantization):
    model_dir, tokenized = trained
    model = load_model(model_dir, torch.device("cpu"))
    sources, refs = sources_and_references(tokenized, model.embedding.num_embeddings)
    out = tmp_path / "export"
    out.mkdir()
    write_ctranslate2(model, tokenized, out, quantization, {"params_hash": "h"})
    metrics = compare(model, Ctranslate2Engine(out, 1), sources, refs, GREEDY)
    assert metrics["bleu_project"] > 50  # trained: outputs end where it learned to, not at the length limit
    if quantization == "none":
        assert metrics["identical_rate"] == 1.0, metrics
        assert metrics["max_log_prob_diff"] < 1e-4, metrics
        assert metrics["bleu_ctranslate2"] == metrics["bleu_project"]
    else:  # int8 weights: near, not equal
        assert metrics["identical_rate"] >= 0.9 and 1e-4 < metrics["max_log_prob_diff"] < 1.0, metrics
        assert abs(metrics["bleu_ctranslate2"] - metrics["bleu_project"]) < 3
    config = json.loads((out / "config.json").read_text())
    assert config["project"]["params_hash"] == "h" and config["project"]["quantization"] == quantization
    assert (out / "spm.model").read_bytes() == (tokenized / "spm.model").read_bytes()


def test_a_weight_mapped_wrongly_changes_the_outputs(trained, tmp_path, monkeypatch):
    """The check itself can fail: every LayerNorm's bias reversed in the spec (the right shape, the wrong values)."""
    model_dir, tokenized = trained
    model = load_model(model_dir, torch.device("cpu"))
    sources, refs = sources_and_references(tokenized, model.embedding.num_embeddings)
    right = spec._norm
    monkeypatch.setattr(spec, "_norm", lambda s, m: (right(s, m), setattr(s, "beta", s.beta[::-1].copy())))
    write_ctranslate2(model, tokenized, tmp_path, "none", {})
    metrics = compare(model, Ctranslate2Engine(tmp_path, 1), sources, refs, GREEDY)
    assert metrics["identical_rate"] < 0.9 and metrics["max_log_prob_diff"] > 0.1, metrics


PRESET_SHAPES = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "conf" / "model").glob("*.yaml"))}


@pytest.mark.parametrize("name", [*PRESET_SHAPES, "heads_narrower_than_d_model", "learned", "small_rotary"])
def test_every_presets_shape_exports_with_the_same_log_probabilities(corpus, tmp_path, name):
    """Each conf/model shape (one layer of it: the mapping is per layer), a head size other than d_model / h,
    learned and rotary positions: CTranslate2's log-probabilities of the same tokens are the project's."""
    tokenized = corpus[1]
    shape = {**PRESET_SHAPES.get(name, PRESET_SHAPES["tiny"]), "n_layers": 1, "dropout": 0.0}
    shape.update({"heads_narrower_than_d_model": dict(d_k=8, d_v=8), "learned": dict(positional_encoding="learned"),
                  "small_rotary": {**PRESET_SHAPES["small"], "n_layers": 1, "positional_encoding": "rotary",
                                   "rotary_base": 1000.0}}.get(name, {}))
    model_dir = trained_model(tmp_path / "model", tokenized, shape["positional_encoding"], steps=0, **shape)
    model = load_model(model_dir, torch.device("cpu"))
    write_ctranslate2(model, tokenized, tmp_path / "out", "none", {})
    rng = np.random.default_rng(0)
    sources = [rng.integers(4, 60, n) for n in (5, 9, 3)]
    outputs = [rng.integers(4, 60, n).tolist() for n in (4, 7, 0)]
    ours = project_log_probs(model, sources, outputs, GREEDY)
    theirs = Ctranslate2Engine(tmp_path / "out", 1).log_probs(sources, outputs, GREEDY)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)) < 1e-4


def test_keys_and_values_of_different_sizes_are_refused_naming_the_setting(corpus, tmp_path):
    model_dir = trained_model(tmp_path / "model", corpus[1], "sinusoidal", steps=1, d_v=4)
    model = load_model(model_dir, torch.device("cpu"))
    with pytest.raises(ExportError, match=r"^model.d_v = 4: CTranslate2 needs keys and values of one size"):
        write_ctranslate2(model, corpus[1], tmp_path / "out", "none", {})


def test_the_length_penalty_maps_to_the_same_slope_and_alpha_0_to_0():
    assert mapped_length_penalty(0.0, 12) == 0.0
    alpha, n = 0.6, 15
    gnmt = lambda y: alpha * np.log((5 + y) / 6)  # noqa: E731
    slope_gnmt = (gnmt(n + 1e-4) - gnmt(n - 1e-4)) / (np.log(n + 1e-4) - np.log(n - 1e-4))
    assert mapped_length_penalty(alpha, n) == pytest.approx(slope_gnmt, rel=1e-6)


def test_export_params_are_checked(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"export": {**EXPORT, "quantization": "int4"}}))
    with pytest.raises(ParamsError, match="export.quantization = 'int4': expected one of 'none', 'int8'"):
        load(path, "export", ExportConfig)


def stage_args(root: Path, model_dir: Path, tokenized: Path, params: Path) -> list[str]:
    return ["--model", str(model_dir), "--tokenized", str(tokenized), "--raw", str(tokenized.parent / "raw"),
            "--out", str(root / "export"), "--metrics", str(root / "export.json"), "--params", str(params)]


def write_params(path: Path, **export) -> Path:
    path.write_text(yaml.safe_dump({"export": {**EXPORT, **export}, "translate": {**TRANSLATE, "max_len_b": 8}}))
    return path


def test_the_stage_exports_checks_and_keeps_the_previous_export_when_the_check_fails(trained, tmp_path, monkeypatch):
    model_dir, tokenized = trained
    args = stage_args(tmp_path, model_dir, tokenized, write_params(tmp_path / "params.yaml"))
    export_stage.main(args)
    metrics = json.loads((tmp_path / "export.json").read_text())
    assert metrics["identical_rate"] == 1.0 and metrics["lines"] == 2 and metrics["enabled"], metrics
    assert metrics["model_bytes_ctranslate2"] > 0 and metrics["sentences_per_second_ctranslate2"] > 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}

    right = spec._norm  # a wrong mapping: every LayerNorm's bias reversed
    monkeypatch.setattr(spec, "_norm", lambda s, m: (right(s, m), setattr(s, "beta", s.beta[::-1].copy())))
    with pytest.raises(ExportError, match=r"the float32 export \(export.quantization = none\) decodes [01] of 2 validation lines as the project"):
        export_stage.main(args)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before


def test_the_disabled_stage_writes_a_note_only(corpus, tmp_path):
    args = stage_args(tmp_path, tmp_path / "no-model", corpus[1], write_params(tmp_path / "p.yaml", enabled=False))
    export_stage.main(args)
    assert [p.name for p in (tmp_path / "export").iterdir()] == ["disabled.json"]
    assert json.loads((tmp_path / "export.json").read_text()) == {"enabled": False}


def test_translate_with_the_ctranslate2_engine_matches_the_project_and_its_stdin_needs_no_torch(trained, tmp_path):
    model_dir, tokenized = trained
    params = write_params(tmp_path / "params.yaml")
    export_stage.main(stage_args(tmp_path, model_dir, tokenized, params))
    greedy = {**TRANSLATE, "beam_size": 1, "length_penalty": 0.0}
    params.write_text(yaml.safe_dump({"translate": greedy}))
    outs = {}
    for engine in ("project", "ctranslate2"):
        translate.main(["--model", str(model_dir), "--tokenized", str(tokenized), "--export", str(tmp_path / "export"),
                        "--raw", str(tokenized.parent / "raw"), "--out", str(tmp_path / engine), "--engine", engine,
                        "--params", str(params)])
        outs[engine] = {p.name: p.read_text() for p in (tmp_path / engine).iterdir()}
    assert outs["ctranslate2"] == outs["project"]

    lines = [en for en, _ in sentence_pairs()[:20]] + [""]
    cmd = [sys.executable, "-X", "importtime", "-m", "stages.translate", "--stdin", "--engine", "ctranslate2",
           "--export", str(tmp_path / "export"), "--params", str(params)]
    start = time.perf_counter()
    result = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=ROOT, timeout=60)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "ctranslate2" in imported and not any(m == "torch" or m.startswith("torch.") for m in imported)
    expected = translate.detokenize(load_spm(tokenized, 60), decoding.translate_ids(
        load_model(model_dir, torch.device("cpu")), [np.asarray(x) for x in load_spm(tokenized, 60).encode(lines)],
        TranslateConfig(**greedy), progress=False))
    assert result.stdout.splitlines() == expected
    assert seconds < 10, seconds  # about 0.4 s on an idle core; a busy test machine is slower
