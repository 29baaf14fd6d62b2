"""pipeline.weights.checkpoint: atomic, sealed checkpoints; broken ones are skipped by name; everything loads weights_only."""

from __future__ import annotations

import logging
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.weights.checkpoint import (CheckpointError, capture_rng, complete_checkpoints, fingerprint, load_checkpoint,
                               restore_rng, resume_point, save_checkpoint, sidecar)
from stages import average
from tests.fixtures.train import MODEL, VOCAB


def training_payload(step: int) -> dict:
    """A payload shaped like the train stage's: real weights, a real Adam state, RNGs, counters."""
    torch.manual_seed(step)
    model = Transformer(ModelConfig(**MODEL), VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.tensor([[4, 5, 3]]), torch.tensor([[2, 6]])).sum().backward()
    optimizer.step()
    return {"step": step, "model": model.state_dict(), "model_config": dict(MODEL), "vocab_size": VOCAB,
            "params_hash": "h", "optimizer": optimizer.state_dict(), "rng": [capture_rng()],
            "data_position": {"epoch": 1, "cursor": 7}, "elapsed_seconds": 1.5, "train_tokens": 99,
            "progress": {"plot_rows": [[2, 3.5, 1e-3, 100.0, None]], "valid": {}}}


def test_a_training_payload_round_trips_with_weights_only(tmp_path):
    payload = training_payload(3)
    path = save_checkpoint(tmp_path, payload, keep=5)
    assert path.name == "step_00000003.pt" and sidecar(path).exists()
    loaded = load_checkpoint(path)
    assert all(torch.equal(loaded["model"][k], v) for k, v in payload["model"].items())
    assert loaded["optimizer"]["param_groups"] == payload["optimizer"]["param_groups"]
    assert all(torch.equal(loaded["optimizer"]["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in payload["optimizer"]["state"].items())
    assert loaded["data_position"] == {"epoch": 1, "cursor": 7}
    assert loaded["progress"]["plot_rows"] == [[2, 3.5, 1e-3, 100.0, None]]


def test_the_sidecar_is_checked_by_sha256sum(tmp_path):
    save_checkpoint(tmp_path, training_payload(1), keep=5)
    out = subprocess.run(["sha256sum", "-c", "step_00000001.pt.sha256"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_broken_checkpoints_are_skipped_with_a_warning_naming_each(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, training_payload(step), keep=10)
    two, three, four = (tmp_path / f"step_0000000{s}.pt" for s in (2, 3, 4))
    data = bytearray(two.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle
    two.write_bytes(bytes(data))
    three.write_bytes(three.read_bytes()[:-100])  # truncated
    sidecar(four).unlink()  # killed between the .pt and its sidecar
    with caplog.at_level(logging.WARNING):
        complete = complete_checkpoints(tmp_path)
    assert [p.name for p in complete] == ["step_00000001.pt"]
    for broken in (two, three, four):
        assert str(broken) in caplog.text


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, {"step": step, "model": {"w": torch.full((2,), float(step))}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000004.pt", "step_00000004.pt.sha256", "step_00000005.pt", "step_00000005.pt.sha256"]
    assert torch.equal(load_checkpoint(complete_checkpoints(tmp_path)[-1])["model"]["w"], torch.full((2,), 5.0))
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, {"step": 6, "model": {}}, keep=0)


def test_only_the_last_set_of_checkpoints_set_aside_is_kept(tmp_path, caplog):
    """Each params change sets the old checkpoints aside; earlier sets are deleted, each with a logged line."""
    checkpoints = tmp_path / "checkpoints"
    for params_hash in ("first", "second", "third"):
        assert resume_point(checkpoints, params_hash, {}) is None
        for step in (1, 2):
            save_checkpoint(checkpoints, {"step": step, "model": {}, "params_hash": params_hash}, keep=5)
    with caplog.at_level(logging.WARNING):
        assert resume_point(checkpoints, "fourth", {}) is None
    sets = list((tmp_path / "checkpoints.stale").iterdir())
    assert len(sets) == 1 and sorted(p.name for p in sets[0].iterdir()) == [
        "step_00000001.pt", "step_00000001.pt.sha256", "step_00000002.pt", "step_00000002.pt.sha256"]
    assert load_checkpoint(sets[0] / "step_00000002.pt")["params_hash"] == "third"
    assert "deleting" in caplog.text and "only the last set is kept" in caplog.text
    assert list(checkpoints.iterdir()) == []


def test_load_errors_name_the_file(tmp_path):
    garbage = tmp_path / "step_00000001.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=str(garbage)):
        load_checkpoint(garbage)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "step_00000002.pt")
    torch.save({"step": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="other.pt.*not a training checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_restored_rngs_replay_every_generator(tmp_path):
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    torch.rand(3), np.random.rand(3), random.random(), np.random.randn()  # leave a cached gaussian
    path = save_checkpoint(tmp_path, {"step": 1, "model": {}, "rng": capture_rng()}, keep=1)
    first = (torch.rand(4), np.random.rand(4), np.random.randn(), [random.random() for _ in range(4)])
    restore_rng(load_checkpoint(path)["rng"])
    again = (torch.rand(4), np.random.rand(4), np.random.randn(), [random.random() for _ in range(4)])
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2] and first[3] == again[3]


def test_fingerprint_follows_values_and_file_contents(tmp_path):
    f = tmp_path / "meta.json"
    f.write_text("{}")
    base = fingerprint({"a": 1, "b": [1, 2]}, [f])
    assert base == fingerprint({"b": [1, 2], "a": 1}, [f])  # key order does not matter
    assert base != fingerprint({"a": 2, "b": [1, 2]}, [f])
    f.write_text("{ }")
    assert base != fingerprint({"a": 1, "b": [1, 2]}, [f])


# --- what resuming and averaging read -----------------------------------------------------------------

PROC_IO = Path("/proc/self/io")


def bytes_read(run) -> tuple[object, int]:
    """run()'s value and the bytes this process read meanwhile (Linux's rchar: read() calls, page cache included)."""
    def rchar() -> int:
        return int(next(line for line in PROC_IO.read_text().splitlines() if line.startswith("rchar:")).split()[1])
    before = rchar()
    value = run()
    return value, rchar() - before


def big_checkpoints(directory: Path, steps: range) -> int:
    """Sealed checkpoints of 2 MiB of weights each (reads of them dwarf everything else); the size of one."""
    for step in steps:
        path = save_checkpoint(directory, {"step": step, "model": {"w": torch.full((2**19,), float(step))},
                                           "params_hash": "p", "code": {}, "model_config": {}, "vocab_size": 1}, keep=10)
    return path.stat().st_size


@pytest.mark.skipif(not PROC_IO.exists(), reason="counts bytes read with Linux's /proc/self/io")
def test_resuming_reads_the_checkpoint_it_resumes_once_and_no_older_one(tmp_path, caplog):
    """Checked and loaded from one read (what is loaded is what was checked); a corrupt older checkpoint goes
    unnoticed until `average` reads it, if it does."""
    size = big_checkpoints(tmp_path, range(1, 6))
    (tmp_path / "step_00000002.pt").write_bytes(b"corrupt")
    with caplog.at_level(logging.WARNING):
        found, read = bytes_read(lambda: resume_point(tmp_path, "p", {}))
    assert found.path.name == "step_00000005.pt" and torch.equal(found.payload["model"]["w"], torch.full((2**19,), 5.0))
    assert size <= read < 1.2 * size, f"read {read / size:.2f} checkpoints' worth"
    assert "step_00000002" not in caplog.text


@pytest.mark.skipif(not PROC_IO.exists(), reason="counts bytes read with Linux's /proc/self/io")
def test_the_average_stage_reads_the_last_n_checkpoints_once_each_and_no_older_one(tmp_path, caplog):
    size = big_checkpoints(tmp_path / "ck", range(1, 7))
    (tmp_path / "ck" / "step_00000002.pt").write_bytes(b"corrupt")
    data = bytearray((tmp_path / "ck" / "step_00000005.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # a corrupt one among the newest: skipped, the next older one taken instead
    (tmp_path / "ck" / "step_00000005.pt").write_bytes(bytes(data))
    (tmp_path / "params.yaml").write_text("average:\n  last_n: 3\n")
    args = ["--checkpoints", str(tmp_path / "ck"), "--out", str(tmp_path / "model"), "--params", str(tmp_path / "params.yaml")]
    average.main(args)  # once first: the stage's imports (MLflow...) are read on its first run
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, read = bytes_read(lambda: average.main(args))
    averaged = load_checkpoint(tmp_path / "model" / "model.pt")
    assert averaged["steps"] == [3, 4, 6] and torch.equal(averaged["model"]["w"], torch.full((2**19,), 13 / 3))
    assert 4 * size <= read < 4.2 * size, f"read {read / size:.2f} checkpoints' worth"  # 3 averaged + 1 corrupt
    assert "step_00000005" in caplog.text and "step_00000002" not in caplog.text
