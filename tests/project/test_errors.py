"""What a user sees when a stage fails: one line naming what to fix, its exit status, and no traceback unless asked.

The commands are run as DVC runs them (dvc.yaml's, in a subprocess; a command already run so by another check, with
other params or environment, in this process as `python -m` runs it: run_here); Ctrl-C is a real SIGINT to the process
group.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import yaml

from pipeline.core import cli
from pipeline.core.config import ParamsError, compose
from pipeline.core.errors import PipelineError
from pipeline.core.files import InputError, OutputError, atomic_dir
from tests.fixtures.train import ROOT, stage_env, write_corpus, write_params
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)


def dvc_command(stage: str, cwd: Path) -> list[str]:
    """The stage's command as dvc.yaml writes it, its ${section.key} interpolated from cwd/params.yaml."""
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    cmd = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["cmd"]
    return shlex.split(re.sub(r"\$\{(\w+)\.(\w+)\}", lambda m: str(params[m[1]][m[2]]), cmd))


def training_setup(tmp_path: Path, **train) -> Path:
    """tmp_path/data/{tokenized,batches} and tmp_path/params.yaml for the train stage's dvc.yaml command."""
    write_corpus(tmp_path / "data")
    write_params(tmp_path / "params.yaml", **train)
    return tmp_path


def one_core() -> None:
    """In the child: one core (torch on a busy machine's two slows to a crawl), and Ctrl-C as at a terminal."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell may have started pytest ignoring it


def run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=stage_env(**env), capture_output=True, text=True, timeout=300,
                          preexec_fn=one_core)


def run_here(cmd: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture,
             **env: str) -> tuple[int, str]:
    """dvc.yaml's `... python -m <module> <args>` run in this process as `python -m` runs it (the module as __main__,
    its arguments in sys.argv), in `cwd` with `env`: its exit status and what it wrote to stderr (file descriptor 2).
    An exception it lets out propagates (the interpreter would print its traceback and exit with 1)."""
    words = cmd[cmd.index("-m") + 1 :]
    monkeypatch.chdir(cwd)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [sys.argv[0], *words[1:]])
    capfd.readouterr()
    try:
        with warnings.catch_warnings():  # imported already (other tests): runpy runs its code afresh, and says so
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(words[0], run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capfd.readouterr().err


# --- one line, exit status 2 -----------------------------------------------------------------------------------


def test_a_missing_input_is_named_as_missing_in_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(compose([])))
    out = run(dvc_command("batch", tmp_path), tmp_path)
    assert out.returncode == 2
    *before, last = out.stderr.splitlines()  # before: MLflow's "Creating initial MLflow database tables", once
    assert last == "batch: error: data/tokenized/meta.json: missing; run the tokenize stage first"
    assert not [line for line in before if "error" in line.lower() or "Traceback" in line]
    assert not (tmp_path / "data").exists() or list((tmp_path / "data").iterdir()) == []


def writers_of_inputs(stage: str) -> set[str]:
    """The stages whose dvc.yaml outs are `stage`'s data deps."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    outs = {out if isinstance(out, str) else next(iter(out)): name for name, s in stages.items() for out in s.get("outs", [])}
    return {outs[dep] for dep in stages[stage]["deps"] if dep in outs}


@pytest.mark.parametrize("stage", [s for s in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
                                   if writers_of_inputs(s)])
def test_every_stage_names_a_missing_input_as_missing_and_the_stage_that_writes_it(tmp_path, monkeypatch, stage):
    """Run in an empty directory, as on a fresh clone: `average` used to say "only 0 complete checkpoint(s)"."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "params.yaml").write_text(yaml.safe_dump(compose([])))
    monkeypatch.chdir(work)
    words = dvc_command(stage, work)
    module = importlib.import_module(words[words.index("-m") + 1])
    with pytest.raises(PipelineError) as refused:
        module.main(words[words.index("-m") + 2 :])
    said = re.fullmatch(r"(\S+): missing; run the (\w+) stage first|missing raw file\(s\): (\S+), .*; run the "
                        r"(\w+) stage first", str(refused.value))
    assert said, str(refused.value)
    assert (said[2] or said[4]) in writers_of_inputs(stage) and (said[1] or said[3]).startswith("data/"), said[0]
    assert [p.name for p in work.iterdir()] == ["params.yaml"]  # nothing written


def test_the_traceback_is_shown_when_asked_for(tmp_path, monkeypatch, capfd):
    """The command of test_a_missing_input_is_named_as_missing_in_one_line, run in this process: it lets the error out
    (an interpreter prints its traceback and exits with 1)."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(compose([])))
    with pytest.raises(InputError) as raised:
        run_here(dvc_command("batch", tmp_path), tmp_path, monkeypatch, capfd, **{cli.TRACEBACK_ENV: "1"})
    shown = "".join(traceback.format_exception(raised.value))
    assert shown.startswith("Traceback (most recent call last)")
    assert shown.rstrip().endswith("InputError: data/tokenized/meta.json: missing; run the tokenize stage first")
    assert "batch: error:" not in capfd.readouterr().err  # instead of the one line, not besides it


