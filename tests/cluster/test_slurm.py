"""The pipeline under a real SLURM (tests/fixtures/slurm.py): the batch file, a requeue that resumes, bad allocations.

A one-host cluster of two nodes (two slurmd) with munged and slurmctld, started once for the module and stopped
after it; skipped, saying why, only where the packages are not installed (`make test-slurm` installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.device import slurm
from pipeline.weights.checkpoint import step_files
from tests.fixtures.files_server import FileServer
from tests.fixtures.pipeline_repo import ROOT, dvc, git_commit, make_repo, tiny_params, write_corpus, write_params
from tests.fixtures.slurm import BATCH, SlurmCluster, missing
from tests.fixtures.train import stage_args, stage_env
from tests.fixtures.train import write_corpus as write_tokenized
from tests.fixtures.train import write_params as write_train_params
from tests.multinode_smoke import TOLERANCE, final_weights, max_difference

STEPS, EVERY = 60, 20  # stopped once the checkpoint of step EVERY is written: in the middle of training


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        print(f"tests/cluster skipped: {why}")
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2).start()
    yield cluster
    cluster.stop()


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A job's environment (sbatch --export=ALL): one thread a task, gloo over 127.0.0.1, a private MLflow store."""
    return stage_env(**{"GLOO_SOCKET_IFNAME": "lo", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra})


def wait_for(path: Path, cluster: SlurmCluster, job: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} {state}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def restart_now(cluster: SlurmCluster, job: str) -> None:
    """Once the job is requeued (PENDING): start it at once (SLURM holds a requeued job two minutes)."""
    cluster.wait(job, {"PENDING"})
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def test_the_batch_file_runs_the_pipeline_and_a_requeue_resumes_at_the_step_it_stopped(cluster, tmp_path):
    """--signal's SIGUSR1 mid-training: the tasks checkpoint, the train stage requeues the job (`scontrol requeue`,
    whose SIGTERM the batch step waits out), the job runs again and resumes. SIGTERM alone (a requeue by hand, a
    preemption) stops the tasks the same way: tests/training/test_preemption.py."""
    repo = make_repo(tmp_path / "repo")
    (repo / "cluster").mkdir()
    shutil.copytree(BATCH.parent, repo / "cluster" / "slurm")
    www, log, checkpoints = tmp_path / "www", repo / "job.out", repo / "data" / "checkpoints"
    www.mkdir()
    with FileServer(www) as server:
        # 2 nodes x 1 task: each trains one of the step's 2 batches; the reference below accumulates both
        params = tiny_params(write_corpus(www, server, {"train": 1000, "valid": 40, "test": 40}), devices=1,
                             tokens_per_step=1200, max_steps=STEPS, checkpoint_every=EVERY, eval_every=30,
                             log_every=EVERY, keep_checkpoints=3)
        params["average"]["last_n"] = 2
        write_params(repo, params)
        git_commit(repo, "the tiny preset")
        job = cluster.sbatch(repo, "--nodes=2", "--ntasks-per-node=1", f"--output={log}",
                             "cluster/slurm/pipeline.sbatch", env=job_env(tmp_path))
        wait_for(checkpoints / f"step_{EVERY:08d}.pt", cluster, job, log)
        assert cluster.run("scancel", "--signal=USR1", job).returncode == 0  # as --signal=USR1@300 does: the steps
        restart_now(cluster, job)
        one = tmp_path / "one_process"  # meanwhile, the same params and data in one process, accumulation 2
        data = repo / "data"
        cmd = [sys.executable, "-m", "stages.train", "--tokenized", str(data / "tokenized"), "--batches",
               str(data / "batches"), "--checkpoints", str(one / "checkpoints"), "--metrics", str(one / "train.json"),
               "--plot", str(one / "train.csv"), "--params", str(repo / "params.yaml")]
        single = subprocess.Popen(cmd, cwd=ROOT, stderr=(tmp_path / "one.log").open("w"),
                                  env=job_env(tmp_path, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'one.db'}"))
        fields = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-4000:]
    stops = re.findall(r"train: stopped by (SIGUSR1|SIGTERM) at step (\d+), checkpointed in (\S+);", text)
    assert [name for name, _, _ in stops] == ["SIGUSR1"], text[-4000:]
    steps = [int(step) for _, step, _ in stops]
    assert EVERY <= steps[0] < STEPS and "Traceback" not in text
    assert f"requeued SLURM job {job}, which resumes from it" in text
    for step, (_, _, path) in zip(steps, stops):
        assert f"resuming from step {step} ({path})" in text
    assert not (checkpoints / "preempted").exists()  # the regular checkpoints alone, as an uninterrupted run keeps
    assert [s for s, _ in step_files(checkpoints)] == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS]
    assert "Data and pipelines are up to date" in dvc(repo, "status")
    assert (repo / "metrics" / "eval.json").exists()
    assert single.wait(timeout=300) == 0, (tmp_path / "one.log").read_text()[-3000:]
    assert max_difference(final_weights(repo / "data"), final_weights(one)) <= TOLERANCE

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    segments = sorted((r for r in runs if r.data.tags.get("stage") == "train"),
                      key=lambda r: r.data.tags["slurm_restart_count"])
    assert [(r.info.status, r.data.tags["slurm_restart_count"], r.data.tags["slurm_job_id"]) for r in segments] == [
        ("KILLED", "0", job), ("FINISHED", "1", job)]
    assert [r.data.tags.get("preempted_at_step") for r in segments] == [str(steps[0]), None]
    assert [r.data.tags.get("resumed_from_step") for r in segments] == [None, str(steps[0])]


