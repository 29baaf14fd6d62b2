"""Faults the pipeline survives, each injected for real: it keeps working and loses nothing.

- SIGKILL of the train stage during a step, a checkpoint write and validation
  (pipeline/weights/faults.py, TRANSFORMER_FAULT), in `python -m stages.train` and inside
  `dvc repro`: the re-run resumes and ends with the same weights as a run never killed.
- Truncated, corrupt or unsealed checkpoints: skipped with a warning naming them,
  never averaged (also tests/training/test_checkpoint.py, test_train.py, test_average.py).
- A download cut part-way resumes where it stopped, in the same run
  (tests/corpus/test_download.py) and in the next one; a file whose sha256 differs is
  refused and deleted (test_download.py::test_checksum_mismatch_is_refused_and_the_file_deleted).
- A full disk (ENOSPC, from the kernel's /dev/full) in every stage: a clear
  error naming the file, and the previous outputs byte for byte.
- The MLflow server gone mid-run, a second `dvc repro` against DVC's lock, and
  two queued `dvc exp run` experiments into one MLflow store (the slow tests at
  the end, sharing one temporary repo).
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.device import distributed
from pipeline.weights import faults
from pipeline.corpus import fetch
from pipeline.core import tracking
from stages import average, batch, download, evaluate, tokenize, train, translate
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint, sidecar
from pipeline.core.config import compose
from tests.fixtures.files_server import FileServer
from tests.fixtures.pipeline_repo import (VENV_BIN, MlflowServer, dvc, dvc_run, git_commit, make_repo, tiny_params,
                                     use_preset, write_corpus)
from tests.fixtures.train import ROOT, stage_args, stage_env
from tests.fixtures.train import write_corpus as write_train_corpus
from tests.fixtures.train import write_params as write_train_params
from tests.fixtures.translation import shared_store  # noqa: F401 (fixture)

DEV_FULL = Path("/dev/full")


@pytest.fixture(autouse=True)
def _tracking_on_one_thread(monkeypatch):
    """Tracking on (a failure turns it off for the rest of a process), torch on one thread (shared cores)."""
    monkeypatch.setattr(tracking, "_disabled", False)
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.001)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def store(tmp_path_factory, _new_store) -> str:
    """The tracking URI of the module's sqlite MLflow store (shared_store sets it for each test): a copy of a new one,
    its tables made (a new store's migrations cost seconds)."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    shutil.copyfile(_new_store, db)
    return f"sqlite:///{db}"


def read_tree(*roots: Path) -> dict[str, bytes]:
    """Every file under `roots` (the download cache aside), by path."""
    return {str(p): p.read_bytes() for root in roots if root.exists() for p in sorted(root.rglob("*"))
            if p.is_file() and ".cache" not in p.parts}


def temporaries(*roots: Path) -> list[str]:
    """Leftover temporary files or directories (pipeline.core.files names them .<name>.*.tmp)."""
    return [str(p) for root in roots if root.exists() for p in root.rglob(".*") if ".cache" not in p.parts]


# --- a whole pipeline run in-process on tmp paths, the arguments as in dvc.yaml ------------------------------

STAGES = {
    "download": (download, "--out data/raw --metrics metrics/download.json"),
    "tokenize": (tokenize, "--raw data/raw --out data/tokenized --metrics metrics/tokenize.json"),
    "batch": (batch, "--tokenized data/tokenized --out data/batches --metrics metrics/batch.json"),
    "train": (train, "--tokenized data/tokenized --batches data/batches --checkpoints data/checkpoints "
                     "--metrics metrics/train.json --plot plots/train.csv"),
    "average": (average, "--checkpoints data/checkpoints --out data/model"),
    "translate": (translate, "--model data/model --tokenized data/tokenized --raw data/raw --out data/translations"),
    "evaluate": (evaluate, "--translations data/translations --raw data/raw --metrics metrics/eval.json"),
}


def run_stage(root: Path, stage: str) -> None:
    """`python -m stages.<stage> ...` in-process, as dvc.yaml calls it, with the paths under `root`."""
    module, args = STAGES[stage]
    argv = [str(root / a) if "/" in a else a for a in args.split()]
    module.main([*argv, "--params", str(root / "params.yaml")])


def small_params(data: dict) -> dict:
    """The composed default params with `data` and everything else tiny: the pipeline runs in seconds."""
    params = compose([])
    params["data"] = data
    params["tokenize"].update(vocab_size=60, max_len=64)
    params["batch"]["max_tokens"] = 300
    params["model"].update(n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.0, max_positions=64)
    params["train"].update(devices=1, tokens_per_step=300, max_steps=4, max_minutes=0, warmup_steps=2, eval_every=2,
                           log_every=2, checkpoint_every=2, keep_checkpoints=5)
    params["average"]["last_n"] = 2
    params["translate"].update(beam_size=2, max_len_b=4, max_tokens=400)
    return params


@pytest.fixture(scope="module")
def finished(tmp_path_factory, store):
    """A directory where every stage ran once, in order, and the corpus server that download used (still up)."""
    root = tmp_path_factory.mktemp("finished")
    (root / "www").mkdir()
    with FileServer(root / "www") as server, pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributed, "available_cores", lambda: 1)
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("MLFLOW_TRACKING_URI", store)
        data = write_corpus(root / "www", server, {"train": 120, "valid": 10, "test": 10})
        (root / "params.yaml").write_text(yaml.safe_dump(small_params(data), sort_keys=False))
        for stage in STAGES:
            run_stage(root, stage)
        yield root


