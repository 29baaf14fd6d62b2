"""Two nodes of one process each over 127.0.0.1 against one process accumulating two batches: the same weights.

    make multinode-smoke        # python -m tests.multinode_smoke [--steps 6]

Starts two torchrun processes as two nodes would (`--nnodes=2
--nproc_per_node=1`, torchrun's c10d rendezvous at one 127.0.0.1 endpoint,
gloo) on the tiny synthetic corpus of tests/fixtures/train.py, then the same
params in one process (gradient accumulation 2: the same 48 tokens per step),
and prints as its last line `max |w_2node - w_1proc| = X`; exits 1 when X
exceeds TOLERANCE. tests/device/test_multinode.py starts its nodes with the
same functions, and loses one with lose_node_1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.fixtures.train import ROOT, final_weights, stage_args, stage_env, write_corpus, write_params

TOLERANCE = 1e-5  # float32 sums in another order (an all-reduce against an accumulation)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_core(i: int):
    """A preexec_fn pinning a process (and so its torch threads) to one of this machine's cores."""
    cores = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cores[i % len(cores)]})


def start_node(root: Path, params: Path, node: int, port: int, nnodes: int = 2, log: Path | None = None,
               **env: str) -> subprocess.Popen:
    """One node's `torchrun ... -m stages.train` (one process), in its own session so that a test can kill it whole.

    Node 0 hosts the rendezvous store (is_host=1), as the node named by --rdzv_endpoint does on a cluster.
    GLOO_SOCKET_IFNAME=lo: every "node" is on this machine, so rank 0's loopback address is reachable
    (pipeline/device/distributed.py, check_reachable); a test may pass another value in `env`.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=smoke",
           f"--rdzv_conf=is_host={int(node == 0)}", "--max_restarts=0", "-m", "stages.train", *stage_args(root, params)]
    out = open(log or root / f"node{node}.log", "a")  # noqa: SIM115 (the child holds it; a restart appends)
    env = {"GLOO_SOCKET_IFNAME": "lo", **env}
    return subprocess.Popen(cmd, cwd=ROOT, env=stage_env(**env), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=on_core(node))


def node_processes(pid: int) -> list[int]:
    """A node's torchrun agent and every process under it (its workers run in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        for task in Path(f"/proc/{found[-1]}/task").glob("*"):
            todo += [int(c) for c in (task / "children").read_text().split()] if (task / "children").exists() else []
    return found


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until node 0's rendezvous store accepts connections (node 1 must not host it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "node 0 exited before its rendezvous store was up"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def start_two_nodes(roots: tuple[Path, Path], params: tuple[Path, Path], **env: str) -> list[subprocess.Popen]:
    """Node 0 then node 1 of one run; each may have its own directory and params (they must agree)."""
    port = free_port()
    first = start_node(roots[0], params[0], 0, port, **env)
    wait_listening(port, first)
    return [first, start_node(roots[1], params[1], 1, port, **env)]


def run_two_nodes(root: Path, params: Path, timeout: float = 300, **env: str) -> list[int]:
    """Both nodes to the end; their exit codes."""
    nodes = start_two_nodes((root, root), (params, params), **env)
    return [p.wait(timeout=timeout) for p in nodes]


def run_one_process(root: Path, params: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`python -m stages.train` in one process, on one core as each node's."""
    cmd = [sys.executable, "-m", "stages.train", *stage_args(root, params)]
    return subprocess.run(cmd, cwd=ROOT, env=stage_env(**env), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=on_core(0))


def sealed_steps(root: Path) -> list[int]:
    """The steps of root's complete checkpoints, oldest first."""
    return sorted(int(p.name[5:13]) for p in (root / "checkpoints").glob("step_*.pt.sha256"))


def lose_node_1(root: Path, nodes: list[subprocess.Popen], lost: signal.Signals, after: int) -> tuple[float, int]:
    """Once a checkpoint past step `after` is sealed, node 1's agent and workers get `lost` (SIGSTOP: frozen,
    SIGKILL: gone) while node 0 goes on; the seconds node 0 took to exit, and its exit code. Node 1 ends killed."""
    deadline = time.monotonic() + 300
    while not sealed_steps(root) or sealed_steps(root)[-1] <= after:
        if any(p.poll() is not None for p in nodes) or time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint past step {after} while both nodes ran:\n"
                               + (root / "node0.log").read_text()[-4000:])
        time.sleep(0.02)
    frozen = node_processes(nodes[1].pid)
    for pid in frozen:
        os.kill(pid, lost)
    stopped = time.monotonic()
    try:
        code = nodes[0].wait(timeout=12 + 90)
        return time.monotonic() - stopped, code
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):  # a killed worker may be gone already
                os.kill(pid, signal.SIGKILL)
        nodes[1].wait()


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def smoke(base: Path, steps: int, **env: str) -> float:
    """Train `steps` steps on two nodes and in one process; max |difference| of the final weights."""
    two, one = base / "two_nodes", base / "one_process"
    for root in (two, one):  # train.devices is per node: 1 on each of the two nodes, 1 in the single process
        write_corpus(root)
        write_params(root / "params.yaml", devices=1, max_steps=steps, checkpoint_every=0, eval_every=0)
    codes = run_two_nodes(two, two / "params.yaml", **env)
    if codes != [0, 0]:
        raise RuntimeError(f"two nodes exited with {codes}:\n" + "".join((two / f"node{i}.log").read_text()[-3000:]
                                                                         for i in range(2)))
    single = run_one_process(one, one / "params.yaml", **env)
    if single.returncode != 0:
        raise RuntimeError(f"one process exited with {single.returncode}:\n{single.stderr[-3000:]}")
    return max_difference(final_weights(two), final_weights(one))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="multinode-smoke-") as tmp:
        diff = smoke(Path(tmp), args.steps, MLFLOW_TRACKING_URI=f"sqlite:///{Path(tmp) / 'mlflow.db'}")
    print(f"max |w_2node - w_1proc| = {diff:.3g}")
    sys.exit(0 if diff <= TOLERANCE else 1)


if __name__ == "__main__":
    main()
