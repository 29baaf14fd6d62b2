"""The train stage inside a SLURM allocation: one srun task per device on every node, rendezvous on the first node.

    TRANSFORMER_SLURM=1 dvc repro        # in a batch job (cluster/slurm/pipeline.sbatch): the data stages run
                                         # once in the batch step, train as srun tasks on every node, the rest once

With TRANSFORMER_SLURM=1 the train stage's command, run in the batch step (no
SLURM_STEP_ID), is a launcher: it checks the allocation against the params
(launch), asks every node whether it sees the data and can reach rank 0's
host (a one-task-per-node srun of `python -m pipeline.device.slurm`), then
starts the training as `srun` tasks, one per device. Each task maps SLURM's
variables onto torch's (adopt: RANK = SLURM_PROCID, LOCAL_RANK =
SLURM_LOCALID...), so no torchrun runs between SLURM and the training: the
signals SLURM sends (`--signal`, requeue, preemption) reach the processes
that checkpoint. Rank 0's host is the allocation's first node
(`scontrol show hostnames`), at its NodeAddr; MASTER_ADDR and MASTER_PORT
from the environment win. A task stopped by SIGUSR1 (SLURM's warning before
the time limit) makes the launcher requeue the job; SIGTERM (a requeue or a
preemption) needs nothing, SLURM requeues the job itself.
Without TRANSFORMER_SLURM nothing here runs: a run on one machine is unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from pipeline.core import signals
from pipeline.core.errors import PipelineError
from pipeline.core.switches import switch

ENV = "TRANSFORMER_SLURM"  # =1: the train stage runs on the SLURM allocation it is in
DOCS = 'docs/multi_node.md, "SLURM"'
WARNING_SIGNAL = signal.SIGUSR1  # sbatch --signal=USR1@<seconds>: the time limit is near; checkpoint and requeue


class SlurmError(PipelineError):
    """The allocation, the params and the nodes disagree (allocation, tasks, GPUs, data, rendezvous host)."""


def requested() -> bool:
    return switch(ENV)


def in_task() -> bool:
    """True in a process srun started (a job step's task), False in the batch step that runs `dvc repro`."""
    return "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ


def per_node(spec: str) -> list[int]:
    """SLURM's compact counts per node, e.g. SLURM_TASKS_PER_NODE "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts


def allocation(devices: int) -> tuple[int, list[str]]:
    """The allocation's node count and host names, checked against train.devices (tasks and GPUs per node)."""
    if "SLURM_JOB_ID" not in os.environ:
        raise SlurmError(f"{ENV}=1 but this process is in no SLURM allocation (SLURM_JOB_ID is unset): submit "
                         f"`sbatch cluster/slurm/pipeline.sbatch` (or run inside `salloc`), or unset {ENV} to train on "
                         f"this machine ({DOCS})")
    job = os.environ["SLURM_JOB_ID"]
    tasks = per_node(os.environ.get("SLURM_TASKS_PER_NODE", ""))
    if not tasks or any(t != devices for t in tasks):
        given = os.environ.get("SLURM_TASKS_PER_NODE", "unset")
        raise SlurmError(f"train.devices={devices} but SLURM job {job} runs {given} task(s) per node "
                         f"(SLURM_TASKS_PER_NODE): one task per device, so submit with --ntasks-per-node={devices} "
                         f"(and --gpus-per-node={devices} on GPUs), or set train.devices to the tasks per node")
    gpus = os.environ.get("SLURM_GPUS_ON_NODE")
    if gpus is not None and int(gpus) != devices:
        raise SlurmError(f"train.devices={devices} but SLURM granted {gpus} GPU(s) on this node (SLURM_GPUS_ON_NODE): "
                         f"submit with --gpus-per-node={devices}, or set train.devices={gpus}")
    hosts = scontrol("show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", ""))
    return len(tasks), hosts


def scontrol(*args: str) -> list[str]:
    """scontrol's output lines; a failure is one line."""
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed ({e}): is SLURM's client installed on this node?") from e
    if out.returncode != 0:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout.split()


def rendezvous(first: str) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT): the environment's, else the first node's NodeAddr and a port from the job id."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        fields = dict(f.split("=", 1) for f in scontrol("show", "node", "-o", first) if "=" in f)
        addr = fields.get("NodeAddr", first)
    port = os.environ.get("MASTER_PORT") or str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
    return addr, port


