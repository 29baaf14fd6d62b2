"""Checkpoint averaging (Sec. 6.1): the parameter-wise mean of the newest complete checkpoints.

    paths = select_checkpoints(directory, last_n)   # oldest first; truncated or unsealed files skipped
    averaged = average_checkpoints(paths)           # {"model", "steps", "params_hash", "code_hash", "model_config", "vocab_size"}

Loaded one at a time, summed in float64 and cast back to each tensor's dtype,
so one checkpoint gives back its weights bit for bit. Checkpoints that disagree
in their tensors' names or shapes, their params_hash, the code that trained
them (code_hash; whatever RESUME_ACROSS_CODE_CHANGE allowed training to resume),
model_config or vocab_size are refused (AverageError), naming the files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pipeline.progress import progress_bar

from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint
from pipeline.core.errors import PipelineError
from pipeline.core.files import InputError
from pipeline.weights.fingerprint import changed_files

# must agree between averaged checkpoints: the same params and data, and the same code (pipeline/weights/fingerprint.py)
HEADER_KEYS = ("params_hash", "code_hash", "model_config", "vocab_size")


class AverageError(PipelineError):
    """The checkpoints cannot be averaged; the message names the files and what differs."""


def select_checkpoints(directory: Path, last_n: int) -> list[Path]:
    """The newest `last_n` complete checkpoints, oldest first."""
    if not directory.is_dir():
        raise InputError(f"{directory}: missing; run the train stage first")
    complete = complete_checkpoints(directory)
    if len(complete) < last_n:
        found = ", ".join(p.name for p in complete) or "none"
        raise AverageError(
            f"{directory}: average.last_n = {last_n} but only {len(complete)} complete checkpoint(s) ({found}); "
            "train longer, keep more (train.keep_checkpoints) or lower average.last_n"
        )
    return complete[-last_n:]


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


def average_checkpoints(paths: list[Path]) -> dict:
    """The averaged model: the mean of each tensor over `paths`, accumulated in float64."""
    first: dict = {}
    sums: dict[str, torch.Tensor] = {}
    steps = []
    for path in progress_bar(paths, desc="average", unit="checkpoint"):
        ckpt = load_checkpoint(path)
        if not first:
            first = layout(ckpt)
            sums = {name: t.to(torch.float64, copy=True) for name, t in ckpt["model"].items()}
        elif problem := mismatch(first, layout(ckpt)):
            raise AverageError(f"cannot average {paths[0]} with {path}: {problem}")
        else:
            for name, t in ckpt["model"].items():
                sums[name] += t.to(torch.float64)
        steps.append(int(ckpt["step"]))
        del ckpt
    model = {name: (s / len(paths)).to(first["tensors"][name][0]) for name, s in sums.items()}
    return {"model": model, "steps": steps, **{key: first[key] for key in HEADER_KEYS}}
