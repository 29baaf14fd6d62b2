"""A rehearsal of the first GPU day, on a CPU: the wmt14_en_de_base preset through all eight stages, 8 processes.

    make rehearse                       # python -m tests.rehearse [--workdir DIR] [--set KEY=VALUE ...]
    python -m tests.rehearse --small    # the tiny model, as tests/bench/test_rehearse.py runs it

The real pipeline in a temporary git + DVC repo (tests/fixtures/pipeline_repo.py):
params.yaml composed from conf/ with `experiment=wmt14_en_de_base` and the
overrides printed at the start, then `dvc repro <stage>` for each of download,
tokenize, batch, train, average, translate and evaluate in turn. The download
names the preset's official URLs; CORPUS_MIRROR points at an HTTP server on
127.0.0.1 serving a stand-in at the official layout (tests/fixtures/wmt_standin.py: every
archive and member the preset reads, newstest2014 as SGML, a made-up lexicon
large enough for 37000 BPE pieces). The model is the paper's base (N=6,
d_model 512, 8 heads), trained by 8 processes (gloo on the CPU); only what a
2-core machine cannot hold is scaled down, and said so.

Per stage it prints the wall time of `dvc repro <stage>` (dvc's own start
included), the CPU time of every process it ran, and the peak memory: the
highest sum, over every process of the stage (dvc, python, torchrun's agent and
its workers), of each one's PSS (shared pages split among the processes that
share them, so 8 workers' torch libraries count once), sampled every 0.25 s (--sample-every;
the first samples sooner: 0.05 s, doubling, so a short stage is sampled too),
and the largest single process's RSS. Then 1 process trains the same steps on
the same data/batches with train.devices=1 (8 micro-batches accumulated, on one
thread as each of the 8 processes) and the last line compares its weights with
the 8-process run's: `max |w_8proc - w_1proc| = X (tolerance T, largest in
PARAM): agree`. The weights alone would say little: with the preset's warmup of
4000 steps, 10 steps move them by at most the sum of the learning rates, about
1e-5 (an Adam step is about lr whatever the gradient). So the line before it
compares Adam's first moments (the gradients' running mean) relative to their
largest value, and the one before that counts the weights that differ by more
than 1e-8, 1e-7 and 1e-6: the few that differ most have gradients at rounding
level, where Adam's step, about lr whatever the gradient, takes the sign that
the rounding gave. Exits 1 when either disagrees, 2 when a stage fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pipeline.core.config import compose
from pipeline.corpus.formats import SPLITS
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint
from tests.fixtures.files_server import FileServer
from tests.fixtures.pipeline_repo import VENV_BIN, make_repo, write_params
from tests.fixtures.wmt_standin import Lexicon, stand_in

EXPERIMENT = "wmt14_en_de_base"
STAGES = ["download", "tokenize", "batch", "train", "average", "export", "translate", "evaluate"]
WEIGHTS_TOLERANCE = 1e-5  # float32 sums in another order (an all-reduce against an accumulation)
MOMENT_TOLERANCE = 1e-4  # the same, relative to the largest first moment
SAMPLE_S = 0.25


@dataclass
class Plan:
    """What the rehearsal runs: Hydra overrides with the reason for each, and the stand-in's size."""

    overrides: list[tuple[str, str]]
    lines: dict[str, int]  # pairs per corpus of each split
    words: int  # made-up words per language
    notes: list[str] = field(default_factory=list)


FULL = Plan(
    overrides=[
        ("batch.max_tokens=1600", "preset 27400: one stored batch a step, scaled down for 2 CPU cores"),
        ("train.tokens_per_step=1600", "preset 27400 = batch.max_tokens: every 8th row of it per process on 8"),
        ("train.max_steps=10", "preset 100000: the number of steps, scaled down"),
        ("train.checkpoint_every=2", "preset 1389 (10 minutes of the paper's steps): scaled with the steps, so "
                                     "that average.last_n = 5 takes 5"),
        ("model.dropout=0.0", "preset 0.1: dropout masks are drawn per process (train.seed + rank), so only "
                              "without dropout can 8 processes' weights equal 1 process's"),
    ],
    lines={"train": 4000, "valid": 100, "test": 300},
    words=20000,
    notes=["newstest2014 has 3003 lines: the test set is scaled down to 300 for 2 cores' beam search",
           "newstest2013 (valid) has 3000 lines: the stand-in has 100 (translated and scored too)"],
)

SMALL = Plan(
    overrides=[
        ("model=tiny", "the test's smaller version: conf/model/tiny.yaml (dropout 0.1)"),
        ("batch.max_tokens=1600", "preset 27400: one stored batch a step, scaled down"),
        ("train.tokens_per_step=1600", "preset 27400 = batch.max_tokens: every 8th row of it per process on 8"),
        ("train.max_steps=5", "preset 100000: the number of steps, scaled down"),
        ("train.checkpoint_every=1", "preset 1389: scaled with the steps, so that average.last_n = 5 takes 5"),
        *FULL.overrides[4:],
    ],
    lines={"train": 1000, "valid": 10, "test": 20},
    words=20000,
)