def node_view(master: str, nodes: int, data: list[str]) -> dict:
    """What this node sees: its name, whether rank 0's host resolves to an address the nodes reach, the data files."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        address = socket.gethostbyname(master)
        problem = ""
        if nodes > 1 and ipaddress.ip_address(address).is_loopback and os.environ.get("GLOO_SOCKET_IFNAME") != "lo":
            problem = f"resolves to {address}, a loopback address the other nodes cannot reach"
    except OSError as e:
        problem = f"does not resolve ({e.strerror or e})"
    files = [f"{p} {p.stat().st_size}" for d in data for p in sorted(Path(d).rglob("*")) if p.is_file()]
    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()  # one short line a node: srun mixes long ones
    return {"node": name, "problem": problem, "files": len(files), "digest": digest}


def check_nodes(views: list[dict], here: dict, master: str, data: list[str]) -> None:
    """One line for the first node that cannot reach rank 0's host or sees other data files than this one."""
    for view in views:
        if view["problem"]:
            raise SlurmError(f"on node {view['node']}, rank 0's host {master} {view['problem']}: set MASTER_ADDR to an "
                             f"address of the allocation's first node that every node reaches, and NCCL_SOCKET_IFNAME "
                             f"and GLOO_SOCKET_IFNAME to their shared interface ({DOCS})")
        if view["digest"] != here["digest"]:
            where = Path.cwd() / data[0]
            raise SlurmError(f"node {view['node']} does not see the data stages' outputs {', '.join(data)} as node "
                             f"{here['node']} does ({view['files']} file(s) against {here['files']}): run "
                             f"the data stages on a filesystem every node mounts at the same path ({where.parent}), "
                             f"or copy them to every node (`dvc pull`), then resubmit ({DOCS})")


def ask_nodes(nodes: int, master: str, data: list[str]) -> list[dict]:
    """Every node's node_view, from one srun task per node."""
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
           sys.executable, "-m", "pipeline.device.slurm", "--master", master, "--nodes", str(nodes), *data]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SlurmError(f"asking every node for its view failed (srun exited with {out.returncode}): "
                         f"{' '.join(out.stderr.split())[-300:]}")
    views = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return sorted(views, key=lambda view: view["node"])


def launch(devices: int, module: str, args: list[str], data: list[str]) -> NoReturn:
    """Check the allocation and the nodes, then run `python -m module args` as devices x nodes srun tasks; exit as
    they did (a task stopped by WARNING_SIGNAL: requeue the job first)."""
    nodes, hosts = allocation(devices)
    master, port = rendezvous(hosts[0])
    here = node_view(master, nodes, data)
    check_nodes(ask_nodes(nodes, master, data), here, master, data)
    env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": port}
    # No --kill-on-bad-exit: the tasks a signal stopped exit one by one (each with the signal's status, the one the
    # launcher reads), and a task that fails ends the others through the process group (stages/train.py, lost peers)
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes * devices}", f"--ntasks-per-node={devices}",
           sys.executable, "-m", module, *args]
    print(f"{module.rsplit('.', 1)[-1]}: SLURM job {os.environ['SLURM_JOB_ID']}: {nodes} node(s) x {devices} task(s), "
          f"rank 0 on {hosts[0]} ({master}:{port})", file=sys.stderr, flush=True)
    with signals.held():  # a SIGTERM to this launcher waits for the tasks (they checkpoint), then ends it
        status = subprocess.Popen(cmd, env=env).wait()
    if status == 128 + WARNING_SIGNAL:
        scontrol("requeue", os.environ["SLURM_JOB_ID"])
        print(f"{module.rsplit('.', 1)[-1]}: stopped by {WARNING_SIGNAL.name} with a checkpoint; requeued SLURM job "
              f"{os.environ['SLURM_JOB_ID']}, which resumes from it", file=sys.stderr, flush=True)
    sys.exit(status)


def adopt() -> None:
    """In an srun task: torch's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from SLURM's variables."""
    local = per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1")))
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ["SLURM_LOCALID"],
                      LOCAL_WORLD_SIZE=str(local[min(int(os.environ.get("SLURM_NODEID", "0")), len(local) - 1)]))


def tags() -> dict[str, str]:
    """The MLflow tags that link the segments of one job (each requeue trains a segment): job id and restart."""
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0")}


def main(argv: list[str] | None = None) -> None:
    """One node's view as a JSON line (ask_nodes runs this on every node)."""
    parser = argparse.ArgumentParser(description="this node's view of the data and of rank 0's host, as JSON")
    parser.add_argument("--master", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("data", nargs="+")
    args = parser.parse_args(argv)
    print(json.dumps(node_view(args.master, args.nodes, args.data)))


if __name__ == "__main__":
    main()