# --- ENOSPC ---------------------------------------------------------------------------------------------


class DiskFull:
    """Files under `root` whose path contains `match`, opened for writing, get /dev/full: every write fails with ENOSPC.

    The file keeps its name; the error comes from the kernel. Covered: builtins.open and io.open (the stages'
    own files, pathlib, numpy), os.fdopen (pipeline.core.files' temporaries), and torch.save to a path (it would
    otherwise write from C++). `hits` lists the files that failed.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, match: str = ""):
        if not DEV_FULL.exists():
            pytest.skip("needs /dev/full (Linux)")
        self.root, self.match, self.hits = str(root), match, []
        real_open, real_fdopen, real_save = builtins.open, os.fdopen, torch.save

        def full(path: str, flags: int) -> int:
            return os.open(DEV_FULL, os.O_WRONLY)

        def fake_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and self.hit(file):
                kwargs["opener"] = full
            return real_open(file, mode, *args, **kwargs)

        def fake_fdopen(fd, mode="r", *args, **kwargs):
            if set(mode) & set("wax+") and self.hit(os.readlink(f"/proc/self/fd/{fd}")):
                full_fd = os.open(DEV_FULL, os.O_WRONLY)
                os.dup2(full_fd, fd)
                os.close(full_fd)
            return real_fdopen(fd, mode, *args, **kwargs)

        def fake_save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and self.hit(f):
                with fake_open(f, "wb") as fh:
                    return real_save(obj, fh, *args, **kwargs)
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(os, "fdopen", fake_fdopen)
        monkeypatch.setattr(torch, "save", fake_save)

    def hit(self, path: str | os.PathLike) -> bool:
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(self.root + os.sep) and self.match in path:
            self.hits.append(path)
            return True
        return False


@pytest.mark.parametrize("stage, match, named, change", [
    ("download", "", "data/raw", None),
    ("download", "download.json", "metrics/download.json", None),
    ("download", ".cache", ".part", None),  # the download itself, into an empty cache
    ("tokenize", "", "data/tokenized", "tokenize.vocab_size=58"),
    ("tokenize", ".ids", "data/tokenized", "tokenize.vocab_size=58"),  # encoded ids, as a big corpus would fill a disk
    ("tokenize", "tokenize.json", "metrics/tokenize.json", "tokenize.vocab_size=58"),
    ("batch", "", "data/batches", "batch.max_tokens=200"),
    ("batch", "batch.json", "metrics/batch.json", "batch.max_tokens=200"),
    ("train", "", "plots/train.csv", None),  # the first write of a resumed run
    ("train", "/checkpoints/", "data/checkpoints/step_00000005.pt", "train.max_steps=5"),
    ("train", "train.json", "metrics/train.json", None),
    ("average", "", "data/model", "average.last_n=1"),
    ("translate", "", "translations", "translate.beam_size=1"),
    ("evaluate", "", "metrics/eval.json", None),
])
def test_a_full_disk_fails_the_stage_naming_the_file_and_keeps_every_previous_output(
        finished, tmp_path, stage, match, named, change):
    """The stage re-runs on a disk that is full (for the files `match` picks) with params that change its outputs."""
    root = tmp_path / "root"
    shutil.copytree(finished, root, ignore=shutil.ignore_patterns("www", "mlflow.db"))
    if match == ".cache":
        shutil.rmtree(root / "data" / ".cache")
    if change:
        key, value = change.split("=")
        params = yaml.safe_load((root / "params.yaml").read_text())
        params[key.split(".")[0]][key.split(".")[1]] = int(value)
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    outputs = [root / "data", root / "metrics", root / "plots"]
    before = read_tree(*outputs)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError) as failure:
        disk = DiskFull(mp, root, match)
        run_stage(root, stage)

    assert failure.value.errno == errno.ENOSPC and disk.hits
    message = str(failure.value)
    assert "No space left on device" in message and named in message, message
    after = read_tree(*outputs)
    if change == "train.max_steps=5":  # the plot is rewritten at each logged step, before that step's checkpoint
        before.pop(str(root / "plots" / "train.csv")), after.pop(str(root / "plots" / "train.csv"))
    assert after.keys() == before.keys()
    assert [name for name in before if after[name] != before[name]] == []
    assert temporaries(*outputs) == []


# --- SIGKILL of the train stage ------------------------------------------------------------------------------

KILL_TRAIN = dict(max_steps=8, checkpoint_every=2, eval_every=3, log_every=2, model={"dropout": 0.1})


def train_subprocess(root: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m stages.train` on root's corpus, on one thread (stage_env: OMP_NUM_THREADS=1), as the reference
    run: the same sums, bit for bit. Not pinned to a core: the scheduler puts it where the other worker is not."""
    cmd = [sys.executable, "-m", "stages.train", *stage_args(root, root / "params.yaml")]
    return subprocess.run(cmd, cwd=ROOT, env=stage_env(**env), capture_output=True, text=True, timeout=300)


