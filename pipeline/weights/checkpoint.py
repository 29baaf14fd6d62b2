"""Training checkpoints: atomic `step_XXXXXXXX.pt` files, each sealed by a sha256 sidecar.

    save_checkpoint(directory, payload, keep) -> Path     # write, seal, keep the newest `keep`
    complete_checkpoints(directory) -> list[Path]         # sealed and intact, oldest step first (reads them all)
    load_checkpoint(path) -> dict                         # torch.load(weights_only=True)
    load_sealed(path) -> dict                             # read once: checked against its sidecar, then loaded
    newest_sealed(directory) -> Iterator[(Path, dict)]    # newest first, each read once, broken ones skipped
    save_sealed(path, payload)                            # write, then seal (the average stage's model.pt too)
    load_averaged(model_dir) -> dict                      # the average stage's model.pt, checked against its seal
    load_model(model_dir, device) -> Transformer          # the same, ready to translate
    resume_point(directory, params_hash, code, ...) -> Resume | None  # what a restarted run continues from
    fingerprint(obj, files) -> str                        # sha256 of a JSON-able object and files
    capture_rng() -> dict / restore_rng(state)            # torch (CPU, CUDA), numpy, random

A checkpoint is the .pt file (written through pipeline.core.files.atomic_file) plus,
written after it, `step_XXXXXXXX.pt.sha256` in `sha256sum` format. It counts
only when both exist and the file's digest matches the sidecar: a kill between
the two writes, a truncated copy or a flipped byte leaves a file that
complete_checkpoints() skips with a warning naming it. Payloads hold only what
`torch.load(weights_only=True)` accepts: tensors, numbers, strings, None, and
lists and dicts of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
import shutil
import time
from pathlib import Path
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

import numpy as np
import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.weights import faults
from pipeline.core import signals
from pipeline.core.errors import PipelineError
from pipeline.core.files import InputError, atomic_file, file_sha256, sidecar, write_text
from pipeline.weights.fingerprint import changed_files

log = logging.getLogger(__name__)

ACROSS_CODE_CHANGE_ENV = "RESUME_ACROSS_CODE_CHANGE"  # =1: resume checkpoints of other code (recorded)
NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(PipelineError):
    """A checkpoint cannot be read; the message names the file."""


class _HashingWriter:
    """A write-only file object that hashes everything written through it."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def step_files(directory: str | Path) -> list[tuple[int, Path]]:
    """Every `step_XXXXXXXX.pt` in `directory` (sealed or not) as (step, path), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def save_checkpoint(directory: str | Path, payload: dict, keep: int) -> Path:
    """Write payload["step"]'s checkpoint atomically, then its sidecar; delete all but the newest `keep`."""
    if keep < 1:
        raise ValueError(f"save_checkpoint: keep must be at least 1, got {keep}")
    path = Path(directory) / checkpoint_name(int(payload["step"]))
    with signals.held():  # Ctrl-C inside torch.save's write callback would become its RuntimeError
        save_sealed(path, payload, int(payload["step"]))
        for _, old in step_files(directory)[:-keep]:
            old.unlink(missing_ok=True)
            sidecar(old).unlink(missing_ok=True)
    return path


