"""stages.average: the mean of the last checkpoints, exact, refused when they do not belong together."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.weights import averaging
from stages import average
from pipeline.weights.checkpoint import save_checkpoint
from tests.fixtures.translation import one_thread, shared_store, store  # noqa: F401 (fixtures)

CONFIG = dict(n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, dropout=0.1,
              positional_encoding="sinusoidal", max_positions=64)
VOCAB = 20


def payload(step: int, state: dict, params_hash: str = "abc", model_config: dict = CONFIG) -> dict:
    return {"step": step, "model": state, "model_config": dict(model_config), "vocab_size": VOCAB,
            "params_hash": params_hash, "optimizer": {"state": {}, "param_groups": []}}


def random_state(seed: int, **overrides) -> dict:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**CONFIG, **overrides}), VOCAB).state_dict()


def run(tmp_path: Path, last_n: int) -> dict:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"average": {"last_n": last_n}}))
    average.main(["--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model"), "--params", str(params)])
    return torch.load(tmp_path / "model" / "model.pt", weights_only=True)


def test_averaging_identical_checkpoints_is_the_identity(tmp_path):
    state = random_state(0)
    for step in (10, 20, 30):
        save_checkpoint(tmp_path / "ckpt", payload(step, state), keep=10)
    out = run(tmp_path, 3)
    assert out["model"].keys() == state.keys()
    assert all(torch.equal(out["model"][k], state[k]) for k in state)
    assert out["steps"] == [10, 20, 30]
    assert out["model_config"] == CONFIG and out["vocab_size"] == VOCAB and out["params_hash"] == "abc"
    assert json.loads((tmp_path / "model" / "averaged.json").read_text())["steps"] == [10, 20, 30]


def test_the_average_is_logged_to_mlflow(tmp_path, store):
    for step in (10, 20):
        save_checkpoint(tmp_path / "ckpt", payload(step, random_state(step)), keep=10)
    run(tmp_path, 2)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.stage = 'average'",
                              order_by=["attributes.start_time DESC"])
    latest = runs.iloc[0]
    assert latest["params.average.last_n"] == "2"
    assert latest["metrics.averaged_checkpoints"] == 2 and latest["metrics.last_step"] == 20


def test_two_checkpoints_average_to_their_exact_mean(tmp_path):
    a, b = random_state(1), random_state(2)
    save_checkpoint(tmp_path / "ckpt", payload(1, a), keep=10)
    save_checkpoint(tmp_path / "ckpt", payload(2, b), keep=10)
    out = run(tmp_path, 2)
    for k in a:
        expected = ((a[k].double() + b[k].double()) / 2).float()
        assert torch.equal(out["model"][k], expected), k
    # the model loads and runs with the averaged weights
    model = Transformer(ModelConfig(**out["model_config"]), out["vocab_size"])
    model.load_state_dict(out["model"])


def test_mean_is_accumulated_in_float64(tmp_path):
    """1 + 2^-24 + 2^-24 is 1 in float32 (each addition rounds back), 1 + 2^-23 in float64."""
    base = random_state(0)
    values = (1.0, 2.0**-24, 2.0**-24)
    for step, v in enumerate(values, 1):
        save_checkpoint(tmp_path / "ckpt", payload(step, {k: torch.full_like(t, v) for k, t in base.items()}), keep=10)
    out = run(tmp_path, 3)
    exact = torch.tensor(sum(values) / 3, dtype=torch.float64).float()
    float32_running = (torch.tensor(1.0) + torch.tensor(2.0**-24) + torch.tensor(2.0**-24)) / 3
    assert exact != float32_running  # the test can tell the two apart
    assert all(torch.all(t == exact) for t in out["model"].values())


def test_last_n_one_is_the_newest_checkpoint_bit_for_bit(tmp_path):
    states = [random_state(s) for s in range(3)]
    for step, state in zip((100, 200, 300), states):
        save_checkpoint(tmp_path / "ckpt", payload(step, state), keep=10)
    out = run(tmp_path, 1)
    assert out["steps"] == [300]
    assert all(torch.equal(out["model"][k], states[-1][k]) for k in states[-1])


def test_checkpoints_of_different_shapes_are_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", payload(1, random_state(0)), keep=10)
    wider = payload(2, random_state(0, d_ff=48), model_config={**CONFIG, "d_ff": 48})
    save_checkpoint(tmp_path / "ckpt", wider, keep=10)
    with pytest.raises(averaging.AverageError, match=r"step_00000001\.pt with .*step_00000002\.pt: model_config"):
        run(tmp_path, 2)
    assert not (tmp_path / "model").exists()


def test_checkpoints_with_different_tensors_but_same_header_are_refused(tmp_path):
    a, b = random_state(0), random_state(1)
    b["encoder.0.ffn.w_1.weight"] = torch.zeros(3, 3)
    save_checkpoint(tmp_path / "ckpt", payload(1, a), keep=10)
    save_checkpoint(tmp_path / "ckpt", payload(2, b), keep=10)
    expected = r"encoder\.0\.ffn\.w_1\.weight is torch.float32 \[32, 16\] vs torch.float32 \[3, 3\]"
    with pytest.raises(averaging.AverageError, match=expected):
        run(tmp_path, 2)


def test_checkpoints_from_different_params_are_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", payload(1, random_state(0), params_hash="aaa"), keep=10)
    save_checkpoint(tmp_path / "ckpt", payload(2, random_state(1), params_hash="bbb"), keep=10)
    with pytest.raises(averaging.AverageError, match=r"step_00000002\.pt: params_hash differs \('aaa' vs 'bbb'\)"):
        run(tmp_path, 2)


def test_fewer_checkpoints_than_last_n_are_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", payload(1, random_state(0)), keep=10)
    save_checkpoint(tmp_path / "ckpt", payload(2, random_state(1)), keep=10)
    with pytest.raises(averaging.AverageError, match=r"last_n = 3 but only 2 complete checkpoint\(s\) "
                                                    r"\(step_00000001\.pt, step_00000002\.pt\)"):
        run(tmp_path, 3)


def test_a_corrupt_checkpoint_is_never_averaged(tmp_path, caplog):
    states = [random_state(s) for s in range(3)]
    paths = [save_checkpoint(tmp_path / "ckpt", payload(step, s), keep=10) for step, s in zip((1, 2, 3), states)]
    data = bytearray(paths[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    paths[-1].write_bytes(bytes(data))
    out = run(tmp_path, 2)
    assert out["steps"] == [1, 2]
    assert "step_00000003.pt" in caplog.text
    with pytest.raises(averaging.AverageError, match="only 2 complete"):
        run(tmp_path, 3)


def test_a_failed_write_leaves_the_previous_model_intact(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "ckpt", payload(1, random_state(0)), keep=10)
    run(tmp_path, 1)
    before = (tmp_path / "model" / "model.pt").read_bytes()
    save_checkpoint(tmp_path / "ckpt", payload(2, random_state(1)), keep=10)

    def half_save(obj, f):  # f: the sealed write's file object
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(OSError, match="No space left"):
        run(tmp_path, 1)
    assert (tmp_path / "model" / "model.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model", "params.yaml"]  # no temporaries


def test_checkpoints_with_different_tensor_names_are_refused(tmp_path):
    a, b = random_state(0), random_state(1)
    b["decoder.9.extra"] = b.pop("decoder.1.ffn.w_2.bias")
    save_checkpoint(tmp_path / "ckpt", payload(1, a), keep=10)
    save_checkpoint(tmp_path / "ckpt", payload(2, b), keep=10)
    with pytest.raises(averaging.AverageError, match=r"only in the first: \['decoder\.1\.ffn\.w_2\.bias'\]; "
                                                    r"only in the second: \['decoder\.9\.extra'\]"):
        run(tmp_path, 2)