def final_weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(complete_checkpoints(checkpoints)[-1])["model"]


@pytest.fixture(scope="module")
def never_killed(tmp_path_factory, store) -> dict[str, torch.Tensor]:
    """The final weights of the run the killed ones must end with."""
    root = tmp_path_factory.mktemp("never_killed")
    write_train_corpus(root)
    write_train_params(root / "params.yaml", **KILL_TRAIN)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributed, "available_cores", lambda: 1)
        mp.setenv("MLFLOW_TRACKING_URI", store)
        train.main(stage_args(root, root / "params.yaml"))
    return final_weights(root / "checkpoints")


def test_fault_specs_are_parsed_strictly_and_unset_means_nothing(monkeypatch):
    assert faults.parse_spec("step@3, validation@6") == {("step", 3), ("validation", 6)}
    with pytest.raises(ValueError, match="TRANSFORMER_FAULT='chekpoint@2'"):
        faults.parse_spec("chekpoint@2")
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.inject("step", 3)  # still alive
    monkeypatch.setenv(faults.ENV, "step@4")
    faults.inject("step", 3)
    faults.inject("validation", 4)


@pytest.mark.parametrize("fault, resumed_from", [("step@5", 4), ("checkpoint_write@6", 4), ("validation@6", 4)])
def test_train_killed_anywhere_resumes_to_the_same_final_weights(tmp_path, caplog, never_killed, fault, resumed_from):
    write_train_corpus(tmp_path)
    write_train_params(tmp_path / "params.yaml", **KILL_TRAIN)
    killed = train_subprocess(tmp_path, TRANSFORMER_FAULT=fault, **{tracking.ENV: "0"})  # no MLflow run read here
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"SIGKILL at {fault}" in killed.stderr
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)][-1] == f"step_{resumed_from:08d}.pt"
    if fault.startswith("checkpoint_write"):
        partial = list(checkpoints.glob(".step_00000006.pt.*.tmp"))
        assert partial and 0 < partial[0].stat().st_size, "the kill came after the temporary file was written"

    with caplog.at_level(logging.INFO):  # the re-run, in-process (one thread, as the others)
        train.main(stage_args(tmp_path, tmp_path / "params.yaml"))
    assert f"resuming from step {resumed_from}" in caplog.text
    weights = final_weights(checkpoints)
    assert weights.keys() == never_killed.keys()
    assert all(torch.equal(weights[k], never_killed[k]) for k in weights)
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"] == 8
    assert list(checkpoints.glob(".*")) == []  # the killed write's temporary is gone


