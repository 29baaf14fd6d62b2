"""A stage started as a command (`python -m stages.<name>`, as dvc.yaml and torchrun start it) imports its modules with
the cyclic garbage collector waiting, then runs main() with the collector on and the imports frozen out of its walks
(stages/__init__.py, pipeline.core.cli.run); imported by anything else, the stages leave the collector alone."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

from pipeline.core import collector, tracking
from tests.fixtures.train import ROOT, stage_env

# Looks on from outside the code under test: at the import of the stage's heaviest module and when the process exits.
WATCH = """
import atexit, gc, json, sys
seen = {}
def watch(event, args):
    if event == "import" and args[0] == "torch" and "torch" not in seen:
        seen["torch"] = gc.isenabled()
sys.addaudithook(watch)
atexit.register(lambda: print("WATCH " + json.dumps(
    {"collector_at_torch_import": seen.get("torch"), "collector_at_exit": gc.isenabled(),
     "frozen_at_exit": gc.get_freeze_count()}), file=sys.stderr))
"""


def watched(tmp_path, *args: str) -> dict:
    (tmp_path / "sitecustomize.py").write_text(WATCH)
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=stage_env(PYTHONPATH=f"{tmp_path}:{ROOT}"))
    line = next(line for line in out.stderr.splitlines() if line.startswith("WATCH "))
    return json.loads(line.removeprefix("WATCH "))


def test_a_stage_command_imports_without_the_collector_and_runs_with_it_on_and_its_imports_frozen(tmp_path):
    seen = watched(tmp_path, "-m", "stages.train", "--help")  # main() parses its arguments: --help ends it there
    assert seen == {"collector_at_torch_import": False, "collector_at_exit": True,
                    "frozen_at_exit": seen["frozen_at_exit"]}
    assert seen["frozen_at_exit"] > 100_000  # torch's and dynamo's objects, kept out of the collector's walks


def test_the_stages_imported_as_modules_leave_the_collector_alone(tmp_path):
    seen = watched(tmp_path, "-c", "import stages.train")
    assert seen == {"collector_at_torch_import": True, "collector_at_exit": True, "frozen_at_exit": 0}


def test_paused_turns_the_collector_off_inside_and_on_after_freezing_nothing():
    with collector.paused():
        assert not gc.isenabled()
        made = [[]]  # a container made while paused: after, still among what the collector walks (never frozen)
        with collector.paused():  # nested: still off, and the outer one turns it on
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    assert any(o is made for o in gc.get_objects())  # gc.get_objects: the collector's generations, not the frozen


def test_a_stage_opens_its_mlflow_run_with_the_collector_paused(tmp_path, monkeypatch):
    """MLflow's and DVC's imports happen there, in a stage's first tracking call."""
    seen = []
    monkeypatch.setattr(tracking, "_disabled", False)
    monkeypatch.setenv(tracking.ENV, "1")
    monkeypatch.setattr(tracking, "_open", lambda *a: seen.append(gc.isenabled()))  # None: the run is not opened
    args = argparse.Namespace(params=tmp_path / "params.yaml")
    with tracking.stage_run("evaluate", args) as run:
        assert gc.isenabled() and not run.active
    assert seen == [False]
