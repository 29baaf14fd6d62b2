"""End to end: `dvc repro` in a temporary git repo learns a tiny synthetic language pair.

The corpus is generated here: sentences of a small grammar (determiner,
adjective, noun, verb, determiner, adjective, noun) and their translation into
a made-up language with its own lexicon and noun-before-adjective order. The
files are served over real HTTP from 127.0.0.1 with pinned sha256, and every
stage runs for real: download, tokenize, batch, train, average, translate,
evaluate. A BLEU of at least 90 shows that the pipeline learns, not only runs.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stages.config import compose
from tests.http_fixtures import FileServer

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILES = ["dvc.yaml", "stages", "model", "conf"]

DET = {"the": "lo", "a": "un", "every": "ogni", "no": "nul"}
ADJ = {"red": "rosso", "small": "piccolo", "big": "grando", "old": "vecchio", "green": "verde", "happy": "felice"}
NOUN = {"cat": "gatto", "dog": "cane", "bird": "uccello", "man": "uomo", "woman": "donna", "child": "bimbo",
        "horse": "cavallo", "tree": "albero", "house": "casa", "ball": "palla"}
VERB = {"sees": "vede", "likes": "ama", "follows": "segue", "finds": "trova", "paints": "dipinge"}


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One source sentence and its translation: adjectives follow their noun in the target."""
    def phrase():
        d, a, n = rng.choice(list(DET)), rng.choice(list(ADJ)), rng.choice(list(NOUN))
        return [d, a, n], [DET[d], NOUN[n], ADJ[a]]
    (s1, t1), (s2, t2) = phrase(), phrase()
    v = rng.choice(list(VERB))
    return " ".join(s1 + [v] + s2) + " .", " ".join(t1 + [VERB[v]] + t2) + " ."


def write_corpus(www: Path, server: FileServer) -> dict:
    """Write train/valid/test files under `www`; return the params `data` section naming them."""
    rng = random.Random(7)
    sizes = {"train": 4000, "valid": 100, "test": 200}
    data = {"name": "synthetic", "src_lang": "en", "tgt_lang": "de"}
    for split, n in sizes.items():
        pairs = [sentence_pair(rng) for _ in range(n)]
        corpus = {"name": f"synthetic-{split}"}
        for side, lang, column in (("src", "en", 0), ("tgt", "de", 1)):
            path = www / f"{split}.{lang}"
            path.write_text("".join(p[column] + "\n" for p in pairs), encoding="utf-8")
            corpus[side] = {"url": server.url(path.name), "member": None,
                            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        data[split] = [corpus]
    return data


def tiny_params(data: dict) -> dict:
    params = compose([])
    params["data"] = data
    params["tokenize"].update(vocab_size=100, max_len=64)
    params["batch"]["max_tokens"] = 600
    params["model"].update(n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16, dropout=0.0, max_positions=128)
    params["train"].update(devices=1, tokens_per_step=600, max_steps=500, max_minutes=0, warmup_steps=100,
                           lr_factor=1.0, eval_every=100, log_every=50, checkpoint_minutes=0,
                           checkpoint_every=100, keep_checkpoints=5)
    params["average"]["last_n"] = 3
    params["translate"].update(max_tokens=2000)
    return params


def dvc(repo: Path, *args: str) -> str:
    result = subprocess.run(["dvc", *args], cwd=repo, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"dvc {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
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


@pytest.mark.slow
def test_dvc_repro_learns_a_synthetic_language(repo, tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    with FileServer(www) as server:
        params = tiny_params(write_corpus(www, server))
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        dvc(repo, "repro")

        scores = json.loads((repo / "metrics" / "eval.json").read_text())
        assert scores["bleu"] >= 90, scores
        assert scores["bleu_tokenized"] >= 90, scores
        hyps = (repo / "data" / "translations" / "test.de").read_text(encoding="utf-8").splitlines()
        assert len(hyps) == 200

        again = dvc(repo, "repro")
        assert "Running stage" not in again, again

        params["translate"]["beam_size"] = 2
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        rerun = dvc(repo, "repro")
        ran = sorted(line.split("'")[1] for line in rerun.splitlines() if line.startswith("Running stage"))
        assert ran == ["evaluate", "translate"], rerun