# --- measuring a command's process tree -------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it, whatever session they run in."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        for children in Path(f"/proc/{found[-1]}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:  # the task ended meanwhile
                pass
    return found


def memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB; (0, 0) once it has gone."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                values[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return values.get("Pss", 0), values.get("Rss", 0)


@dataclass
class Usage:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_pss_kib: int = 0  # the highest sum over the tree
    peak_rss_kib: int = 0  # the largest single process
    most_processes: int = 0

    def line(self, name: str) -> str:
        gib = 1024 * 1024
        return (f"{name:<34} {self.wall_s:7.1f} s  cpu {self.cpu_s:7.1f} s  peak {self.peak_pss_kib / gib:6.2f} GiB "
                f"(largest process {self.peak_rss_kib / gib:5.2f} GiB, {self.most_processes} processes)")


def measured(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, every: float = SAMPLE_S) -> tuple[int, Usage]:
    """Run `cmd` (output to `log`), sampling its process tree's memory every `every` seconds (each sample reads
    every process's smaps_rollup: milliseconds of CPU a process); its exit code and usage."""
    usage, before = Usage(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            wait = min(every, 0.05)
            while not done.wait(wait):  # 0.05 s, doubling up to `every`: a command shorter than that is sampled too
                pids = process_tree(proc.pid)
                mem = [memory_kib(p) for p in pids]
                usage.peak_pss_kib = max(usage.peak_pss_kib, sum(m[0] for m in mem))
                usage.peak_rss_kib = max([usage.peak_rss_kib] + [m[1] for m in mem])
                usage.most_processes = max(usage.most_processes, sum(1 for m in mem if m[1]))
                wait = min(every, 2 * wait)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        done.set()
        sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    usage.wall_s = time.monotonic() - start
    usage.cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return code, usage


# --- the rehearsal ----------------------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, flush=True)


def params_for(plan: Plan, official: dict, pinned: dict) -> dict:
    """The preset composed with the plan's overrides; the stand-in's sha256 where the preset pins the real file's."""
    params = compose([f"experiment={EXPERIMENT}", *(o for o, _ in plan.overrides)])
    for split in SPLITS:
        for i, (corpus, was) in enumerate(zip(pinned[split], official[split])):
            for side in ("src", "tgt"):
                if was[side]["sha256"] is not None:  # null stays null: the download warns, as it will on the day
                    params["data"][split][i][side]["sha256"] = corpus[side]["sha256"]
                    say(f"override: data.{split}[{i}].{side}.sha256={corpus[side]['sha256'][:12]}... "
                        f"(the stand-in's, not {was[side]['member']}'s)")
    return params


def stage_env(mirror: str, work: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "CORPUS_MIRROR": mirror,
            "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "DVC_NO_ANALYTICS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


def run_stages(repo: Path, env: dict[str, str], logs: Path, every: float) -> Usage:
    """`dvc repro <stage>` for each stage in turn, a line each; the summed usage."""
    total = Usage()
    for stage in STAGES:
        code, usage = measured(["dvc", "repro", stage], repo, env, logs / f"{stage}.log", every)
        text = (logs / f"{stage}.log").read_text(errors="replace")
        if code != 0 or f"Running stage '{stage}'" not in text:
            say(text[-4000:])
            say(f"stage {stage}: `dvc repro {stage}` exited with {code}; log: {logs / f'{stage}.log'}")
            sys.exit(2)
        say("stage " + usage.line(stage))
        total.wall_s += usage.wall_s
        total.cpu_s += usage.cpu_s
        total.peak_pss_kib = max(total.peak_pss_kib, usage.peak_pss_kib)
        total.peak_rss_kib = max(total.peak_rss_kib, usage.peak_rss_kib)
        total.most_processes = max(total.most_processes, usage.most_processes)
    return total


def train_one_process(repo: Path, params: dict, out: Path, env: dict[str, str], logs: Path, every: float) -> Usage:
    """The train stage with train.devices=1 on the pipeline's data/batches; checkpoints in out/checkpoints.

    On one thread (OMP_NUM_THREADS=1), as each of the 8 processes ran (pipeline/device/distributed.py gives each
    cores // 8, at least 1): the same kernels, and no threads spinning at a busy machine's barriers.
    """
    # micro-batches of 200 padded tokens: the memory of one of the 8 processes' shares
    one = {**params, "train": {**params["train"], "devices": 1, "checkpoint_every": 0, "micro_batch_tokens": 200}}
    out.mkdir(parents=True, exist_ok=True)
    write_params(out, one)  # out/params.yaml
    cmd = [sys.executable, "-m", "stages.train", "--tokenized", "data/tokenized", "--batches", "data/batches",
           "--checkpoints", str(out / "checkpoints"), "--metrics", str(out / "train.json"),
           "--plot", str(out / "train.csv"), "--params", str(out / "params.yaml")]
    code, usage = measured(cmd, repo, {**env, "OMP_NUM_THREADS": "1"}, logs / "train_1proc.log", every)
    if code != 0:
        say((logs / "train_1proc.log").read_text(errors="replace")[-4000:])
        say(f"the 1-process train exited with {code}")
        sys.exit(2)
    return usage


def differences(eight: dict, one: dict) -> tuple[float, str, float]:
    """max |weights difference| and the parameter holding it, and max |Adam first moment difference| /
    max |first moment|."""
    assert eight["model"].keys() == one["model"].keys()
    weights, where = max(((eight["model"][k] - one["model"][k]).abs().max().item(), k) for k in eight["model"])
    m8, m1 = ([s["exp_avg"] for _, s in sorted(c["optimizer"]["state"].items())] for c in (eight, one))
    scale = max(m.abs().max().item() for m in m1)
    moments = max((a - b).abs().max().item() for a, b in zip(m8, m1, strict=True)) / scale
    return weights, where, moments


def spread(eight: dict, one: dict) -> str:
    """How many weights differ, by how much: the few that differ most are those whose gradient is at rounding level,
    where Adam's step (about lr, whatever the gradient's size) takes the sign the rounding gave."""
    diff = torch.cat([(eight["model"][k] - one["model"][k]).abs().flatten() for k in eight["model"]])
    counts = ", ".join(f"{int((diff > t).sum()):,} by more than {t:g}" for t in (1e-8, 1e-7, 1e-6))
    return f"weights: {diff.numel():,}; {counts}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tiny model and a smaller stand-in (the test's)")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temporary directory)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override of the preset, e.g. train.ddp_static_graph=true (repeatable)")
    parser.add_argument("--sample-every", type=float, default=SAMPLE_S, metavar="SECONDS",
                        help=f"seconds between memory samples (default {SAMPLE_S}); each sample costs CPU")
    args = parser.parse_args(argv)
    plan = SMALL if args.small else FULL
    plan = replace(plan, overrides=[*plan.overrides, *((o, "asked with --set") for o in args.set)])
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rehearse-") as tmp:
        work = args.workdir or Path(tmp)
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        say(f"rehearsal of experiment={EXPERIMENT} in {work} ({len(os.sched_getaffinity(0))} cores, "
            f"load {os.getloadavg()[0]:.2f}); stage output in {logs}")
        for override, why in plan.overrides:
            say(f"override: {override} ({why})")
        official = compose([f"experiment={EXPERIMENT}"])["data"]
        pinned = stand_in(work / "www", official, plan.lines, Lexicon(plan.words))
        sizes = ", ".join(f"{split} {plan.lines[split]} x {len(official[split])}" for split in SPLITS)
        say(f"stand-in: pairs per corpus x corpora: {sizes}; {plan.words} made-up words per language")
        for note in plan.notes:
            say(f"scaled down: {note}")
        with FileServer(work / "www") as server:
            params = params_for(plan, official, pinned)
            repo = make_repo(work / "repo")
            write_params(repo, params)
            env = stage_env(server.url(), work)
            say(f"model: {params['model']}; tokenize.vocab_size {params['tokenize']['vocab_size']}; train.devices "
                f"{params['train']['devices']}; CORPUS_MIRROR={server.url()}")
            total = run_stages(repo, env, logs, args.sample_every)
        say("stage " + total.line("all eight (peak: the largest stage)"))
        averaged = json.loads((repo / "data" / "model" / "averaged.json").read_text())
        scores = json.loads((repo / "metrics" / "eval.json").read_text())
        say(f"average: {len(averaged['checkpoints'])} checkpoints (steps {averaged['steps']}); "
            f"evaluate: BLEU {scores['bleu']} (sacreBLEU), {scores['bleu_tokenized']} (tokenized), "
            f"{sum(1 for _ in (repo / 'data' / 'raw' / 'test.de').open())} test lines")
        usage = train_one_process(repo, params, work / "one_process", env, logs, args.sample_every)
        say("stage " + usage.line("train, 1 process, 1 thread"))
        eight = load_checkpoint(complete_checkpoints(repo / "data" / "checkpoints")[-1])
        one = load_checkpoint(complete_checkpoints(work / "one_process" / "checkpoints")[-1])
        if eight["step"] != one["step"] or one["step"] != params["train"]["max_steps"]:
            say(f"the runs ended at steps {eight['step']} (8 processes) and {one['step']} (1 process), "
                f"not train.max_steps = {params['train']['max_steps']}")
            sys.exit(1)
        weights, where, moments = differences(eight, one)
        say(f"total {time.monotonic() - start:.0f} s (load average now {os.getloadavg()[0]:.2f})")
        say(spread(eight, one))
        ok_m, ok_w = moments <= MOMENT_TOLERANCE, weights <= WEIGHTS_TOLERANCE
        say(f"max |m_8proc - m_1proc| / max |m_1proc| = {moments:.3g} (Adam first moments after step "
            f"{one['step']}, tolerance {MOMENT_TOLERANCE:g}): "
            f"{'agree' if ok_m else 'DISAGREE'}")
        say(f"max |w_8proc - w_1proc| = {weights:.3g} (tolerance {WEIGHTS_TOLERANCE:g}, largest in {where}): "
            f"{'agree' if ok_w else 'DISAGREE'}")
    sys.exit(0 if ok_m and ok_w else 1)


if __name__ == "__main__":
    main()
