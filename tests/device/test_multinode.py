"""Several nodes: torchrun's c10d rendezvous over 127.0.0.1, resumes across world sizes, a node lost mid-run.

Each "node" is its own torchrun process (tests/multinode_smoke.py), gloo, one
training process per node, on the tiny corpus of tests/fixtures/train.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from pipeline.device import distributed, precision
from pipeline.core.config import BatchConfig, ParamsError, TrainConfig
from pipeline.training.params import params_hash
from pipeline.device.precision import resolve
from stages import train
from tests.multinode_smoke import (TOLERANCE, final_weights, free_port, max_difference, node_processes,
                                   run_one_process, start_two_nodes)
from tests.fixtures.train import MODEL, ROOT, TRAIN, stage_args, torchrun, write_corpus, write_params


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def store(tmp_path) -> str:
    """An MLflow store created before the nodes start, so that rank 0 does not spend seconds creating it."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def logs(root: Path) -> str:
    return "".join((root / f"node{i}.log").read_text() for i in range(2))


def wait_all(nodes, root: Path, timeout: float = 300) -> list[int]:
    codes = [p.wait(timeout=timeout) for p in nodes]
    assert codes == [0, 0], logs(root)[-4000:]
    return codes


# --- one node's view: devices per node, timeouts, precision, what shapes the weights ----------------------


def test_train_devices_counts_processes_per_node_and_only_the_start_waits_past_the_timeout(monkeypatch):
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "16")  # 2 nodes x 8 GPUs; this is the second GPU of the second node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")  # rank 0's node, reachable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: calls.update(init=(backend, kw)))
    monkeypatch.setattr(distributed.dist, "new_group", lambda **kw: calls.setdefault("groups", []).append(kw) or "gloo")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    ctx = distributed.setup(8, timeout_minutes=0.5)
    assert (ctx.rank, ctx.world, ctx.local_rank, ctx.device) == (9, 16, 1, torch.device("cuda", 1))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # a timed-out collective raises, not kills
    backend, kw = calls["init"]
    assert backend == "nccl" and kw["timeout"] == datetime.timedelta(seconds=30)
    assert calls["groups"] == [{"backend": "gloo", "timeout": datetime.timedelta(minutes=distributed.STARTUP_MINUTES)},
                               {"backend": "gloo", "timeout": datetime.timedelta(seconds=30)}]  # start; host-side flags
    assert ctx.startup_group == ctx.host_group == "gloo"

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun started 4 processes on this node, params say 8
    with pytest.raises(ParamsError, match=r"train\.devices=8 but 4 process\(es\) were started on this node.*--nnodes=N"):
        distributed.setup(8, timeout_minutes=0.5)


def meet_late(rank: int, port: int, late_s: float) -> None:
    """One process of a 2-node run (timeout late_s / 3) whose rank 0 reaches check_same late, as after opening MLflow."""
    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", RANK=str(rank), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # 2 "nodes" on this machine
    ctx = distributed.setup(1, timeout_minutes=late_s / 3 / 60)
    if ctx.is_main:
        time.sleep(late_s)
    distributed.check_same("the same", "a value", ctx)
    distributed.teardown(ctx)


@pytest.mark.slow
def test_ranks_wait_for_a_slow_rank_0_at_the_start_longer_than_the_collective_timeout():
    torch.multiprocessing.spawn(meet_late, args=(free_port(), 6.0), nprocs=2)  # raises if a process failed


def choose_precision(rank: int, port: int, out: str) -> None:
    """One process of a 2-process run in which rank 1's GPU has no bf16 (fp16), rank 0's has; each writes what it hit."""
    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = distributed.setup(2, timeout_minutes=0.5)
    precision.autocast_dtype = lambda device: torch.float16 if rank == 1 else torch.bfloat16
    try:
        distributed.check_precision(resolve("fp32", ctx.device).label, ctx)
        said = "no error"
    except distributed.DistributedError as e:
        said = str(e)
    Path(out, f"rank{rank}").write_text(said)
    distributed.teardown(ctx)


def test_ranks_that_chose_different_precisions_stop_naming_the_odd_one(tmp_path):
    """Mixed GPUs (an A100 beside a V100) would average gradients of differently scaled losses: every rank stops."""
    torch.multiprocessing.spawn(choose_precision, args=(free_port(), str(tmp_path)), nprocs=2)
    host = os.uname().nodename
    expected = (f"training precision differs from rank 0's (bf16 autocast on {host}) on rank 1 on {host} (fp16 "
                "autocast with a gradient scaler): every process of a run must train in the same precision: run it "
                "on GPUs of one kind (bf16 on compute capability 8.0 and newer, fp16 on 7.x, fp32 before), or CPUs "
                "of one kind: train.cpu_matmul chooses by the CPU's flags (AMX, AVX-512)")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [expected, expected]


