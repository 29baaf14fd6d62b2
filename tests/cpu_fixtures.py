"""/proc/cpuinfo texts of the CPUs the CPU-dependent choices tell apart, and a way to make a test run as one."""

from __future__ import annotations

from pipeline.device import peak

XEON = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\ncpu MHz\t\t: 2500.000\n"
        "flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 2445.406\nflags\t\t: fpu sse2 avx fma avx2\n"  # AVX2 only
ZEN = ("processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 3000.000\n"
       "flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16\n")
SKYLAKE = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\ncpu MHz\t\t: 2000.000\n"
           "flags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl\n")  # AVX-512 without bf16
# metrics/train.json's `precision` for each choice but torch's BLAS
BF16, ONEDNN = "fp32, bf16 matrix products (AMX)", "fp32 (oneDNN's matrix products)"
AUTOCAST = "fp32 weights, bf16 autocast (AVX-512 BF16)"


def as_cpu(monkeypatch, text: str) -> None:
    """Make /proc/cpuinfo read `text` for the choice and the peak."""
    read = peak.cpuinfo
    monkeypatch.setattr(peak, "cpuinfo", lambda field, t=None: read(field, text if t is None else t))
