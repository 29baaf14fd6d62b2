"""pipeline.translation.decoding.decoding_precision: translate.precision, the weights cast once (auto: fp32 on every device).

A GPU with bf16 is pretended on the CPU (precision.autocast_dtype patched): CPUs run bf16 kernels too, so the
cast and the decoding in it are exercised here; the stage's own CPU run stays fp32 (tests/translation/test_translate.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.beam_search import beam_search
from pipeline.core.config import ParamsError, TranslateConfig, parse
from pipeline.device import precision
from pipeline.translation import decoding
from tests.fixtures.beam import BOS, EOS, V, sources, tiny_model


class LinearWeights(TorchDispatchMode):
    """Records whether each aten.linear call got one of `params` as its weight, or a copy of one (a cast)."""

    def __init__(self, params):
        super().__init__()
        self.pointers, self.own = {p.data_ptr() for p in params}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.linear:
            self.own.append(args[1].data_ptr() in self.pointers)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def bf16_device(monkeypatch):
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: torch.bfloat16)


def test_the_weights_are_cast_once_and_decoding_casts_none_of_them(bf16_device):
    model = tiny_model()
    assert decoding.decoding_precision(model, "bf16") == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}  # the positional encoding too
    weights = LinearWeights(model.parameters())
    with weights:
        beam_search(model, sources([5, 3, 8], seed=1), 4, 0.6, 1.0, 6, BOS, EOS)
    assert weights.own and all(weights.own)  # every product used the cast weights themselves
    # What the cast replaced: autocast around the steps hands every product a bf16 copy of its fp32 weight.
    fp32 = tiny_model()
    weights = LinearWeights(fp32.parameters())
    with weights, torch.autocast("cpu", dtype=torch.bfloat16):
        beam_search(fp32, sources([5, 3, 8], seed=1), 4, 0.6, 1.0, 6, BOS, EOS)
    assert weights.own and not any(weights.own)


def test_bf16_decoding_gives_valid_translations_within_each_length_limit(bf16_device):
    model = tiny_model(seed=4)
    decoding.decoding_precision(model, "bf16")
    cfg = TranslateConfig(beam_size=4, length_penalty=0.6, max_len_a=1.0, max_len_b=5, max_tokens=200)
    g = np.random.default_rng(0)
    srcs = [g.integers(4, V, size=n) for n in (3, 7, 1, 12, 5)]
    outputs = decoding.translate_ids(model, srcs, cfg, progress=False)
    assert len(outputs) == len(srcs) and any(outputs)
    for src, out in zip(srcs, outputs):
        assert len(out) + 1 <= cfg.max_len_a * (len(src) + 1) + cfg.max_len_b  # EOS counted, source with EOS
        assert all(4 <= t < V for t in out), out  # no PAD, UNK, BOS or EOS inside a translation


def test_a_cpu_decodes_in_fp32_leaving_the_model_as_it_is():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert decoding.decoding_precision(model) == torch.float32
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())


def test_auto_decodes_in_fp32_where_training_runs_bf16_and_a_setting_forces_another(bf16_device):
    """bf16 weights decoded slower than fp32 on the GPU measured: auto keeps fp32; fp16 or bf16 only when asked."""
    model = tiny_model()
    assert decoding.decoding_precision(model, "auto") == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert decoding.decoding_precision(tiny_model(), "fp16") == torch.float16
    with pytest.raises(ParamsError, match=r"translate\.precision"):
        parse({"translate": {"beam_size": 4, "length_penalty": 0.6, "max_len_a": 1.0, "max_len_b": 5,
                             "max_tokens": 200, "precision": "int8"}}, "translate", TranslateConfig)


def test_the_precision_bench_decodes_the_same_model_in_fp32_and_bf16_and_scores_both(tmp_path, capsys):
    from bench.decoding import precision as decode_precision
    from tests.fixtures.translation import make_corpus, save_model

    raw, tokenized = make_corpus(tmp_path)
    results = decode_precision.main(["--model", str(save_model(tmp_path / "model", tokenized)), "--tokenized",
                                     str(tokenized), "--raw", str(raw), "--dtype", "bf16"])
    assert list(results) == ["fp32", "bf16"]
    assert all(len(r["hyps"]) == len(raw.joinpath("test.de").read_text().splitlines()) for r in results.values())
    assert "bf16 - fp32: sacreBLEU" in capsys.readouterr().out.splitlines()[-1]
