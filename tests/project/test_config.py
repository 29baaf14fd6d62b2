"""params.yaml, conf/ presets and the strict loader agree with each other and with the paper."""

import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import CONF_DIR, SECTIONS, ParamsError, compose, load, load_all, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def test_committed_params_are_the_composed_default():
    committed = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert committed == compose([])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_preset_loads_strictly(experiment, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(compose([f"experiment={experiment}"])))
    loaded = load_all(path)
    assert set(loaded) == set(SECTIONS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_selecting_an_experiment_changes_every_value_it_sets(experiment):
    """Guards the Hydra pitfall: `_self_` after `experiment` would let the base win silently."""
    spec = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text())
    composed = compose([f"experiment={experiment}"])
    flat = flatten(composed)
    own = flatten({k: v for k, v in spec.items() if k != "defaults"})
    for key, value in own.items():
        assert flat[key] == value, f"{experiment}: {key} = {flat[key]!r}, the preset sets {value!r}"
    bases = [entry for entry in spec.get("defaults", []) if isinstance(entry, str)]
    if bases:  # a preset on top of another: the other's values, but for those it sets
        (base,) = bases
        assert {k: v for k, v in flatten(compose([f"experiment={base}"])).items() if k not in own} == {
            k: v for k, v in flat.items() if k not in own}
        return
    groups = {}
    for entry in spec.pop("defaults", []):
        (key, name), = entry.items()
        groups[key.removeprefix("override /")] = name
    model_group = yaml.safe_load((CONF_DIR / "model" / f"{groups['model']}.yaml").read_text())
    for key, value in model_group.items():
        if f"model.{key}" not in flatten(spec):
            assert composed["model"][key] == value, f"{experiment}: model.{key} not taken from model/{groups['model']}"
    data_group = yaml.safe_load((CONF_DIR / "data" / f"{groups['data']}.yaml").read_text())
    assert composed["data"] == data_group["data"]
    for key, value in data_group["tokenize"].items():
        if f"tokenize.{key}" not in flatten(spec):
            assert composed["tokenize"][key] == value, f"{experiment}: tokenize.{key} not taken from data/{groups['data']}"


def test_override_of_one_knob():
    assert compose(["train.warmup_steps=8000"])["train"]["warmup_steps"] == 8000
    assert compose(["experiment=wmt14_en_de_base", "train.devices=1"])["train"]["devices"] == 1


def test_each_compose_is_a_fresh_copy_and_an_edited_conf_is_composed_again(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    first = compose(["train.warmup_steps=8"], conf)
    first["train"]["warmup_steps"] = 9  # a caller's change stays its own
    assert compose(["train.warmup_steps=8"], conf)["train"]["warmup_steps"] == 8
    main = conf / "config.yaml"
    main.write_text(main.read_text().replace("\n", "\n# an edit\n", 1) + "extra_section:\n  knob: 1\n")
    assert compose(["train.warmup_steps=8"], conf)["extra_section"] == {"knob": 1}


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ParamsError, match="(?s)experiment/nope.*multi30k_small"):
        compose(["experiment=nope"])


def write_params(tmp_path, mutate) -> Path:
    params = compose([])
    mutate(params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_missing_key_names_the_key(tmp_path):
    path = write_params(tmp_path, lambda p: p["train"].pop("warmup_steps"))
    with pytest.raises(ParamsError, match=r"params.yaml: .*missing key\(s\) train\.warmup_steps"):
        load(path, "train", TrainConfig)


def test_a_key_with_a_default_may_be_left_out_and_is_still_checked(tmp_path):
    """Keys added later (batch.length_bucket_step, train.micro_batch_tokens) keep older params files loading."""
    path = write_params(tmp_path, lambda p: (p["train"].pop("micro_batch_tokens"), p["batch"].pop("length_bucket_step")))
    assert load(path, "train", TrainConfig).micro_batch_tokens == 0
    assert load(path, "batch", SECTIONS["batch"]).length_bucket_step == 1.0
    path = write_params(tmp_path, lambda p: p["batch"].update(length_bucket_step=0.5))
    with pytest.raises(ParamsError, match=r"batch\.length_bucket_step = 0\.5: expected a number in \[1, 2\]"):
        load(path, "batch", SECTIONS["batch"])


def test_unknown_key_names_the_key(tmp_path):
    path = write_params(tmp_path, lambda p: p["train"].update(warmup=4000))
    with pytest.raises(ParamsError, match=r"unknown key\(s\) train\.warmup\b"):
        load(path, "train", TrainConfig)


def test_mistyped_key_names_the_key_and_type(tmp_path):
    path = write_params(tmp_path, lambda p: p["train"].update(warmup_steps="4k"))
    with pytest.raises(ParamsError, match=r"train\.warmup_steps: expected int, got str '4k'"):
        load(path, "train", TrainConfig)


def test_nested_source_key_is_named(tmp_path):
    path = write_params(tmp_path, lambda p: p["data"]["test"][0]["tgt"].pop("sha256"))
    with pytest.raises(ParamsError, match=r"data\.test\[0\]\.tgt\.sha256"):
        load_all(path)


def test_int_is_accepted_where_float_is_expected(tmp_path):
    path = write_params(tmp_path, lambda p: p["train"].update(max_minutes=20))
    assert load(path, "train", TrainConfig).max_minutes == 20.0


def test_unknown_section_is_refused(tmp_path):
    path = write_params(tmp_path, lambda p: p.update(trian={}))
    with pytest.raises(ParamsError, match="unknown section.*trian"):
        load_all(path)


def test_help_prints_the_usage_instead_of_reading_a_file_named_help(capsys):
    from pipeline.core.config import main

    main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m pipeline.core.config [PARAMS]") and "--compose PARAMS" in out