def save_sealed(path: Path, payload: dict, step: int | None = None) -> None:
    """torch.save `payload` to `path` atomically, then its sidecar (the same bytes, hashed as written)."""
    with atomic_file(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(payload, writer)
        if step is not None:
            faults.inject("checkpoint_write", step)  # tests only: killed, temporary file unrenamed
    write_text(sidecar(path), f"{writer.sha.hexdigest()}  {path.name}\n")


class UnsealedCheckpoint(CheckpointError):
    """A checkpoint without its sidecar, or whose bytes do not match it; the message says which."""


def _seal_problem(path: Path, data: bytes | None = None) -> str | None:
    """Why `path` is not sealed (no sidecar, or the sha256 of its bytes, `data` if given, differs from the
    sidecar's), else None. The file is read only when it has a sidecar."""
    seal = sidecar(path)
    if not seal.exists():
        return f"no {seal.name} (interrupted while saving?)"
    expected = seal.read_text(encoding="utf-8").split()[:1]
    actual = file_sha256(path) if data is None else hashlib.sha256(data).hexdigest()
    if expected != [actual]:
        return f"sha256 {actual[:12]}... does not match {seal.name} (truncated or corrupt)"
    return None


def is_complete(path: Path) -> str | None:
    """None when `path` and its sidecar agree, else why not (for the warning)."""
    return _seal_problem(path)


def load_sealed(path: Path) -> dict:
    """The payload of a sealed checkpoint, its bytes read once: hashed, checked against the sidecar, then loaded
    from memory (what is loaded is what was checked). UnsealedCheckpoint when it is not sealed."""
    data = path.read_bytes() if sidecar(path).exists() else b""
    problem = _seal_problem(path, data)
    if problem is not None:
        raise UnsealedCheckpoint(problem)
    return load_checkpoint(io.BytesIO(data), name=path)


def newest_sealed(directory: Path) -> Iterator[tuple[Path, dict]]:
    """Sealed checkpoints of `directory` and their payloads, newest first, each read once when asked for (a resume
    reads one, the average stage average.last_n); the broken ones on the way are skipped with a warning."""
    for _, path in reversed(step_files(directory)):
        try:
            yield path, load_sealed(path)
        except UnsealedCheckpoint as e:
            log.warning("skipping checkpoint %s: %s", path, e)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Sealed, intact checkpoints in `directory`, oldest step first; others are skipped with a warning."""
    complete = []
    for _, path in step_files(directory):
        problem = is_complete(path)
        if problem is None:
            complete.append(path)
        else:
            log.warning("skipping checkpoint %s: %s", path, problem)
    return complete


def load_checkpoint(path: str | Path | BinaryIO, name: str | Path | None = None) -> dict:
    """Load a checkpoint onto the CPU with torch.load(weights_only=True); errors name the file (`name` for a buffer)."""
    source = path if isinstance(path, io.IOBase) else Path(path)
    path = Path(name) if name is not None else source
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load checkpoint: {_reason(e)}") from e
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"{path}: not a training checkpoint (expected a dict with 'model')")
    return payload


def _reason(e: Exception) -> str:
    """torch.load's error in one line: for a weights_only refusal, what it refused (its message runs to ten lines)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        refused = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0].split(". ")[0]
        text = f"weights only load failed: {refused} (not a checkpoint of this pipeline, or a corrupt one)"
    return " ".join(text.split()) or f"{type(e).__name__} (an empty or truncated file?)"


def load_averaged(model_dir: str | Path) -> dict:
    """The average stage's <model_dir>/model.pt, read once and checked against its seal (model.pt.sha256)."""
    path = Path(model_dir) / "model.pt"
    if not path.exists():
        raise InputError(f"{path}: missing; run the average stage first")
    try:
        return load_sealed(path)
    except UnsealedCheckpoint as e:
        raise CheckpointError(f"{path}: {e}; run `dvc repro average` (or python -m stages.average)") from None


def load_model(model_dir: str | Path, device: torch.device, saved: dict | None = None) -> Transformer:
    """The averaged model of <model_dir>/model.pt (the average stage's output; `saved`: its payload, already read by
    load_averaged), in eval mode on `device`."""
    saved, path = saved or load_averaged(model_dir), Path(model_dir) / "model.pt"
    try:
        model = Transformer(ModelConfig(**saved["model_config"]), saved["vocab_size"])
        model.load_state_dict(saved["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a model the average stage wrote ({type(e).__name__}: {e})") from e
    return model.to(device).eval()


class OtherPrecision(CheckpointError):
    """The newest checkpoint was trained in another precision than this machine resolves (resume_point)."""

    def __init__(self, path: Path, key: str, label: str):
        super().__init__(f"{path} trained in {label}")
        self.path, self.key, self.label = path, key, label


class Resume(NamedTuple):
    """What a restarted run continues from; `code_changed` lists the files whose code differs (empty: none)."""

    path: Path
    payload: dict
    code_changed: list[str]


def newest_complete(directory: Path) -> tuple[Path, dict] | None:
    """The newest sealed, intact checkpoint and its payload; only files newer than it are read (and skipped with
    a warning), so a resume reads one checkpoint, once, not every kept one."""
    return next(newest_sealed(directory), None)


def resume_point(directory: str | Path, params_hash: str, code: dict[str, str],
                 across_code_change: bool = False, precision: str | None = None,
                 optimizer: str | None = None) -> Resume | None:
    """The newest complete checkpoint if it has `params_hash` and was made by the same `code`
    (pipeline/weights/fingerprint.py); else set every checkpoint aside and return None.

    A checkpoint that records another `precision` (the key the trainer's device resolved,
    which params_hash holds too) raises OtherPrecision and moves nothing: a run is not thrown
    away because it met a machine that computes otherwise. One trained with another `optimizer`
    (train.optimizer, which params_hash holds) is set aside as one of other params is, the line
    naming both optimizers: Adam's moments are not Muon's momentum.

    Checkpoints of other code are resumed only with `across_code_change`, and then
    Resume.code_changed names the files that differ. Unsealed or corrupt files
    newer than the one resumed are deleted (a run would overwrite them anyway,
    and they would outlive newer ones in the rotation). When nothing can be
    resumed, all step files move to `<directory>.stale/<time>/`, logged in one
    line saying why, so a fresh run starts from an empty directory; only that
    last set is kept: what earlier changes set aside is deleted, logged (each
    set is a run's worth of checkpoints: ~800 MB for the base model).
    """
    directory = Path(directory)
    for tmp in directory.glob(".step_*.tmp") if directory.is_dir() else []:  # a write killed before its rename
        log.warning("removing %s, left by an interrupted checkpoint write", tmp)
        tmp.unlink()
    found = newest_complete(directory)
    why = "no complete checkpoint to resume"
    if found is not None:
        newest, payload = found
        changed = changed_files(payload.get("code"), code)
        theirs = payload.get("precision") or {}
        if precision is not None and theirs.get("key", precision) != precision:
            raise OtherPrecision(newest, theirs["key"], theirs.get("label", theirs["key"]))
        trained_with = payload.get("optimizer_name", "adam")  # a checkpoint without it predates Muon
        if optimizer is not None and trained_with != optimizer:
            why = (f"params changed ({newest.name} was trained with train.optimizer = {trained_with}, and this run "
                   f"asks for {optimizer}: one optimizer's state cannot resume the other)")
        elif payload.get("params_hash") != params_hash:
            why = f"params changed (params_hash of {newest.name} differs)"
        elif changed and not across_code_change:
            why = (f"code changed since {newest.name} ({', '.join(changed)} differ{'s' if len(changed) == 1 else ''}; "
                   f"{ACROSS_CODE_CHANGE_ENV}=1 resumes anyway)")
        else:
            for _, path in step_files(directory):
                if path.name > newest.name:
                    log.warning("removing incomplete checkpoint %s (newer than %s)", path, newest.name)
                    path.unlink()
                    sidecar(path).unlink(missing_ok=True)
            return Resume(newest, payload, changed)
    set_aside(directory, why)
    return None


def set_aside(directory: Path, why: str) -> None:
    """Move every step file of `directory` to `<directory>.stale/<time>/` (deleting earlier sets), logging why."""
    old = step_files(directory)
    if not old:
        return
    stale = directory.with_name(f"{directory.name}.stale")
    for earlier in sorted(stale.iterdir()) if stale.is_dir() else []:
        log.warning("deleting %s, set aside by an earlier change (only the last set is kept)", earlier)
        if earlier.is_dir() and not earlier.is_symlink():
            shutil.rmtree(earlier)
        else:
            earlier.unlink()
    aside = stale / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for _, path in old:
        for p in (path, sidecar(path)):
            if p.exists():
                shutil.move(str(p), aside / p.name)
    log.warning("%s: starting afresh; moved %d old checkpoint(s) from %s to %s", why, len(old), directory, aside)


def fingerprint(obj: object, files: list[Path]) -> str:
    """sha256 of a JSON-able object (keys sorted) and the names and contents of `files`."""
    sha = hashlib.sha256(json.dumps(obj, sort_keys=True).encode())
    for path in files:
        sha.update(f"\0{Path(path).name}\0{file_sha256(path)}".encode())
    return sha.hexdigest()


def capture_rng() -> dict:
    """Every random generator training touches, as weights_only-loadable values."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    rng = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rank_rng(rngs: list[dict], rank: int, world: int, seed: int, step: int) -> bool:
    """This rank's RNGs from a checkpoint's per-rank states; True if restored exactly.

    A checkpoint of another world size has no state for this rank's place in
    the new run: torch's RNG (dropout) is then seeded from (seed, step, rank),
    the same on every resume of that checkpoint, and False is returned.
    """
    if len(rngs) == world:
        restore_rng(rngs[rank])
        return True
    torch.manual_seed(int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0]))
    return False


def restore_rng(rng: dict) -> None:
    """Put back what capture_rng() returned."""
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = rng["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
