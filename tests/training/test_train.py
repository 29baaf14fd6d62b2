"""stages.train: the paper's schedule and loss, exact data-parallel updates, exact resumes, outputs (a step shared by
a world of processes: test_train_world.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import flops as flops_lib
from model import loss as loss_lib
from model.schedule import lrate
from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.device import cpu, peak
from pipeline.training import trainer as trainer_lib
from pipeline.core.files import write_json
from stages import batch as batch_stage
from stages import train
from pipeline.weights.checkpoint import complete_checkpoints, load_checkpoint
from pipeline.core.config import ParamsError
from pipeline.corpus.formats import BOS_ID, EOS_ID, PAD_ID, load_batches, load_split
from pipeline.training.loader import collate
from tests.fixtures.train import (MODEL, ROOT, VOCAB, final_weights, last_checkpoint, run_stage, stage_args, stage_env,
                                  torchrun, write_corpus, write_params)
from tests.fixtures.train_runs import (TWO_PROCESS_RECIPE, one_process_run, one_thread_shared_store,  # noqa: F401
                                       plot_rows, shared_store)
from tests.fixtures.untracked import untracked  # noqa: F401 (autouse: this module reads no MLflow run)


# --- schedule and loss --------------------------------------------------------------------


def test_lrate_is_the_papers_formula_with_its_peak_at_warmup():
    d_model, warmup = 512, 4000
    for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
        expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert lrate(step, d_model, warmup) == pytest.approx(expected, rel=1e-12)
    assert lrate(1000, d_model, warmup) == pytest.approx(1000 / 4000 * lrate(4000, d_model, warmup))  # linear warmup
    assert lrate(16000, d_model, warmup) == pytest.approx(lrate(4000, d_model, warmup) / 2)  # 1/sqrt(step) decay
    peak = max(range(1, 20_000), key=lambda s: lrate(s, d_model, warmup))
    assert peak == warmup
    assert lrate(warmup, d_model, warmup) == pytest.approx(512**-0.5 * 4000**-0.5)
    with pytest.raises(ValueError):
        lrate(0, d_model, warmup)


def test_label_smoothed_loss_matches_a_hand_computation():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
    targets = torch.tensor([0, 1])
    eps = 0.1
    expected = 0.0
    for row, y in zip(logits.tolist(), targets.tolist()):
        log_z = math.log(sum(math.exp(v) for v in row))
        logp = [v - log_z for v in row]
        # q = (1 - eps) * one_hot(y) + eps / V (Szegedy et al. 2016, as Sec. 5.4 cites); loss = -sum q log p
        expected += -sum(((1 - eps) * (k == y) + eps / 3) * logp[k] for k in range(3))
    smoothed, nll = loss_lib.projected_smoothed_and_nll(logits, torch.eye(3), targets, eps)  # logits @ I^T: logits
    assert smoothed.item() == pytest.approx(expected, rel=1e-6)
    assert F.cross_entropy(logits, targets, label_smoothing=eps, reduction="sum").item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item(), rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_chunked_loss_equals_cross_entropy_of_the_models_projection(eps):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    n = 2 * loss_lib.ProjectedSmoothedLoss.CHUNK + 37  # three chunks, the last one short
    hidden = torch.randn(n, MODEL["d_model"], requires_grad=True)
    targets = torch.randint(0, VOCAB, (n,))
    expected = F.cross_entropy(model.project(hidden), targets, label_smoothing=eps, reduction="sum")
    (3 * expected).backward()
    want = hidden.grad.clone(), model.embedding.weight.grad.clone()
    hidden.grad, model.embedding.weight.grad = None, None
    got = loss_lib.ProjectedSmoothedLoss.apply(hidden, model.embedding.weight, targets, eps)
    (3 * got).backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(hidden.grad, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.embedding.weight.grad, want[1], rtol=1e-4, atol=1e-4)


def test_padding_changes_neither_the_loss_nor_the_gradient():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    loss_model = loss_lib.SmoothedLoss(model, 0.1, chunked=True)
    pairs = [([5, 6, 7, 8], [9, 10]), ([11, 12], [13, 14, 15, 16, 17])]
    padded = [torch.tensor([s + [EOS_ID] + [PAD_ID] * (5 - len(s)) for s, _ in pairs]),
              torch.tensor([[BOS_ID] + t + [PAD_ID] * (5 - len(t)) for _, t in pairs]),
              torch.tensor([t + [EOS_ID] + [PAD_ID] * (5 - len(t)) for _, t in pairs])]
    together = loss_model(*padded, sum(len(t) + 1 for _, t in pairs))
    together.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = sum(loss_model(torch.tensor([s + [EOS_ID]]), torch.tensor([[BOS_ID] + t]), torch.tensor([t + [EOS_ID]]),
                           len(t) + 1) for s, t in pairs)
    alone.backward()
    assert together.item() == pytest.approx(alone.item(), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


# --- data ---------------------------------------------------------------------------------


def test_batches_frame_sentences_with_eos_and_bos_and_pad_the_rest(tmp_path):
    tokenized, batches = write_corpus(tmp_path)
    src, tgt = load_split(tokenized, "train", "en"), load_split(tokenized, "train", "de")
    rows = np.array([0, 3, 7])
    batch = collate(src, tgt, rows, torch.device("cpu"))
    for i, r in enumerate(rows):
        s, t = src[r].tolist(), tgt[r].tolist()
        assert batch.src[i].tolist() == s + [EOS_ID] + [PAD_ID] * (batch.src.shape[1] - len(s) - 1)
        assert batch.tgt_in[i].tolist() == [BOS_ID] + t + [PAD_ID] * (batch.tgt_in.shape[1] - len(t) - 1)
        assert batch.labels[i].tolist() == t + [EOS_ID] + [PAD_ID] * (batch.labels.shape[1] - len(t) - 1)
    assert batch.tokens == int((batch.labels != PAD_ID).sum())
    assert batch.src.shape[1] == max(len(src[r]) for r in rows) + 1


def test_torchrun_starting_fewer_processes_than_devices_is_a_clear_error(tmp_path, monkeypatch):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", devices=2)
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):  # `torchrun --nproc_per_node=1`
        monkeypatch.setenv(name, value)
    with pytest.raises(ParamsError, match=r"train\.devices=2 but 1 process\(es\) were started"):
        train.main(stage_args(tmp_path, params))
    assert not (tmp_path / "metrics").exists() and not (tmp_path / "checkpoints").exists()


# --- whole runs -----------------------------------------------------------------------------


def test_a_tiny_model_overfits_a_handful_of_pairs(tmp_path):
    write_corpus(tmp_path, n_train=6, n_valid=6, max_len=4, max_tokens=40)
    # the valid split is a copy of the train split: overfitting shows there too
    for lang in ("en", "de"):
        for ext in ("ids", "offsets"):
            (tmp_path / "tokenized" / f"valid.{lang}.{ext}").write_bytes((tmp_path / "tokenized" / f"train.{lang}.{ext}").read_bytes())
    for ext in ("index", "bounds"):
        (tmp_path / "batches" / f"valid.{ext}.npy").write_bytes((tmp_path / "batches" / f"train.{ext}.npy").read_bytes())
    # 100 steps: valid nll 0.0014 (train.seed 1 and 2; 0.0002 after 300), far below the bound
    params = write_params(tmp_path / "params.yaml", max_tokens=40, max_steps=100, tokens_per_step=40, warmup_steps=20,
                          lr_factor=0.5, label_smoothing=0.0, eval_every=0, log_every=50, checkpoint_every=0,
                          model={"d_model": 32, "d_ff": 64, "n_heads": 4})
    metrics = run_stage(tmp_path, params)
    assert metrics["steps"] == 100
    assert metrics["valid_nll"] < 0.05, metrics
    assert metrics["valid_ppl"] < 1.06


def test_metrics_and_plot_describe_the_run(tmp_path):
    tokenized, batches = write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", max_steps=5, eval_every=2, log_every=2, checkpoint_every=0)
    metrics = run_stage(tmp_path, params)
    # flops_analytic is training_flops summed over every trained batch's real tokens: one pass over
    # the batch order (5 steps x 2 batches, the 10 batches of one epoch) covers each batch once.
    b = load_batches(batches, "train")
    assert len(b) == 10 and metrics["grad_accum"] == 2
    S = np.diff(load_split(tokenized, "train", "en").offsets)[b.values] + 1
    T = np.diff(load_split(tokenized, "train", "de").offsets)[b.values] + 1
    assert metrics["flops_analytic"] == pytest.approx(flops_lib.training_flops(ModelConfig(**MODEL), VOCAB, S, T))
    assert metrics["train_tokens"] == int(T.sum())
    assert 0 < metrics["mfu"] <= 1
    assert metrics["mfu"] == pytest.approx(metrics["flops_analytic"] / (metrics["step_seconds"] * metrics["peak_flops"]))
    assert metrics["flops_paper_estimate"] == pytest.approx(metrics["train_hours"] * 3600 * metrics["peak_flops"])
    assert metrics["valid_ppl"] == pytest.approx(math.exp(metrics["valid_nll"]))
    assert metrics["valid_loss"] > metrics["valid_nll"]  # smoothing adds the cross-entropy to the uniform
    for key in ("steps", "train_hours", "tokens_per_second", "device", "devices", "peak_flops"):
        assert key in metrics
    assert metrics["peak_flops_source"] in ("nominal", "measured", "cached", "achieved")
    rows = plot_rows(tmp_path)
    assert [r["step"] for r in rows] == ["2", "4", "5"]
    assert rows[0]["valid_ppl"] and rows[2]["valid_ppl"]  # evaluated at 2, 4 and the end
    assert float(rows[2]["valid_ppl"]) == pytest.approx(metrics["valid_ppl"], rel=1e-4)
    assert all(float(r["lr"]) > 0 and float(r["loss"]) > 0 for r in rows)


def test_a_run_faster_than_the_cached_peak_raises_it_and_reports_mfu_one(tmp_path, monkeypatch):
    """A cached peak below what the run achieves (e.g. measured under load) cannot give MFU > 1."""
    monkeypatch.setattr(peak, "nominal_cpu_peak", lambda threads, text=None: None)  # a CPU without /proc/cpuinfo
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    keys = [peak.cache_key(cpu.name(), threads, "fp32") for threads in range(1, (os.cpu_count() or 1) + 1)]
    write_json(peak.cache_path(), {key: 1.0 for key in keys})  # 1 FLOP/s, whatever threads the stage takes
    write_corpus(tmp_path)
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=2, eval_every=0, checkpoint_every=0))
    achieved = metrics["flops_analytic"] / metrics["step_seconds"]
    assert metrics["peak_flops_source"] == "achieved"
    assert metrics["peak_flops"] == pytest.approx(achieved) and metrics["mfu"] == pytest.approx(1.0)
    assert max(peak.read_cache(peak.cache_path()).values()) == pytest.approx(achieved)


def test_train_json_records_the_real_tokens_per_step_that_batch_json_foretold(tmp_path):
    """Both stages report real source / target tokens per step (Sec. 5.1's ~25000 each); over one epoch they agree."""
    write_corpus(tmp_path, n_train=60)
    params = write_params(tmp_path / "params.yaml", max_steps=1, checkpoint_every=0)  # 48 tokens a step: 2 batches
    batch_stage.main(["--tokenized", str(tmp_path / "tokenized"), "--out", str(tmp_path / "batches"),
                "--metrics", str(tmp_path / "batch.json"), "--params", str(params)])
    foretold = json.loads((tmp_path / "batch.json").read_text())
    assert foretold["batches_per_step"] == 2
    one_epoch = math.ceil(foretold["num_batches"] / 2)
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=one_epoch, checkpoint_every=0))
    assert metrics["steps"] == one_epoch and metrics["epochs"] == 1
    keys = [f"{side}_tokens_per_step_{stat}" for side in ("src", "tgt") for stat in ("mean", "min", "max")]
    assert {k: metrics[k] for k in keys} == pytest.approx({k: foretold[k] for k in keys})
    assert metrics["tgt_tokens_per_step_mean"] * one_epoch == metrics["train_tokens"]
    assert metrics["src_tokens_per_step_min"] < metrics["src_tokens_per_step_max"]


