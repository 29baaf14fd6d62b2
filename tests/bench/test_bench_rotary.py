"""bench.rotary: Rotary's complex fp32 turn against the pair-by-pair one, timed and against the fp64 turn."""

import re

import pytest
import torch

from bench import rotary


def test_bench_rotary_times_both_turns_and_the_complex_one_is_nearer_the_exact_turn_in_bf16(capsys):
    rotary.main(["--shapes", "default", "--repeats", "1", "--rounds", "1", "--threads", "1"])
    header, line = capsys.readouterr().out.strip().splitlines()
    assert "bf16" in header and line.startswith("default [81, 19, 512], d_k 32:")
    times = [float(t) for t in re.findall(r"([0-9.]+) ms", line)]
    errors = [float(e) for e in re.search(r"turn ([0-9.]+) and ([0-9.]+)$", line).groups()]
    assert len(times) == 2 and all(t > 0 for t in times)
    assert errors[0] > 1.3 * errors[1] > 0  # bf16's real products round each product; the complex turn rounds once


def test_bench_rotary_in_fp32_turns_both_ways_to_the_same_numbers():
    r = rotary.measure("default", torch.device("cpu"), torch.float32, repeats=1, rounds=1)
    assert r["pair by pair error"] == pytest.approx(r["complex fp32 error"], rel=1e-6)


def test_bench_rotary_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda"):
        rotary.main(["--device", "cuda"])
