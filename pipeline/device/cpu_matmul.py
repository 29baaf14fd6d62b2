"""train.cpu_matmul: the precision of a CPU's matrix products in training, and whose kernels compute them.

    choice = cpu_matmul.choose(train_cfg.cpu_matmul, device)   # "fp32", "onednn", "bf16" or "autocast"; fails where
                                                                # bf16 cannot run
    cpu_matmul.use(choice)                                      # for the rest of this process (the flag is global)
    cpu.cpu_class()                                             # the CPU's model and the class that decides the choice

A run takes these through its Precision (pipeline/device/precision.py), resolved once.

Settings:
  fp32  the paper's precision: every product in fp32, by the fastest fp32 kernels measured on this CPU: oneDNN's
        on a CPU with AVX-512 and without AMX (an AMD EPYC with AVX-512: 2.1 to 3.0 times as fast a product as
        MKL's, 1.6x the train stage's steps), torch's BLAS (MKL) on any other.
  blas  fp32 by torch's BLAS (MKL) on every CPU: torch's default.
  bf16  bf16 matrix products, the weights and Adam fp32. On a CPU with AMX (the amx_bf16 flag of /proc/cpuinfo)
        oneDNN rounds each product's inputs to bf16 and accumulates in fp32 on the AMX tiles, the activations
        and gradients stay fp32. On a CPU with AVX-512 BF16 (avx512_bf16) and without AMX, where torch's flag
        leaves oneDNN's products fp32, the step runs under torch.autocast(bf16) ("autocast"): the products'
        inputs and outputs bf16, by oneDNN's avx512_bf16 kernels (an AMD EPYC with AVX-512: about twice as
        fast a product as oneDNN's fp32, 1.18x the default's step). A CPU with neither fails with one line.
  auto  bf16 on a CPU with AMX or AVX-512 BF16, else what fp32 chooses; a GPU ignores the setting (it trains under
        autocast: pipeline/device/precision.py).
  autocast  bf16 autocast on a CPU with AVX-512 BF16 and without AMX, else what fp32 chooses (AMX's bf16 products
        cost the default valid BLEU: docs/results.md).

oneDNN computes a process's fp32 products only when torch's flag allows it bf16
(torch.backends.mkldnn.matmul.fp32_precision = "bf16"): on AMX it then rounds them, on a CPU
without it (oneDNN 3.x) its AVX-512 kernels keep them fp32. Where fp32 chooses oneDNN, one
product is checked first: if oneDNN rounded it (another oneDNN, another CPU), the run keeps
torch's BLAS and says so. Under oneDNN a CPU's attention runs torch's math kernel
(pipeline/device/attention.py): there torch's flash kernel for CPUs is slower than the math
one, and slower than torch's BLAS (bench.cpu.matmul). The choice changes how a step computes,
never what it trains: pipeline/device/precision.py turns it into the run's Precision, which
params_hash, metrics/train.json and MLflow record; the same machine with the same params and
code trains the same weights. Speed and BLEU: docs/benchmarks.md, docs/results.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields

import torch

from pipeline.core.config import ParamsError, TrainConfig
from pipeline.device import cpu

log = logging.getLogger(__name__)

SETTINGS = next(f for f in fields(TrainConfig) if f.name == "cpu_matmul").metadata["choices"]  # one list: the field's
# oneDNN compiles a product's kernel (a primitive) per shape and keeps 1024 of them by default; the default's 217
# batch shapes need more, and recompiling evicted ones made its bf16 training slower than fp32 (docs/benchmarks.md).
# Read once, when oneDNN first builds a primitive in the process; a value set outside wins. Speed only: an evicted
# primitive is rebuilt the same, so the weights do not depend on it.
PRIMITIVE_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
CHOICES = ("fp32", "onednn", "bf16", "autocast")  # choose()'s answers: fp32 by torch's BLAS, fp32 by oneDNN, bf16
# products on AMX, bf16 autocast on AVX-512 BF16


def onednn_keeps_fp32() -> bool:
    """Whether oneDNN, allowed bf16, computes a product in fp32 on this CPU: one 64 x 256 by 256 x 64 product
    against its float64 value (fp32 rounding is ~1e-5 there; bf16 inputs' is ~0.1)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=generator), torch.randn(256, 64, generator=generator)
    before = torch.backends.mkldnn.matmul.fp32_precision
    os.environ.setdefault(*PRIMITIVE_CACHE)
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        product = a @ b
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    return float((product.double() - a.double() @ b.double()).abs().max()) < 1e-3


def choose(setting: str, device: torch.device, text: str | None = None) -> str:
    """What computes the products for train.cpu_matmul = `setting` on `device` (one of CHOICES): "fp32" (torch's
    BLAS), "onednn" (fp32 by oneDNN), "bf16" (AMX) or "autocast" (bf16 autocast, AVX-512 BF16)."""
    if setting not in SETTINGS:
        raise ParamsError(f"train.cpu_matmul = {setting!r}: expected one of {', '.join(map(repr, SETTINGS))}")
    if device.type != "cpu":
        return "fp32"
    amx, onednn = cpu.has_amx(text), torch.backends.mkldnn.is_available()
    if setting in ("bf16", "auto") and amx:
        return "bf16"
    if setting in ("bf16", "auto", "autocast") and not amx and cpu.has_avx512_bf16(text) and onednn:
        return "autocast"
    if setting == "bf16":
        raise ParamsError(f"train.cpu_matmul = 'bf16': this CPU has neither AMX nor AVX-512 BF16 ({cpu.AMX_BF16}, "
                          f"{cpu.AVX512_BF16} are not among the flags of /proc/cpuinfo)"
                          + ("" if onednn else " or torch lacks oneDNN") + ", the native bf16 products it needs; "
                          "set it to 'auto' or 'fp32'")
    if setting == "blas" or amx or not cpu.has_avx512(text) or not onednn:
        return "fp32"
    if onednn_keeps_fp32():
        return "onednn"
    log.warning("oneDNN rounded a test product to bf16 on this CPU: its fp32 products stay on torch's BLAS")
    return "fp32"


def use(choice: str) -> None:
    """Apply `choice` (one of CHOICES) to this process's CPU matrix products until the next call (torch's flag
    is process-wide; pipeline/device/attention.py reads it)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_matmul.use: expected one of {', '.join(map(repr, CHOICES))}, got {choice!r}")
    if choice != "fp32":
        os.environ.setdefault(*PRIMITIVE_CACHE)
    torch.backends.mkldnn.matmul.fp32_precision = "none" if choice == "fp32" else "bf16"
