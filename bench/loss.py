"""The chunked training loss on this CPU: the eager chunks CPUs train with against the fused chunk GPUs compile.

    python -m bench.loss [--rounds 7] [--no-compile]

Times forward + backward of model/loss.py's ProjectedSmoothedLoss (label
smoothing 0.1, fp32, one thread) on random inputs of a default-sized step
(N = 1200 real target tokens, D = 256, V = 5000 and 8000) and a base-sized
one (D = 512, V = 37000), both ways in the same rounds, interleaved:
  - eager: chunk by chunk as CPUs train (the path the default's weights come
    from, to the bit);
  - fused: the chunks GPUs run, fused_chunk compiled by torch.compile
    (inductor: a C++ build of about 30 s a shape on a 2-core CPU, not timed),
    the last, shorter chunk eager as there.
Prints ms (median / min) and fused / eager. Target: CPUs train eager, so the
fused chunk is only kept off CPUs unless it is faster there by more than noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import loss as loss_lib

CASES = (("default, V = 5000", 1200, 256, 5000), ("default, V = 8000", 1200, 256, 8000),
         ("base, V = 37000", 1200, 512, 37000))
EPS = 0.1


def inputs(N: int, D: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [N, D], a projection [V, D] giving logits of a few units, targets [N]."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * D**-0.5 * 4
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def seconds(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, fused: bool) -> float:
    """One forward + backward, as a training step runs it."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    start = time.perf_counter()
    loss = loss_lib.ProjectedSmoothedLoss.apply(h, w, targets, EPS, None, loss_lib.chunk_rows(h.device), True, fused)
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="time the fused chunk eagerly (no C++ build)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.no_compile:
        loss_lib.ProjectedSmoothedLoss.COMPILE_BACKEND = "eager"  # dynamo traces, no code generated
    print(f"torch {torch.__version__}, 1 thread, fused chunk backend {loss_lib.ProjectedSmoothedLoss.COMPILE_BACKEND}")
    for name, N, D, V in CASES:
        hidden, weight, targets = inputs(N, D, V)
        seconds(hidden, weight, targets, True)  # compiles this shape
        if loss_lib._fused_failed:
            print(f"{name}: the fused chunk did not compile here; eager only")
            return
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for fused in (False, True):
                times[fused].append(seconds(hidden, weight, targets, fused))
        (eager_med, eager_min), (fused_med, fused_min) = (
            (statistics.median(t) * 1e3, min(t) * 1e3) for t in (times[False], times[True]))
        print(f"{name} (N = {N}, D = {D}): eager {eager_med:.0f} / {eager_min:.0f} ms, fused {fused_med:.0f} / "
              f"{fused_min:.0f} ms, fused / eager {fused_med / eager_med:.2f} (median), {fused_min / eager_min:.2f} (min)")


if __name__ == "__main__":
    main()