def test_two_runs_of_the_same_params_give_identical_weights(tmp_path):
    """The budget is steps, not minutes: same params and data, same model, whatever the machine's speed."""
    finals = []
    for run in ("a", "b"):
        write_corpus(tmp_path / run)
        params = write_params(tmp_path / run / "params.yaml", max_steps=7, checkpoint_every=0, model={"dropout": 0.1})
        metrics = run_stage(tmp_path / run, params)
        assert metrics["steps"] == 7 and metrics["stopped_by"] == "max_steps"
        finals.append(final_weights(tmp_path / run))
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


@pytest.mark.slow
def test_libgomps_wait_settings_leave_the_weights_unchanged(tmp_path):
    """dvc.yaml runs training with GOMP_SPINCOUNT set (docs/benchmarks.md, "Training on a busy CPU"): how idle threads wait, never the result."""
    finals = []
    for run, extra in (("default", {}), ("spin", {"GOMP_SPINCOUNT": "10000"}), ("passive", {"OMP_WAIT_POLICY": "PASSIVE"})):
        write_corpus(tmp_path / run, n_train=64, max_tokens=96)
        params = write_params(tmp_path / run / "params.yaml", max_tokens=96, tokens_per_step=96, max_steps=4,
                              checkpoint_every=0, model={"d_model": 64, "d_ff": 256, "d_k": 32, "d_v": 32, "dropout": 0.1})
        env = stage_env(OMP_NUM_THREADS="2")
        env.pop("GOMP_SPINCOUNT", None), env.pop("OMP_WAIT_POLICY", None)
        env.update(extra)
        result = subprocess.run([sys.executable, "-m", "stages.train", *stage_args(tmp_path / run, params)], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-2000:]
        finals.append(final_weights(tmp_path / run))
    for other in finals[1:]:
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0])


