"""stages.train on several processes (torchrun, gloo): exact data-parallel updates, DDP's settings, the ranks' shares,
and only rank 0 writes."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from pipeline.core.config import ParamsError
from pipeline.corpus.formats import load_batches
from stages import train
from tests.fixtures.train import final_weights, run_stage, stage_args, torchrun, write_corpus, write_params
from tests.fixtures.train_runs import (TWO_PROCESS_RECIPE, one_process_run, one_thread_shared_store,  # noqa: F401
                                       plot_rows, shared_store)


def test_torchrun_starting_fewer_processes_than_devices_is_a_clear_error(tmp_path, monkeypatch):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", devices=2)
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):  # `torchrun --nproc_per_node=1`
        monkeypatch.setenv(name, value)
    with pytest.raises(ParamsError, match=r"train\.devices=2 but 1 process\(es\) were started"):
        train.main(stage_args(tmp_path, params))
    assert not (tmp_path / "metrics").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_two_processes_update_like_one_process_with_the_same_global_batch(tmp_path, one_process_run):
    """A step of one stored batch: two processes take every other row of it (row parts), one process takes it in
    micro-batches of at most 12 padded tokens (train.micro_batch_tokens): the same update."""
    m1, a = one_process_run
    write_corpus(tmp_path, max_tokens=48)
    write_params(tmp_path / "params.yaml", devices=2, micro_batch_tokens=0, **TWO_PROCESS_RECIPE)
    out = torchrun(tmp_path, tmp_path / "params.yaml", 2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "each cut into 2 row parts" in out.stderr
    m2 = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert (m1["grad_accum"], m2["grad_accum"], m2["devices"]) == (1, 1, 2)
    assert m1["train_tokens"] == m2["train_tokens"] and m1["params_hash"] == m2["params_hash"]
    b = final_weights(tmp_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize("ddp", [{"ddp_static_graph": True, "ddp_bucket_mb": 0.01}, {"grad_compression": "fp16"}],
                         ids=["static-graph-small-buckets", "fp16-all-reduce"])
@pytest.mark.slow
def test_two_processes_under_ddps_settings_update_like_one_process(tmp_path, ddp, one_process_run):
    """train.ddp_static_graph with micro-batches (its first step syncs each one) and 10 KiB buckets: the one
    process's update, and its params_hash; train.grad_compression = fp16: the all-reduce rounded to fp16, so
    the weights come near the one process's but not onto them, and the hash says it trained otherwise."""
    m1, a = one_process_run
    write_corpus(tmp_path, max_tokens=48)
    write_params(tmp_path / "params.yaml", devices=2, micro_batch_tokens=12, **TWO_PROCESS_RECIPE, **ddp)
    out = torchrun(tmp_path, tmp_path / "params.yaml", 2)
    assert out.returncode == 0, out.stderr[-3000:]
    m2 = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert "micro-batches of at most 12 padded tokens" in out.stderr  # each rank's half in 2 (no_sync on the first)
    assert m1["train_tokens"] == m2["train_tokens"]
    b = final_weights(tmp_path)
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    print("largest weight difference", gap)
    if "grad_compression" in ddp:
        assert m1["params_hash"] != m2["params_hash"] and 0 < gap < 1e-2
    else:
        assert m1["params_hash"] == m2["params_hash"] and gap < 1e-5


def test_bf16_gradient_compression_without_a_cuda_gpu_is_one_clear_line(tmp_path):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", devices=2, grad_compression="bf16")
    with pytest.raises(ParamsError, match=r"train\.grad_compression = bf16: .*NCCL.*set train\.grad_compression=fp16"):
        run_stage(tmp_path, params)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_eight_processes_share_every_batch_once_agree_and_only_rank_0_writes(tmp_path):
    write_corpus(tmp_path, n_train=60)  # 15 batches: the epoch ends inside the second step of 8
    params = write_params(tmp_path / "params.yaml", devices=8, tokens_per_step=8 * 24, max_steps=3,
                          checkpoint_every=1, keep_checkpoints=2, eval_every=2, log_every=1)
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    db = tmp_path / "mlflow.db"
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
