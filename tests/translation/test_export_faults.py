"""Nothing used unverified: a damaged export, an export of another run, a damaged model.pt, a wrong mapping at int8,
a killed export and contradicting params each end in one line (exit 2 where the command refuses), with nothing
wrong written or decoded. One tiny export is made per module and copied where a test damages it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.core import cli, config, tracking
from pipeline.core.config import ParamsError
from pipeline.export import spec
from pipeline.translation.engine import computed_type
from stages import export as export_stage
from stages import translate
from tests.fixtures.export import trained_model
from tests.fixtures.translation import TRANSLATE, make_corpus
from tests.fixtures.translation import one_thread, shared_store, store  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
EXPORT = {"enabled": True, "quantization": "none", "check_lines": 0}
GREEDY = {**TRANSLATE, "beam_size": 1, "length_penalty": 0.0}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(root, model dir, tokenized, params) with root/export the export stage's output of a tiny trained model."""
    root = tmp_path_factory.mktemp("faults")
    raw, tokenized = make_corpus(root)
    model = trained_model(root / "model", tokenized, "sinusoidal", steps=80)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump({"export": EXPORT, "translate": {**GREEDY, "max_len_b": 8}}))
    export_stage.main(stage_args(root, model, tokenized, params))
    return root, model, tokenized, params


def stage_args(root: Path, model: Path, tokenized: Path, params: Path) -> list[str]:
    return ["--model", str(model), "--tokenized", str(tokenized), "--raw", str(tokenized.parent / "raw"),
            "--out", str(root / "export"), "--metrics", str(root / "export.json"), "--params", str(params)]