def test_the_wall_clock_safety_stop_is_recorded(tmp_path):
    write_corpus(tmp_path)
    # a safety stop far below one step: training stops after its first step, evaluates, saves, and says why
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=1000, max_minutes=1e-9,
                                               checkpoint_every=0, eval_every=0))
    assert metrics["steps"] == 1 and "valid_ppl" in metrics and metrics["stopped_by"] == "max_minutes"
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001.pt"]


@pytest.mark.parametrize("seconds_per_tick", [1e-6, 3600.0])
def test_checkpoints_fall_on_the_same_steps_whatever_the_machines_speed(tmp_path, monkeypatch, seconds_per_tick):
    """A clock that moves an hour at each reading (a very slow machine) or a microsecond: the same checkpoints,
    so average takes the same steps on any hardware (Sec. 6.1's 10 minutes are converted to steps in the presets)."""
    clock = iter(range(10**9))
    monkeypatch.setattr(trainer_lib.time, "monotonic", lambda: next(clock) * seconds_per_tick)
    write_corpus(tmp_path)
    run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=7, checkpoint_every=3, eval_every=0))
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000003.pt", "step_00000006.pt", "step_00000007.pt"]


@pytest.mark.slow
def test_resume_after_sigkill_ends_with_the_same_weights(tmp_path, caplog):
    steps = 30
    full, killed = tmp_path / "full", tmp_path / "killed"
    for root in (full, killed):
        write_corpus(root)
        write_params(root / "params.yaml", max_steps=steps, checkpoint_every=2, eval_every=5,
                     model={"dropout": 0.1})  # dropout: the RNG state must be restored too
    run_stage(full, full / "params.yaml")

    cmd = [sys.executable, "-m", "stages.train", *stage_args(killed, killed / "params.yaml")]
    env = stage_env()
    # one thread (stage_env), as in the run above: the same sums
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not list((killed / "checkpoints").glob("step_*.pt.sha256")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sealed = sorted((killed / "checkpoints").glob("step_*.pt.sha256"))
    assert sealed and int(sealed[-1].name[5:13]) < steps, "killed too late to test resuming"

    caplog.clear()
    run_stage(killed, killed / "params.yaml")  # the re-run, in process (one thread, as the others)
    assert "resuming from step" in caplog.text
    a, b = final_weights(full), final_weights(killed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps_logged = [r["step"] for r in plot_rows(killed)]
    assert steps_logged == [r["step"] for r in plot_rows(full)]  # no duplicated rows after the resume
    assert json.loads((killed / "metrics" / "train.json").read_text())["train_tokens"] == \
        json.loads((full / "metrics" / "train.json").read_text())["train_tokens"]


def test_a_finished_run_rerun_with_more_steps_continues(tmp_path, caplog):
    write_corpus(tmp_path)
    run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4))
    caplog.clear()
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=6))
    assert "resuming from step 4" in caplog.text
    assert metrics["steps"] == 6


