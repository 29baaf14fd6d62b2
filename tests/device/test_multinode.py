"""Several nodes: torchrun's c10d rendezvous over 127.0.0.1, resumes across world sizes, a node lost mid-run.

Each "node" is its own torchrun process (tests/multinode_smoke.py), gloo, one
training process per node, on the tiny corpus of tests/fixtures/train.py. One
run's life (the fixture `life`: two nodes, a node frozen, a node killed, a
restart on one process, two nodes again) is what three tests read.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from pipeline.device import distributed, precision
from pipeline.core.config import BatchConfig, ParamsError, TrainConfig
from pipeline.training.params import params_hash
from pipeline.device.precision import resolve
from stages import train
from tests.multinode_smoke import (TOLERANCE, final_weights, free_port, lose_node_1, max_difference, sealed_steps,
                                   start_two_nodes)
from tests.fixtures.train import MODEL, ROOT, TRAIN, stage_args, write_corpus, write_params
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)


pytestmark = pytest.mark.usefixtures("one_thread")


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


def forked(fn, *args) -> None:
    """fn(rank, *args) in 2 processes forked from this one (torch already loaded, no process group in it); raises if
    one failed."""
    torch.multiprocessing.start_processes(fn, args=args, nprocs=2, start_method="fork")


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
    forked(meet_late, free_port(), 6.0)


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
    forked(choose_precision, free_port(), str(tmp_path))
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


def test_a_real_two_node_run_over_a_loopback_address_stops_both_nodes_with_that_line(tmp_path):
    """Node 1's process starts 5 s late (a slower node): rank 0 waits for its check before its node's store goes."""
    write_corpus(tmp_path)
    write_params(tmp_path / "params.yaml", max_steps=2, timeout_minutes=0.5)
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(5)\n")
    started = time.monotonic()
    nodes = start_two_nodes((tmp_path, tmp_path), (tmp_path / "params.yaml",) * 2, GLOO_SOCKET_IFNAME="",
                            PYTHONPATH=f"{ROOT}:{tmp_path / 'late'}")
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


# --- several nodes: one run's life, which three tests read ------------------------------------------------

STEPS = 30  # past the step a node is lost at (2 to 8 or so): margin for a busy machine
KEYS = dict(checkpoint_every=2, eval_every=6, log_every=1, timeout_minutes=0.2)  # a collective timeout of 12 s


@dataclass
class Loss:
    """Node 1 lost while both nodes trained: how long node 0 took to exit, its exit code, what it logged since it
    started; the newest sealed checkpoint's step afterwards."""

    waited: float
    code: int
    said: str
    last: int


@dataclass
class Stretch:
    """A stretch of the run trained to its end: what rank 0 logged, metrics/train.json, the plot's (step, lr) rows
    and the final weights."""

    said: str
    metrics: dict
    lrs: list
    weights: dict

    @classmethod
    def of(cls, root: Path, said: str) -> Stretch:
        rows = [line.split(",") for line in (root / "plots" / "train.csv").read_text().splitlines()[1:]]
        return cls(said, json.loads((root / "metrics" / "train.json").read_text()), [(r[0], r[2]) for r in rows],
                   final_weights(root))


@dataclass
class Life:
    """What the fixture `life` recorded of the run, in order, and of its references."""

    frozen: Loss  # the run's first start, 2 nodes from step 0: node 1 frozen after the first checkpoint
    killed: Loss  # both nodes restarted: node 1 killed after the next checkpoint
    one: Stretch  # then 1 process, to step killed.last + 3
    two: Stretch  # then 2 nodes again, to STEPS
    trace: list  # per rank, the batches of each step of `two`
    references: dict  # 1 process never stopped: {steps: Stretch} to one's step and to STEPS


def train_here(root: Path, steps: int) -> str:
    """The train stage over root in this process, to step `steps`; the messages it logged (INFO and up)."""
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    rootlog = logging.getLogger()
    level = rootlog.level
    rootlog.setLevel(logging.INFO)
    rootlog.addHandler(handler)
    try:
        train.main(stage_args(root, write_params(root / "params.yaml", max_steps=steps, **KEYS)))
    finally:
        rootlog.removeHandler(handler)
        rootlog.setLevel(level)
    return "\n".join(said)


def node0_log(root: Path) -> str:
    return (root / "node0.log").read_text()