def run_command(main, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """(exit status, the last stderr line) of `main` run as its command (cli.run: one line per expected failure)."""
    monkeypatch.setattr(sys, "argv", ["x", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.run(main)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exit_info.value.code, err.strip().splitlines()[-1]


def translate_args(made, export: Path, tmp_path: Path, engine: str = "ctranslate2", model: Path | None = None):
    root, model_dir, tokenized, params = made
    return ["--model", str(model or model_dir), "--tokenized", str(tokenized), "--export", str(export),
            "--raw", str(tokenized.parent / "raw"), "--out", str(tmp_path / "out"), "--engine", engine,
            "--params", str(params)]


def copy_export(made, tmp_path: Path) -> Path:
    shutil.copytree(made[0] / "export", tmp_path / "export")
    return tmp_path / "export"


DAMAGES = {
    "flipped byte in model.bin": ("model.bin", lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "does not match"),
    "truncated model.bin": ("model.bin", lambda b: b[: len(b) // 2], "does not match seal.sha256"),
    "empty model.bin": ("model.bin", lambda b: b"", "does not match seal.sha256"),
    "truncated config.json": ("config.json", lambda b: b[:40], "does not match seal.sha256"),
    "truncated spm.model": ("spm.model", lambda b: b[:100], "does not match seal.sha256"),
    "missing shared_vocabulary.json": ("shared_vocabulary.json", None, "missing (the export's seal lists it)"),
    "missing seal": ("seal.sha256", None, "seal.sha256: missing"),
}


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_export_is_one_line_in_both_modes_and_nothing_is_written(made, tmp_path, case, capsys, monkeypatch):
    name, damage, expected = DAMAGES[case]
    export = copy_export(made, tmp_path)
    path = export / name
    path.write_bytes(damage(path.read_bytes())) if damage else path.unlink()
    code, line = run_command(translate.main, translate_args(made, export, tmp_path), capsys, monkeypatch)
    assert code == 2 and line.startswith("translate: error: ") and str(export) in line and expected in line, line
    assert "dvc repro export" in line and not (tmp_path / "out").exists()
    stdin = subprocess.run([sys.executable, "-m", "stages.translate", "--stdin", *translate_args(made, export, tmp_path)],
                           input="a man\n", capture_output=True, text=True, cwd=ROOT, timeout=60) if case == \
        "flipped byte in model.bin" else None
    if stdin is not None:  # stdin mode: the same check before the first line is read
        assert stdin.returncode == 2 and stdin.stdout == "" and stdin.stderr.strip().splitlines()[-1] == line


def test_an_export_of_another_model_or_tokenizer_is_refused(made, tmp_path, capsys, monkeypatch):
    root, model_dir, tokenized, _ = made
    other = trained_model(tmp_path / "other", tokenized, "sinusoidal", steps=0, seed=1)
    code, line = run_command(translate.main, translate_args(made, root / "export", tmp_path, model=other), capsys,
                             monkeypatch)
    assert code == 2 and "exported from another model" in line and "trained-sinusoidal" not in line, line
    assert f"not {other / 'model.pt'}" in line and "dvc repro export" in line
    spm_copy = tmp_path / "tokenized"
    shutil.copytree(tokenized, spm_copy)
    (spm_copy / "spm.model").write_bytes((spm_copy / "spm.model").read_bytes() + b"\0")
    argv = translate_args(made, root / "export", tmp_path)
    argv[argv.index("--tokenized") + 1] = str(spm_copy)
    code, line = run_command(translate.main, argv, capsys, monkeypatch)
    assert code == 2 and f"not the tokenizer {spm_copy / 'spm.model'}" in line, line
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_model_pt_is_one_line_for_the_project_engine(made, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(made[1], model)
    data = bytearray((model / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (model / "model.pt").write_bytes(bytes(data))
    code, line = run_command(translate.main, translate_args(made, made[0] / "export", tmp_path, "project", model),
                             capsys, monkeypatch)
    assert code == 2 and f"{model / 'model.pt'}: sha256" in line and "does not match model.pt.sha256" in line, line
    assert "dvc repro average" in line and not (tmp_path / "out").exists()


def test_a_wrong_mapping_fails_the_int8_export_and_the_previous_export_is_kept(made, tmp_path, monkeypatch, caplog):
    root, model, tokenized, _ = made
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"export": {**EXPORT, "quantization": "int8"},
                                      "translate": {**GREEDY, "max_len_b": 8}}))
    args = stage_args(tmp_path, model, tokenized, params)
    export_stage.main(args)  # the right mapping at int8 passes export.min_identical.int8
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    assert "int8" in (tmp_path / "export.json").read_text()
    right = spec._norm  # every LayerNorm's bias reversed
    monkeypatch.setattr(spec, "_norm", lambda s, m: (right(s, m), setattr(s, "beta", s.beta[::-1].copy())))
    with pytest.raises(spec.ExportError, match=r"the int8 export \(export.quantization = int8\) decodes [01] of 2 "
                                               r"validation lines .* under export.min_identical.int8 = 90.0%"):
        export_stage.main(args)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_type_ctranslate2_would_replace_is_refused_naming_what_it_computes():
    import ctranslate2

    supported = ctranslate2.get_supported_compute_types("cpu")
    assert computed_type("none") == "float32" and computed_type("int8") == "int8"
    for quantization in ("int16", "bfloat16", "float16"):
        if quantization not in supported:
            with pytest.raises(ParamsError, match=rf"export.quantization = '{quantization}': CTranslate2 cannot "
                                                  rf"compute {quantization} on this cpu"):
                computed_type(quantization)


@pytest.mark.parametrize("point", ["export_written", "export_checked"])
def test_a_killed_export_leaves_nothing_the_next_run_does_not_remove_or_restore(made, tmp_path, point):
    root, model, tokenized, params = made
    shutil.copytree(root / "export", tmp_path / "export")
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    env = {**os.environ, "TRANSFORMER_FAULT": f"{point}@0", tracking.ENV: "0"}  # no MLflow run read here
    killed = subprocess.run([sys.executable, "-m", "stages.export", *stage_args(tmp_path, model, tokenized, params)],
                            env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in tmp_path.glob(".export.*.tmp")]  # the kill left its temporary folder
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    os.replace(tmp_path / "export", tmp_path / ".export.old")  # and a kill between atomic_dir's two renames
    right = spec._norm  # the next run fails its check: what it found is put back, its own folder removed
    spec._norm = lambda s, m: (right(s, m), setattr(s, "beta", s.beta[::-1].copy()))
    try:
        with pytest.raises(spec.ExportError, match="the previous export is kept"):
            export_stage.main(stage_args(tmp_path, model, tokenized, params))
    finally:
        spec._norm = right
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


@pytest.mark.parametrize("params, expected", [
    ({"translate": {**GREEDY, "engine": "ctranslate2"}, "export": {**EXPORT, "enabled": False}},
     "translate.engine = ctranslate2 decodes the export, and export.enabled = false writes none"),
    ({"translate": {**GREEDY, "engine": "ctranslate2", "precision": "bf16"}, "export": EXPORT},
     "translate.precision = 'bf16' sets the project engine's weights"),
])
def test_contradicting_params_are_refused_before_any_stage_runs(tmp_path, params, expected, capsys, monkeypatch):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match=expected):
        config.load(path, "translate", config.TranslateConfig)
    # the export stage refuses them when it loads its params, before it reads any input (none exists here)
    code, line = run_command(export_stage.main, stage_args(tmp_path, tmp_path / "model", tmp_path / "tokenized", path),
                             capsys, monkeypatch)
    assert code == 2 and line.startswith(f"export: error: {path}: ") and expected in line, line
    assert not (tmp_path / "export").exists()


def test_the_ctranslate2_engine_warns_of_cut_sources(made, tmp_path, caplog):
    root, model, tokenized, params = made
    from pipeline.core.config import TranslateConfig
    from pipeline.translation.engine import Ctranslate2Engine

    engine = Ctranslate2Engine(root / "export", 1, model / "model.pt", tokenized / "spm.model")
    cfg = TranslateConfig(**{**GREEDY, "max_len_b": 8})
    limit = engine.max_positions - 8 - 1
    outputs = engine.translate_ids([np.full(limit + 3, 5), np.array([5, 6])], cfg)
    assert len(outputs) == 2 and "1 source sentence(s) longer than" in caplog.text


def test_inspect_checks_the_export_as_translate_does(made, tmp_path, capsys):
    from tools.inspect.main import main as inspect

    root = made[0]
    assert inspect([str(root / "export"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "sealed (seal.sha256: every file's sha256 matches)" in out and "(matches)" in out
    export = copy_export(made, tmp_path)
    (export / "model.bin").write_bytes(b"")
    assert inspect([str(export), "--out", str(tmp_path / "out")]) == 1
    assert "model.bin: sha256" in capsys.readouterr().err


def test_compile_scope_step_with_rdrop_is_a_contradiction_before_training():
    from types import SimpleNamespace

    from pipeline.core.checks import contradictions

    train = SimpleNamespace(keep_checkpoints=5, compile_scope="step", compile=True, cuda_graphs=False, rdrop_alpha=0.1)
    with pytest.raises(ParamsError, match=r"^p.yaml: train.compile_scope = step compiles the plain loss, and "
                                          r"train.rdrop_alpha = 0.1 asks for R-Drop"):
        contradictions({"train": train}, "p.yaml")
    contradictions({"train": SimpleNamespace(**{**vars(train), "compile": False})}, "p.yaml")  # eager: no graph
