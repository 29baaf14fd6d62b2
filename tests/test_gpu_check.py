"""bench.gpu_check (make gpu-check) on a CPU: it times the train stage's own Trainer, so a break shows without a GPU.

What a GPU adds (NCCL instead of gloo, autocast bf16, inductor, memory) cannot run here; everything else does:
the presets' settings, the process group of one and DDP, the prefetch thread, train.compile (aot_eager, as
tests/test_compile.py), the checkpoint it saves, decoding and every printed line.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bench import gpu_check
from bench.train_throughput import synthetic_corpus
from pipeline.core import config
from pipeline.core.tracking import StageRun
from pipeline.training import compiled, distributed
from pipeline.training.trainer import Trainer
from pipeline.weights import fingerprint
from pipeline.weights.checkpoint import resume_point

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_says_and_uses_the_presets_batch_max_tokens():
    for name in ("base", "big"):
        preset = config.compose([f"experiment=wmt14_en_de_{name}", "train.devices=1"])
        s = gpu_check.preset(name, CPU, tiny=False)
        assert (s.max_tokens, s.train_cfg.compile) == (preset["batch"]["max_tokens"], True)
        said = re.search(r"batch\.max_tokens (\d+)", gpu_check.__doc__)
        assert said and int(said[1]) == s.max_tokens, said and said[0]


def test_gpu_check_times_the_trainers_step_under_ddp_compiled_or_not_and_saves_a_resumable_checkpoint(
        tmp_path, monkeypatch):
    monkeypatch.setenv(compiled.BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    s = gpu_check.preset("base", CPU, tiny=True)
    data = gpu_check.training_data(*synthetic_corpus(300, vocab=s.vocab, mean=gpu_check.WMT_MEAN), s.vocab,
                                   s.max_tokens)
    steps = 2
    with gpu_check.process_group(CPU) as ctx:
        eager = gpu_check.time_training(s, data, ctx, steps, False, tmp_path / "ck")
        comp = gpu_check.time_training(s, data, ctx, steps, True)
    torch._dynamo.reset()
    for r in (eager, comp):  # DDP as each rank of a preset's run has it, around the train stage's loss
        assert isinstance(r["trainer"].loss_model, DistributedDataParallel)
        assert r["tokens_per_s"] > 0 and r["accum"] == 2  # train.tokens_per_step 1024 / batch.max_tokens 512
    assert comp["compiled"] and not eager["compiled"]
    assert comp["tokens_per_step"] == eager["tokens_per_step"]  # both time the same steps
    # The checkpoint it timed is the train stage's: resumed as one (sealed, the trainer's code) ...
    found = resume_point(tmp_path / "ck", "gpu-check", fingerprint.code_fingerprint("stages.train"))
    assert found is not None and found.payload["step"] == gpu_check.WARMUP_STEPS + steps
    # ... with the weights the Trainer gets without the group: DDP over one process changes no number.
    plain = Trainer(data, s.model_cfg, s.train_cfg.__class__(**{**vars(s.train_cfg), "compile": False}), s.max_tokens,
                    distributed.Dist(0, 1, 0, CPU), StageRun(), phash="")
    assert not isinstance(plain.loss_model, DistributedDataParallel)
    for _ in range(gpu_check.WARMUP_STEPS + steps):
        plain.step(plain.epoch_order())
    for name, want in plain.model.state_dict().items():
        assert torch.equal(found.payload["model"][name], want), name


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_check.main([])
    assert capsys.readouterr().out.splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check"]


def test_gpu_check_prints_training_checkpoint_and_decoding_lines_for_both_models_on_the_cpu(monkeypatch, capsys):
    """--tiny (hidden): the same code with a small model on the CPU, so the GPU run meets no untried line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_check.main(["--tiny", "--steps", "1", "--sentences", "4", "--no-compile"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["base"] * 3 + ["big"] * 3, lines
    train_line, save_line, decode_line = lines[:3]
    assert "target tokens/s, MFU" in train_line and "x batch.max_tokens 512" in train_line
    assert float(train_line.split(" target tokens/s")[0].split(": ")[1].replace(",", "")) > 0
    assert re.search(r"checkpoint [\d.]+ MiB saved in [\d.]+ s", save_line), save_line
    assert "beam 4:" in decode_line and "sentences/s (translate_ids, fp32)" in decode_line
