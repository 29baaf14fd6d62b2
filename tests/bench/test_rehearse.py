"""`make rehearse`, smaller: the tiny model through the same path (tests/rehearse.py --small).

The en-de base preset's eight stages under real `dvc repro` in a temporary
repo, the stand-in served from 127.0.0.1 as CORPUS_MIRROR, 8 training
processes (gloo), then 1 process accumulating 8 micro-batches on the same
batches: the printed figures, the metrics and the verdict are checked. Memory
is sampled every second rather than every 0.25 s (each sample reads every
process's smaps_rollup), and tracking is off (PIPELINE_TRACKING=0: no assertion here reads an MLflow run;
tests/project/test_tracking.py and test_run_records.py check the runs of a real `dvc repro`).
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest

from pipeline.core import tracking
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint
from tests.fixtures.pipeline_repo import ROOT, dvc
from tests.rehearse import SMALL, STAGES, WEIGHTS_TOLERANCE, differences

pytestmark = pytest.mark.slow

STAGE_LINE = r"stage {}\s+([\d.]+) s  cpu\s+[\d.]+ s  peak\s+([\d.]+) GiB \(largest process\s+[\d.]+ GiB, (\d+) processes\)"


def test_the_rehearsal_runs_every_stage_with_8_processes_and_1_process_agrees(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "tests.rehearse", "--small", "--workdir", str(work),
                             "--sample-every", "1"], cwd=ROOT, capture_output=True, text=True, timeout=420,
                            env={**os.environ, tracking.ENV: "0"})
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]

    for override in ("batch.max_tokens=1600", "train.max_steps=5", "train.checkpoint_every=1",
                     "model.dropout=0.0", "data.test[0].tgt.sha256="):
        assert f"override: {override}" in out
    for stage in STAGES:
        match = re.search(STAGE_LINE.format(stage), out)
        assert match, (stage, out)
        assert float(match[1]) > 0 and float(match[2]) > 0
    assert int(re.search(STAGE_LINE.format("train"), out)[3]) >= 9  # dvc, the launcher, 8 workers at once

    repo = work / "repo"
    assert "Data and pipelines are up to date" in dvc(repo, "status")  # every stage ran under dvc, none is stale
    assert "8 device(s) x 1 piece(s) a step: 1 batch(es) of <= 1600 padded tokens, each cut into 8 row parts" in (
        work / "logs" / "train.log").read_text()
    one = (work / "logs" / "train_1proc.log").read_text()
    assert "1 device(s) x 1 piece(s) a step" in one and "micro-batches of at most 200 padded tokens" in one
    assert "sha256 NOT PINNED" in (work / "logs" / "download.log").read_text()  # the preset's training files
    averaged = json.loads((repo / "data" / "model" / "averaged.json").read_text())
    assert averaged["steps"] == [1, 2, 3, 4, 5] and "average: 5 checkpoints" in out
    scores = json.loads((repo / "metrics" / "eval.json").read_text())
    for key in ("bleu", "bleu_tokenized", "valid_bleu", "valid_bleu_tokenized"):
        assert isinstance(scores[key], float), key
    assert json.loads((repo / "metrics" / "tokenize.json").read_text())["vocab_size"] == 37000
    assert len((repo / "data" / "translations" / "test.de").read_text().splitlines()) == SMALL.lines["test"]

    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"max \|w_8proc - w_1proc\| = (\S+) \(tolerance 1e-05, largest in \S+\): agree", last)
    assert match, last
    assert float(match[1]) <= WEIGHTS_TOLERANCE

    # The comparison can disagree: one weight of the 8-process checkpoint moved by 1e-4.
    eight = load_checkpoint(complete_checkpoints(repo / "data" / "checkpoints")[-1])
    one = load_checkpoint(complete_checkpoints(work / "one_process" / "checkpoints")[-1])
    eight["model"]["decoder.0.ffn.w_1.weight"][0, 0] += 1e-4
    weights, where, _ = differences(eight, one)
    assert weights > WEIGHTS_TOLERANCE and where == "decoder.0.ffn.w_1.weight"
