"""A CPU's matrix products in training: fp32 against bf16 on AMX tiles (train.cpu_matmul), in the default's step.

    python -m bench.cpu_matmul [--steps 12] [--rounds 3] [--threads 2]

The default's training step as bench.train_throughput times it (pipeline.training.optimizer.train_step on
synthetic 1250-token batches shaped like Multi30k's, the default's model), one model per way, alternating
rounds in one process so that load from other programs hits every way alike:
  fp32         torch's default: fp32 products, its flash attention kernel for CPUs;
  bf16         what train.cpu_matmul = auto trains with on a CPU with AMX: bf16 products
               (pipeline/training/cpu_matmul.py) and torch's math attention kernel
               (pipeline/training/attention.py);
  bf16, flash  bf16 products with the flash kernel: why attention changes with them.
Prints target tokens/s (best and median round) and each way's speed over fp32. Targets: bf16 >= 1.3x fp32,
and faster than bf16 with the flash kernel. On a CPU without AMX only fp32 runs: bf16 does not apply.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.train_throughput import VOCAB, default_configs, our_step, synthetic_batches
from model.transformer import Transformer
from pipeline.training import attention, cpu_matmul, distributed

CPU = torch.device("cpu")


@contextlib.contextmanager
def way(products: str, flash: bool = False):
    """Run the block with `products` and the attention kernels the trainer picks for them (or the flash kernel)."""
    cpu_matmul.use(products)
    attention.use(CPU)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext():
            yield
    finally:
        cpu_matmul.use("fp32")
        attention.use(CPU)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per round and way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, train_cfg = default_configs()
    amx = cpu_matmul.has_amx()
    ways = {"fp32": ("fp32", False)}
    if amx:
        ways |= {"bf16": ("bf16", False), "bf16, flash": ("bf16", True)}
    print(f"{torch.get_num_threads()} threads; AMX (amx_bf16): {'yes' if amx else 'no: bf16 does not apply here'}; "
          f"train.cpu_matmul of the default: {train_cfg.cpu_matmul}")
    _, _, _, _, data = synthetic_batches(1250, args.steps + 1)
    warmup, timed = data[0], data[1:]
    tokens = sum(b.tokens for b in timed)
    steps = {}
    for name, (products, flash) in ways.items():
        torch.manual_seed(0)
        steps[name] = our_step(Transformer(cfg, VOCAB), train_cfg)
        with way(products, flash):
            steps[name](warmup)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name, (products, flash) in ways.items():
            with way(products, flash):
                start = time.perf_counter()
                for b in timed:
                    steps[name](b)
                seconds[name].append(time.perf_counter() - start)
            print(f"  round {r + 1} {name:12s} {tokens / seconds[name][-1]:8.0f} tok/s")
    print(f"{'':12s} {'tok/s (best)':>13s} {'tok/s (median)':>15s} {'x fp32 (best)':>14s}")
    for name, times in seconds.items():
        print(f"{name:12s} {tokens / min(times):13.0f} {tokens / statistics.median(times):15.0f} "
              f"{min(seconds['fp32']) / min(times):13.2f}x")
    if amx:
        print(f"bf16 products: {min(seconds['fp32']) / min(seconds['bf16']):.2f}x fp32 (target >= 1.3x), "
              f"{min(seconds['bf16, flash']) / min(seconds['bf16']):.2f}x bf16 with the flash kernel (target > 1x)")


if __name__ == "__main__":
    main()
