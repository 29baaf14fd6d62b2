"""This CPU as /proc/cpuinfo describes it: its model, clock and vector flags, read once per process.

    cpu.flags()            # the first processor's flags (a set); cpu.flags(text) reads a /proc/cpuinfo text instead
    cpu.has_amx()          # AMX's bf16 tiles; has_avx512_bf16(), has_avx512(): the AVX-512 torch's oneDNN needs
    cpu.unit()             # the widest of UNITS this process may use ("AVX2")
    cpu.cpu_class()        # the model name and the widest unit the choices go by ("AMD EPYC (AVX2 only)")

An ISA cap in the environment (torch's ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA, MKL's
MKL_ENABLE_INSTRUCTIONS: CAPS) withholds the flags of the units above it: a process capped to AVX2 on an AVX-512
CPU chooses and counts as an AVX2 CPU does (torch's BLAS, the AVX2 peak), and its class says so.

train.cpu_matmul's choice (pipeline/device/cpu_matmul.py) and a CPU's nominal peak (pipeline/device/peak.py) both
read the CPU here. A test makes a process run as another CPU by replacing `cpuinfo`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Mapping

AMX_BF16 = "amx_bf16"  # the flag of AMX's bf16 tiles
AVX512_BF16 = "avx512_bf16"  # the flag of AVX-512's bf16 dot products: two products and their sum per fp32 lane
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what torch asks of a CPU before it lets oneDNN compute
UNITS = ("no AVX2", "AVX2", "AVX-512", "AVX-512 BF16", "AMX")  # the units the choices tell apart, narrowest first
CAPS = {  # an ISA cap's variable -> {its value, any case: the widest unit it leaves}; another value narrows nothing
    "ATEN_CPU_CAPABILITY": {"default": "no AVX2", "avx2": "AVX2"},
    "ONEDNN_MAX_CPU_ISA": {"sse41": "no AVX2", "avx": "no AVX2", "avx2": "AVX2", "avx2_vnni": "AVX2",
                           "avx2_vnni_2": "AVX2", "avx512_core": "AVX-512", "avx512_core_vnni": "AVX-512",
                           "avx512_core_bf16": "AVX-512 BF16", "avx512_core_fp16": "AVX-512 BF16"},
    "MKL_ENABLE_INSTRUCTIONS": {"sse4_2": "no AVX2", "avx": "no AVX2", "avx2": "AVX2"},
}
WITHHELD = {"AMX": (), "AVX-512 BF16": ("amx",), "AVX-512": ("amx", "avx512_bf16"), "AVX2": ("amx", "avx512"),
            "no AVX2": ("amx", "avx512", "avx2")}  # the flags (by prefix) a cap to each unit withholds
CLASS_NAMES = {"AMX": "AMX", "AVX-512 BF16": "AVX-512 BF16, no AMX", "AVX-512": "AVX-512, no bf16",
               "AVX2": "AVX2 only", "no AVX2": "no AVX2"}


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


def caps(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ISA caps that narrow a unit in `environ` (this process's environment by default), as they are set."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k, values in CAPS.items() if env.get(k, "").lower() in values}


def caps_line(environ: Mapping[str, str] | None = None) -> str:
    """The narrowing ISA caps as an environment line ("ONEDNN_MAX_CPU_ISA=AVX2 ..."); "" without one."""
    return " ".join(f"{k}={v}" for k, v in caps(environ).items())


def cap(environ: Mapping[str, str] | None = None) -> str | None:
    """The widest unit of UNITS the ISA caps in `environ` leave (the narrowest of theirs); None where none narrows."""
    units = [CAPS[k][v.lower()] for k, v in caps(environ).items()]
    return min(units, key=UNITS.index) if units else None


def flags(text: str | None = None, environ: Mapping[str, str] | None = None) -> set[str]:
    """The first processor's flags in /proc/cpuinfo (or in `text`), less those an ISA cap in `environ` (this
    process's environment by default) withholds."""
    found = set((cpuinfo("flags", text) or "").split())
    withheld = WITHHELD[cap(environ) or "AMX"]
    return {f for f in found if not f.startswith(withheld)} if withheld else found


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


def unit(text: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The widest of UNITS this CPU (or a /proc/cpuinfo `text`) has and an ISA cap in `environ` leaves."""
    found = flags(text, environ)
    if AMX_BF16 in found:
        return "AMX"
    if found.issuperset(AVX512):
        return "AVX-512 BF16" if AVX512_BF16 in found else "AVX-512"
    return "AVX2" if "avx2" in found else "no AVX2"


def cpu_class(text: str | None = None) -> str:
    """This CPU (or a /proc/cpuinfo `text`) as the choices see it: its model name, the widest of AMX, AVX-512 BF16,
    AVX-512 and AVX2 it has, and the ISA caps that narrowed it."""
    line = caps_line()
    capped = f"; ISA capped: {line}" if line else ""
    return f"{cpuinfo('model name', text) or 'a CPU'} ({CLASS_NAMES[unit(text)]}{capped})"
