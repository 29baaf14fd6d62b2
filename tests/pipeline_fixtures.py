"""Temporary git + DVC repos running the real pipeline on a synthetic language pair, and a real MLflow server.

    repo = make_repo(tmp_path / "repo")                  # the project's dvc.yaml, stages, model, conf; git + dvc init
    with FileServer(www) as server:
        params = tiny_params(write_corpus(www, server))  # the corpus served over HTTP from 127.0.0.1, sha256 pinned
        write_params(repo, params)
        dvc(repo, "repro")
    use_preset(repo, params)                             # as conf/experiment/tiny.yaml, for `dvc exp run`
    with MlflowServer(tmp_path / "mlflow.db") as server:  # `mlflow server` on a free port of 127.0.0.1
        ... MLFLOW_TRACKING_URI=server.uri ...

The corpus: sentences of a small grammar (determiner, adjective, noun, verb,
determiner, adjective, noun) and their translation into a made-up language
with its own lexicon and noun-before-adjective order.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from pipeline.core.config import compose
from tests.http_fixtures import FileServer

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PROJECT_FILES = ["dvc.yaml", "stages", "pipeline", "model", "conf"]
GIT_USER = ["-c", "user.name=Test", "-c", "user.email=test@example.org"]

DET = {"the": "lo", "a": "un", "every": "ogni", "no": "nul"}
ADJ = {"red": "rosso", "small": "piccolo", "big": "grando", "old": "vecchio", "green": "verde", "happy": "felice"}
NOUN = {"cat": "gatto", "dog": "cane", "bird": "uccello", "man": "uomo", "woman": "donna", "child": "bimbo",
        "horse": "cavallo", "tree": "albero", "house": "casa", "ball": "palla"}
VERB = {"sees": "vede", "likes": "ama", "follows": "segue", "finds": "trova", "paints": "dipinge"}
SIZES = {"train": 4000, "valid": 100, "test": 200}


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One source sentence and its translation: adjectives follow their noun in the target."""
    def phrase():
        d, a, n = rng.choice(list(DET)), rng.choice(list(ADJ)), rng.choice(list(NOUN))
        return [d, a, n], [DET[d], NOUN[n], ADJ[a]]
    (s1, t1), (s2, t2) = phrase(), phrase()
    v = rng.choice(list(VERB))
    return " ".join(s1 + [v] + s2) + " .", " ".join(t1 + [VERB[v]] + t2) + " ."


def write_corpus(www: Path, server: FileServer, sizes: dict[str, int] | None = None) -> dict:
    """Write train/valid/test files under `www`; return the params `data` section naming them."""
    rng = random.Random(7)
    data = {"name": "synthetic", "src_lang": "en", "tgt_lang": "de"}
    for split, n in (sizes or SIZES).items():
        pairs = [sentence_pair(rng) for _ in range(n)]
        corpus = {"name": f"synthetic-{split}"}
        for side, lang, column in (("src", "en", 0), ("tgt", "de", 1)):
            path = www / f"{split}.{lang}"
            path.write_text("".join(p[column] + "\n" for p in pairs), encoding="utf-8")
            corpus[side] = {"url": server.url(path.name), "member": None,
                            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        data[split] = [corpus]
    return data


def tiny_params(data: dict, **train: int) -> dict:
    """The composed default params with the synthetic data and a tiny model; `train` overrides train keys."""
    params = compose([])
    params["data"] = data
    params["tokenize"].update(vocab_size=100, max_len=64)
    params["batch"]["max_tokens"] = 600
    params["model"].update(n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16, dropout=0.0, max_positions=128)
    params["train"].update(devices=1, tokens_per_step=600, max_steps=500, max_minutes=0, warmup_steps=100,
                           lr_factor=1.0, eval_every=100, log_every=50,
                           checkpoint_every=50, keep_checkpoints=5)
    params["train"].update(train)
    params["average"]["last_n"] = 3
    params["export"]["check_lines"] = 20  # the export stage checks 20 validation lines: a few seconds a repro
    params["translate"].update(max_tokens=2000)
    return params


def write_params(repo: Path, params: dict) -> Path:
    path = repo / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def dvc_run(repo: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 900
            ) -> subprocess.CompletedProcess:
    """Run `dvc args...` in `repo` (by default with the venv first on PATH: the stages call python, torchrun)."""
    env = env or {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["dvc", *args], cwd=repo, capture_output=True, text=True, timeout=timeout, env=env)


def dvc(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run `dvc args...` in `repo`, which must succeed; its stdout and stderr."""
    result = dvc_run(repo, *args, env=env)
    assert result.returncode == 0, f"dvc {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def make_repo(repo: Path) -> Path:
    """A new git + DVC repo holding the project's pipeline files (no params.yaml yet)."""
    repo.mkdir(parents=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, repo / name)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    dvc(repo, "config", "core.analytics", "false")
    return repo


def use_preset(repo: Path, params: dict) -> None:
    """`params` as conf/experiment/tiny.yaml, made the default; params.yaml composed from conf/, as `dvc exp run` does.

    With hydra enabled (as in the project), `dvc exp run` recomposes params.yaml from conf/ before running.
    """
    preset = "# @package _global_\n" + yaml.safe_dump(params, sort_keys=False)
    (repo / "conf" / "experiment" / "tiny.yaml").write_text(preset)
    config = repo / "conf" / "config.yaml"
    text = config.read_text()
    if "- experiment: tiny" not in text:
        assert "- experiment: multi30k_small" in text, text
        config.write_text(text.replace("- experiment: multi30k_small", "- experiment: tiny"))
    composed = compose([], repo / "conf")
    assert composed == params, "conf/experiment/tiny.yaml does not compose to the params it holds"
    write_params(repo, composed)
    dvc(repo, "config", "hydra.enabled", "true")


def git_commit(repo: Path, message: str) -> None:
    """Commit everything in `repo` that git does not ignore."""
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", *GIT_USER, "commit", "-q", "-m", message], cwd=repo, check=True)


@pytest.fixture
def repo(tmp_path):
    return make_repo(tmp_path / "repo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` with a sqlite store on a free port of 127.0.0.1, started and stopped by the test."""

    def __init__(self, db: Path, startup_s: float = 120) -> None:
        self.db, self.startup_s, self.port = db, startup_s, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        """Start the server and wait until it answers."""
        return self.launch().wait_ready()

    def launch(self) -> MlflowServer:
        """Start the server without waiting for it (it takes seconds): wait_ready() before using it."""
        cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.db}",
               "--default-artifact-root", (self.db.parent / "mlartifacts").as_uri(),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self._log = open(self.db.with_suffix(".log"), "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self) -> MlflowServer:
        """Poll /health until the server answers."""
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.db.with_suffix(".log").read_text()
            try:
                if requests.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer on {self.uri}/health in {self.startup_s} s")

    def stop(self) -> None:
        """Stop the server and its workers (its own process group) for good."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server, its uvicorn worker and its job runners
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