def test_a_multi_node_run_whose_rank_0_address_is_loopback_fails_at_once_saying_what_to_set(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")  # 2 nodes x 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # a host name that /etc/hosts maps to 127.0.x.x
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **kw: pytest.fail("joined the group"))
    with pytest.raises(distributed.DistributedError, match=r"rank 0's address localhost resolves to 127\.0\.\d+\.\d+, a "
                       r"loopback address, on a run of 2 nodes: .*--local_addr=.*NCCL_SOCKET_IFNAME and "
                       r"GLOO_SOCKET_IFNAME"):
        distributed.setup(8, timeout_minutes=0.5)


def test_a_real_two_node_run_over_a_loopback_address_stops_both_nodes_with_that_line(tmp_path, store):
    """Node 1's process starts 5 s late (a slower node): rank 0 waits for its check before its node's store goes."""
    write_corpus(tmp_path)
    write_params(tmp_path / "params.yaml", max_steps=2, timeout_minutes=0.5)
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(5)\n")
    started = time.monotonic()
    nodes = start_two_nodes((tmp_path, tmp_path), (tmp_path / "params.yaml",) * 2, MLFLOW_TRACKING_URI=store,
                            GLOO_SOCKET_IFNAME="", PYTHONPATH=f"{ROOT}:{tmp_path / 'late'}")
    assert [p.wait(timeout=120) for p in nodes] == [1, 1] and time.monotonic() - started < 60
    for node in range(2):
        lines = (tmp_path / f"node{node}.log").read_text().strip().splitlines()
        assert any(line.startswith("train: error: rank 0's address ") and "loopback" in line for line in lines), lines
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("capability, dtype", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                               ((7, 0), torch.float16), ((7, 5), torch.float16),
                                               ((6, 0), torch.float32)])
