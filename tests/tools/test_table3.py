"""The Table 3 rows (base, A-E, big) compose into valid presets; their sizes against the paper's."""

import functools

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core.config import compose
from tools.table3 import ROWS, main, n_params, row_command, row_overrides, vocab_for


@functools.cache
def model_of(name: str) -> ModelConfig:
    return ModelConfig(**compose(row_overrides(ROWS[name]))["model"])


def test_every_row_changes_exactly_its_knobs_from_its_preset():
    for name, row in ROWS.items():
        base, params = compose([f"experiment={row.experiment}"]), compose(row_overrides(row))
        for knob in row.knobs:
            key, value = knob.split("=")
            section, field = key.split(".")
            assert str(params[section][field]) == value, name
        changed = {(s, k) for s in params for k in params[s] if params[s][k] != base[s][k]}
        assert changed == {tuple(o.split("=")[0].split(".")) for o in row.knobs} | {("average", "last_n")}, name
        assert params["average"]["last_n"] == 1  # Table 3: no checkpoint averaging


def test_the_table_has_the_papers_base_and_big_rows_around_the_variations():
    names = list(ROWS)
    assert names[0] == "base" and names[-1] == "big" and len(names) == 20
    assert (ROWS["base"].experiment, ROWS["base"].knobs, ROWS["base"].params_m) == ("wmt14_en_de_base", (), 65)
    assert (ROWS["big"].experiment, ROWS["big"].knobs, ROWS["big"].params_m) == ("wmt14_en_de_big", (), 213)


def test_parameter_count_on_the_meta_device_is_the_models():
    cfg = ModelConfig(**{**compose(row_overrides(ROWS["base"]))["model"], "n_layers": 1, "d_model": 64, "d_ff": 128})
    assert n_params(cfg, 1000) == sum(p.numel() for p in Transformer(cfg, 1000).parameters())


def test_no_single_vocabulary_gives_every_size_in_table3():
    """At 37000 every sized row is 1.2-4.1M under the paper's and big 1.2M over; 41000 fixes all but big."""
    sized = {name: row.params_m for name, row in ROWS.items() if row.params_m is not None}
    for name, paper_m in sized.items():
        ours = n_params(model_of(name), 37000) / 1e6
        assert (paper_m - 4.2 < ours < paper_m - 1.1) if name != "big" else (paper_m + 1.1 < ours < paper_m + 1.4)
        assert (round(n_params(model_of(name), 41000) / 1e6) == paper_m) == (name != "big"), name
    ranges = {name: vocab_for(model_of(name), paper_m) for name, paper_m in sized.items()}
    for name, (lo, hi) in ranges.items():  # the range is exact: its ends round to the paper's size, one step out not
        m = model_of(name)
        assert round(n_params(m, lo) / 1e6) == round(n_params(m, hi) / 1e6) == sized[name], name
        assert round(n_params(m, lo - 1) / 1e6) != sized[name] != round(n_params(m, hi + 1) / 1e6), name
    assert max(lo for n, (lo, _) in ranges.items() if n != "big") == 40932
    assert min(hi for n, (_, hi) in ranges.items() if n != "big") == 41160
    assert ranges["big"][1] == 36272


def test_dry_run_prints_one_queue_command_per_row_with_its_size(capsys):
    main(["--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(ROWS) == 20
    assert lines[0].startswith("dvc exp run --queue -n table3-base -S experiment=wmt14_en_de_base -S average.last_n=1")
    assert lines[0].endswith("# ours 63.1M at vocab 37000; paper 65M (vocab 39769-41721 rounds to it)")
    assert lines[-1].startswith("dvc exp run --queue -n table3-big -S experiment=wmt14_en_de_big -S average.last_n=1")
    assert "# ours 214.2M at vocab 37000; paper 213M" in lines[-1]
    assert row_command("C-N2", ROWS["C-N2"])[-2:] == ["-S", "model.n_layers=2"]