# --- broken checkpoints and averaging ----------------------------------------------------------------------


def test_average_skips_truncated_and_unsealed_checkpoints_naming_each(finished, tmp_path, caplog):
    root = tmp_path / "root"
    shutil.copytree(finished, root, ignore=shutil.ignore_patterns("www", "mlflow.db"))
    checkpoints = root / "data" / "checkpoints"
    two, four = checkpoints / "step_00000002.pt", checkpoints / "step_00000004.pt"
    shutil.copy(two, checkpoints / "step_00000006.pt")  # a newer one whose sidecar never came (killed)
    shutil.copy(four, checkpoints / "step_00000008.pt")
    shutil.copy(sidecar(four), sidecar(checkpoints / "step_00000008.pt"))
    (checkpoints / "step_00000008.pt").write_bytes(four.read_bytes()[:5000])  # truncated after it was sealed
    with caplog.at_level(logging.WARNING):
        run_stage(root, "average")
    assert json.loads((root / "data" / "model" / "averaged.json").read_text())["steps"] == [2, 4]
    for broken in ("step_00000006.pt", "step_00000008.pt"):
        assert f"skipping checkpoint {checkpoints / broken}" in caplog.text


# --- downloads cut across runs --------------------------------------------------------------------------


def test_a_download_cut_in_every_try_is_resumed_by_the_next_run(tmp_path):
    (tmp_path / "www").mkdir()
    with FileServer(tmp_path / "www") as server:
        data = write_corpus(tmp_path / "www", server, {"train": 400, "valid": 10, "test": 10})
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(small_params(data)))
        server.cut_after, server.cut_times = 1000, fetch.TRIES  # every try of the first file is cut
        with pytest.raises(fetch.DownloadError, match=r"train\.en: failed after 5 tries.*partial file kept"):
            run_stage(tmp_path, "download")
        part = next((tmp_path / "data" / ".cache").rglob("train.en.part"))
        assert part.stat().st_size == 1000 * fetch.TRIES and not (tmp_path / "data" / "raw").exists()
        run_stage(tmp_path, "download")
        resumed = [r for r in server.requests if r.path == "/train.en"][-1]
        assert resumed.headers["Range"] == f"bytes={1000 * fetch.TRIES}-" and resumed.status == 206
    assert (tmp_path / "data" / "raw" / "train.en").read_bytes() == (tmp_path / "www" / "train.en").read_bytes()


# --- end to end: one temporary repo, `dvc repro` with a real MLflow server, then queued experiments ----------

E2E_TRAIN = dict(max_steps=20, warmup_steps=10, eval_every=10, log_every=5, checkpoint_every=5, keep_checkpoints=10)
TRACKING_WARNING = "MLflow tracking at"
ASK_EVERY_S = 60  # queue_done: how often `dvc queue status` is asked whatever the result backend holds


def pipeline_env(**extra: str) -> dict[str, str]:
    """The environment of a `dvc` command: the venv first on PATH, one thread a stage (as the in-process reference
    run), no tracking URI or fault unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", faults.ENV)}
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env['PATH']}", "OMP_NUM_THREADS": "1", **extra}


def start_dvc(repo: Path, log: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """`dvc args...` in the background, output to `log` (pipeline_env: one thread a stage, so every training run
    sums alike)."""
    with open(log, "w") as f:
        return subprocess.Popen(["dvc", *args], cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> tuple[int, str]:
    return proc.wait(timeout=timeout), log.read_text()


def wait_for(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"dvc ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def warnings_per_stage(output: str) -> dict[str, int]:
    """How many tracking warnings each stage's process printed (the output of a `dvc repro`, stages in order)."""
    counts = {}
    for section in output.split("Running stage '")[1:]:
        counts[section.split("'")[0]] = section.count(TRACKING_WARNING)
    return counts


