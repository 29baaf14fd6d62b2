"""Which kernels F.scaled_dot_product_attention runs on CUDA (model/transformer.py, MultiHeadAttention.attend).

torch picks, for each call, the first backend in its priority order that is enabled and takes the call. On Hopper
it prefers cuDNN's, which builds a new plan for every new (batch, length) shape: ~9 ms of CPU per call, 144 calls
per base step, so that on an H100 (torch 2.11) a step took 3.95 s with the GPU busy for 87 ms of it; without cuDNN
the same Trainer.step trained 6.7x faster (49,631 against 7,378 tokens/s). Our batches come in many shapes, so
training and decoding use, in this order:

    flash      no attn_mask, only is_causal: the decoder's self-attention
    efficient  any mask: the padding masks of the encoder's self-attention and of cross-attention
    math       everything

and no cuDNN. TRANSFORMER_SDPA_BACKENDS (a comma list of cudnn, flash, efficient, math, in priority order) replaces
that list, for a GPU where other kernels measured faster. On a CPU nothing changes, torch's default CPU kernels (the
variable is checked, not applied), unless oneDNN computes the process's matrix products (bf16 on AMX, or fp32:
pipeline/device/cpu_matmul.py): then the math kernel: with oneDNN's products torch's flash kernel for CPUs made the
default's training step slower than torch's BLAS, the math kernel faster (bench.cpu.matmul, docs/benchmarks.md).

    description = attention.use(device)   # once per process (the Trainer, the translate stage): log it
    with attention.kernels(device): ...   # the same, for a block only
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.core.config import ParamsError

ENV = "TRANSFORMER_SDPA_BACKENDS"
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
DEFAULT = ("flash", "efficient", "math")
CPU = "torch's default CPU kernels"
CPU_ONEDNN = ("math",)  # a CPU whose matrix products oneDNN computes (bf16 on AMX, or fp32)

_process = contextlib.ExitStack()  # what use() entered, held until the process ends
_process_choice: tuple[str, ...] | None = None


def overridden() -> tuple[str, ...] | None:
    """The backends $TRANSFORMER_SDPA_BACKENDS names, in its order, or None when it is unset or empty."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    names = [name.strip().lower() for name in raw.split(",")]
    bad = [name for name in names if name not in BACKENDS]
    if bad:
        raise ParamsError(f"{ENV}={raw!r}: {', '.join(repr(b) for b in bad)} is not a backend; set it to a comma list of "
                          f"{', '.join(BACKENDS)} in priority order (e.g. {','.join(DEFAULT)}), or unset it")
    return tuple(dict.fromkeys(names))


def choice(device: torch.device) -> tuple[str, ...] | None:
    """The backends, in priority order, that attention on `device` runs under; None: torch's default (CPUs)."""
    named = overridden()  # a bad value fails on every device, so a typo shows before the GPU run
    if device.type != "cuda":
        return CPU_ONEDNN if torch.backends.mkldnn.matmul.fp32_precision == "bf16" else None
    return named or DEFAULT


def has_priority() -> bool:
    """Whether this torch's sdpa_kernel takes set_priority (the order, not only the set, of the backends)."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def describe(names: tuple[str, ...] | None, device: torch.device | None = None) -> str:
    """One line for the log: the backends and why (`names` from choice(device); a device other than CUDA: a CPU's)."""
    if names is None or (device is not None and device.type != "cuda"):
        cpu = CPU if names is None else "torch's math kernel on a CPU with oneDNN's matrix products"
        return cpu + (f" ({ENV} applies to CUDA GPUs only)" if overridden() else "")
    order = "in that order" if has_priority() else "enabled, in torch's own order (this torch has no set_priority)"
    why = (f"{ENV} overrides" if names == DEFAULT else f"from {ENV}")
    cudnn = "" if "cudnn" in names else "cuDNN off: it builds a plan per new shape; "
    return f"scaled_dot_product_attention backends {', '.join(names)} {order} ({cudnn}{why})"


@contextlib.contextmanager
def kernels(device: torch.device) -> Iterator[str]:
    """Run the block under choice(device)'s backends (nothing changes on a CPU); yields describe's line."""
    names = choice(device)
    if names is None:
        yield describe(names, device)
        return
    priority = {"set_priority": True} if has_priority() else {}
    with sdpa_kernel([BACKENDS[n] for n in names], **priority):
        yield describe(names, device)


def use(device: torch.device) -> str:
    """Apply choice(device) for the rest of this process (the backend flags are process-wide); returns describe's line.

    Calling it again with the same choice changes nothing; with another (the variable changed), the other applies.
    """
    global _process_choice
    names = choice(device)
    if names != _process_choice:
        _process.close()
        if names is not None:
            _process.enter_context(kernels(device))
        _process_choice = names
    return describe(names, device)
