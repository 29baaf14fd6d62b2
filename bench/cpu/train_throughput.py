"""Training throughput: our training step against torch.nn.Transformer of the same size, same batches, same loss.

    python -m bench.cpu.train_throughput [OVERRIDE ...] [--steps 8] [--rounds 2] [--threads N]

The default model (conf/ composed with the OVERRIDEs, Hydra overrides as `dvc exp run -S` takes them, e.g.
`model.positional_encoding=sinusoidal model.rotary_base=10000`; with none, the `small` preset) with an
8000-token vocabulary, trained on synthetic batches shaped like Multi30k's
(29000 pairs, source ~ 14 +- 5 tokens, target ~ 15 +- 6 and following the
source, plus EOS/BOS), bucketed by pipeline.corpus.batching.make_batches at
batch.max_tokens = 2500, one batch per step.

  ours      pipeline.training.optimizer.train_step with build_optimizer (what the train
            stage runs): SmoothedLoss (projection and loss on real target
            tokens only), fused Adam, the paper's dropout placement with
            model/dropout.py's masks (docs/benchmarks.md has them timed alone).
  baseline  torch.nn.Transformer(d_model, nhead, layers, dim_feedforward,
            dropout, batch_first=True), post-norm as the paper, with the same
            shared embedding (x sqrt(d_model)), sinusoidal encoding, output
            projection through the embedding matrix, and label-smoothed
            cross-entropy ignoring padding, computed over all positions; Adam
            with the same settings. It also has what torch adds on top of the
            paper (attention- and ReLU-dropout, a final LayerNorm per stack).

Both run in one process, alternating rounds of `--steps` timed steps (after one
warm-up step each) so that load from other programs hits both alike, with the
matrix products the default's train.cpu_matmul resolves to on this CPU (the run's
Precision, pipeline/device/precision.py: fp32 by oneDNN or torch's BLAS for the
default) and the attention kernels that go with them, for both; ours as the preset
trains it (R-Drop's cost: docs/benchmarks.md). Reported: real target tokens per second, and MFU = analytic
training FLOPs (model.flops.training_flops on real tokens) / (best round's time x
the machine's matmul peak in those products: the best of
model.flops.measure_matmul_peak before and after every round, since a shared
machine's load changes while we run). Targets on a 2-core CPU:
ours >= 1.3x the baseline's tokens/s, and MFU >= 0.45 of the measured peak.
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.harness import (MAX_TOKENS, VOCAB, alternate, on_this_cpu, our_step, over, synthetic_batches,
                           under_autocast)
from model import flops as flops_lib
from model.config import ModelConfig
from model.loss import SmoothedLoss
from model.positions import sinusoidal_encoding
from model.transformer import Transformer
from pipeline.core import config
from pipeline.device import distributed
from pipeline.corpus.formats import PAD_ID
from pipeline.training.loader import Batch
from pipeline.training.optimizer import build_optimizer, train_step
from pipeline.device.precision import Precision
from pipeline.corpus.batching import make_batches


class TorchTransformer(nn.Module):
    """The baseline: nn.Transformer with our embedding, positional encoding and tied output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = math.sqrt(cfg.d_model)
        self.embedding = nn.Embedding(VOCAB, cfg.d_model, padding_idx=PAD_ID)
        nn.init.normal_(self.embedding.weight, std=1 / self.scale)
        self.register_buffer("pe", sinusoidal_encoding(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.n_layers, cfg.d_ff, cfg.dropout,
                                          batch_first=True)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.dropout(self.embedding(tokens) * self.scale + self.pe[: tokens.shape[1]])

    def forward(self, src: Tensor, tgt_in: Tensor, labels: Tensor, label_smoothing: float) -> Tensor:
        T = tgt_in.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = may not attend (the future)
        hidden = self.transformer(self.embed(src), self.embed(tgt_in), tgt_mask=causal, tgt_is_causal=True,
                                  src_key_padding_mask=src == PAD_ID, tgt_key_padding_mask=tgt_in == PAD_ID,
                                  memory_key_padding_mask=src == PAD_ID)
        logits = hidden @ self.embedding.weight.t()  # [B, T, V]
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=PAD_ID,
                               label_smoothing=label_smoothing, reduction="sum")


