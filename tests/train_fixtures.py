"""Tiny on-disk inputs for the train stage: a synthetic tokenized corpus, its batches, a params file.

The corpus is written in the pipeline/corpus/formats.py formats directly (no
sentencepiece): source sentences of random ids, targets a fixed function of
them (each id shifted by one, reversed), so a tiny model can learn the mapping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from pipeline.corpus.formats import ID_DTYPE, OFFSET_DTYPE, batch_paths, split_paths
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 24
FIRST_ID = 4  # after PAD, UNK, BOS, EOS
MODEL = dict(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.0,
             positional_encoding="sinusoidal", max_positions=64)
TRAIN = dict(devices=1, tokens_per_step=48, max_steps=6, max_minutes=0, warmup_steps=4, lr_factor=1.0,
             adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-9, label_smoothing=0.1, eval_every=3, log_every=2,
             checkpoint_every=2, keep_checkpoints=10, seed=1,
             timeout_minutes=10, compile=False)


def target_of(src: np.ndarray) -> np.ndarray:
    """The synthetic translation: every id shifted by one within the vocabulary, in reverse order."""
    return ((src - FIRST_ID + 1) % (VOCAB - FIRST_ID) + FIRST_ID)[::-1]


def write_split(directory: Path, split: str, sentences: list[np.ndarray], lang: str) -> None:
    ids_path, offsets_path = split_paths(directory, split, lang)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(OFFSET_DTYPE)
    np.concatenate(sentences).astype(ID_DTYPE).tofile(ids_path)
    offsets.tofile(offsets_path)


def bucket(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged by length: pairs sorted by longest side (+ EOS/BOS), cut where n x longest would exceed max_tokens."""
    L = np.maximum(src_lens, tgt_lens) + 1
    index = np.argsort(L, kind="stable")
    bounds, n = [0], 0
    for i, row in enumerate(index):
        n += 1
        if n * L[row] > max_tokens:
            bounds.append(i)
            n = 1
    bounds.append(len(index))
    return index.astype(np.int64), np.asarray(bounds, dtype=np.int64)


def write_corpus(root: Path, n_train: int = 40, n_valid: int = 8, max_len: int = 7, max_tokens: int = 24,
                 seed: int = 0) -> tuple[Path, Path]:
    """Write root/tokenized and root/batches; returns their paths."""
    rng = np.random.default_rng(seed)
    tokenized, batches = root / "tokenized", root / "batches"
    tokenized.mkdir(parents=True)
    batches.mkdir(parents=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        src = [rng.integers(FIRST_ID, VOCAB, size=rng.integers(1, max_len + 1)) for _ in range(n)]
        tgt = [target_of(s) for s in src]
        write_split(tokenized, split, src, "en")
        write_split(tokenized, split, tgt, "de")
        if split != "test":
            index, bounds = bucket(np.array([len(s) for s in src]), np.array([len(t) for t in tgt]), max_tokens)
            index_path, bounds_path = batch_paths(batches, split)
            np.save(index_path, index)
            np.save(bounds_path, bounds)
    meta = {"vocab_size": VOCAB, "src_lang": "en", "tgt_lang": "de", "lines": {"train": n_train, "valid": n_valid}}
    (tokenized / "meta.json").write_text(json.dumps(meta))
    (tokenized / "spm.model").write_bytes(b"not a real sentencepiece model")
    return tokenized, batches


def write_params(path: Path, max_tokens: int = 24, model: dict | None = None, **train) -> Path:
    """A params file with the sections the train stage reads (and data.name for tracking)."""
    params = {"model": {**MODEL, **(model or {})}, "train": {**TRAIN, **train},
              "batch": {"max_tokens": max_tokens, "seed": 1}, "data": {"name": "synthetic"}}
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def stage_args(root: Path, params: Path) -> list[str]:
    """Command-line arguments of the train stage over root's corpus."""
    return ["--tokenized", str(root / "tokenized"), "--batches", str(root / "batches"),
            "--checkpoints", str(root / "checkpoints"), "--metrics", str(root / "metrics" / "train.json"),
            "--plot", str(root / "plots" / "train.csv"), "--params", str(params)]


def run_stage(root: Path, params: Path) -> dict:
    """The train stage, in process, over root's corpus; its metrics."""
    from stages import train

    train.main(stage_args(root, params))
    return json.loads((root / "metrics" / "train.json").read_text())


def last_checkpoint(root: Path) -> dict:
    """The newest complete checkpoint under root/checkpoints."""
    return load_checkpoint(complete_checkpoints(root / "checkpoints")[-1])


def final_weights(root: Path) -> dict:
    return last_checkpoint(root)["model"]


def stage_env(**extra: str) -> dict[str, str]:
    """Environment for a stage subprocess: the repo importable, and one thread (as the in-process runs and the
    one-core subprocesses they are compared with) whatever the shell exports, unless `extra` says otherwise."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def torchrun(root: Path, params: Path, nproc: int, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run the train stage as dvc.yaml does: torchrun --standalone --nproc_per_node=nproc -m stages.train."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "stages.train", *stage_args(root, params)]
    return subprocess.run(cmd, cwd=ROOT, env=stage_env(**env), capture_output=True, text=True, timeout=timeout)
