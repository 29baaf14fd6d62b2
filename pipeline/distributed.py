"""Data-parallel plumbing for the train stage: processes, devices (their peak: pipeline/peak.py; which batches: pipeline/steps.py).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them (plain `python -m
stages.train`) there is one process and no process group at all. GPUs: one per
process, NCCL. CPUs: `train.devices` gloo processes sharing the cores.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.config import ParamsError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    """This process's place in the run."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

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


def setup(devices: int) -> Dist:
    """Join the torchrun process group (if any) and pick this process's device and threads."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world != devices:
        raise ParamsError(
            f"train.devices={devices} but {world} process(es) were started; run `python -m stages.train ...` "
            f"(as dvc.yaml does: it starts train.devices processes) or `torchrun --nproc_per_node={devices} ...`")
    if torch.cuda.is_available():
        if devices > torch.cuda.device_count():
            raise ParamsError(f"train.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, available_cores() // world))
        backend = "gloo"
    if world > 1:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Dist(rank, world, local_rank, device)


def launched_by_torchrun() -> bool:
    """True in a process torchrun started (it sets LOCAL_RANK), False in the command a user or DVC ran."""
    return "LOCAL_RANK" in os.environ


def launch(devices: int, module: str, args: list[str]) -> None:
    """Run `python -m module args` in `devices` processes, as `torchrun --standalone` does; exit as they did on a failure.

    torchrun itself would end a failure with its own traceback and banner, burying the
    process's message; here the last line is that message (the `<stage>: error: ...` line
    pipeline.cli.run recorded in TORCHELASTIC_ERROR_FILE), or which process failed and how.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # torchrun's own notices and its failure report
    try:
        run(parse_args(["--standalone", f"--nproc_per_node={devices}", "-m", module, *args]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        line = failure.error_file_data.get("message")
        if not isinstance(line, str):  # no line recorded: a crash, with its traceback above
            how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
            line = f"{module.rsplit('.', 1)[-1]}: error: process {rank} of {devices} {how}; its output is above"
        print(line, file=sys.stderr, flush=True)
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)
    except SignalException as e:  # Ctrl-C or a kill: each process says where it stopped
        sys.exit(128 + e.sigval)


def teardown(ctx: Dist) -> None:
    if ctx.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(t: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """Sum a tensor over all ranks, in place."""
    if ctx.world > 1:
        dist.all_reduce(t)
    return t


def broadcast_flags(flags: list[bool], ctx: Dist) -> list[bool]:
    """Rank 0's decisions (stop, checkpoint...) for every rank."""
    if ctx.world == 1:
        return flags
    t = torch.tensor([float(f) for f in flags], device=ctx.device)
    dist.broadcast(t, src=0)
    return [bool(v) for v in t.tolist()]


def broadcast_object(obj: object, ctx: Dist) -> object:
    if ctx.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: object, ctx: Dist) -> list:
    """Every rank's `obj`, in rank order (e.g. RNG states for a checkpoint)."""
    if ctx.world == 1:
        return [obj]
    out: list = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out