def salloc_train(cluster: SlurmCluster, root: Path, tmp_path: Path, tasks: int = 1, **env: str
                 ) -> subprocess.CompletedProcess:
    """The train stage's launcher in a 2-node allocation of `tasks` tasks per node."""
    return cluster.run("salloc", "--nodes=2", f"--ntasks-per-node={tasks}", sys.executable, "-m", "stages.train",
                       *stage_args(root, root / "params.yaml"), cwd=ROOT,
                       env=job_env(tmp_path, TRANSFORMER_SLURM="1", **env))


def our_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("train:")]


@pytest.mark.parametrize("devices, env, expected", [
    (2, {}, "train.devices=2 but SLURM job \\d+ runs 1\\(x2\\) task\\(s\\) per node .*--ntasks-per-node=2"),
    (1, {"MASTER_ADDR": "no-such-host.invalid"}, "on node n1, rank 0's host no-such-host.invalid does not resolve "),
    (1, {"GLOO_SOCKET_IFNAME": "eth0"}, "on node n1, rank 0's host 127.0.0.1 resolves to 127.0.0.1, a loopback "
                                        "address the other nodes cannot reach: set MASTER_ADDR"),
])
def test_an_allocation_that_cannot_train_the_params_is_refused_in_one_line(cluster, tmp_path, devices, env, expected):
    root = tmp_path / "run"
    write_tokenized(root)
    write_train_params(root / "params.yaml", devices=devices)
    result = salloc_train(cluster, root, tmp_path, **env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = our_lines(result)
    assert re.fullmatch(f"train: error: {expected}.*", line), line
    assert not (root / "checkpoints").exists()


def test_no_allocation_where_one_is_required_is_refused_in_one_line(tmp_path):
    root = tmp_path / "run"
    write_tokenized(root)
    write_train_params(root / "params.yaml")
    env = {k: v for k, v in job_env(tmp_path, TRANSFORMER_SLURM="1").items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "stages.train", *stage_args(root, root / "params.yaml")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "train: error: TRANSFORMER_SLURM=1 but this process is in no SLURM allocation (SLURM_JOB_ID is unset): "
        "submit `sbatch cluster/slurm/pipeline.sbatch` (or run inside `salloc`), or unset TRANSFORMER_SLURM to train "
        "on this machine (docs/multi_node.md, \"SLURM\")"), result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("train:")]) == 1


def test_a_node_that_does_not_see_the_data_stages_outputs_is_named(tmp_path, monkeypatch):
    """What a node without the shared filesystem answers (node_view) against the batch host's view."""
    root = tmp_path / "run"
    tokenized, batches = write_tokenized(root)
    monkeypatch.chdir(root)
    here = slurm.node_view("127.0.0.1", 1, ["tokenized", "batches"])
    monkeypatch.chdir(tmp_path)  # where the other node looks: no tokenized/, no batches/
    elsewhere = {**slurm.node_view("127.0.0.1", 1, ["tokenized", "batches"]), "node": "n2"}
    assert here["files"] and not elsewhere["files"]
    slurm.check_nodes([here, here], here, "127.0.0.1", ["tokenized", "batches"])  # every node sees them: no error
    with pytest.raises(slurm.SlurmError, match=r"node n2 does not see the data stages' outputs tokenized, batches as "
                                               r"node \S+ does \(0 file\(s\) against \d+\): run the data stages on a "
                                               r"filesystem every node mounts"):
        slurm.check_nodes([here, elsewhere], here, "127.0.0.1", ["tokenized", "batches"])


def test_fewer_gpus_than_train_devices_are_refused_in_one_line(monkeypatch):
    """The GPUs SLURM grants a node (SLURM_GPUS_ON_NODE) must be train.devices, as its tasks must."""
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    with pytest.raises(slurm.SlurmError) as refused:
        slurm.allocation(8)
    assert str(refused.value) == ("train.devices=8 but SLURM granted 4 GPU(s) on this node (SLURM_GPUS_ON_NODE): "
                                  "submit with --gpus-per-node=8, or set train.devices=4")
    assert slurm.per_node("2(x3),1") == [2, 2, 2, 1]
