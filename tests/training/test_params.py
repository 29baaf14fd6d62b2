"""Every param of every section has a declared valid range or set, checked at load by the stage that reads it.

The params are not listed here: they are walked from the config dataclasses (pipeline.core.config.SECTIONS),
and the stage that reads each section, with its command line, is taken from dvc.yaml.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from pipeline.core.config import FORMATS, SECTIONS, ParamsError, compose

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = compose([])
BAD_STRING = "../ Not valid"  # no format accepts it: a space, capitals, '..'


def leaves(cls: type, key: str) -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every field below `cls`; a list of sections is walked through its first item too."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], f"{key}.{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from leaves(tp, name)
            continue
        yield name, f
        if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from leaves(typing.get_args(tp)[0], f"{name}[0]")


def bad_values(f: dataclasses.Field, value: Any) -> Iterator[tuple[Any, str]]:
    """Values outside what the field declares, each with the text the error must show (the range, the set...)."""
    meta = f.metadata
    if isinstance(value, bool):  # a switch: true or false, nothing else (not "yes", not 1)
        yield "yes", "expected bool"
    if "range" in meta:
        left, lo, hi, right = re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", meta["range"]).groups()
        if isinstance(value, list):
            yield value[: int(float(lo)) - 1], meta["range"]
        else:
            step = 1 if isinstance(value, int) else 0.5
            if lo != "-inf":
                yield type(value)(float(lo) - (step if left == "[" else 0)), meta["range"]
            if hi != "inf":
                yield type(value)(float(hi) + (step if right == "]" else 0)), meta["range"]
    if "multiple_of" in meta:
        yield value + 1, f"a multiple of {meta['multiple_of']}"
    if "choices" in meta:
        yield "nope", ", ".join(map(repr, meta["choices"]))
    if "format" in meta:
        yield BAD_STRING, FORMATS[meta["format"]][1]


def set_key(params: dict, key: str, value: Any) -> None:
    """params[a][b][0][c] = value for key "a.b[0].c"."""
    *path, last = re.findall(r"[^.\[\]]+", key)
    node = params
    for part in path:
        node = node[int(part)] if part.isdigit() else node[part]
    node[last] = value


def get_key(params: dict, key: str) -> Any:
    node = params
    for part in re.findall(r"[^.\[\]]+", key):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


def stage_reading(section: str) -> tuple[str, list[str]]:
    """The stage that lists the whole section under `params:` in dvc.yaml: its module and its path arguments."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    (name,) = [n for n, s in stages.items() if section in s.get("params", [])]
    words = shlex.split(stages[name]["cmd"])
    return words[words.index("-m") + 1], words[words.index("-m") + 2 :]


CASES = [
    pytest.param(section, key, bad, expected, id=f"{key}={bad!r}")
    for section, cls in SECTIONS.items()
    for key, f in leaves(cls, section)
    for bad, expected in bad_values(f, get_key(DEFAULT, key))
]


def test_every_param_declares_what_it_may_be():
    tried = {case.values[1] for case in CASES}
    assert [key for section, cls in SECTIONS.items() for key, _ in leaves(cls, section) if key not in tried] == []
    assert len(tried) > 50  # the walk found every section's fields


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("section, key, bad, expected", CASES)
def test_a_value_out_of_its_range_is_refused_by_its_stage_naming_key_and_range(tmp_path, section, key, bad, expected):
    params = yaml.safe_load(yaml.safe_dump(DEFAULT))
    set_key(params, key, bad)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    module, args = stage_reading(section)
    work = tmp_path / "work"  # every path the stage reads or writes, with an existing output in place
    args = [str(work / a) if not a.startswith("-") else a for a in args]
    for out in ("data/raw", "data/tokenized", "data/batches", "data/model", "data/translations", "metrics"):
        (work / out).mkdir(parents=True)
        (work / out / "kept").write_text("previous output\n")
    before = tree(tmp_path)
    with pytest.raises(ParamsError) as refused:
        importlib.import_module(module).main([*args, "--params", str(tmp_path / "params.yaml")])
    assert f"{key} = {bad!r}" in str(refused.value) or f"{key}: " in str(refused.value), str(refused.value)
    assert expected in str(refused.value), str(refused.value)
    assert tree(tmp_path) == before  # nothing created, nothing changed


def write_params(tmp_path: Path, **changes: Any) -> Path:
    params = yaml.safe_load(yaml.safe_dump(DEFAULT))
    for key, value in changes.items():
        set_key(params, key.replace("__", "."), value)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def check_params_command(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.core.config", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_same_language_on_both_sides_is_refused_naming_both_keys(tmp_path):
    out = check_params_command(write_params(tmp_path, data__tgt_lang="en"))
    assert out.returncode == 2
    assert out.stderr == (f"config: error: {tmp_path / 'params.yaml'}: data.tgt_lang = 'en': expected a language "
                          "other than data.src_lang\n")


def test_keeping_fewer_checkpoints_than_are_averaged_is_refused_by_the_params_check(tmp_path):
    out = check_params_command(write_params(tmp_path, train__keep_checkpoints=3, average__last_n=5))
    assert out.returncode == 2
    assert "train.keep_checkpoints = 3: expected at least average.last_n = 5" in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    ok = check_params_command(write_params(tmp_path, train__keep_checkpoints=5, average__last_n=5))
    assert ok.returncode == 0, ok.stderr


def test_rotary_params_that_do_not_fit_together_are_refused_by_the_params_check(tmp_path):
    """model.rotary_base only with rotary positions, and rotary positions only with an even d_k: refused when the
    params load (one line naming the file and the key), not when a stage builds the model."""
    path = tmp_path / "params.yaml"
    for changes, message in [
        (dict(model__positional_encoding="sinusoidal", model__rotary_base=1000),
         "model.rotary_base: used by positional_encoding rotary only, got 1000 with positional_encoding sinusoidal"),
        (dict(model__positional_encoding="rotary", model__d_k=7), "model.d_k must be even, got 7"),
    ]:
        out = check_params_command(write_params(tmp_path, **changes))
        assert out.returncode == 2
        assert out.stderr.startswith(f"config: error: {path}: model.") and message in out.stderr
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    ok = check_params_command(write_params(tmp_path, model__positional_encoding="sinusoidal", model__rotary_base=10000,
                                           model__d_k=7))
    assert ok.returncode == 0, ok.stderr
