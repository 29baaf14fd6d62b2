"""Data-parallel plumbing for the train stage: processes, devices (their peak: pipeline/device/peak.py; which batches: pipeline/corpus/steps.py).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; without them
(plain `python -m stages.train`) there is one process and no process group at
all. `train.devices` processes per node, on one node (`--standalone`) or on
several (torchrun's c10d rendezvous, one launch per node): WORLD_SIZE =
devices x nodes. GPUs: one per process, NCCL, and a second (gloo) group for
host-side decisions so that they never wait for the GPU. CPUs: gloo processes
sharing the cores. A collective that waits longer than train.timeout_minutes
(a node died or froze) fails the run instead of hanging it.
"""

from __future__ import annotations

import datetime
import inspect
import ipaddress
import logging
import os
import socket
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from pipeline.core import cli
from pipeline.core.config import ParamsError
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)


class DistributedError(PipelineError):
    """The processes of a run disagree (params, data) or lost one another (a node died or froze)."""


STARTUP_MINUTES = 30.0  # how long ranks wait for each other to start (check_same)
LOST_PEERS = "lost the other processes"  # the line of a rank that failed because another did (stages/train.py)
SAME_RUN = "every node must run the same commit with the same params.yaml, data/tokenized and data/batches"


@dataclass(frozen=True)
class Dist:
    """This process's place in the run."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    host_group: dist.ProcessGroup | None = None  # gloo group for flags and objects; None = the default group
    startup_group: dist.ProcessGroup | None = None  # gloo, waiting STARTUP_MINUTES: ranks meeting (check_same)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def available_cores() -> int:
    """The CPU threads this machine gives training: $OMP_NUM_THREADS when set (runs sharing a machine, e.g.
    `OMP_NUM_THREADS=1 python -m tools.seeds ... -j 3`), else the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    asked = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not asked:
        return cores
    if not asked.isdigit() or int(asked) < 1:
        raise ParamsError(f"OMP_NUM_THREADS={asked!r} in the environment: expected a whole number of threads >= 1")
    return int(asked)


