"""The device's peak FLOP/s, the denominator of MFU: a stable figure, recorded with where it came from.

    python -m pipeline.device.peak      # measure this machine's peak now (best of ROUNDS) and raise the cached figure

Sources, as `peak_flops_source` in metrics/train.json:
  nominal   a GPU in model.flops.PEAK_TFLOPS: its datasheet's dense peak at the
            training precision (the run's Precision: bf16, fp16 on V100
            and T4), fp32 for the paper's cost estimate.
  nominal   a CPU whose /proc/cpuinfo gives its clock and vector flags:
            threads x clock ("cpu MHz") x fp32 FLOP per cycle of its widest
            fused multiply-add unit (FLOPS_PER_CYCLE: two FMA pipes, as on
            Zen and most Xeons). The AMD EPYC here: 2 x 2445 MHz x 32 =
            156.5 GFLOP/s, where a quiet matmul measured 155-162. With
            bf16 matrix products (train.cpu_matmul, on AMX): threads x clock
            x AMX_BF16_FLOPS_PER_CYCLE, the tiles' bf16 rate; under bf16
            autocast on AVX-512 BF16: twice the fp32 figure.
  measured  other CPUs and GPUs: the best matmul rate at that precision of
            ROUNDS rounds of SECONDS each, measured when this machine has no
            cached figure yet, then cached. (Measured on a loaded machine it
            came out at a third of the quiet figure, and every MFU read 100%:
            hence the nominal figure wherever there is one.)
  cached    that figure, read back: one JSON file ($XDG_CACHE_HOME or
            ~/.cache, then CACHE_NAME) keyed by device name, torch threads and
            torch version and dtype. One short measurement per run swung 1.6x
            on a shared machine (105 vs 171 GFLOP/s), and every MFU with it.
  achieved  the run itself computed faster than the figure above: the peak is
            raised to the run's own rate (so MFU <= 1 by construction) and
            the cache with it.
Measuring draws random matrices inside torch.random.fork_rng, so the training
RNG does not move (exact resumes).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from model import flops as flops_lib
from pipeline.core.files import write_json
from pipeline.device import cpu
from pipeline.device.distributed import Dist

if TYPE_CHECKING:
    from pipeline.device.precision import Precision

log = logging.getLogger(__name__)

ROUNDS, SECONDS = 5, 1.0
CACHE_NAME = "attention-is-all-you-need/peak_flops.json"
# fp32 FLOP per cycle and core for the widest FMA unit the flags show: two pipes x lanes x 2 (multiply, add).
FLOPS_PER_CYCLE = ((("avx512f",), 64), (("avx2", "fma"), 32), (("avx",), 16), (("sse2",), 8))
AMX_BF16_FLOPS_PER_CYCLE = 1024  # per core: a 16 x 32 by 32 x 16 bf16 tile product (16,384 FLOP) every 16 cycles


@dataclass(frozen=True)
class Peak:
    """One device's peak, for MFU and for the paper's cost estimate."""

    flops: float  # FLOP/s per device: the MFU denominator
    fp32_tflops: float  # sustained fp32 TFLOPS: the paper's estimate (Sec. 6.1)
    device: str
    source: str  # nominal | measured | cached | achieved (module docstring)
    key: str | None  # its cache entry; None for a datasheet figure


def cache_path() -> Path:
    """Where measured peaks are kept: $XDG_CACHE_HOME (else ~/.cache) / CACHE_NAME."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / CACHE_NAME


def cache_key(device: str, threads: int, dtype: str) -> str:
    """One machine configuration: the same CPU with more threads, or another torch, has another peak."""
    return f"{device} | {threads} threads | torch {torch.__version__} | {dtype}"


def read_cache(path: Path) -> dict[str, float]:
    """The cached peaks (FLOP/s by key); {} when the file is missing or unreadable (it is only a cache)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable peak cache (%s); measuring again", path, e)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def remember(path: Path, key: str, flops: float) -> None:
    """Raise (never lower) the cached peak of `key` to `flops`."""
    cache = read_cache(path)
    if cache.get(key, 0.0) >= flops:
        return
    try:
        write_json(path, {**cache, key: flops})
    except OSError as e:
        log.warning("cannot write the peak cache %s: %s", path, e)


def cached_peak(path: Path, key: str, measure: Callable[[], float]) -> tuple[float, str]:
    """(FLOP/s, source): the cached peak of `key`, else measure() now, cached for the next run."""
    if key in (cache := read_cache(path)):
        return cache[key], "cached"
    flops = measure()
    remember(path, key, flops)
    return flops, "measured"


def measured_peak(dtype: torch.dtype, device: torch.device) -> float:
    """The best matmul rate of ROUNDS rounds of SECONDS, without moving the training RNG (exact resumes)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        n = 8192 if device.type == "cuda" else 1024
        return max(flops_lib.measure_matmul_peak(dtype, n=n, seconds=SECONDS, device=device) for _ in range(ROUNDS))


