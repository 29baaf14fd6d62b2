"""train.cpu_matmul: the precision of a CPU's matrix products in training.

    choice = cpu_matmul.choose(train_cfg.cpu_matmul, device)   # "fp32" or "bf16"; fails where bf16 cannot run
    cpu_matmul.use(choice)                                      # for the rest of this process (the flag is global)

  fp32  the paper's precision: every product in fp32 (torch's default).
  bf16  the weights, activations, gradients and Adam stay fp32; oneDNN rounds
        the inputs of each matrix product to bf16 and accumulates in fp32
        (torch.backends.mkldnn.matmul.fp32_precision = "bf16"), on the CPU's
        AMX tiles. Only on a CPU with AMX (the amx_bf16 flag of /proc/cpuinfo),
        the only kind measured faster; a CPU without it fails with one line.
  auto  bf16 on a CPU with AMX, fp32 on any other; a GPU ignores the setting
        (it trains under autocast: distributed.mixed_precision).

Under bf16 a CPU's attention runs torch's math kernel (pipeline/training/attention.py):
with bf16 products torch's flash kernel for CPUs is slower than the math one, and
slower than fp32 products (bench.cpu_matmul). The choice depends on the CPU and is
recorded (`precision` in metrics/train.json and MLflow); the same machine with the same
params and code trains the same weights. Speed and BLEU: docs/benchmarks.md, docs/results.md.
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch

from pipeline.core.config import ParamsError, TrainConfig
from pipeline.training.peak import AMX_BF16_FLAG as AMX_FLAG, cpuinfo

SETTINGS = next(f for f in fields(TrainConfig) if f.name == "cpu_matmul").metadata["choices"]  # one list: the field's
# oneDNN compiles a bf16 product's kernel (a primitive) per shape and keeps 1024 of them by default; the default's 217
# batch shapes need more, and recompiling evicted ones made its training slower than fp32 (docs/benchmarks.md).
# Read once, when oneDNN first builds a primitive in the process; a value set outside wins. Speed only: an evicted
# primitive is rebuilt the same, so the weights do not depend on it.
PRIMITIVE_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")


def has_amx(text: str | None = None) -> bool:
    """Whether this CPU (or a /proc/cpuinfo `text`) has AMX's bf16 tiles."""
    return AMX_FLAG in (cpuinfo("flags", text) or "").split()


def choose(setting: str, device: torch.device, text: str | None = None) -> str:
    """The products' precision for train.cpu_matmul = `setting` on `device`: "fp32" or "bf16"."""
    if setting not in SETTINGS:
        raise ParamsError(f"train.cpu_matmul = {setting!r}: expected one of {', '.join(map(repr, SETTINGS))}")
    if device.type != "cpu" or setting == "fp32":
        return "fp32"
    if has_amx(text):
        return "bf16"
    if setting == "bf16":
        raise ParamsError(f"train.cpu_matmul = 'bf16': this CPU has no AMX ({AMX_FLAG} is not among the flags of "
                          "/proc/cpuinfo), so bf16 products would only be slower; set it to 'auto' or 'fp32'")
    return "fp32"


def use(choice: str) -> None:
    """Apply `choice` ("fp32" or "bf16") to this process's CPU matrix products until the next call (torch's flag
    is process-wide; pipeline/training/attention.py reads it)."""
    if choice not in ("fp32", "bf16"):
        raise ValueError(f"cpu_matmul.use: expected 'fp32' or 'bf16', got {choice!r}")
    if choice == "bf16":
        os.environ.setdefault(*PRIMITIVE_CACHE)
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if choice == "bf16" else "none"


def describe(choice: str) -> str:
    """The `precision` of metrics/train.json and MLflow for a CPU run."""
    return "fp32, bf16 matrix products (AMX)" if choice == "bf16" else "fp32"
