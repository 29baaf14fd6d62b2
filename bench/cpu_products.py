"""The default's fp32 matrix products one by one on a CPU: torch's BLAS (MKL) against oneDNN called directly.

    python -m bench.cpu_products [OVERRIDE ...] [--repeats 30] [--threads N]

For each kind of weight matrix of the default's model (conf/ composed with the OVERRIDEs; attention's stacked
projections, the feed-forward's two layers, the shared embedding as the output projection) and
batch.max_tokens rows: the forward product and the two of its backward (input and weight gradients),
each timed by torch's BLAS (what `torch.nn.functional.linear` and `@` run with train.cpu_matmul = blas)
and by oneDNN through `torch.ops.mkldnn._linear_pointwise` (its fp32 kernels, whatever torch's
dispatch would choose on this CPU), the median of --repeats after 5 warm-up calls, one product at a time
(BLAS's calls, then oneDNN's). Each product is warmed on the shape it then times: this flatters oneDNN,
which compiles and keeps a kernel per shape (a run's 217 batch shapes meet it colder), so a result
against oneDNN holds for the train stage. Prints a line per product (ms,
oneDNN's speed over BLAS's, their largest difference relative to the product's largest entry) and the
sums; exits non-zero if the two disagree beyond fp32 rounding. Which library the train stage uses on
which CPU: pipeline/device/cpu_matmul.py; figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.core import config
from pipeline.core.config import BatchConfig, ModelConfig, TokenizeConfig
from pipeline.device import distributed

AGREE = 1e-4  # fp32 products of these sizes differ by ~1e-6 of their largest entry; bf16 rounding by ~1e-2


def weight_shapes(model: ModelConfig, vocab: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of each kind of weight matrix of the model."""
    d, heads = model.d_model, model.n_heads
    return [("self-attention q, k, v", d, heads * (2 * model.d_k + model.d_v)),
            ("attention output", heads * model.d_v, d), ("cross-attention k, v", d, heads * (model.d_k + model.d_v)),
            ("feed-forward 1", d, model.d_ff), ("feed-forward 2", model.d_ff, d), ("output projection", d, vocab)]


Product = Callable[[], torch.Tensor]


def median_seconds(fn: Product, repeats: int, warmup: int = 5) -> float:
    """The median seconds of `repeats` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def products(rows: int, n_in: int, n_out: int) -> list[tuple[str, Product, Product]]:
    """(name, BLAS, oneDNN) for the forward product and the two backward ones of a [n_out, n_in] weight."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, n_in, generator=generator), torch.randn(n_out, n_in, generator=generator)
    g = torch.randn(rows, n_out, generator=generator)
    w_t, g_t, x_t = w.t().contiguous(), g.t().contiguous(), x.t().contiguous()
    onednn = torch.ops.mkldnn._linear_pointwise
    return [("forward x W^T", lambda: F.linear(x, w), lambda: onednn(x, w, None, "none", [], "")),
            ("input gradient g W", lambda: g @ w, lambda: onednn(g, w_t, None, "none", [], "")),
            ("weight gradient g^T x", lambda: g.t() @ x, lambda: onednn(g_t, x_t, None, "none", [], ""))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of conf/")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = config.compose(args.overrides)
    model = config.parse(params, "model", ModelConfig)
    vocab = config.parse(params, "tokenize", TokenizeConfig).vocab_size
    rows = config.parse(params, "batch", BatchConfig).max_tokens
    print(f"{rows} rows, {args.threads} threads, median of {args.repeats}: torch's BLAS against oneDNN, fp32")
    total_blas = total_onednn = worst = 0.0
    for name, n_in, n_out in weight_shapes(model, vocab):
        for product, blas, onednn in products(rows, n_in, n_out):
            expected = blas()
            worst_here = float((onednn() - expected).abs().max() / expected.abs().max())
            t_blas, t_onednn = median_seconds(blas, args.repeats), median_seconds(onednn, args.repeats)
            total_blas, total_onednn, worst = total_blas + t_blas, total_onednn + t_onednn, max(worst, worst_here)
            print(f"{name} {n_in} x {n_out}, {product}: BLAS {t_blas * 1e3:.3f} ms, oneDNN {t_onednn * 1e3:.3f} ms, "
                  f"{t_blas / t_onednn:.2f}x, difference {worst_here:.1e}")
    print(f"all: BLAS {total_blas * 1e3:.2f} ms, oneDNN {total_onednn * 1e3:.2f} ms, "
          f"oneDNN {total_blas / total_onednn:.2f}x")
    if worst > AGREE:
        raise SystemExit(f"oneDNN's products differ from torch's BLAS by {worst:.1e} of their largest entry "
                         f"(more than fp32 rounding, {AGREE:.0e}): not fp32 on this CPU")


if __name__ == "__main__":
    main()