def train_in_process(root: Path) -> dict[str, torch.Tensor]:
    """The train stage over root's corpus, in this process on one thread (as the one-thread stage processes: the same
    sums) and untracked; its final weights."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distributed, "available_cores", lambda: 1)
        mp.setattr(tracking, "_disabled", True)
        threads = torch.get_num_threads()
        try:
            train.main(stage_args(root, root / "params.yaml"))
        finally:
            torch.set_num_threads(threads)
    return final_weights(root / "checkpoints")


def queue_done(repo: Path, env: dict[str, str], tasks: int, timeout: float = 600) -> str:
    """`dvc queue status` once its `tasks` experiments have ended (Success or Failed): that output.

    Asked when the queue's result backend holds a result per task (.dvc/tmp/exps/celery/result, one file a finished
    task), and every ASK_EVERY_S seconds whatever it holds: each `dvc queue status` is a second of CPU.
    """
    results = repo / ".dvc" / "tmp" / "exps" / "celery" / "result"
    deadline = asked = time.monotonic()
    deadline += timeout
    while True:
        if len(list(results.glob("*"))) >= tasks or time.monotonic() - asked > ASK_EVERY_S:
            status, asked = dvc(repo, "queue", "status", env=env), time.monotonic()
            lines = [line for line in status.splitlines()[1:] if line.strip() and "Worker status" not in line]
            if len(lines) == tasks and all(("Success" in t or "Failed" in t) for t in lines):
                return status
            assert time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, _new_store):
    """Runs the whole story once; the tests below each check one part of what it recorded.

    1. `dvc repro` (20 steps) with an MLflow server up all along; once training wrote a checkpoint,
       a second `dvc repro` is started, and must be refused by DVC's lock.
    2. train.max_steps 20 -> 40 and `dvc repro` with TRANSFORMER_FAULT=checkpoint_write@30: killed mid-write.
    3. `dvc repro` again: training resumes; the MLflow server is killed at its first new checkpoint.
    4. Two experiments queued (`dvc exp run --queue`, two beam sizes) and run by `dvc queue start`; meanwhile the
       same 40 steps trained in one go (in this process), for the weights to compare with.
    """
    root = tmp_path_factory.mktemp("pipeline")
    repo = make_repo(root / "repo")
    (repo / ".gitignore").write_text("/data/.cache/\n/data/checkpoints/\n/mlflow.db\n/mlartifacts/\n")
    for db in (root / "server.db", repo / "mlflow.db"):  # new stores, their tables made (seconds of migrations each)
        shutil.copyfile(_new_store, db)
    server = MlflowServer(root / "server.db").launch()
    record: dict = {"repo": repo, "server_db": root / "server.db"}
    www = root / "www"
    www.mkdir()
    try:
        with FileServer(www) as files:
            params = tiny_params(write_corpus(www, files, {"train": 300, "valid": 20, "test": 20}), **E2E_TRAIN)
            params["average"]["last_n"] = 2
            params["translate"]["max_len_b"] = 5
            use_preset(repo, params)
            server.wait_ready()
            env = pipeline_env(MLFLOW_TRACKING_URI=server.uri)

            first = start_dvc(repo, root / "first.log", env, "repro")
            wait_for(lambda: list((repo / "data" / "checkpoints").glob("*.sha256")), first, root / "first.log",
                     "the first checkpoint")
            started = time.monotonic()
            record["locked"] = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True,
                                              timeout=120)
            record["locked_seconds"] = time.monotonic() - started
            record["first"] = finish(first, root / "first.log")
            record["first_params_hash"] = hashlib.sha256((repo / "params.yaml").read_bytes()).hexdigest()
            record["status_after_first"] = dvc(repo, "status", env=env)

            params["train"]["max_steps"] = 40
            use_preset(repo, params)
            killed = start_dvc(repo, root / "killed.log", {**env, faults.ENV: "checkpoint_write@30"}, "repro")
            record["killed"] = finish(killed, root / "killed.log")
            record["partial"] = [p.stat().st_size for p in (repo / "data" / "checkpoints").glob(".step_00000030.*")]

            resumed = start_dvc(repo, root / "resumed.log", env, "repro")
            wait_for(lambda: (repo / "data" / "checkpoints" / "step_00000030.pt.sha256").exists(), resumed,
                     root / "resumed.log", "a checkpoint of the resumed run")
            server.stop()
            record["resumed"] = finish(resumed, root / "resumed.log")
            record["leftovers"] = sorted(p.name for p in (repo / "data" / "checkpoints").glob(".*"))
            record["cached"] = {p.parent.name + p.name for p in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*")
                                if p.is_file()}
            record["md5"] = {p: hashlib.md5(p.read_bytes()).hexdigest()
                             for p in [*(repo / "data" / "checkpoints").glob("step_*.pt"), repo / "data" / "model" / "model.pt"]}

        straight = root / "straight"
        for name in ("tokenized", "batches"):
            shutil.copytree(repo / "data" / name, straight / name)
        shutil.copy(repo / "params.yaml", straight / "params.yaml")

        git_commit(repo, "the tiny pipeline, trained")
        for key, value in (("user.name", "Test"), ("user.email", "test@example.org")):  # dvc commits experiments
            subprocess.run(["git", "config", key, value], cwd=repo, check=True)
        queue_env = pipeline_env()  # no MLFLOW_TRACKING_URI: the default store, mlflow.db at the repo root
        # -C: the checkpoints are not in DVC's cache, so a queued copy of the repo has them only when copied
        # a sweep (hydra's syntax): two experiments, queued in this order
        record["queued"] = [dvc(repo, "exp", "run", "--queue", "-C", "data/checkpoints", "-S", "translate.beam_size=1,2",
                                env=queue_env)]
        with open(root / "queue.log", "w") as log:  # not a pipe: the worker it starts inherits it and holds it open
            started = subprocess.run(["dvc", "queue", "start", "-j", "1"], cwd=repo, env=queue_env, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=120)
        assert started.returncode == 0, (root / "queue.log").read_text()
        record["straight_weights"] = train_in_process(straight)  # meanwhile, in the background worker: the queue
        record["queue_status"] = queue_done(repo, queue_env, 2)
        record["exp_show"] = json.loads(dvc_run(repo, "exp", "show", "--json", env=queue_env).stdout)
        yield record
    finally:
        server.stop()
        if "queued" in record:
            dvc_run(repo, "queue", "stop", "--kill", env=pipeline_env())  # no worker outlives the test


@pytest.mark.slow
def test_a_second_dvc_repro_is_refused_by_the_lock_and_the_first_completes(pipeline):
    locked = pipeline["locked"]
    said = locked.stdout + locked.stderr
    # DVC holds its repo lock ("Unable to acquire lock") between stages, and while a stage runs, read/write
    # locks on the stage's dependencies and outputs (".dvc/tmp/rwlock": "... is busy").
    assert locked.returncode != 0, said
    assert "Unable to acquire lock" in said or ("is busy, it is being blocked by" in said and "rwlock" in said), said
    assert pipeline["locked_seconds"] < 60
    rc, output = pipeline["first"]
    assert rc == 0, output[-4000:]
    assert "Data and pipelines are up to date" in pipeline["status_after_first"]


@pytest.mark.slow
def test_with_the_server_up_the_pipeline_run_is_complete_in_mlflow(pipeline, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{pipeline['server_db']}")  # the server's own store
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    parent = next(r for r in runs if r.data.tags.get("params_file_sha256") == pipeline["first_params_hash"]
                  and "stage" not in r.data.tags)
    children = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    stages = yaml.safe_load((pipeline["repo"] / "dvc.yaml").read_text())["stages"]
    assert sorted(children) == sorted(stages)  # every stage of the repro has its child run
    assert {r.info.status for r in children.values()} == {"FINISHED"} and parent.info.status == "FINISHED"
    dvc_metrics = {stem: json.loads((pipeline["repo"] / "metrics" / f"{stem}.json").read_text())
                   for stem in ("download", "tokenize", "batch")}
    assert parent.data.metrics["download.train_lines"] == dvc_metrics["download"]["train_lines"] == 300
    assert parent.data.metrics["tokenize.vocab_size"] == dvc_metrics["tokenize"]["vocab_size"]
    assert parent.data.metrics["batch.padding_efficiency"] == pytest.approx(dvc_metrics["batch"]["padding_efficiency"])
    assert parent.data.metrics["train.steps"] == 20 and "eval.bleu" in parent.data.metrics
    assert children["train"].data.metrics["steps"] == 20 and "valid_ppl" in children["train"].data.metrics
    assert "bleu" in children["evaluate"].data.metrics


@pytest.mark.slow
def test_training_killed_inside_dvc_repro_resumes_there_to_the_same_weights(pipeline):
    rc, output = pipeline["killed"]
    assert rc != 0 and "SIGKILL at checkpoint_write@30" in output, output[-4000:]
    assert pipeline["partial"] and min(pipeline["partial"]) > 0  # the killed write left a partial temporary
    rc, output = pipeline["resumed"]
    assert rc == 0, output[-4000:]
    assert "resuming from step 25" in output and "interrupted checkpoint write" in output
    assert pipeline["leftovers"] == []
    weights = final_weights(pipeline["repo"] / "data" / "checkpoints")
    assert weights.keys() == pipeline["straight_weights"].keys()
    assert all(torch.equal(weights[k], pipeline["straight_weights"][k]) for k in weights)


@pytest.mark.slow
def test_checkpoints_stay_out_of_the_dvc_cache_and_the_averaged_model_goes_in(pipeline):
    """dvc.yaml: data/checkpoints is `cache: false` (GBs at the paper's scale), data/model is cached."""
    model = pipeline["repo"] / "data" / "model" / "model.pt"
    checkpoints = {p: md5 for p, md5 in pipeline["md5"].items() if p != model}
    assert len(checkpoints) >= 2
    assert not set(checkpoints.values()) & pipeline["cached"]
    assert pipeline["md5"][model] in pipeline["cached"]
    lock = yaml.safe_load((pipeline["repo"] / "dvc.lock").read_text())["stages"]
    written = {o["path"]: o["md5"] for o in lock["train"]["outs"]}  # still recorded in dvc.lock, uncached
    assert {d["path"]: d["md5"] for d in lock["average"]["deps"]}["data/checkpoints"] == written["data/checkpoints"]


@pytest.mark.slow
def test_the_tracking_server_gone_mid_run_costs_one_warning_per_stage_and_no_number(pipeline):
    rc, output = pipeline["resumed"]
    assert rc == 0, output[-4000:]
    warned = warnings_per_stage(output)  # the stages that ran (evaluate only if the translations changed)
    assert {"train", "average", "export", "translate"} <= warned.keys() <= {"train", "average", "export", "translate",
                                                                            "evaluate"}, warned
    assert set(warned.values()) == {1}, warned  # train: the server died under it; the others: found it gone
    metrics = {p.stem: json.loads(p.read_text()) for p in (pipeline["repo"] / "metrics").glob("*.json")}
    assert sorted(metrics) == ["batch", "download", "eval", "export", "tokenize", "train"]
    assert metrics["train"]["steps"] == 40
    for key in ("flops_analytic", "mfu", "valid_ppl", "train_tokens", "tokens_per_second"):
        assert key in metrics["train"], key
    for key in ("bleu", "chrf", "bleu_tokenized", "signature", "valid_bleu"):
        assert key in metrics["eval"], key


@pytest.mark.slow
def test_two_queued_experiments_run_to_the_end_into_one_mlflow_store(pipeline):
    from mlflow.tracking import MlflowClient

    names = [line.split("'")[1] for out in pipeline["queued"] for line in out.splitlines()
             if line.startswith("Queued experiment")]
    assert len(names) == 2
    assert pipeline["queue_status"].count("Success") == 2, pipeline["queue_status"]
    shown = {e["name"]: e for base in pipeline["exp_show"] for x in base.get("experiments") or [] for e in x["revs"]}
    for name, beam in zip(names, (1, 2)):
        params = shown[name]["data"]["params"]["params.yaml"]["data"]
        assert params["translate"]["beam_size"] == beam
        assert "bleu" in shown[name]["data"]["metrics"]["metrics/eval.json"]["data"]
    client = MlflowClient(f"sqlite:///{pipeline['repo'] / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = {r.data.tags["dvc_exp_name"]: r for r in runs if "stage" not in r.data.tags}
    assert sorted(parents) == sorted(names)
    for name, parent in parents.items():
        stages = [r.data.tags["stage"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert "translate" in stages and parent.info.status == "FINISHED"
        # Where DVC finds evaluate's deps and params in its run-cache (translations the same as an earlier run's),
        # it restores its output without running it: no stage of this run scored the translations, so its run
        # holds no BLEU (`dvc exp show` has DVC's record). Where evaluate ran, the BLEU is this experiment's own.
        # It used to get the queueing repo's metrics/eval.json (DVC_ROOT names that repo, not the copy that runs).
        own = shown[name]["data"]["metrics"]["metrics/eval.json"]["data"]["bleu"]
        if "evaluate" in stages:
            assert parent.data.metrics["eval.bleu"] == pytest.approx(own, abs=0.005)
        else:
            assert "eval.bleu" not in parent.data.metrics
        assert parent.data.metrics["train.steps"] == 40  # the copy's own metrics/train.json (max_steps 40, step 2 above)