def baseline_step(model: TorchTransformer, optimizer: torch.optim.Optimizer, batch: Batch, lr: float,
                  label_smoothing: float) -> None:
    loss = model(batch.src, batch.tgt_in, batch.labels, label_smoothing) / batch.tokens
    loss.backward()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of conf/, e.g. model.dropout=0.2")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    args = parser.parse_args(argv)
    cfg, train_cfg, precision = on_this_cpu(args.overrides, args.threads)
    print(f"model {cfg}, vocab {VOCAB}, batch.max_tokens {MAX_TOKENS}, {torch.get_num_threads()} threads, "
          f"{precision.label} (train.cpu_matmul = {train_cfg.cpu_matmul}) for both")

    src, tgt, batches, order, data = synthetic_batches(MAX_TOKENS, args.steps + 1)
    warmup, timed = data[0], data[1:]
    lens = [(np.diff(src.offsets)[batches[b]] + 1, np.diff(tgt.offsets)[batches[b]] + 1) for b in order[1:]]
    flops = sum(flops_lib.training_flops(cfg, VOCAB, S, T) for S, T in lens)
    tokens = sum(b.tokens for b in timed)
    real = tokens / sum(b.labels.numel() for b in timed)
    print(f"{len(timed)} timed batches: {tokens} target tokens ({real:.1%} of padded positions), "
          f"{flops / len(timed) / 1e9:.1f} GFLOP per step (analytic, training)")

    torch.manual_seed(0)
    ours = Transformer(cfg, VOCAB)
    run_ours = our_step(ours, train_cfg)
    base = TorchTransformer(cfg)
    base_opt = build_optimizer(base, train_cfg)
    n_ours, n_base = (sum(p.numel() for p in m.parameters()) for m in (ours, base))
    print(f"parameters: ours {n_ours / 1e6:.2f}M, nn.Transformer {n_base / 1e6:.2f}M")
    run_base = lambda b: baseline_step(base, base_opt, b, 1e-4, train_cfg.label_smoothing)
    run_ours, run_base = (under_autocast(step, precision) for step in (run_ours, run_base))  # the same for both
    matmul_dtype = precision.dtype
    for step in (run_ours, run_base):
        step(warmup)

    peaks = [flops_lib.measure_matmul_peak(matmul_dtype)]  # before and after every round: the load changes

    def said(r: int, name: str, seconds: float) -> None:
        print(f"  round {r + 1} {name:15s} {tokens / seconds:8.0f} tok/s")
        if name == "nn.Transformer":
            peaks.append(flops_lib.measure_matmul_peak(matmul_dtype))
    seconds = alternate({"ours": over(run_ours, timed), "nn.Transformer": over(run_base, timed)}, args.rounds, said)
    peak = max(peaks)  # the machine's peak; lower figures were measured under someone else's load
    print(f"{precision.label} matmul peak: {peak / 1e9:.1f} GFLOP/s "
          f"(best of {', '.join(f'{p / 1e9:.0f}' for p in peaks)})")
    print(f"{'':15s} {'tok/s (best)':>13s} {'tok/s (median)':>15s} {'MFU (best)':>11s}")
    best = {}
    for name, times in seconds.items():
        best[name] = tokens / min(times)
        print(f"{name:15s} {best[name]:13.0f} {tokens / statistics.median(times):15.0f} {flops / min(times) / peak:11.1%}")
    print(f"speed-up: {best['ours'] / best['nn.Transformer']:.2f}x (target >= 1.3x); "
          f"MFU {flops / min(seconds['ours']) / peak:.1%} of the measured {precision.peak} peak (target >= 45%)")

if __name__ == "__main__":
    main()