def live(base: Path) -> Life:
    """The run and its references under base (module doc of the fixture `life`)."""
    root = base / "run"
    write_corpus(root)
    params = write_params(root / "params.yaml", max_steps=STEPS, **KEYS)
    nodes = start_two_nodes((root, root), (params, params))
    frozen = Loss(*lose_node_1(root, nodes, signal.SIGSTOP, after=0), node0_log(root), sealed_steps(root)[-1])
    started = len(node0_log(root))
    nodes = start_two_nodes((root, root), (params, params))
    killed = Loss(*lose_node_1(root, nodes, signal.SIGKILL, after=frozen.last), node0_log(root)[started:],
                  sealed_steps(root)[-1])
    middle = killed.last + 3
    one = Stretch.of(root, train_here(root, middle))
    started, trace = len(node0_log(root)), base / "trace"
    trace.mkdir()
    params = write_params(root / "params.yaml", max_steps=STEPS, **KEYS)
    wait_all(start_two_nodes((root, root), (params, params), STAGES_TRAIN_TRACE=str(trace)), root)
    two = Stretch.of(root, node0_log(root)[started:])
    ranks = [[json.loads(line)["batches"] for line in (trace / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(2)]
    references = {}
    for steps in (middle, STEPS):
        write_corpus(base / f"reference_{steps}")
        references[steps] = Stretch.of(base / f"reference_{steps}", train_here(base / f"reference_{steps}", steps))
    return Life(frozen, killed, one, two, ranks, references)


@pytest.fixture(scope="module")
def life(tmp_path_factory, _new_store) -> Life:
    """One run's life, recorded: 2 nodes of one process from step 0, node 1 frozen (SIGSTOP: no process exits, no
    socket closes) right after the first checkpoint; both nodes restarted, node 1 killed (SIGKILL: its sockets close)
    right after the next; 1 process (in this process) resumes to 3 steps past it; 2 nodes resume to STEPS, each
    rank's batches traced. Beside it, 1 process trains to each of those ends uninterrupted. In-process runs on one
    thread, as each node's; a store of its own (a copy of the conftest's new one, made before the nodes start)."""
    base = tmp_path_factory.mktemp("life")
    shutil.copyfile(_new_store, base / "mlflow.db")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{base / 'mlflow.db'}")
        patch.setattr(distributed, "available_cores", lambda: 1)
        try:
            return live(base)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_lost_node_stops_the_other_within_the_timeout_and_a_restart_resumes(life):
    """Frozen or killed, a lost node 1 stops node 0 within train.timeout_minutes, saying so; a restart resumes."""
    for loss, resumed_by in ((life.frozen, life.killed.said), (life.killed, life.one.said)):
        assert loss.code != 0
        assert "lost the other processes" in loss.said and "train.timeout_minutes = 0.2" in loss.said, loss.said[-4000:]
        assert "Restart every node: training resumes from the newest checkpoint" in loss.said
        assert loss.waited < 12 + 60, loss.waited  # the timeout and the process's exit; not torch's default of 30 min
        assert loss.last < STEPS, "the run ended before the loss; nothing to resume"
        assert f"resuming from step {loss.last}" in resumed_by, resumed_by[-4000:]
    assert life.killed.last > life.frozen.last
    assert life.two.metrics["steps"] == STEPS
    assert max_difference(life.two.weights, life.references[STEPS].weights) <= TOLERANCE


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_world_size_at_the_same_step_lr_and_data(life):
    """2 processes (nodes) resumed by 1, and 1 resumed by 2: the same weights, every step's lr and the same data
    position as 1 process never stopped."""
    middle = life.one.metrics["steps"]
    for stretch, first, then, since in ((life.one, 2, 1, life.killed.last), (life.two, 1, 2, middle)):
        assert f"resuming from step {since}" in stretch.said, stretch.said[-3000:]
        assert f"checkpoint of {first} process(es) resumed by {then}: dropout RNGs seeded afresh" in stretch.said
        reference = life.references[stretch.metrics["steps"]]
        assert max_difference(stretch.weights, reference.weights) <= TOLERANCE, (first, then)
        assert stretch.lrs == reference.lrs  # every step, the same lr
        assert [stretch.metrics[k] for k in ("steps", "epochs", "train_tokens")] == \
            [reference.metrics[k] for k in ("steps", "epochs", "train_tokens")]  # the same data position and batches


@pytest.mark.slow
def test_two_nodes_of_one_process_update_like_one_process_accumulating_two(life):
    m2, m1 = life.two.metrics, life.references[STEPS].metrics
    assert (m2["devices"], m2["grad_accum"], m1["devices"], m1["grad_accum"]) == (2, 1, 1, 2)
    assert m2["train_tokens"] == m1["train_tokens"]
    assert max_difference(life.two.weights, life.references[STEPS].weights) <= TOLERANCE
    # each rank trained on its own batch of every step, never the other's
    assert [len(rank) for rank in life.trace] == [STEPS - life.one.metrics["steps"]] * 2, life.trace
    assert all(len(a) == len(b) == 1 and a != b for a, b in zip(*life.trace)), life.trace


@pytest.mark.slow
def test_nodes_with_different_params_or_data_both_stop_naming_the_odd_rank(tmp_path):
    roots = (tmp_path / "a", tmp_path / "b")
    for root, smoothing in zip(roots, (0.1, 0.2)):
        write_corpus(root)
        write_params(root / "params.yaml", max_steps=2, label_smoothing=smoothing)
    nodes = start_two_nodes(roots, tuple(r / "params.yaml" for r in roots))
    assert [p.wait(timeout=300) for p in nodes] != [0, 0]
    for root in roots:
        said = (root / f"node{roots.index(root)}.log").read_text()
        assert ("params_hash (model, train, batch.max_tokens, the data and the precision) differs from rank 0's"
                in said), said[-3000:]
        assert "on rank 1 on" in said
    assert not (roots[0] / "checkpoints").exists() and not (roots[1] / "checkpoints").exists()
