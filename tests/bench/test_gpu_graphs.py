"""bench.gpu.graphs on a CPU: each mode trains the same batches in the same windows, and the totals add up."""

from __future__ import annotations

import re

import pytest
import torch

from bench.gpu import graphs as gpu_graphs
from pipeline.device import compiled

pytestmark = pytest.mark.usefixtures("one_thread")


def window(first: int, last: int, seconds: float) -> dict:
    return {"steps": [first, last], "seconds": seconds, "tokens": 1000, "compile_seconds": 0.0, "graphs": None,
            "pool_bytes": None, "dynamo_graphs": 0, "recompiles": []}


def test_ahead_after_is_the_first_window_where_the_running_totals_cross():
    eager = [window(1, 10, 1.0), window(11, 20, 1.0), window(21, 30, 1.0)]
    assert gpu_graphs.ahead_after(eager, [window(1, 10, 2.5), window(11, 20, 0.2), window(21, 30, 0.2)]) == 30
    assert gpu_graphs.ahead_after(eager, [window(1, 10, 0.9), window(11, 20, 5.0), window(21, 30, 0.1)]) == 10
    assert gpu_graphs.ahead_after(eager, [window(1, 10, 1.0), window(11, 20, 1.0), window(21, 30, 1.0)]) is None


def test_without_cuda_it_says_so_and_times_nothing(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_graphs.main([]) is None
    assert capsys.readouterr().out.splitlines() == [
        "gpu-graphs: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to time"]


@pytest.mark.slow
def test_each_mode_trains_the_same_batches_in_the_same_windows(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")  # dynamo without AOT autograd: the fastest compile there is
    torch._dynamo.reset()
    out = tmp_path / "windows.json"
    results = gpu_graphs.main(["--tiny", "--models", "base", "--steps", "5", "--window", "2", "--modes", "compiled",
                               "step", "--json", str(out)])
    torch._dynamo.reset()
    r = results["base"]
    assert set(r) == {"num_shapes", "eager", "compiled", "step"} and r["num_shapes"] > 0
    for mode in ("eager", "compiled", "step"):
        assert [w["steps"] for w in r[mode]] == [[1, 2], [3, 4], [5, 5]]  # the last window holds what is left
        assert all(w["epoch"] == 0 and w["seconds"] > 0 for w in r[mode])
    # The same corpus in the same order: every window trained the same target tokens in both modes.
    assert [w["tokens"] for w in r["eager"]] == [w["tokens"] for w in r["compiled"]] == [w["tokens"] for w in r["step"]]
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("  ")]
    assert lines[0] == f"base: 5 steps of one fresh corpus, {r['num_shapes']} distinct batch shapes"
    for line, e, c in zip(lines[1:4], r["eager"], r["compiled"]):
        ratio = float(re.search(r"\(([\d.]+)x;", line)[1])
        assert ratio == pytest.approx((c["tokens"] / c["seconds"]) / (e["tokens"] / e["seconds"]), abs=0.01), line
    total_e, total_c = (sum(w["seconds"] for w in r[m]) for m in ("eager", "compiled"))
    assert lines[4].startswith(f"base all 5 timed steps: eager {total_e:.1f} s, compiled {total_c:.1f} s")
    assert lines[8].startswith("base all 5 timed steps: eager ") and ", step " in lines[8]  # the whole step, after
    assert out.exists() and '"compiled"' in out.read_text() and '"step"' in out.read_text()