def setup(devices: int, timeout_minutes: float) -> Dist:
    """Join the torchrun process group (if any) and pick this process's device and threads.

    `devices` is per node: torchrun's LOCAL_WORLD_SIZE must equal it, and each
    node needs that many GPUs; WORLD_SIZE counts the processes of all nodes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if local_world != devices:
        raise ParamsError(
            f"train.devices={devices} but {local_world} process(es) were started on this node (train.devices counts "
            f"the processes of one node); run `python -m stages.train ...` (as dvc.yaml does: it starts train.devices "
            f"processes), `torchrun --nproc_per_node={devices} ...`, or on each node of a multi-node run `torchrun "
            f"--nnodes=N --nproc_per_node={devices} --rdzv_backend=c10d ...` (README, \"Multi-node training\")")
    if torch.cuda.is_available():
        if devices > torch.cuda.device_count():
            raise ParamsError(f"train.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, available_cores() // local_world))
        backend = "gloo"
    host_group = startup_group = None
    if world > 1:
        if world > local_world:
            check_nodes_reachable(rank, world, local_world, datetime.timedelta(minutes=timeout_minutes))
        # A collective that outlives the timeout: NCCL's watchdog aborts the communicator and the waiting call
        # raises (2 = clean up only), so the stage ends with its one-line error (lost_peers) instead of the
        # watchdog killing the process mid-write (3, torch's default). A user's own setting is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        # A group's timeout bounds every wait in it, the other ranks' side of a barrier included: waiting for
        # rank 0 to open MLflow and hash the data needs a group of its own, not a longer barrier timeout.
        startup_group = dist.new_group(backend="gloo", timeout=max(timeout, datetime.timedelta(minutes=STARTUP_MINUTES)))
        if backend == "nccl":
            host_group = dist.new_group(backend="gloo", timeout=timeout)
    return Dist(rank, world, local_rank, device, host_group, startup_group)


def check_nodes_reachable(rank: int, world: int, local_world: int, timeout: datetime.timedelta) -> None:
    """check_reachable on every rank; rank 0 raises its error only once every rank has made its own check.

    Rank 0's node hosts torchrun's store: once its process exits, its agent ends and takes the store along, and
    the agents of the other nodes stop their processes, a slower one before it could say why. Each rank counts
    itself in that store after its check (TORCHELASTIC_USE_AGENT_STORE: torchrun's c10d rendezvous), and a rank 0
    that fails waits (train.timeout_minutes at most) until all have, so that every node's log names the problem.
    """
    problem = None
    try:
        check_reachable(os.environ.get("MASTER_ADDR", ""), world // local_world)
    except DistributedError as error:
        problem = error
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        key = f"transformer/checked_reachable/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            store.add(key, 1)
            deadline = time.monotonic() + timeout.total_seconds()
            while problem and rank == 0 and store.add(key, 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
        except (KeyError, ValueError, RuntimeError) as error:  # no store to reach: the process group will say why
            log.debug("the check-in store was out of reach: %s", error)
    if problem:
        raise problem


def check_reachable(master_addr: str, nodes: int) -> None:
    """On several nodes, rank 0's address (torchrun's --local_addr, else its host name) must reach the other nodes.

    A host name that resolves to a loopback address (127.0.1.1 in Debian's /etc/hosts) would have every node
    wait for itself until the timeout. Setting GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to lo says that every
    "node" runs on this one machine (tests/multinode_smoke.py).
    """
    if "lo" in (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")):
        return
    try:
        address = ipaddress.ip_address(socket.gethostbyname(master_addr))
    except (OSError, ValueError):
        return  # unresolvable: the process group's own error names it
    if address.is_loopback:
        raise DistributedError(
            f"rank 0's address {master_addr} resolves to {address}, a loopback address, on a run of {nodes} nodes: "
            "the other nodes cannot reach it; start torchrun on every node with --local_addr=<an address of this "
            "node the others reach> (or map its host name to that address), and set NCCL_SOCKET_IFNAME and "
            "GLOO_SOCKET_IFNAME to the network interface the nodes share, e.g. eth0 "
            '(docs/multi_node.md, "Network interfaces")')


def launched_by_torchrun() -> bool:
    """True in a process torchrun started (it sets LOCAL_RANK), False in the command a user or DVC ran."""
    return "LOCAL_RANK" in os.environ


def launch(devices: int, module: str, args: list[str]) -> None:
    """Run `python -m module args` in `devices` processes, as `torchrun --standalone` does; exit as they did on a failure.

    torchrun itself would end a failure with its own traceback and banner, burying the
    process's message; here the last line is that message (the `<stage>: error: ...` line
    pipeline.core.cli.run recorded in TORCHELASTIC_ERROR_FILE), or which process failed and how.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # torchrun's own notices and its failure report
    try:
        run(parse_args(["--standalone", f"--nproc_per_node={devices}", "-m", module, *args]))
    except ChildFailedError as e:
        rank, failure = cause(e)
        line = failure.error_file_data.get("message")
        status = failure.exitcode if failure.exitcode > 0 else 1
        if not isinstance(line, str):  # no line recorded: a crash, with its traceback above
            how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
            line = f"{module.rsplit('.', 1)[-1]}: error: process {rank} of {devices} {how}; its output is above"
        elif failure.exitcode <= 0:  # its line recorded, then stopped by torchrun with the others: the line's status
            status = cli.EXIT_INTERRUPTED if line.split(": ", 2)[1:2] == ["interrupted"] else cli.EXIT_ERROR
        print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except SignalException as e:  # Ctrl-C or a kill: each process says where it stopped
        sys.exit(128 + e.sigval)


def cause(error) -> tuple[int, object]:
    """The rank whose failure ended the run and its ProcessFailure: the first to fail, unless it failed only because
    another had (LOST_PEERS: its connection closed, which may be recorded before the failing rank's own line)."""
    failures = sorted(error.failures.items(), key=lambda item: item[1].timestamp)
    own = [(rank, f) for rank, f in failures if LOST_PEERS not in str(f.error_file_data.get("message", ""))]
    return (own or failures)[0]


def teardown(ctx: Dist) -> None:
    if ctx.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# DDP's all-reduce cast to a half precision and back (torch's hooks); bf16's refuses a group without NCCL
COMPRESSION_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def ddp(module: torch.nn.Module, ctx: Dist, bucket_mb: float = 25.0, static_graph: bool = False,
        compression: str = "none") -> DistributedDataParallel:
    """`module` wrapped in DistributedDataParallel for this process's device, on whichever torch is installed
    (ddp_keywords of its DistributedDataParallel.__init__), with train.ddp_bucket_mb, ddp_static_graph and
    grad_compression (the hook registered before the first step)."""
    keywords = ddp_keywords(inspect.signature(DistributedDataParallel.__init__).parameters, ctx,
                            bucket_mb=bucket_mb, static_graph=static_graph)
    model = DistributedDataParallel(module, **keywords)
    if compression != "none":
        model.register_comm_hook(None, COMPRESSION_HOOKS[compression])
    return model


