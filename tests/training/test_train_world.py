"""stages.train's world: a step's batches shared among any number of processes, eight real processes sharing them
(torchrun, gloo), and the threads each process trains on."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from pipeline.core.config import ParamsError
from pipeline.corpus import steps
from pipeline.corpus.formats import load_batches
from pipeline.device import distributed
from tests.fixtures.train import final_weights, torchrun, write_corpus, write_params
from tests.fixtures.train_runs import one_thread_shared_store, plot_rows, shared_store  # noqa: F401 (fixtures)


def test_a_step_holds_the_same_batches_on_every_world():
    assert steps.batches_per_step(26400, 3300) == 8  # 8 batches of <= 3300 padded tokens
    assert [steps.grad_accumulation(26400, 3300, world) for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert steps.batches_per_step(25000, 3000) == 9  # ceil: never fewer tokens than asked
    assert steps.batches_per_step(100, 2500) == 1
    # the presets: one stored batch a step, cut by rows among the processes
    assert [steps.parts_per_batch(1, world) for world in (1, 2, 8, 16)] == [1, 2, 8, 16]
    assert [steps.grad_accumulation(27400, 27400, world) for world in (1, 2, 8, 16)] == [1, 1, 1, 1]


@pytest.mark.parametrize("batches, world", [(8, 1), (8, 2), (8, 6), (8, 16), (1, 8), (2, 3), (9, 6)])
def test_any_world_shares_a_steps_rows_equally_each_row_once(batches, world):
    """A world that does not divide the step's batches cuts each into row parts: 6 GPUs take 4 thirds of the 8
    batches each, 8 GPUs every 8th row of a one-batch step; every row of the step once, in every world."""
    parts = steps.parts_per_batch(batches, world)
    per_process = steps.grad_accumulation(batches * 100, 100, world)
    rows = {b: np.arange(b * 1000, b * 1000 + 37) for b in range(batches)}
    step = np.arange(batches)
    shares = [steps.rank_share(step, r, world, parts) for r in range(world)]
    assert all(len(mine) == n == per_process for mine, n in shares)  # equal shares, no zero-weight filler
    trained = np.concatenate([rows[b][p::parts] for mine, _ in shares for b, p in mine])
    assert np.array_equal(np.sort(trained), np.concatenate(list(rows.values())))
    sizes = [sum(len(rows[b][p::parts]) for b, p in mine) for mine, _ in shares]
    assert max(sizes) - min(sizes) <= per_process  # the rows spread evenly


def test_sharding_uses_every_batch_of_an_epoch_exactly_once():
    world, accum, num_batches = 8, 2, 37
    order = steps.epoch_order(num_batches, seed=1, epoch=0)
    assert sorted(order.tolist()) == list(range(num_batches))
    assert not np.array_equal(order, steps.epoch_order(num_batches, seed=1, epoch=1))  # reshuffled per epoch
    seen, cursor = [], 0
    while cursor < num_batches:
        step = order[cursor : cursor + world * accum]
        cursor += len(step)
        shares = [steps.rank_share(step, r, world) for r in range(world)]
        assert len({n for _, n in shares}) == 1  # every rank runs as many micro-batches
        assert all(len(mine) <= n for mine, n in shares)
        seen += [b for mine, _ in shares for b, part in mine]
    assert sorted(seen) == list(range(num_batches))


@pytest.mark.slow
def test_eight_processes_share_every_batch_once_agree_and_only_rank_0_writes(tmp_path, _new_store):
    write_corpus(tmp_path, n_train=60)  # 15 batches: the epoch ends inside the second step of 8
    params = write_params(tmp_path / "params.yaml", devices=8, tokens_per_step=8 * 24, max_steps=3,
                          checkpoint_every=1, keep_checkpoints=2, eval_every=2, log_every=1)
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    db = tmp_path / "mlflow.db"
    shutil.copyfile(_new_store, db)
    out = torchrun(tmp_path, params, 8, STAGES_TRAIN_TRACE=str(trace_dir), MLFLOW_TRACKING_URI=f"sqlite:///{db}",
                   DVC_STAGE="train", DVC_ROOT=str(tmp_path))  # as `dvc repro` runs it: a child of a pipeline run
    assert out.returncode == 0, out.stderr[-3000:]
    num_batches = len(load_batches(tmp_path / "batches", "train"))
    traces = [[json.loads(line) for line in (trace_dir / f"rank{r}.jsonl").read_text().splitlines()] for r in range(8)]
    assert all([t["step"] for t in tr] == [1, 2, 3] for tr in traces)
    epoch_0 = [b for tr in traces for t in tr if t["step"] <= 2 for b in t["batches"]]
    assert 8 < num_batches < 16  # so rank 7 has no batch in step 2 and joins with a zero-weight one
    assert sorted(epoch_0) == list(range(num_batches))  # steps 1-2 are exactly epoch 0
    for step in range(3):
        assert len({tr[step]["checksum"] for tr in traces}) == 1, f"ranks disagree after step {step + 1}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000002.pt.sha256", "step_00000003.pt", "step_00000003.pt.sha256"]
    assert [r["step"] for r in plot_rows(tmp_path)] == ["1", "2", "3"]
    final = final_weights(tmp_path)
    assert sum(v.double().sum().item() for k, v in final.items()) == pytest.approx(traces[0][2]["checksum"], rel=1e-9)
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.data.tags.get("stage", "parent") for r in runs) == ["parent", "train"]


AVAILABLE_CORES = distributed.available_cores  # the real one: one_thread_shared_store replaces it in every test


def test_omp_num_threads_sets_the_training_threads_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.setattr(distributed, "available_cores", AVAILABLE_CORES)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert distributed.available_cores() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert distributed.available_cores() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert distributed.available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ParamsError, match="OMP_NUM_THREADS='two'"):
        distributed.available_cores()