def nominal_cpu_peak(threads: int, text: str | None = None, products: str = "fp32") -> float | None:
    """threads x clock x FLOPS_PER_CYCLE of the widest FMA unit (for bf16 `products`: AMX_BF16_FLOPS_PER_CYCLE on a
    CPU with amx_bf16, else twice the fp32 figure on one with avx512_bf16), from /proc/cpuinfo (or `text`); None if
    unknown."""
    mhz, flags = cpu.cpuinfo("cpu MHz", text), cpu.flags(text)
    fp32 = next((n for needs, n in FLOPS_PER_CYCLE if flags.issuperset(needs)), None)
    if products == "bf16":
        per_cycle = (AMX_BF16_FLOPS_PER_CYCLE if cpu.has_amx(text) else
                     2 * fp32 if cpu.has_avx512_bf16(text) and fp32 else None)
    else:
        per_cycle = fp32
    try:
        clock = float(mhz) * 1e6 if mhz else 0.0
    except ValueError:
        clock = 0.0
    return threads * clock * per_cycle if clock > 0 and per_cycle else None


def peak_flops(ctx: Dist, precision: Precision, path: Path | None = None) -> Peak:
    """This process's device peak: a GPU's datasheet figure, a CPU's nominal one, else the cached (or now measured)
    matmul peak, at the run's `precision` (pipeline/device/precision.py, applied before this call); the paper's
    estimate keeps the fp32 figure."""
    path = path or cache_path()
    products = precision.peak
    if ctx.cuda:
        name = torch.cuda.get_device_name(ctx.device)
        dtype = precision.dtype
        try:
            return Peak(flops_lib.device_tflops(name, dtype) * 1e12, flops_lib.device_tflops(name, "fp32"), name,
                        "nominal", None)
        except KeyError as e:
            log.warning("%s; measuring the matmul peaks instead", e)
        fp32, _ = cached_peak(path, cache_key(name, 1, "fp32"), lambda: measured_peak(torch.float32, ctx.device))
        key = cache_key(name, 1, flops_lib.DTYPE_NAMES[dtype])
        flops, source = cached_peak(path, key, lambda: measured_peak(dtype, ctx.device))
        return Peak(flops, fp32 / 1e12, name, source, key)
    threads = torch.get_num_threads()
    device = f"{cpu.name()} ({threads} threads/process)"
    fp32 = nominal_cpu_peak(threads)
    if products == "bf16" and (nominal := nominal_cpu_peak(threads, products="bf16")):
        return Peak(nominal, (fp32 or nominal) / 1e12, device, "nominal", None)
    if products == "fp32" and fp32:
        return Peak(fp32, fp32 / 1e12, device, "nominal", None)
    key = cache_key(cpu.name(), threads, "fp32" if products == "fp32" else "fp32 with bf16 products")
    flops, source = cached_peak(path, key, lambda: measured_peak(torch.float32, ctx.device))
    return Peak(flops, (fp32 or flops) / 1e12, device, source, key)


def at_least(peak: Peak, achieved: float) -> Peak:
    """`peak`, or the run's achieved FLOP/s per device when that is higher (source "achieved"): MFU <= 1."""
    if achieved <= peak.flops:
        return peak
    fp32 = achieved / 1e12 if peak.key is not None and peak.key.endswith("fp32") else peak.fp32_tflops
    return replace(peak, flops=achieved, fp32_tflops=fp32, source="achieved")


def settle(peak: Peak, achieved: float, path: Path | None = None) -> Peak:
    """at_least(peak, achieved), and a raised peak goes into the cache too."""
    settled = at_least(peak, achieved)
    if settled is not peak:
        log.warning("this run computed %.3g FLOP/s per device, above the %s peak %.3g: MFU is taken against the run's "
                    "own rate", achieved, peak.source, peak.flops)
        if peak.key is not None:
            remember(path or cache_path(), peak.key, achieved)
    return settled


def main() -> None:
    """Measure now and raise the cached figure (e.g. once on a quiet machine, before training)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    key = cache_key(cpu.name(), torch.get_num_threads(), "fp32")
    flops = measured_peak(torch.float32, torch.device("cpu"))
    remember(cache_path(), key, flops)
    print(f"{key}: measured {flops / 1e9:.1f} GFLOP/s; cached {read_cache(cache_path())[key] / 1e9:.1f} "
          f"({cache_path()})")


if __name__ == "__main__":
    main()
