"""train.compile_scope = step: forward, loss and backward as one compiled graph (pipeline/device/compiled.py).

It serves a stream of bucketed shapes with one graph (a single row: one more, its reason recorded), each loss that of
the real rows; falls back to eager in one warning; refuses R-Drop in one line; keeps inductor's graphs beside the
checkpoints so that a resumed run loads them; and under DDP trains the weights of one eager process (eager
checkpoints, compiling counted apart).
Backend aot_eager (the aot_eager fixture), but for the cache, which only inductor fills. One layer a stack
(ONE_LAYER): the graph's size is what a compile costs, and nothing here depends on the depth.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.transformer import Transformer
from pipeline.core.config import ParamsError
from pipeline.device import compiled
from tests.fixtures.train import (FIRST_ID, MODEL, ROOT, VOCAB, final_weights, last_checkpoint, run_stage,
                                  stage_args, stage_env, torchrun, write_corpus, write_params)
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)

pytestmark = pytest.mark.usefixtures("one_thread", "aot_eager")

ONE_LAYER = {"n_layers": 1}  # model keys of every run here (write_params' model=)
# Inductor's build cut to what the cache test checks (that the graphs are kept and loaded, not how fast they run):
# C++ at -O0 without vector code (no ISA probe builds), no pattern-matching passes (seconds of tracing), and one C++
# build a graph (cpp_wrapper: the kernels and their caller in one library, not ~30 builds of one kernel each).
CHEAP_INDUCTOR = {"TORCHINDUCTOR_DEBUG_COMPILE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0",
                  "TORCHINDUCTOR_DISABLED_PASSES": "PASS_PATTERN_0,PASS_PATTERN_1,PASS_PATTERN_2",
                  "TORCHINDUCTOR_CPP_WRAPPER": "1"}


def one_layer_model() -> Transformer:
    return Transformer(ModelConfig(**{**MODEL, **ONE_LAYER}), VOCAB)


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def batch(rows: int, s: int, t: int, rng: torch.Generator) -> tuple[torch.Tensor, ...]:
    """src [rows, s], tgt_in and labels [rows, t], the first row's last label padding."""
    src, tgt_in, labels = (torch.randint(FIRST_ID, VOCAB, shape, generator=rng) for shape in
                           ((rows, s), (rows, t), (rows, t)))
    labels[0, -1] = 0
    return src, tgt_in, labels


def test_a_stream_of_shapes_builds_one_graph_a_single_row_one_more_and_a_third_past_the_limit_raises():
    """Under a recompile limit of 2 (compiled.limited): 30 bucketed shapes (rows >= 2) twice: one graph, built on
    the first; then a batch of one row: one graph more (torch specialises a size of 1), whose recompile and reason
    watch() records. Every loss equals the loss over the real rows (SmoothedLoss as the layers and eager train it):
    under the limit nothing changes. Then a source of length 1 (a third graph: past the limit): raised, not run
    eager with a log line, and its reason the guard that failed."""
    model = one_layer_model()
    forward, real = compiled.compile_step(SmoothedLoss(model, 0.1, padded=True)), SmoothedLoss(model, 0.1)
    rng, order = torch.Generator().manual_seed(0), np.random.default_rng(0)
    shapes = [(int(order.integers(2, 8)), int(order.integers(2, 15)), int(order.integers(2, 15))) for _ in range(30)]
    with compiled.limited(2):
        for epoch in range(2):
            for rows, s, t in shapes:
                src, tgt_in, labels = batch(rows, s, t, rng)
                tokens = int((labels != 0).sum())
                forward(src, tgt_in, labels, tokens).backward()
                assert graphs() == 1, f"graph {graphs()} at shape {(rows, s, t)}, epoch {epoch}"
        with compiled.watch() as seen:
            src, tgt_in, labels = batch(1, 6, 5, rng)
            got = forward(src, tgt_in, labels, int((labels != 0).sum()))
        assert graphs() == 2 and len(seen.reasons) == 1 and "src.size()[0]" in seen.reasons[0]
        torch.testing.assert_close(got, real(src, tgt_in, labels, int((labels != 0).sum())), rtol=1e-5, atol=1e-5)
        with compiled.watch() as seen, pytest.raises(compiled.RecompileLimitHit):
            src, tgt_in, labels = batch(3, 1, 4, rng)
            forward(src, tgt_in, labels, int((labels != 0).sum()))
    assert graphs() == 2 and "limit (2 graphs)" in compiled.limit_reason(2, seen.reasons)
    assert "src.size()[1]" in compiled.limit_reason(2, seen.reasons)  # the guard that failed last


