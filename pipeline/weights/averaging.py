"""Checkpoint averaging (Sec. 6.1): the parameter-wise mean of the newest complete checkpoints.

    averaged, paths = average_checkpoints(directory, last_n)   # {"model", "steps", "params_hash", "code_hash",
                                                               #  "model_config", "vocab_size"}, oldest first
    paths = select_checkpoints(directory, last_n)   # which ones average_checkpoints takes (tools.inspect)

Loaded one at a time, newest first, each file read once: its bytes checked
against its sidecar and then loaded (pipeline/weights/checkpoint.py,
newest_sealed), so what is averaged is what was verified; truncated, corrupt or
unsealed files are skipped with a warning, and files older than the last_n
taken are never read. Summed in float64 and cast back to each tensor's dtype,
so one checkpoint gives back its weights bit for bit. Checkpoints that disagree
in their tensors' names or shapes, their params_hash, the code that trained
them (code_hash; whatever RESUME_ACROSS_CODE_CHANGE allowed training to resume),
model_config or vocab_size are refused (AverageError), naming the files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pipeline.progress import progress_bar

from pipeline.weights.checkpoint import is_complete, newest_sealed, step_files
from pipeline.core.errors import PipelineError
from pipeline.core.files import InputError
from pipeline.weights.fingerprint import changed_files

log = logging.getLogger(__name__)

# must agree between averaged checkpoints: the same params and data, and the same code (pipeline/weights/fingerprint.py)
HEADER_KEYS = ("params_hash", "code_hash", "model_config", "vocab_size")


class AverageError(PipelineError):
    """The checkpoints cannot be averaged; the message names the files and what differs."""


def too_few(directory: Path, last_n: int, complete: list[Path]) -> AverageError:
    found = ", ".join(p.name for p in complete) or "none"
    return AverageError(f"{directory}: average.last_n = {last_n} but only {len(complete)} complete checkpoint(s) "
                        f"({found}); train longer, keep more (train.keep_checkpoints) or lower average.last_n")


def select_checkpoints(directory: Path, last_n: int) -> list[Path]:
    """The newest `last_n` complete checkpoints, oldest first (sha256 checked newest first, older ones not read)."""
    if not directory.is_dir():
        raise InputError(f"{directory}: missing; run the train stage first")
    complete = []
    for _, path in reversed(step_files(directory)):
        if len(complete) == last_n:
            break
        if (problem := is_complete(path)) is None:
            complete.insert(0, path)
        else:
            log.warning("skipping checkpoint %s: %s", path, problem)
    if len(complete) < last_n:
        raise too_few(directory, last_n, complete)
    return complete


def layout(ckpt: dict) -> dict:
    """What must agree between averaged checkpoints: the header and each tensor's dtype and shape."""
    tensors = {name: (t.dtype, list(t.shape)) for name, t in ckpt["model"].items()}
    return {**{key: ckpt.get(key) for key in HEADER_KEYS}, "code": ckpt.get("code"), "tensors": tensors}


def mismatch(a: dict, b: dict) -> str | None:
    """What differs between two layouts, or None."""
    if a["code_hash"] != b["code_hash"]:
        files = changed_files(a["code"], b["code"] or {}) if a["code"] is not None else ["every file (no code recorded)"]
        return f"made by different code ({', '.join(files)} differ)"
    for key in HEADER_KEYS:
        if a[key] != b[key]:
            return f"{key} differs ({a[key]!r} vs {b[key]!r})"
    only_a = sorted(a["tensors"].keys() - b["tensors"].keys())
    only_b = sorted(b["tensors"].keys() - a["tensors"].keys())
    if only_a or only_b:
        return f"tensor names differ (only in the first: {only_a}; only in the second: {only_b})"
    for name, (dtype, shape) in a["tensors"].items():
        if (dtype, shape) != b["tensors"][name]:
            return f"{name} is {dtype} {shape} vs {b['tensors'][name][0]} {b['tensors'][name][1]}"
    return None


def average_checkpoints(directory: Path, last_n: int) -> tuple[dict, list[Path]]:
    """The averaged model of the newest `last_n` complete checkpoints (the mean of each tensor, accumulated in
    float64), and their paths, oldest first."""
    if not directory.is_dir():
        raise InputError(f"{directory}: missing; run the train stage first")
    first: dict = {}
    sums: dict[str, torch.Tensor] = {}
    paths: list[Path] = []
    steps: list[int] = []
    with progress_bar(total=last_n, desc="average", unit="checkpoint") as bar:
        for path, ckpt in newest_sealed(directory):
            if not first:
                first = layout(ckpt)
                sums = {name: t.to(torch.float64, copy=True) for name, t in ckpt["model"].items()}
            elif problem := mismatch(layout(ckpt), first):  # older vs newer, as the files go
                raise AverageError(f"cannot average {path} with {paths[-1]}: {problem}")
            else:
                for name, t in ckpt["model"].items():
                    sums[name] += t.to(torch.float64)
            paths.insert(0, path)
            steps.insert(0, int(ckpt["step"]))
            del ckpt
            bar.update(1)
            if len(paths) == last_n:
                break
    if len(paths) < last_n:
        raise too_few(directory, last_n, paths)
    model = {name: (s / len(paths)).to(first["tensors"][name][0]) for name, s in sums.items()}
    return {"model": model, "steps": steps, **{key: first[key] for key in HEADER_KEYS}}, paths
