"""bench.cpu.optimizer: a language the model can learn, the first step a windowed loss reaches a target, and a run."""

import numpy as np
import pytest
import torch

from bench.cpu import optimizer as bench
from bench.harness import learnable_batches
from tests.fixtures.train import VOCAB, write_corpus


def test_each_target_is_its_source_reversed_through_one_permutation():
    batches = learnable_batches(200, 30, vocab=50)
    table = {}
    for b in batches:
        for src, labels in zip(b.src.tolist(), b.labels.tolist()):
            s = [i for i in src if i > 3]  # EOS and PAD out
            t = [i for i in labels if i > 3]
            assert len(s) == len(t) > 0
            for a, z in zip(s, reversed(t)):
                assert table.setdefault(a, z) == z  # one id always maps to the same id
    assert len(set(table.values())) == len(table) > 20  # a permutation, not a constant


def test_the_first_step_counts_from_one_and_waits_for_a_full_window():
    losses = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert bench.first_step_at(losses, 3.0, 1) == 3
    assert bench.first_step_at(losses, 3.0, 2) == 4  # (3 + 2) / 2 at steps 3..4
    assert bench.first_step_at(losses, 0.5, 2) is None


def test_a_short_run_prints_both_ratios(capsys, one_thread):
    torch.set_num_threads(1)
    bench.main(["model=tiny", "train.warmup_steps=2", "--steps", "4", "--chunk", "2", "--window", "2",
                "--threads", "1"])
    out = capsys.readouterr().out
    assert "step time: muon / adam = " in out and "steps to loss" in out
    assert "ns_steps 5" in out and np.isfinite(float(out.split("muon / adam = ")[1].split("x")[0]))



def test_with_a_pipelines_data_it_trains_on_the_batch_stages_batches_and_vocabulary(capsys, one_thread, tmp_path):
    write_corpus(tmp_path, n_train=40)
    batches, vocab = bench.stored_batches(tmp_path, 3)
    assert vocab == VOCAB and len(batches) == 3 and all(b.tokens > 0 for b in batches)
    torch.set_num_threads(1)
    bench.main(["model=tiny", "train.warmup_steps=2", "--steps", "3", "--chunk", "1", "--window", "1",
                "--threads", "1", "--data", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: model ") and f"vocab {VOCAB}," in out and "step time: muon / adam = " in out
    with pytest.raises(SystemExit, match="fewer than --steps 999"):
        bench.stored_batches(tmp_path, 999)