def test_autocast_follows_the_gpus_capability_and_cpus_train_in_fp32(monkeypatch, capability, dtype):
    """H100/A100: bf16; V100 (7.0) and T4 (7.5): fp16 with a gradient scaler; P100 (6.0) and older: fp32."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert precision.autocast_dtype(torch.device("cuda", 0)) == dtype
    assert precision.autocast_dtype(torch.device("cpu")) == torch.float32


def test_the_params_hash_counts_the_batches_of_a_step_not_the_processes(tmp_path):
    """2 processes x 1 batch and 1 process x 2 batches train alike (a resume may switch); 3 batches a step do not."""
    tokenized, batches = write_corpus(tmp_path)
    model = ModelConfig(**MODEL)

    def phash(devices: int, **train_keys) -> str:
        cfg = TrainConfig(**{**TRAIN, "devices": devices, **train_keys})
        return params_hash(model, cfg, BatchConfig(max_tokens=24, seed=1), tokenized, batches, "fp32")

    assert phash(1) == phash(2)  # 48 tokens per step = 2 stored batches of <= 24, any world
    assert phash(1) == phash(1, timeout_minutes=1.0)
    assert phash(1, tokens_per_step=72) != phash(1)


# --- several nodes ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_of_one_process_update_like_one_process_accumulating_two(tmp_path, store):
    two, one = tmp_path / "two", tmp_path / "one"
    for root in (two, one):
        write_corpus(root)
        write_params(root / "params.yaml", max_steps=5, checkpoint_every=0, eval_every=0, log_every=1)
    trace = tmp_path / "trace"
    trace.mkdir()
    wait_all(start_two_nodes((two, two), (two / "params.yaml",) * 2, MLFLOW_TRACKING_URI=store,
                             STAGES_TRAIN_TRACE=str(trace)), two)
    single = run_one_process(one, one / "params.yaml", MLFLOW_TRACKING_URI=store)
    assert single.returncode == 0, single.stderr[-3000:]
    m2, m1 = (json.loads((root / "metrics" / "train.json").read_text()) for root in (two, one))
    assert (m2["devices"], m2["grad_accum"], m1["devices"], m1["grad_accum"]) == (2, 1, 1, 2)
    assert m2["train_tokens"] == m1["train_tokens"]
    assert max_difference(final_weights(two), final_weights(one)) <= TOLERANCE
    # each rank trained on its own batch of every step, never the other's
    ranks = [[json.loads(line)["batches"] for line in (trace / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(2)]
    assert all(len(a) == len(b) == 1 and a != b for a, b in zip(*ranks)), ranks


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_world_size_at_the_same_step_lr_and_data(tmp_path, caplog, monkeypatch,
                                                                                 store):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    reference = tmp_path / "reference"
    write_corpus(reference)
    train.main(stage_args(reference, write_params(reference / "params.yaml", max_steps=6, checkpoint_every=3,
                                                  log_every=1)))
    for first, then in ((2, 1), (1, 2)):
        root = tmp_path / f"{first}_then_{then}"
        write_corpus(root)
        for devices, steps in ((first, 3), (then, 6)):
            params = write_params(root / "params.yaml", devices=devices, max_steps=steps, checkpoint_every=3,
                                  log_every=1)
            caplog.clear()
            if devices == 1:
                with caplog.at_level(logging.INFO):
                    train.main(stage_args(root, params))
                said = caplog.text
            else:
                out = torchrun(root, params, 2, MLFLOW_TRACKING_URI=store)
                assert out.returncode == 0, out.stderr[-3000:]
                said = out.stderr
        assert "resuming from step 3" in said, said[-3000:]
        assert f"checkpoint of {first} process(es) resumed by {then}: dropout RNGs seeded afresh" in said
        assert max_difference(final_weights(root), final_weights(reference)) <= TOLERANCE, (first, then)
        rows = [line.split(",") for line in (root / "plots" / "train.csv").read_text().splitlines()[1:]]
        ref_rows = [line.split(",") for line in (reference / "plots" / "train.csv").read_text().splitlines()[1:]]
        assert [(r[0], r[2]) for r in rows] == [(r[0], r[2]) for r in ref_rows]  # every step, the same lr
        metrics, ref = (json.loads((r / "metrics" / "train.json").read_text()) for r in (root, reference))
        assert (metrics["steps"], metrics["epochs"], metrics["train_tokens"]) == \
            (ref["steps"], ref["epochs"], ref["train_tokens"])  # the same data position, the same batches


@pytest.mark.slow
@pytest.mark.parametrize("lost", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_a_lost_node_stops_the_other_within_the_timeout_and_a_restart_resumes(tmp_path, monkeypatch, store, lost):
    """Node 1 frozen (SIGSTOP: no process exits, no socket closes) or killed (SIGKILL: its sockets close) right
    after the first checkpoint: node 0 fails within train.timeout_minutes, saying so; both restart and resume."""
    root, reference = tmp_path / "nodes", tmp_path / "reference"
    keys = dict(max_steps=60, checkpoint_every=2, eval_every=0, log_every=10, timeout_minutes=0.2)  # 12 s
    for r in (root, reference):
        write_corpus(r)
        write_params(r / "params.yaml", **keys)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    train.main(stage_args(reference, reference / "params.yaml"))

    nodes = start_two_nodes((root, root), (root / "params.yaml",) * 2, MLFLOW_TRACKING_URI=store)
    deadline = time.monotonic() + 300
    while not list((root / "checkpoints").glob("step_*.pt.sha256")):
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, logs(root)[-4000:]
        time.sleep(0.02)
    frozen = node_processes(nodes[1].pid)
    for pid in frozen:
        os.kill(pid, lost)
    stopped = time.monotonic()
    try:
        assert nodes[0].wait(timeout=12 + 90) != 0
        waited = time.monotonic() - stopped
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):  # a killed worker may be gone already
                os.kill(pid, signal.SIGKILL)
        nodes[1].wait()
    said = (root / "node0.log").read_text()
    assert "lost the other processes" in said and "train.timeout_minutes = 0.2" in said, said[-4000:]
    assert "Restart every node: training resumes from the newest checkpoint" in said
    assert waited < 12 + 60, waited  # the timeout and the process's exit; not torch's default of 30 minutes
    sealed = sorted((root / "checkpoints").glob("step_*.pt.sha256"))
    last = int(sealed[-1].name[5:13])
    assert last < 60, "the run ended before the freeze; nothing to resume"

    wait_all(start_two_nodes((root, root), (root / "params.yaml",) * 2, MLFLOW_TRACKING_URI=store), root)
    assert f"resuming from step {last}" in logs(root)
    assert json.loads((root / "metrics" / "train.json").read_text())["steps"] == 60
    assert max_difference(final_weights(root), final_weights(reference)) <= TOLERANCE


@pytest.mark.slow
def test_nodes_with_different_params_or_data_both_stop_naming_the_odd_rank(tmp_path, store):
    roots = (tmp_path / "a", tmp_path / "b")
    for root, smoothing in zip(roots, (0.1, 0.2)):
        write_corpus(root)
        write_params(root / "params.yaml", max_steps=2, label_smoothing=smoothing)
    nodes = start_two_nodes(roots, tuple(r / "params.yaml" for r in roots), MLFLOW_TRACKING_URI=store)
    assert [p.wait(timeout=300) for p in nodes] != [0, 0]
    for root in roots:
        said = (root / f"node{roots.index(root)}.log").read_text()
        assert ("params_hash (model, train, batch.max_tokens, the data and the precision) differs from rank 0's"
                in said), said[-3000:]
        assert "on rank 1 on" in said
    assert not (roots[0] / "checkpoints").exists() and not (roots[1] / "checkpoints").exists()