def test_an_unexpected_error_keeps_its_traceback_and_an_expected_one_is_one_line(capsys):
    def main() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        cli.run(main)

    def bad_params() -> None:
        raise ParamsError("params.yaml: train.max_steps = 0: expected an integer in [1, inf)")

    with pytest.raises(SystemExit) as exited:
        cli.run(bad_params)
    assert exited.value.code == 2
    assert capsys.readouterr().err == "test_errors: error: params.yaml: train.max_steps = 0: expected an integer in [1, inf)\n"


def test_an_input_that_cannot_be_read_is_not_reported_as_a_failed_write(tmp_path):
    with pytest.raises(FileNotFoundError) as failure, atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("partial")
        (tmp_path / "missing.txt").read_text()
    assert not isinstance(failure.value, OutputError) and failure.value.filename == str(tmp_path / "missing.txt")
    assert not (tmp_path / "out").exists()
    with pytest.raises(OutputError, match=r"could not write .*out: Is a directory"), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").mkdir()
        (tmp / "a").write_text("x")


# --- the train stage, one or several processes --------------------------------------------------------------


def test_a_bad_train_param_is_the_only_line_the_train_command_prints(tmp_path, monkeypatch, capfd):
    """`dvc exp run -S train.max_minutes=abc`: torchrun's report used to bury the message 20 lines up. Two processes
    (train.devices 2): the command, in a process of its own; one (devices 1): the same command, in this process."""
    line = "train: error: params.yaml: train.max_minutes: expected float, got str 'abc'\n"
    training_setup(tmp_path / "two", devices=2, max_minutes="abc")
    out = run(dvc_command("train", tmp_path / "two"), tmp_path / "two")
    assert out.returncode == 2
    assert out.stderr == line
    training_setup(tmp_path / "one", devices=1, max_minutes="abc")
    assert run_here(dvc_command("train", tmp_path / "one"), tmp_path / "one", monkeypatch, capfd) == (2, line)


@pytest.mark.slow
def test_a_failure_inside_one_of_two_training_processes_ends_with_its_message(tmp_path):
    """A checkpoint only rank 0 reads is broken: rank 1 crashes on the lost connection; the last line is rank 0's."""
    training_setup(tmp_path, devices=2, max_steps=4)
    garbage = tmp_path / "data" / "checkpoints" / "step_00000002.pt"
    garbage.parent.mkdir()
    garbage.write_bytes(b"not a checkpoint")
    garbage.with_name(garbage.name + ".sha256").write_text(f"{hashlib.sha256(b'not a checkpoint').hexdigest()}  x\n")
    out = run(dvc_command("train", tmp_path), tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1].startswith(
        "train: error: data/checkpoints/step_00000002.pt: cannot load checkpoint: weights only load failed"), out.stderr
    assert "ChildFailedError" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_ctrl_c_while_training_says_where_it_stopped_and_how_to_resume(tmp_path, devices):
    training_setup(tmp_path, devices=devices, max_steps=1_000_000, checkpoint_every=2, eval_every=0, log_every=50)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(dvc_command("train", tmp_path), cwd=tmp_path, env=stage_env(), stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True, preexec_fn=one_core)
        deadline = time.monotonic() + 240
        while not list((tmp_path / "data" / "checkpoints").glob("*.sha256")) and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at a terminal does
        assert proc.wait(timeout=120) == 130
    stderr = (tmp_path / "stderr.txt").read_text()
    last = stderr.splitlines()[-1]
    match = re.fullmatch(r"train: interrupted: stopped at step (\d+); the same command \(or `dvc repro`\) resumes "
                         r"from the newest checkpoint, step (\d+)", last)
    assert match, stderr[-3000:]
    assert (tmp_path / "data" / "checkpoints" / f"step_{int(match[2]):08d}.pt.sha256").exists()
    assert int(match[2]) <= int(match[1])
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
