"""R-Drop's cost on this CPU: the default's training step plain, with a share of each batch's rows passing twice
(train.rdrop_fraction 0.1, 0.25) and with every row twice (1.0).

    python -m bench.cpu.rdrop [--steps 12] [--rounds 4] [--threads 2] [--alpha 12.5] [--fractions 0.1 0.25 1.0]
                          [--cpu-matmul auto]

The step as bench.cpu.train_throughput times it (pipeline.training.optimizer.train_step, synthetic 1250-token batches of
the default's shapes and vocabulary, the products and attention kernels the train stage picks on this CPU for the
default's train.cpu_matmul or for --cpu-matmul, under autocast where that choice trains so), the same starting weights
for each way, the ways alternating in the same rounds so that load from other programs hits all alike; each way warmed
on a batch of a shape the timed steps do not meet. Prints target tokens/s (best round) and each way's step time over the
plain step's, against 1 + fraction, the passes a pair takes (model/rdrop.py): the time the FLOPs count would predict.
"""

from __future__ import annotations

import argparse

import torch

from bench.harness import alternate, default_configs, our_step, over, synthetic_batches, under_autocast
from model.transformer import Transformer
from pipeline.core import config
from pipeline.device import attention, cpu_matmul
from pipeline.device.precision import resolve

FRACTIONS = (0.1, 0.25, 1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=12.5, help="train.rdrop_alpha (no effect on the time)")
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS, help="train.rdrop_fraction values")
    parser.add_argument("--cpu-matmul", choices=cpu_matmul.SETTINGS, help="train.cpu_matmul (the default's if absent)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = config.compose([])["tokenize"]["vocab_size"]  # the whole logits R-Drop builds grow with it
    setting = [f"train.cpu_matmul={args.cpu_matmul}"] if args.cpu_matmul else []
    precision = resolve(default_configs(setting)[1].cpu_matmul, torch.device("cpu"))
    precision.use()  # the products and attention kernels the train stage uses on this CPU
    attention.use(torch.device("cpu"))
    print(f"torch {torch.__version__}, {args.threads} threads, {precision.label}, alpha {args.alpha}, "
          f"vocabulary {vocab}")
    *_, batches = synthetic_batches(1250, args.steps + 32, vocab)
    timed = batches[:args.steps]
    shapes = {(*b.src.shape, b.tgt_in.shape[1]) for b in timed}
    warm = next((b for b in batches[args.steps:] if (*b.src.shape, b.tgt_in.shape[1]) not in shapes), None)
    if warm is None:
        raise SystemExit("bench.cpu.rdrop: no batch of a shape the timed steps lack to warm up on: lower --steps")
    tokens = sum(b.tokens for b in timed)
    ways = {"plain": setting}
    ways.update({f"fraction {f}": [*setting, f"train.rdrop_alpha={args.alpha}", f"train.rdrop_fraction={f}"]
                 for f in args.fractions})
    steps = {}
    for name, overrides in ways.items():
        cfg, train_cfg = default_configs(overrides)
        torch.manual_seed(0)
        steps[name] = under_autocast(our_step(Transformer(cfg, vocab), train_cfg), precision)
        steps[name](warm)
    best = {name: min(times) for name, times in alternate({n: over(s, timed) for n, s in steps.items()},
                                                          args.rounds).items()}
    for name in ways:
        passes = 1.0 if name == "plain" else 1 + float(name.split()[1])
        print(f"{name}: {tokens / best[name]:.0f} target tokens/s, step time {best[name] / best['plain']:.2f}x the "
              f"plain step's (passes {passes:.2f}x)")


if __name__ == "__main__":
    main()
