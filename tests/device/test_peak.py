"""pipeline/device/peak.py: a stable MFU denominator, cached per machine, recorded with its source, never below the run."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pipeline.device import cpu, peak
from pipeline.device.distributed import Dist
from pipeline.device.peak import Peak
from pipeline.device.precision import of_choice, resolve
from tests.fixtures.cpu import EPYC

CPU = Dist(0, 1, 0, torch.device("cpu"))


class Measure:
    """A stand-in for the matmul benchmark: returns `flops`, counts its calls."""

    def __init__(self, flops: float):
        self.flops, self.calls = flops, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.flops


def test_a_cache_miss_measures_once_and_later_runs_read_the_cached_figure(tmp_path):
    path, measure = tmp_path / "peak.json", Measure(2.0e11)
    assert peak.cached_peak(path, "cpu A | 2 threads", measure) == (2.0e11, "measured")
    assert peak.cached_peak(path, "cpu A | 2 threads", Measure(9.9e11)) == (2.0e11, "cached")  # not re-measured
    assert measure.calls == 1
    assert peak.cached_peak(path, "cpu A | 1 threads", Measure(1.1e11)) == (1.1e11, "measured")  # another key
    assert json.loads(path.read_text()) == {"cpu A | 2 threads": 2.0e11, "cpu A | 1 threads": 1.1e11}


def test_the_cache_key_names_device_threads_torch_and_dtype():
    keys = {peak.cache_key("cpu A", 2, "fp32"), peak.cache_key("cpu A", 1, "fp32"), peak.cache_key("cpu B", 2, "fp32"),
            peak.cache_key("cpu A", 2, "bf16")}
    assert len(keys) == 4
    assert torch.__version__ in peak.cache_key("cpu A", 2, "fp32")


def test_remember_raises_the_cached_figure_and_never_lowers_it(tmp_path):
    path = tmp_path / "sub" / "peak.json"
    peak.remember(path, "k", 1.0e11)
    peak.remember(path, "k", 0.5e11)
    assert peak.read_cache(path) == {"k": 1.0e11}
    peak.remember(path, "k", 1.5e11)
    assert peak.read_cache(path) == {"k": 1.5e11}


def test_an_unreadable_cache_is_measured_again_and_rewritten(tmp_path, caplog):
    path = tmp_path / "peak.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert peak.cached_peak(path, "k", Measure(3.0e11)) == (3.0e11, "measured")
    assert "unreadable peak cache" in caplog.text and str(path) in caplog.text
    assert peak.read_cache(path) == {"k": 3.0e11}


@pytest.mark.parametrize("flags, per_cycle", [("sse2 avx fma avx2", 32), ("sse2 avx fma avx2 avx512f", 64),
                                              ("sse2 avx avx2", 16), ("sse2 avx", 16), ("sse2", 8)])
def test_a_cpus_nominal_peak_is_threads_times_clock_times_its_fma_width(flags, per_cycle):
    text = EPYC.replace("fpu sse2 avx fma avx2", flags)
    assert peak.nominal_cpu_peak(2, text) == pytest.approx(2 * 2445.406e6 * per_cycle)
    assert peak.nominal_cpu_peak(1, text) == pytest.approx(2445.406e6 * per_cycle)


@pytest.mark.parametrize("text", ["", "model name\t: some arm\nFeatures\t: fp asimd\n",
                                  EPYC.replace("2445.406", "unknown"), EPYC.replace("fpu sse2 avx fma avx2", "fpu")])
def test_a_cpu_without_clock_or_known_flags_has_no_nominal_peak(text):
    assert peak.nominal_cpu_peak(2, text) is None


def test_a_cpu_run_takes_its_nominal_peak_whatever_the_load(tmp_path, monkeypatch):
    read = cpu.cpuinfo
    monkeypatch.setattr(cpu, "cpuinfo", lambda field, text=None: read(field, EPYC))
    monkeypatch.setattr(peak, "measured_peak", lambda *a: pytest.fail("measured despite a nominal figure"))
    found = peak.peak_flops(CPU, of_choice("fp32"), tmp_path / "peak.json")
    threads = torch.get_num_threads()
    assert (found.flops, found.source, found.key) == (pytest.approx(threads * 2445.406e6 * 32), "nominal", None)
    assert found.fp32_tflops == pytest.approx(found.flops / 1e12) and found.device == f"AMD EPYC ({threads} threads/process)"
    assert not (tmp_path / "peak.json").exists()  # a nominal figure is not cached


def test_a_cpu_run_takes_the_cached_peak_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(peak, "nominal_cpu_peak", lambda threads, text=None: None)  # e.g. no /proc/cpuinfo
    path = tmp_path / "peak.json"
    key = peak.cache_key(cpu.name(), torch.get_num_threads(), "fp32")
    path.write_text(json.dumps({key: 1.23e11}))
    monkeypatch.setattr(peak, "measured_peak", lambda *a: pytest.fail("measured despite a cached figure"))
    found = peak.peak_flops(CPU, of_choice("fp32"), path)
    assert (found.flops, found.fp32_tflops, found.source, found.key) == (1.23e11, 0.123, "cached", key)


def test_measuring_the_peak_leaves_the_training_rng_where_it_was(monkeypatch):
    monkeypatch.setattr(peak, "ROUNDS", 2)
    monkeypatch.setattr(peak, "SECONDS", 0.05)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert peak.measured_peak(torch.float32, torch.device("cpu")) > 1e8
    assert torch.equal(torch.rand(3), expected)


def test_a_run_faster_than_the_peak_raises_it_so_mfu_stays_at_most_one(tmp_path):
    path = tmp_path / "peak.json"
    path.write_text(json.dumps({"k fp32": 1.0e11}))
    cached = Peak(1.0e11, 0.1, "cpu", "cached", "k fp32")
    assert peak.settle(cached, 0.8e11, path) is cached  # slower than the peak: unchanged
    raised = peak.settle(cached, 1.6e11, path)
    assert (raised.flops, raised.fp32_tflops, raised.source) == (1.6e11, 0.16, "achieved")
    assert peak.read_cache(path) == {"k fp32": 1.6e11}  # the next run starts from the raised figure
    nominal = Peak(312e12, 19.5, "A100", "nominal", None)
    assert peak.settle(nominal, 400e12, path).flops == 400e12  # impossible on a real A100, but MFU <= 1 anyway
    assert peak.read_cache(path) == {"k fp32": 1.6e11}  # datasheet figures are not cached


@pytest.mark.parametrize("name, capability, tflops", [("NVIDIA H100 80GB HBM3", (9, 0), 989.4),
                                                      ("Tesla V100-SXM2-16GB", (7, 0), 125.0)])
def test_a_gpus_peak_is_its_datasheets_at_the_precision_it_trains_in(tmp_path, monkeypatch, name, capability, tflops):
    """H100: bf16; V100 has no bf16 and trains in fp16 (precision.autocast_dtype): its fp16 tensor-core peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    got = peak.peak_flops(Dist(0, 1, 0, gpu), resolve("fp32", gpu), tmp_path / "peak.json")
    assert (got.flops, got.source, got.key) == (tflops * 1e12, "nominal", None)
    assert not (tmp_path / "peak.json").exists()
