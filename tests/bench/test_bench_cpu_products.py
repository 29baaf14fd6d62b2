"""bench.cpu_products: each of the default's fp32 products by torch's BLAS and by oneDNN, timed and compared."""

import re

import pytest

from bench import cpu_products
from model.config import ModelConfig
from pipeline.core import config

TINY = ["model.d_model=32", "model.n_heads=2", "model.d_k=16", "model.d_v=16", "model.d_ff=64",
        "tokenize.vocab_size=96", "batch.max_tokens=24", "--repeats", "1", "--threads", "1"]


def test_bench_cpu_products_times_every_product_of_every_weight_shape_and_the_two_libraries_agree(capsys):
    cpu_products.main(TINY)
    header, *lines, total = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("24 rows, 1 threads")
    assert len(lines) == 6 * 3
    assert [line.rsplit(",", 4)[0] for line in lines[::3]] == [
        "self-attention q, k, v 32 x 96", "attention output 32 x 32", "cross-attention k, v 32 x 64",
        "feed-forward 1 32 x 64", "feed-forward 2 64 x 32", "output projection 32 x 96"]
    for line in lines:
        blas, onednn = map(float, re.findall(r"([0-9.]+) ms", line))
        assert blas > 0 and onednn > 0
        assert float(line.rsplit("difference ", 1)[1]) < cpu_products.AGREE
    assert total.startswith("all: BLAS")


def test_bench_cpu_products_fails_where_onednn_rounds_the_products(monkeypatch):
    products = cpu_products.products

    def rounded(rows, n_in, n_out):  # oneDNN's products as bf16 would leave them
        return [(name, blas, lambda onednn=onednn: onednn().bfloat16().float())
                for name, blas, onednn in products(rows, n_in, n_out)]

    monkeypatch.setattr(cpu_products, "products", rounded)
    with pytest.raises(SystemExit, match="not fp32 on this CPU"):
        cpu_products.main(TINY)


def test_weight_shapes_of_the_default_model():
    model = config.parse(config.compose([]), "model", ModelConfig)
    assert [(i, o) for _, i, o in cpu_products.weight_shapes(model, 5000)] == [
        (256, 768), (256, 256), (256, 512), (256, 1024), (1024, 256), (256, 5000)]