def test_changed_params_start_afresh_and_say_so(tmp_path, caplog):
    write_corpus(tmp_path)
    run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4))
    caplog.clear()
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=4, label_smoothing=0.2))
    assert "params changed" in caplog.text and "starting afresh" in caplog.text
    assert "resuming" not in caplog.text
    assert metrics["steps"] == 4
    stale = list(tmp_path.glob("checkpoints.stale/*/step_00000004.pt"))
    assert stale, "old checkpoints were not moved aside"
    assert str(stale[0].parent) in caplog.text
    assert last_checkpoint(tmp_path)["params_hash"] != \
        load_checkpoint(stale[0])["params_hash"]


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_previous_one_resumed(tmp_path, caplog):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", max_steps=4)
    run_stage(tmp_path, params)
    newest = tmp_path / "checkpoints" / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    caplog.clear()
    metrics = run_stage(tmp_path, write_params(tmp_path / "params.yaml", max_steps=5))
    assert "step_00000004.pt" in caplog.text and "skipping" in caplog.text
    assert "resuming from step 2" in caplog.text
    assert metrics["steps"] == 5


# --- several processes ----------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_update_like_one_process_with_the_same_global_batch(tmp_path, one_process_run):
    """A step of one stored batch: two processes take every other row of it (row parts), one process takes it in
    micro-batches of at most 12 padded tokens (train.micro_batch_tokens): the same update."""
    m1, a = one_process_run
    write_corpus(tmp_path, max_tokens=48)
    write_params(tmp_path / "params.yaml", devices=2, micro_batch_tokens=0, **TWO_PROCESS_RECIPE)
    out = torchrun(tmp_path, tmp_path / "params.yaml", 2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "each cut into 2 row parts" in out.stderr
    m2 = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert (m1["grad_accum"], m2["grad_accum"], m2["devices"]) == (1, 1, 2)
    assert m1["train_tokens"] == m2["train_tokens"] and m1["params_hash"] == m2["params_hash"]
    b = final_weights(tmp_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize("ddp", [{"ddp_static_graph": True, "ddp_bucket_mb": 0.01}, {"grad_compression": "fp16"}],
                         ids=["static-graph-small-buckets", "fp16-all-reduce"])
@pytest.mark.slow
def test_two_processes_under_ddps_settings_update_like_one_process(tmp_path, ddp, one_process_run):
    """train.ddp_static_graph with micro-batches (its first step syncs each one) and 10 KiB buckets: the one
    process's update, and its params_hash; train.grad_compression = fp16: the all-reduce rounded to fp16, so
    the weights come near the one process's but not onto them, and the hash says it trained otherwise."""
    m1, a = one_process_run
    write_corpus(tmp_path, max_tokens=48)
    write_params(tmp_path / "params.yaml", devices=2, micro_batch_tokens=12, **TWO_PROCESS_RECIPE, **ddp)
    out = torchrun(tmp_path, tmp_path / "params.yaml", 2)
    assert out.returncode == 0, out.stderr[-3000:]
    m2 = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert "micro-batches of at most 12 padded tokens" in out.stderr  # each rank's half in 2 (no_sync on the first)
    assert m1["train_tokens"] == m2["train_tokens"]
    b = final_weights(tmp_path)
    gap = max((a[k] - b[k]).abs().max().item() for k in a)
    print("largest weight difference", gap)
    if "grad_compression" in ddp:
        assert m1["params_hash"] != m2["params_hash"] and 0 < gap < 1e-2
    else:
        assert m1["params_hash"] == m2["params_hash"] and gap < 1e-5


def test_bf16_gradient_compression_without_a_cuda_gpu_is_one_clear_line(tmp_path):
    write_corpus(tmp_path)
    params = write_params(tmp_path / "params.yaml", devices=2, grad_compression="bf16")
    with pytest.raises(ParamsError, match=r"train\.grad_compression = bf16: .*NCCL.*set train\.grad_compression=fp16"):
        run_stage(tmp_path, params)
    assert not (tmp_path / "checkpoints").exists()


def test_a_failed_step_frees_what_its_frames_held_before_the_process_group_ends(tmp_path, monkeypatch):
    """What a failed step's frames hold (the DDP model, in a run of several processes) is freed before
    distributed.teardown ends the process group, not later when the exit drops the error: a reducer freed then ends
    the group holding the interpreter lock, which one of gloo's threads may be waiting for (a rank hung so)."""
    write_corpus(tmp_path)
    params = write_params(tmp_path / "p.yaml", max_steps=2)

    class Held:  # what a frame of the failed step holds
        pass

    held: list[weakref.ref] = []

    def failing_fit(self):
        model = Held()
        held.append(weakref.ref(model))
        raise RuntimeError("a collective failed")

    alive_at_teardown = []
    teardown = train.distributed.teardown
    monkeypatch.setattr(trainer_lib.Trainer, "fit", failing_fit)
    monkeypatch.setattr(train.distributed, "teardown", lambda ctx: alive_at_teardown.append(held[0]() is not None)
                        or teardown(ctx))
    with pytest.raises(RuntimeError, match="a collective failed"):
        run_stage(tmp_path, params)
    assert alive_at_teardown == [False]
