"""This CPU as /proc/cpuinfo describes it: its model, clock and vector flags, read once per process.

    cpu.flags()            # the first processor's flags (a set); cpu.flags(text) reads a /proc/cpuinfo text instead
    cpu.has_amx()          # AMX's bf16 tiles; has_avx512_bf16(), has_avx512(): the AVX-512 torch's oneDNN needs
    cpu.cpu_class()        # the model name and the widest unit the choices go by ("AMD EPYC (AVX2 only)")

train.cpu_matmul's choice (pipeline/device/cpu_matmul.py) and a CPU's nominal peak (pipeline/device/peak.py) both
read the CPU here. A test makes a process run as another CPU by replacing `cpuinfo`.
"""

from __future__ import annotations

import functools
from pathlib import Path

AMX_BF16 = "amx_bf16"  # the flag of AMX's bf16 tiles
AVX512_BF16 = "avx512_bf16"  # the flag of AVX-512's bf16 dot products: two products and their sum per fp32 lane
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what torch asks of a CPU before it lets oneDNN compute


@functools.cache
def proc_cpuinfo() -> str:
    """/proc/cpuinfo as this process first read it ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo(field: str, text: str | None = None) -> str | None:
    """The first processor's `field` in /proc/cpuinfo (or in `text`); None where there is none."""
    for line in (proc_cpuinfo() if text is None else text).splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def flags(text: str | None = None) -> set[str]:
    """The first processor's flags in /proc/cpuinfo (or in `text`)."""
    return set((cpuinfo("flags", text) or "").split())


def name(text: str | None = None) -> str:
    """The CPU's model name; "cpu" where /proc/cpuinfo gives none."""
    return cpuinfo("model name", text) or "cpu"


def has_amx(text: str | None = None) -> bool:
    """Whether this CPU (or a /proc/cpuinfo `text`) has AMX's bf16 tiles."""
    return AMX_BF16 in flags(text)


def has_avx512(text: str | None = None) -> bool:
    """Whether this CPU (or a /proc/cpuinfo `text`) has the AVX-512 that torch's oneDNN products need."""
    return flags(text).issuperset(AVX512)


def has_avx512_bf16(text: str | None = None) -> bool:
    """Whether this CPU (or a /proc/cpuinfo `text`) has that AVX-512 with its bf16 dot products."""
    return has_avx512(text) and AVX512_BF16 in flags(text)


def cpu_class(text: str | None = None) -> str:
    """This CPU (or a /proc/cpuinfo `text`) as the choices see it: its model name and the widest of AMX, AVX-512
    BF16, AVX-512 and AVX2 it has."""
    kind = ("AMX" if has_amx(text) else "AVX-512 BF16, no AMX" if has_avx512_bf16(text) else
            "AVX-512, no bf16" if has_avx512(text) else "AVX2 only" if "avx2" in flags(text) else "no AVX2")
    return f"{cpuinfo('model name', text) or 'a CPU'} ({kind})"
