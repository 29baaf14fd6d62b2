"""tools.seeds: the `dvc exp run --queue` commands of a seed study, and that they vary what the report groups over."""

from __future__ import annotations

import pytest

from pipeline.core.config import ParamsError, compose
from tools import groups, seeds


def test_dry_run_prints_one_queue_command_per_seed_then_the_run(capsys, monkeypatch):
    monkeypatch.setattr(seeds.subprocess, "run", lambda *a, **k: pytest.fail("--dry-run ran a command"))
    seeds.main(["--seeds", "1", "2", "3", "-S", "train.warmup_steps=400", "--name", "warm", "--dry-run", "--run",
                "-j", "2"])
    assert capsys.readouterr().out.splitlines() == [
        "dvc exp run --queue -n warm-seed1 -S train.warmup_steps=400 -S train.seed=1 -S batch.seed=1",
        "dvc exp run --queue -n warm-seed2 -S train.warmup_steps=400 -S train.seed=2 -S batch.seed=2",
        "dvc exp run --queue -n warm-seed3 -S train.warmup_steps=400 -S train.seed=3 -S batch.seed=3",
        "dvc exp run --run-all -j 2",
    ]


def test_the_commands_run_in_order_and_the_queue_only_with_run(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(seeds.subprocess, "run", lambda cmd, **kwargs: ran.append((cmd, kwargs["check"])))
    seeds.main(["--seeds", "7", "8"])
    assert ran == [(["dvc", "exp", "run", "--queue", "-S", "train.seed=7", "-S", "batch.seed=7"], True),
                   (["dvc", "exp", "run", "--queue", "-S", "train.seed=8", "-S", "batch.seed=8"], True)]
    ran.clear()
    seeds.main(["--seeds", "7", "--run"])
    assert [cmd for cmd, _ in ran] == [seeds.seed_command(7, []), ["dvc", "exp", "run", "--run-all", "-j", "1"]]


def test_a_seed_study_changes_only_the_seeds_the_report_groups_over():
    base = compose(["train.warmup_steps=400"])
    params = compose(seeds.seed_overrides(5, ["train.warmup_steps=400"]))
    changed = {f"params.{s}.{k}" for s in params for k in params[s] if params[s][k] != base[s][k]}
    assert changed == groups.SEED_PARAMS == {"params.train.seed", "params.batch.seed"}
    assert params["train"]["seed"] == params["batch"]["seed"] == 5
    assert params["tokenize"]["seed"] == base["tokenize"]["seed"]  # the same tokens for every seed


def test_bad_settings_fail_before_anything_is_queued(monkeypatch, capsys):
    monkeypatch.setattr(seeds.subprocess, "run", lambda *a, **k: pytest.fail("queued despite a bad setting"))
    with pytest.raises(ParamsError, match="train.warmup_step"):
        seeds.main(["--seeds", "1", "-S", "train.warmup_step=400"])
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", "1", "2", "-S", "train.seed=3"])
    assert "train.seed=3: the seeds are set by --seeds, not by -S" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", "1", "1"])
    assert "each seed once" in capsys.readouterr().err