def test_a_run_past_the_recompile_limit_turns_eager_in_the_open_or_stops(tmp_path, caplog, monkeypatch):
    """Nothing marked dynamic and a limit of 1: the second shape passes it. train.compile_on_limit = eager: one
    warning, the step repeated eager and every step after it (train.json: why, from which step, how many), the
    weights of an eager run; fail (the same run again, its first graph already built): one line naming the step
    and the keys to change, no checkpoint."""
    monkeypatch.setattr(compiled, "STEP_DIMS", ((), (), ()))
    keys = dict(max_steps=4, checkpoint_every=0, eval_every=0, adam_eps=1e-4, model={**ONE_LAYER, "dropout": 0.1})
    for on_limit in ("eager", "fail"):
        write_corpus(tmp_path / on_limit)
        write_params(tmp_path / on_limit / "p.yaml", compile=True, compile_scope="step", compile_recompile_limit=1,
                     compile_on_limit=on_limit, **keys)
    m = run_stage(tmp_path / "eager", tmp_path / "eager" / "p.yaml")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "train.compile" in r.getMessage()]
    assert len(warned) == 1 and "recompile limit (1 graphs) hit" in warned[0] and "eager" in warned[0]
    assert m["compile_fallback"].startswith("dynamo's recompile limit (1 graphs) hit; last guard failed: ")
    assert 1 <= m["compile_fallback_step"] <= 4 and m["compile_graphs"] >= 1
    assert m["compile_eager_steps"] == 4 - m["compile_fallback_step"] + 1
    write_corpus(tmp_path / "reference")
    run_stage(tmp_path / "reference", write_params(tmp_path / "reference" / "p.yaml", compile=False, **keys))
    want, got = final_weights(tmp_path / "reference"), final_weights(tmp_path / "eager")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    stop = (r"train.compile: step \d: dynamo's recompile limit \(1 graphs\) hit; last guard failed: "
            r".*train.compile_on_limit=eager")
    with pytest.raises(compiled.RecompileLimitError, match=stop):
        run_stage(tmp_path / "fail", tmp_path / "fail" / "p.yaml")
    assert not list((tmp_path / "fail").glob("checkpoints/*.pt"))


def failing_compiler(gm, example_inputs):
    raise RuntimeError("injected compiler failure")


