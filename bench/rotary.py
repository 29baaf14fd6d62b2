"""Rotary's two turns of the queries and keys, forward + backward: as complex numbers in fp32 (the eager turn of
model/positions.py) against pair by pair with real products in x's dtype (its compiled turn).

    python -m bench.rotary [--device cpu|cuda] [--dtype bf16|fp32] [--shapes default base big] [--repeats 50]
                           [--rounds 3] [--threads 2]

Shapes ([B, L, G * d_k] and d_k): default [81, 19, 512], d_k 32 (a batch of the default's); base [800, 34, 512] and
big [400, 34, 1024], d_k 64 (batches of the paper presets' widths). Per shape: each way's best round of --repeats
forward + backward passes (the two ways alternating in the same rounds, each warmed on a length the timed passes do not
meet), the pair-by-pair time over the complex one, and each way's mean error against the fp64 turn of the same inputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu_setup import sync
from model.positions import Rotary

SHAPES = {"default": ((81, 19, 512), 32), "base": ((800, 34, 512), 64), "big": ((400, 34, 1024), 64)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def passes(turn, x: torch.Tensor, grad: torch.Tensor, repeats: int) -> float:
    """Seconds of `repeats` forward + backward passes of `turn` on x."""
    sync(x.device)
    start = time.perf_counter()
    for _ in range(repeats):
        x.grad = None
        turn(x, 0).backward(grad)
    sync(x.device)
    return time.perf_counter() - start


def measure(name: str, device: torch.device, dtype: torch.dtype, repeats: int, rounds: int) -> dict:
    """One shape's figures: ms a pass of each way (best round), and each way's mean error against the fp64 turn."""
    (batch, length, width), d_k = SHAPES[name]
    rotary = Rotary(d_k, 1024, 1000.0).to(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    lengths = (length, length, length + 1)  # warm-up on a length the timed passes do not meet
    x, grad, warm = (torch.randn(batch, n, width, generator=generator).to(device, dtype) for n in lengths)
    x.requires_grad_(True)
    warm.requires_grad_(True)
    ways = {"pair by pair": rotary.pair_by_pair, "complex fp32": rotary.complex_turn}
    exact = rotary.complex_turn(x.detach().double(), 0)
    out = {"shape": [batch, length, width], "d_k": d_k}
    for way, turn in ways.items():
        turn(warm, 0).backward(torch.ones_like(warm))
        out[f"{way} error"] = float((turn(x.detach(), 0).double() - exact).abs().mean())
    best = {way: float("inf") for way in ways}
    for _ in range(rounds):
        for way, turn in ways.items():
            best[way] = min(best[way], passes(turn, x, grad, repeats))
    out.update({f"{way} ms": 1000 * best[way] / repeats for way in ways})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), help="default: all on cuda, default on cpu")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.rotary: --device cuda, but torch.cuda.is_available() is False on this machine")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = args.shapes or (list(SHAPES) if device.type == "cuda" else ["default"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, {args.repeats} passes x {args.rounds} rounds")
    for name in shapes:
        r = measure(name, device, DTYPES[args.dtype], args.repeats, args.rounds)
        print(f"{name} {r['shape']}, d_k {r['d_k']}: pair by pair {r['pair by pair ms']:.3f} ms, complex fp32 "
              f"{r['complex fp32 ms']:.3f} ms ({r['pair by pair ms'] / r['complex fp32 ms']:.2f}x); mean error against "
              f"the fp64 turn {r['pair by pair error']:.5f} and {r['complex fp32 error']:.5f}")


if __name__ == "__main__":
    main()
