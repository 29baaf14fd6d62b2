"""bench.gpu_check (make gpu-check) on a CPU: it times the train stage's own Trainer, so a break shows without a GPU.

What a GPU adds (NCCL instead of gloo, autocast bf16, inductor, memory) cannot run here; everything else does:
the presets' settings, each mode's fresh corpus through the batch stage, the process group of one and DDP, the
prefetch thread, train.compile and the compiled reference step (dynamo with TRANSFORMER_COMPILE_BACKEND=eager or
aot_eager, as tests/test_compile.py), the checkpoint it saves, decoding under autocast and every printed line.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bench import gpu_check
from pipeline.core import config
from pipeline.core.tracking import StageRun
from pipeline.corpus import steps
from pipeline.training import compiled, distributed
from pipeline.training.trainer import Trainer
from pipeline.weights import fingerprint
from pipeline.weights.checkpoint import resume_point
from stages.translate import translate_ids

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_uses_the_presets_batch_config_and_times_at_least_50_steps():
    for name in gpu_check.PRESETS:
        preset = config.compose([f"experiment=wmt14_en_de_{name}", "train.devices=1"])
        s = gpu_check.preset(name, CPU, tiny=False)
        assert s.batch_cfg == config.parse(preset, "batch", config.BatchConfig)
        assert s.vocab == preset["tokenize"]["vocab_size"] == 37000
    assert "vocabulary 37000" in " ".join(gpu_check.__doc__.split())
    said = re.search(r"--steps (\d+)", gpu_check.__doc__)
    assert said and int(said[1]) == gpu_check.arguments().parse_args([]).steps >= 50


def test_each_stream_is_a_fresh_corpus_batched_by_the_batch_stage_with_the_whole_config(tmp_path, monkeypatch):
    s = gpu_check.preset("base", CPU, tiny=True)
    calls = []
    write_batches = gpu_check.write_batches
    monkeypatch.setattr(gpu_check, "write_batches", lambda *a: calls.append(a) or write_batches(*a))
    a = gpu_check.training_data(s, 1, 2, tmp_path / "a")
    b = gpu_check.training_data(s, 2, 2, tmp_path / "b")
    assert all(call[3] is s.batch_cfg for call in calls)  # the BatchConfig as composed, whatever fields it has
    # Enough batches that the warm-up, the timed steps and the prefetched step come from one epoch.
    assert min(len(a.train_batches), len(b.train_batches)) >= (gpu_check.WARMUP_STEPS + 3) * s.batches_per_step
    assert gpu_check.digest(a) != gpu_check.digest(b)


def test_gpu_check_times_the_trainers_step_under_ddp_in_epoch_order_and_saves_a_resumable_checkpoint(tmp_path):
    s = gpu_check.preset("base", CPU, tiny=True)
    data = gpu_check.training_data(s, 1, 2, tmp_path / "corpus")
    n = 2
    with gpu_check.process_group(CPU) as ctx:
        r = gpu_check.time_training(s, data, ctx, n, False, tmp_path / "ck")
        t = r.pop("trainer")
        assert isinstance(t.loss_model, DistributedDataParallel)  # DDP as each rank of a preset's run has it
        t.close()
    assert r["tokens_per_s"] > 0 and r["accum"] == 2 and not r["compiled"]  # tokens_per_step 1024 / max_tokens 512
    assert r["warmup_seconds"] > 0 and r["new_graphs"] == 0
    # The steps took the batches in the trainer's epoch order, none twice, all in the first epoch.
    taken = [b for ids in r["batches"] for b in ids]
    assert taken == steps.epoch_order(len(data.train_batches), s.train_cfg.seed, 0)[: len(taken)].tolist()
    assert len(r["batches"]) == gpu_check.WARMUP_STEPS + n and r["epochs"] == 1
    assert len(r["batch_shapes"]) == n * r["accum"]
    # The checkpoint it timed is the train stage's: resumed as one (sealed, the trainer's code) ...
    found = resume_point(tmp_path / "ck", "gpu-check", fingerprint.code_fingerprint("stages.train"))
    assert found is not None and found.payload["step"] == gpu_check.WARMUP_STEPS + n
    # ... with the weights the Trainer gets without the group: DDP over one process changes no number.
    plain = Trainer(data, s.model_cfg, s.train_cfg.__class__(**{**vars(s.train_cfg), "compile": False}), s.max_tokens,
                    distributed.Dist(0, 1, 0, CPU), StageRun(), phash="")
    assert not isinstance(plain.loss_model, DistributedDataParallel)
    for _ in range(gpu_check.WARMUP_STEPS + n):
        plain.step(plain.epoch_order())
    for name, want in plain.model.state_dict().items():
        assert torch.equal(found.payload["model"][name], want), name


def test_decoding_under_autocast_reaches_translate_ids_worker_threads():
    """translate_ids searches in worker threads, where an autocast block around the call does not reach."""
    s = gpu_check.preset("base", CPU, tiny=True)
    src, _ = gpu_check.synthetic_corpus(4, seed=5, vocab=s.vocab, mean=8, sd=2, longest=12)
    sources = [np.asarray(src[i], dtype=np.int64) for i in range(len(src))]
    seen = []

    def spied(model):
        inner = model.model if isinstance(model, gpu_check.Autocast) else model
        step = inner.decode_step

        def decode_step(tokens, state):
            logits, state = step(tokens, state)
            seen.append((threading.current_thread() is threading.main_thread(), torch.is_autocast_enabled("cpu"),
                         logits.dtype))
            return logits, state

        inner.decode_step = decode_step
        return model

    with torch.autocast("cpu", dtype=torch.bfloat16):  # around the call: the searches run without it
        translate_ids(spied(gpu_check.decoding_model(s, torch.float32)), sources, s.translate_cfg, progress=False)
    assert seen and not any(main or on for main, on, _ in seen)
    seen.clear()
    translate_ids(spied(gpu_check.decoding_model(s, torch.bfloat16)), sources, s.translate_cfg, progress=False)
    assert seen and all(on and dtype == torch.bfloat16 for _, on, dtype in seen)
    assert gpu_check.time_decoding(s, sources, torch.bfloat16) > 0


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) is None
    assert capsys.readouterr().out.splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check"]


def tokens_per_s(line: str) -> float:
    return float(line.split(" target tokens/s")[0].split(": ")[1].replace(",", ""))


def test_gpu_check_prints_the_reference_then_each_mode_on_its_own_corpus_then_decoding(monkeypatch, capsys):
    """--tiny (hidden): the same code with a small model on the CPU, so the GPU run meets no untried line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(compiled.BACKEND_ENV, "eager")  # dynamo without AOT autograd: the fastest compile there is
    torch._dynamo.reset()
    results = gpu_check.main(["--tiny", "--models", "base", "--steps", "2", "--sentences", "4"])
    torch._dynamo.reset()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "base reference", "base eager", "base", "base compiled", "base", "base"], lines
    reference, eager, save, comp, decode_trained, decode_fp32 = lines
    r = results["base"]
    # The reference: the step's tokens in one fixed-shape micro-batch, the whole loss compiled.
    assert "1 x [32, 32] micro-batch" in reference and "under one torch.compile" in reference, reference
    assert r["reference"]["compiled"] and r["reference"]["warmup_graphs"] > 0
    assert r["reference"]["tokens_per_step"] == 1024
    for line, mode in ((eager, "eager"), (comp, "compiled")):
        assert "target tokens/s" in line and "MFU" in line and "n/a peak" in line, line
        ratio = float(re.search(r", ([\d.]+)x of the reference \(", line)[1])
        assert ratio == pytest.approx(tokens_per_s(line) / tokens_per_s(reference), rel=0.02, abs=0.01), line
        assert "2 timed steps of a fresh corpus" in line and "in 2 batch(es) of batch.max_tokens 512" in line, line
        assert len(r[mode]["batches"]) == gpu_check.WARMUP_STEPS + 2
    # Compile time apart from the timed steps' tokens/s, with the graphs compiled in each part.
    assert re.search(r"\(compile: 3 warm-up steps [\d.]+ s, [1-9]\d* graph\(s\); 0 graph\(s\) compiled during the "
                     r"timed steps;", comp), comp
    assert r["compiled"]["compiled"] and r["compiled"]["warmup_graphs"] > 0 and r["compiled"]["new_graphs"] == 0
    assert re.search(r"\(warm-up 3 steps [\d.]+ s; 2 timed", eager) and "graph" not in eager, eager
    # Each mode trained on a corpus of its own: other token ids, other batch shapes.
    assert r["eager"]["seed"] != r["compiled"]["seed"] and r["eager"]["corpus"] != r["compiled"]["corpus"]
    assert set(r["eager"]["batch_shapes"]) != set(r["compiled"]["batch_shapes"])
    assert re.search(r"checkpoint [\d.]+ MiB saved in [\d.]+ s", save), save
    # Decoding: beam 4 under the training precision (fp32 on a CPU, as the trainer picks) and in fp32.
    assert re.fullmatch(r"base: beam 4, training precision, fp32: [\d.]+ sentences/s \(translate_ids\)",
                        decode_trained), decode_trained
    assert re.fullmatch(r"base: beam 4, fp32: [\d.]+ sentences/s \(translate_ids\)", decode_fp32), decode_fp32
