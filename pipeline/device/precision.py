"""The precision a run's training step computes in: resolved once from train.cpu_matmul and the device.

    p = precision.resolve(train_cfg.cpu_matmul, device)   # a Precision; fails with one line where it cannot run
    p.use()                                               # a CPU's products and attention kernels, this process
    with p.autocast(): ...                                # the step's autocast (none for fp32)
    scaler = p.grad_scaler()                              # enabled for fp16 only
    p.key      # hashed into params_hash: "fp32", "bf16 products", "bf16 autocast" or "fp16 autocast"
    p.label    # `precision` of metrics/train.json and MLflow: the key and whose kernels compute it
    p.peak     # the products' precision MFU is taken against: "fp32" or "bf16" (pipeline/device/peak.py)
    p.line()   # the line the train stage logs before training: the device class, the precision, how to force one

The hardware may change how a step is computed, never what is trained: the
recipe (loss terms, R-Drop, schedule, steps, data, model) is the params' alone,
on every machine. What the device resolved is part of the run's identity: its
key is in params_hash (a checkpoint of another precision is not resumed:
pipeline/training/run_checkpoints.py), its label in metrics/train.json and in
MLflow's params. Kernels of one precision (fp32 by torch's BLAS or by oneDNN)
only sum in another order, as torch.compile does: named in the label, not hashed.

CPUs: train.cpu_matmul (pipeline/device/cpu_matmul.py chooses the kernels by
the CPU's flags). GPUs: bf16 autocast where the GPU has bf16 (compute
capability 8.0+), fp16 autocast with a gradient scaler on 7.x, fp32 before
(autocast_dtype); train.cpu_matmul does not apply.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from model import flops as flops_lib
from pipeline.device import cpu, cpu_matmul

# A CPU choice (cpu_matmul.CHOICES): (key, label, autocast dtype, the products' precision for MFU)
CPU_CHOICES = {
    "fp32": ("fp32", "fp32", torch.float32, "fp32"),
    "onednn": ("fp32", "fp32 (oneDNN's matrix products)", torch.float32, "fp32"),
    "bf16": ("bf16 products", "fp32, bf16 matrix products (AMX)", torch.float32, "bf16"),
    "autocast": ("bf16 autocast", "fp32 weights, bf16 autocast (AVX-512 BF16)", torch.bfloat16, "bf16"),
}
GPU_LABELS = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast with a gradient scaler",
              torch.float32: "fp32"}
# train.cpu_matmul that makes a CPU compute in a key, where its flags allow (cpu_matmul.choose)
FORCES = {"fp32": "fp32", "bf16 products": "bf16 (a CPU with AMX)", "bf16 autocast": "autocast (a CPU with "
          "AVX-512 BF16 and no AMX)"}


@dataclass(frozen=True)
class Precision:
    """How this run's steps compute, as resolved on its device; every consumer takes this value."""

    device: str  # "cpu" or "cuda"
    machine: str  # the device class that decided it: cpu.cpu_class, or the GPU and its capability
    setting: str  # train.cpu_matmul as written
    products: str  # a CPU's choice (cpu_matmul.CHOICES); "gpu" on a GPU, whose products follow `dtype`
    dtype: torch.dtype  # the step's autocast dtype; fp32 = no autocast
    key: str  # what params_hash holds
    label: str  # what metrics/train.json and MLflow record
    peak: str  # "fp32" or "bf16": the products' rate MFU is taken against

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16 autocast)."""
        return self.dtype == torch.float16

    def use(self) -> None:
        """Apply a CPU's products (and the attention kernels that follow them) to this process; a GPU: nothing."""
        if self.device == "cpu":
            cpu_matmul.use(self.products)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a training step (and validation) runs in: torch.autocast in `dtype`, or none for fp32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """The gradient scaler of the step: enabled for fp16 only."""
        return torch.amp.GradScaler(self.device, enabled=self.scaled)

    def line(self) -> str:
        """One line for the log before training: what this machine is, what it computes in, how to force another."""
        if self.device != "cpu":
            return f"precision: {self.label} on {self.machine} (a GPU's own; train.cpu_matmul applies to CPUs only)"
        others = ", ".join(s for s in cpu_matmul.SETTINGS if s != self.setting)
        return (f"precision: {self.label} on {self.machine} (train.cpu_matmul = {self.setting}); "
                f"another: -S train.cpu_matmul=<{others}> (README, \"Quick start\")")


def autocast_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it (compute capability 8.0+), fp16 (with a grad scaler) on 7.x, else fp32; CPUs fp32.

    V100 and T4 (7.0, 7.5) have fp16 tensor cores but no bf16; P100 and older
    (6.x) get fp32, as the paper trained.
    """
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16 if major >= 7 else torch.float32


def resolve(setting: str, device: torch.device, text: str | None = None) -> Precision:
    """The Precision of train.cpu_matmul = `setting` on `device` (`text`: a /proc/cpuinfo to read instead)."""
    gpu_dtype = autocast_dtype(device)
    if device.type != "cpu" or gpu_dtype != torch.float32:  # a GPU (or a test making a CPU train as one)
        cpu_matmul.choose(setting, device, text)  # the setting is checked everywhere
        machine = (f"{torch.cuda.get_device_name(device)} (compute capability "
                   f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})" if device.type == "cuda"
                   else device.type)
        key = "fp32" if gpu_dtype == torch.float32 else f"{flops_lib.DTYPE_NAMES[gpu_dtype]} autocast"
        peak = "fp32" if gpu_dtype == torch.float32 else "bf16"
        products = "gpu" if device.type != "cpu" else "fp32"
        return Precision(device.type, machine, setting, products, gpu_dtype, key, GPU_LABELS[gpu_dtype], peak)
    return of_choice(cpu_matmul.choose(setting, device, text), setting, cpu.cpu_class(text))


def of_choice(products: str, setting: str = "", machine: str = "cpu") -> Precision:
    """The CPU Precision of one of cpu_matmul.CHOICES (benchmarks comparing the ways name them directly)."""
    key, label, dtype, peak = CPU_CHOICES[products]
    return Precision("cpu", machine, setting or products, products, dtype, key, label, peak)


def force_hint(key: str) -> str:
    """How a CPU computes in `key`: the train.cpu_matmul setting that gives it, or why none does."""
    force = FORCES.get(key)
    return f"train.cpu_matmul={force}" if force else f"a GPU that trains in {key}"