def ddp_keywords(parameters: Collection[str], ctx: Dist, *, bucket_mb: float, static_graph: bool) -> dict[str, object]:
    """DistributedDataParallel's keywords for this process, given the names its __init__ takes (torch's version).

    No buffer sync before each forward: the only buffer is the positional table (model/transformer.py), the same
    constant on every rank. torch 2.13 says so with forward_sync_buffers=False (and deprecates broadcast_buffers);
    older torch (2.11 on the GPU machine) has no such keyword and says it with broadcast_buffers=False, which also
    skips the table's sync at the start: no matter, every rank computes the same table. gradient_as_bucket_view:
    gradients live in the all-reduce buckets instead of beside them (one copy less per step, and one gradient's
    memory less: 1 GB for big); the optimizer zeroes them in place to keep it so (optimizer.zero_grads).
    bucket_cap_mb and static_graph: train.ddp_bucket_mb and ddp_static_graph (both keywords in 2.11 and 2.13).
    """
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in parameters else {"broadcast_buffers": False}
    return {"device_ids": [ctx.local_rank] if ctx.cuda else None, "gradient_as_bucket_view": True,
            "bucket_cap_mb": bucket_mb, "static_graph": static_graph, **no_sync}


def all_sum(t: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """Sum a tensor over all ranks, in place."""
    if ctx.world > 1:
        dist.all_reduce(t)
    return t


def broadcast_flags(flags: list[bool], ctx: Dist) -> list[bool]:
    """Rank 0's decisions (stop, checkpoint...) for every rank; on the host group, so no wait for the GPU."""
    if ctx.world == 1:
        return flags
    t = torch.tensor([float(f) for f in flags])
    dist.broadcast(t, src=0, group=ctx.host_group)
    return [bool(v) for v in t.tolist()]


def broadcast_object(obj: object, ctx: Dist) -> object:
    """Rank 0's `obj` (e.g. the checkpoint it resumes: other nodes need not see its file) for every rank."""
    if ctx.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.host_group)
    return box[0]


def gather_objects(obj: object, ctx: Dist) -> list:
    """Every rank's `obj`, in rank order (e.g. RNG states for a checkpoint)."""
    if ctx.world == 1:
        return [obj]
    out: list = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.host_group)
    return out


def check_same(value: str, what: str, ctx: Dist, remedy: str = SAME_RUN, shown: bool = False) -> None:
    """Wait for every rank to start, then fail on every rank, naming the ranks and hosts (and their values, if
    `shown`), unless all hold the same `value` (e.g. a params hash). The wait allows STARTUP_MINUTES (rank 0 alone
    opens MLflow first), or train.timeout_minutes if longer (ctx.startup_group): a short collective timeout need not
    cover a slow start."""
    if ctx.world > 1:
        dist.monitored_barrier(ctx.startup_group, wait_all_ranks=True)
    seen = gather_objects((value, os.uname().nodename), ctx)
    odd = [f"rank {r} on {host}" + (f" ({v})" if shown else "") for r, (v, host) in enumerate(seen) if v != seen[0][0]]
    if odd:
        first = f"{seen[0][0]} on {seen[0][1]}" if shown else seen[0][1]
        raise DistributedError(f"{what} differs from rank 0's ({first}) on {', '.join(odd)}: {remedy}")


def lost_peers(error: BaseException, ctx: Dist) -> bool:
    """Whether `error` is a collective that failed: a peer closed its connection, or timed out (gloo, NCCL)."""
    return ctx.world > 1 and (isinstance(error, dist.DistError) or "gloo" in str(error))


def check_precision(label: str, ctx: Dist) -> None:
    """Every process of a run must train in the same precision (`label`: the run's Precision.label): a world of
    mixed GPUs would average gradients of differently scaled losses."""
    check_same(label, "training precision", ctx, shown=True,
               remedy="every process of a run must train in the same precision: run it on GPUs of one kind (bf16 on "
                      "compute capability 8.0 and newer, fp16 on 7.x, fp32 before), or CPUs of one kind: "
                      "train.cpu_matmul chooses by the CPU's flags (AMX, AVX-512)")
