"""bench.gpu.profile: the read of a profiler trace (busy share, idle gaps and the host op in each, time per
kind) on a hand-made trace, and the whole read on a CPU with a tiny model."""

import json

import pytest
import torch

from bench.gpu.profile import kind, main, read_trace


def event(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


TRACE = [
    event("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "kernel", 0, 10),
    event("void at::native::vectorized_elementwise_kernel<4>", "kernel", 5, 15),  # overlaps the first: [0, 20)
    event("Optimizer.step#Adam.step", "user_annotation", 22, 100),  # the host, while the GPU idles 20..130
    event("aten::empty", "cpu_op", 30, 1),  # inside the gap, but too short to be why
    event("cudaLaunchKernel", "cuda_runtime", 126, 2),
    event("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "kernel", 130, 10),
    event("Memset (Device)", "gpu_memset", 140, 10),
    event("void at::native::reduce_kernel<128, 4>", "kernel", 180, 20),  # a 30 us gap: launch latency, no stall
]


def test_busy_share_gaps_and_the_host_op_the_gpu_waited_on():
    r = read_trace(TRACE, steps=2)
    assert r["busy"] == pytest.approx((20 + 20 + 20) / 200)
    assert r["span_ms"] == pytest.approx(0.2)
    assert (r["stalls"], r["stall_ms"]) == (1, pytest.approx(0.11))  # the 30 us gap is under GAP_US
    gap_ms, at_ms, host = r["largest"][0]
    assert (gap_ms, at_ms) == (pytest.approx(0.11), pytest.approx(0.02))
    assert host == ["Optimizer.step#Adam.step"]
    assert r["largest"][1][0] == pytest.approx(0.03)
    assert r["kinds"] == {"elementwise": (pytest.approx(0.0075), pytest.approx(0.5)),
                          "reduction": (pytest.approx(0.01), pytest.approx(0.5)),
                          "gemm": (pytest.approx(0.005), pytest.approx(0.5)),
                          "attention": (pytest.approx(0.005), pytest.approx(0.5)),
                          "memset": (pytest.approx(0.005), pytest.approx(0.5))}
    assert r["gpu_ms_per_step"] == pytest.approx(0.0325)
    assert r["runtime"] == {"cudaLaunchKernel": (pytest.approx(0.5), pytest.approx(0.001))}


def test_kinds_of_kernels():
    assert kind(event("void cublasLt::splitKreduce_kernel<32, 16>", "kernel", 0, 1)) == "gemm"
    assert kind(event("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel", "kernel", 0, 1)) == "attention"
    assert kind(event("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", "kernel", 0, 1)) == "optimizer"
    assert kind(event("GammaBetaBackwardCUDAKernelTemplate<float>", "kernel", 0, 1)) == "reduction"
    assert kind(event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 0, 1)) == "copy"


def test_a_trace_without_gpu_events_has_no_gpu_read():
    assert read_trace([e for e in TRACE if e["cat"] not in ("kernel", "gpu_memset")], steps=1) is None


def test_tiny_read_times_the_step_and_keeps_a_trace_of_it(tmp_path, capsys):
    results = main(["--tiny", "--models", "base", "--steps", "2", "--trace", str(tmp_path)])
    r = results["base"]
    assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
    if not torch.cuda.is_available():
        assert r["gpu"] is None and "no GPU events" in capsys.readouterr().out
    events = json.loads((tmp_path / "base.json").read_text())["traceEvents"]
    assert sum(e.get("name") == "Optimizer.step#Adam.step" for e in events) == 2  # one update per profiled step


def test_every_preset_is_timed_before_any_profiler_runs(monkeypatch):
    # A profiler session can leave CUPTI attached and slow every later launch: no timed step may follow one.
    import bench.gpu.profile as gpu_profile
    from bench.harness import steps as gpu_timing

    events: list[str] = []

    def recording(label, real):
        def call(*args, **kwargs):
            events.append(label)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(gpu_profile, "timed", recording("timed", gpu_profile.timed))
    monkeypatch.setattr(gpu_profile, "profile", recording("profile", gpu_profile.profile))
    monkeypatch.setattr(gpu_timing, "profiled", recording("profiled warm-up step", gpu_timing.profiled))
    results = main(["--tiny", "--models", "base", "big", "--steps", "1"])
    assert events == ["timed", "timed", "profile", "profile"]
    assert all(r["ms_per_step"] > 0 and r["steps"] == 1 for r in results.values())


def test_timed_profiles_its_last_warm_up_step_only_where_asked(monkeypatch):
    from bench.harness import steps as gpu_timing

    calls = []
    real = gpu_timing.profiled
    monkeypatch.setattr(gpu_timing, "profiled", lambda device: calls.append(device) or real(device))
    for kernels, expected in ((True, 1), (False, 0)):
        calls.clear()
        gpu_timing.timed(lambda: None, lambda: (0.0, 0.0), 2, torch.device("cpu"), warmup=3, kernels=kernels)
        assert len(calls) == expected
