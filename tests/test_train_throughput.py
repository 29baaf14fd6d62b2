"""bench.train_throughput measures the model that conf/ composes with the overrides it is given."""

import pytest

from bench.train_throughput import default_configs
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