def test_a_whole_step_that_fails_to_compile_trains_eager_with_one_warning(tmp_path, caplog, monkeypatch):
    """The compiler fails on the first step: one warning, the step repeated eager (its gradients dropped, the RNGs
    put back) and the run eager from there: the weights of an eager run, to the rounding of the padded loss's sum."""
    if "failing_step_for_tests" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(failing_compiler, name="failing_step_for_tests")
    keys = dict(max_steps=3, checkpoint_every=0, eval_every=0, adam_eps=1e-4, model={**ONE_LAYER, "dropout": 0.1})
    for root, compile_ in ((tmp_path / "eager", False), (tmp_path / "step", True)):
        write_corpus(root)
        monkeypatch.setenv(compiled.BACKEND_ENV, "failing_step_for_tests")
        caplog.clear()
        run_stage(root, write_params(root / "p.yaml", compile=compile_, compile_scope="step", **keys))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "train.compile" in r.getMessage()]
    assert len(warned) == 1 and "training eager instead" in warned[0] and "failing_step_for_tests" in warned[0]
    want, got = final_weights(tmp_path / "eager"), final_weights(tmp_path / "step")
    for name in want:  # the same dropout masks: a different mask would move them far more
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_rdrop_with_the_whole_step_compiled_is_refused_in_one_line(tmp_path):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "p.yaml", compile=True, compile_scope="step", rdrop_alpha=1.0)
    with pytest.raises(ParamsError, match=r"train.compile_scope = step .* train.rdrop_alpha = 1 .* "
                                          r"train.compile_scope=layers"):
        run_stage(tmp_path, params)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_a_resumed_run_loads_the_compiled_graphs_from_the_cache_beside_the_checkpoints(tmp_path, _new_store):
    """Inductor for real (a C++ build, cut to CHEAP_INDUCTOR: ~30 CPU-s for this one-layer model): the first run
    builds the whole step's graphs and keeps them in compile_cache/ beside the checkpoints (not torch's default
    directory, which torch sets on import); the resumed run, a new process, loads them and builds none.
    metrics/train.json counts both (run totals), and its recompiles with their reasons."""
    write_corpus(tmp_path)
    keys = dict(compile=True, compile_scope="step", checkpoint_every=1, eval_every=0, model=ONE_LAYER)
    shutil.copyfile(_new_store, tmp_path / "m.db")  # a store with its tables: MLflow's migrations cost seconds
    env = stage_env(TRANSFORMER_COMPILE_BACKEND="inductor", MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'm.db'}",
                    **CHEAP_INDUCTOR)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    metrics = []
    for steps in (1, 2):
        params = write_params(tmp_path / "p.yaml", max_steps=steps, **keys)
        out = subprocess.run([sys.executable, "-m", "stages.train", *stage_args(tmp_path, params)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        metrics.append(json.loads((tmp_path / "metrics" / "train.json").read_text()))
    assert "resuming from step 1" in out.stderr
    first, resumed = metrics
    assert first["compile_cache_misses"] > 0 and first["compile_cache_hits"] == 0  # built, into the run's cache
    assert resumed["compile_cache_hits"] > 0 and resumed["compile_cache_misses"] == first["compile_cache_misses"]
    assert (tmp_path / "compile_cache" / "fxgraph").is_dir()
    for m in metrics:  # a recompile counted is a recompile explained
        assert (m["compile_recompiles"] > 0) == bool(m["compile_recompile_reasons"])
    assert set(last_checkpoint(tmp_path)["model"]) == set(one_layer_model().state_dict())  # an eager checkpoint


def test_the_compile_cache_goes_beside_the_checkpoints_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(compiled.CACHE_ENV, default_cache_dir())  # what torch sets on import
    assert compiled.keep_cache(tmp_path / "compile_cache") == str((tmp_path / "compile_cache").resolve())
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))  # the user's
    assert compiled.keep_cache(tmp_path / "compile_cache") == str(tmp_path / "mine")


@pytest.mark.slow
@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic graph", "static graph"])
def test_two_processes_with_the_whole_step_compiled_update_like_one_eager_process(tmp_path, static_graph):
    """DDP compiled whole (dynamo splits the graph at DDP's buckets) against one eager process taking the same
    step in micro-batches: the same update, as test_train's two eager processes; with train.ddp_static_graph
    too (DDP told the graph never changes, under the compiled step)."""
    one, two = tmp_path / "one", tmp_path / "two"
    for root, devices, micro, compile_ in ((one, 1, 12, False), (two, 2, 0, True)):
        write_corpus(root, max_tokens=48)
        write_params(root / "params.yaml", max_tokens=48, devices=devices, tokens_per_step=48, max_steps=4,
                     checkpoint_every=0, eval_every=0, micro_batch_tokens=micro, adam_eps=1e-4, compile=compile_,
                     compile_scope="step", ddp_static_graph=static_graph and devices == 2, model=ONE_LAYER)
    m1 = run_stage(one, one / "params.yaml")
    out = torchrun(two, two / "params.yaml", 2, TRANSFORMER_COMPILE_BACKEND="aot_eager")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the whole step compiled" in out.stderr and "training eager instead" not in out.stderr
    m2 = json.loads((two / "metrics" / "train.json").read_text())
    assert m2["devices"] == 2 and m1["params_hash"] == m2["params_hash"]
    assert m2["compile_graphs"] >= 1 and 0 < m2["compile_seconds"] < m2["step_seconds"]  # compiling counted apart
    a, b = final_weights(one), final_weights(two)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
