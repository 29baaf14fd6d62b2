"""A CPU's matrix products in training: torch's BLAS against oneDNN's fp32 or bf16 (train.cpu_matmul), in the
default's step.

    python -m bench.cpu.matmul [--steps 24] [--rounds 3] [--threads 2] [--batches data/batches]

The default's training step as bench.cpu.train_throughput times it (pipeline.training.optimizer.train_step, the
default's model) on synthetic batches shaped like Multi30k's, with the default's vocabulary and
batch.max_tokens, or with --batches on the batch stage's train batches (of `make run`, say), each way in a
process of its own (a process that has run oneDNN's products runs torch's BLAS slower), the processes taking
turns round by round so that load from other programs hits every way alike:
  fp32          torch's default: fp32 products by its BLAS (MKL), its flash attention kernel for CPUs;
  onednn        on a CPU with AVX-512 and without AMX, what train.cpu_matmul = fp32 trains with: fp32
                products by oneDNN (pipeline/device/cpu_matmul.py) and torch's math attention kernel
                (pipeline/device/attention.py);
  bf16          on a CPU with AMX, what train.cpu_matmul = auto trains with: bf16 products and the math kernel;
  autocast      on a CPU with AVX-512 BF16 and without AMX, what auto trains with there: the onednn way's step
                under torch.autocast(bf16), the products' inputs and outputs bf16 (oneDNN's avx512_bf16 kernels);
  WAY, flash    the same products with the flash kernel: why attention changes with them.
A run's batches come in many shapes (the default's: `num_shapes` in metrics/batch.json), and oneDNN's products
are faster on a few shapes met again and again than over all of a run's: oneDNN compiles a kernel the first
time it meets a shape and keeps it, and a step is a little slower the more kernels a run keeps. So the bench
times the steps as a run meets them, over every shape of its batches:
  first  one step of each distinct shape, each met for the first time (as in a run's first epoch);
  later  each round, `--steps` steps of batches in a seeded epoch order (all shapes met before).
A run of the default's train.max_steps meets each shape first once and runs its other steps later: `run`
blends the seconds a target token of the two in that proportion. Prints target tokens/s (later: median of
the rounds) and each way's `run` speed over fp32's. Targets: bf16 >= 1.3x fp32 in a run, onednn > 1x, and
each faster than with the flash kernel; autocast faster than onednn. On a CPU with neither AMX nor AVX-512
only fp32 runs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.harness import alternate, default_configs, our_step, stored_epoch, synthetic_corpus
from model.transformer import Transformer
from pipeline.core import config
from pipeline.core.errors import PipelineError
from pipeline.corpus.batching import make_batches
from pipeline.device import attention, cpu, cpu_matmul, distributed
from pipeline.training.loader import Batch, collate
from pipeline.device.precision import of_choice

CPU = torch.device("cpu")


@contextlib.contextmanager
def way(products: str, flash: bool = False):
    """Run the block with `products` and the attention kernels the trainer picks for them (or the flash kernel),
    under bf16 autocast where the trainer runs them so ("autocast")."""
    precision = of_choice(products)
    precision.use()
    attention.use(CPU)
    try:
        with (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext(), precision.autocast()):
            yield
    finally:
        cpu_matmul.use("fp32")
        attention.use(CPU)


def shape(b: Batch) -> tuple[int, ...]:
    return (*b.src.shape, b.tgt_in.shape[1])


def stream(vocab: int, max_tokens: int, stored: tuple[Path, Path] | None = None,
           seed: int = 0) -> tuple[int, list[Batch], list[Batch]]:
    """(vocabulary, one batch of each distinct shape, an epoch's batches in a seeded order): the synthetic corpus's
    batches of `max_tokens` with `vocab`, or the train batches `stored` by the tokenize and batch stages."""
    if stored is None:
        src, tgt = synthetic_corpus(29000, vocab=vocab)
        batches = make_batches(src.lengths + 1, tgt.lengths + 1, max_tokens, seed=1)
        order = np.random.default_rng(seed).permutation(len(batches))
        epoch = [collate(src, tgt, batches[i], CPU) for i in order]
    else:
        vocab, epoch = stored_epoch(*stored, seed=seed)
    first: dict[tuple[int, ...], Batch] = {}
    for b in epoch:
        first.setdefault(shape(b), b)
    return vocab, list(first.values()), epoch


def seconds_a_token(step, batches: list[Batch]) -> float:
    start = time.perf_counter()
    for b in batches:
        step(b)
    return (time.perf_counter() - start) / sum(b.tokens for b in batches)


def worker(conn, products: str, flash: bool, threads: int, vocab: int, max_tokens: int,
           stored: tuple[Path, Path] | None) -> None:
    """One way in a process of its own: answers each (start, stop) slice of the epoch (None: one batch of each
    shape) with the seconds a target token of those steps, until it receives "stop"."""
    torch.set_num_threads(threads)
    cfg, train_cfg = default_configs()
    _, distinct, epoch = stream(vocab, max_tokens, stored)
    torch.manual_seed(0)
    step = our_step(Transformer(cfg, vocab), train_cfg)
    with way(products, flash):
        conn.send("ready")
        while (job := conn.recv()) != "stop":
            conn.send(seconds_a_token(step, distinct if job is None else epoch[slice(*job)]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed later steps per round and way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=distributed.available_cores())
    parser.add_argument("--batches", type=Path, help="time the batch stage's train batches (e.g. data/batches) "
                        "instead of synthetic ones")
    parser.add_argument("--tokenized", type=Path, default=Path("data/tokenized"), help="their tokenized corpus")
    args = parser.parse_args(argv)
    _, train_cfg = default_configs()
    other = cpu_matmul.choose("auto", CPU)  # bf16 on AMX, bf16 autocast on AVX-512 BF16, oneDNN's fp32 on other
    ways = {"fp32": ("fp32", False)}  # AVX-512, else torch's BLAS
    if other == "autocast":
        ways |= {"onednn": ("onednn", False)}  # what train.cpu_matmul = fp32 trains with there
    if other != "fp32":
        ways |= {other: (other, False), f"{other}, flash": (other, True)}
    print(f"{args.threads} threads; against torch's BLAS: {of_choice(other).label if other != 'fp32' else 'none'}"
          f" (AMX: {'yes' if cpu.has_amx() else 'no'}, AVX-512: {'yes' if cpu.has_avx512() else 'no'});"
          f" train.cpu_matmul of the default: {train_cfg.cpu_matmul}")
    stored = (args.tokenized, args.batches) if args.batches else None
    try:
        default = config.compose([])  # its vocabulary (the output projection's share) and batch size
        max_tokens = int(default["batch"]["max_tokens"])
        vocab, distinct, epoch = stream(int(default["tokenize"]["vocab_size"]), max_tokens, stored)
    except PipelineError as e:  # stored batches missing or unreadable: one line
        raise SystemExit(f"bench.cpu.matmul: {e}") from None
    print(f"batches: {'the train batches in ' + str(args.batches) if stored else 'synthetic'}, vocabulary {vocab}")
    if args.rounds * args.steps > len(epoch):
        raise SystemExit(f"bench.cpu.matmul: {args.rounds} rounds x {args.steps} steps is more than the "
                         f"{len(epoch)} batches of an epoch: lower --steps or --rounds")
    first_share = min(1.0, len(distinct) / train_cfg.max_steps)
    spawn = multiprocessing.get_context("spawn")
    conns, procs = {}, []
    for name, (products, flash) in ways.items():
        conns[name], child = spawn.Pipe()
        procs.append(spawn.Process(target=worker, args=(child, products, flash, args.threads, vocab, max_tokens, stored)))
        procs[-1].start()
    try:
        for conn in conns.values():
            conn.recv()  # built: the ways take turns from here on
        first = {}
        for name, conn in conns.items():
            conn.send(None)
            first[name] = conn.recv()
            print(f"  {name:14s} first meeting of {len(distinct)} shapes: {1 / first[name]:6.0f} tok/s")
        def ask(conn, r: int) -> float:  # the worker times round r's slice of the epoch: seconds a target token
            conn.send((r * args.steps, (r + 1) * args.steps))
            return conn.recv()
        later = alternate({name: (lambda r, conn=conn: ask(conn, r)) for name, conn in conns.items()}, args.rounds,
                          lambda r, name, s: print(f"  round {r + 1} {name:14s} {1 / s:6.0f} tok/s"))
    finally:
        for conn in conns.values():
            with contextlib.suppress(OSError):  # a way that failed has said why and gone
                conn.send("stop")
        for proc in procs:
            proc.join()
    run = {name: first_share * first[name] + (1 - first_share) * statistics.median(later[name]) for name in ways}
    print(f"{len(distinct)} distinct shapes in {train_cfg.max_steps} steps: {first_share:.1%} of a run's steps meet a "
          "shape for the first time")
    print(f"{'':14s} {'first tok/s':>12s} {'later tok/s':>12s} {'run tok/s':>10s} {'x fp32 (run)':>13s}")
    for name in ways:
        print(f"{name:14s} {1 / first[name]:12.0f} {1 / statistics.median(later[name]):12.0f} {1 / run[name]:10.0f} "
              f"{run['fp32'] / run[name]:12.2f}x")
    if other != "fp32":
        print(f"{other} products: {run['fp32'] / run[other]:.2f}x fp32 in a run "
              f"(target {'>= 1.3x' if other == 'bf16' else '> 1x'}), "
              f"{run[other + ', flash'] / run[other]:.2f}x {other} with the flash kernel (target > 1x)")
    if other == "autocast":
        print(f"autocast: {run['onednn'] / run[other]:.2f}x onednn in a run (target > 1x)")


if __name__ == "__main__":
    main()
