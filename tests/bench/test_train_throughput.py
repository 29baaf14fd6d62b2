"""bench.cpu.train_throughput measures the model that conf/ composes with the overrides it is given."""

import pytest
import torch

from bench.harness import VOCAB, default_configs, our_step, synthetic_batches
from model.transformer import Transformer
from pipeline.core.config import ParamsError


def test_the_benchmark_composes_its_model_from_the_overrides():
    default, _ = default_configs()
    sinusoidal, train = default_configs(["model.positional_encoding=sinusoidal", "model.rotary_base=10000",
                                         "train.weight_decay=0.1"])
    assert default.positional_encoding == "rotary" and sinusoidal.positional_encoding == "sinusoidal"
    assert sinusoidal.rotary_base == 10000 and train.weight_decay == 0.1
    assert sinusoidal.shape() == default.shape()  # the same products: only the positions differ
    with pytest.raises(ParamsError, match="model.rotary_base: used by positional_encoding rotary only"):
        default_configs(["model.positional_encoding=sinusoidal"])  # the default's base 1000 without rotary


def test_the_benchmarks_step_trains_with_r_drop_where_the_overrides_set_it(one_thread):
    torch.set_num_threads(1)  # one_thread restores the count
    *_, (batch,) = synthetic_batches(400, 1)
    weights = {}
    for name, overrides in (("plain", []), ("again", []),
                            ("rdrop", ["train.rdrop_alpha=12.5", "train.rdrop_fraction=0.25"])):
        cfg, train_cfg = default_configs(overrides)
        torch.manual_seed(0)
        model = Transformer(cfg, VOCAB)
        our_step(model, train_cfg)(batch)
        weights[name] = model.embedding.weight.detach().clone()
    torch.testing.assert_close(weights["again"], weights["plain"])  # the step itself is repeatable
    assert not torch.equal(weights["rdrop"], weights["plain"])  # rows twice and a KL: other gradients
