"""Queue one configuration over several seeds as DVC experiments, and run them: a seed study.

    python -m tools.seeds --seeds 1 2 3 [-S key=value ...] [--name NAME] [--dry-run] [--run [-j N]]
    python -m tools.report      # then: one row per configuration, mean, sd, min and max over its seeds

Each seed N becomes one `dvc exp run --queue -S train.seed=N -S batch.seed=N
[-S key=value ...]` (named NAME-seedN with --name, else DVC names it); --run
then runs DVC's queue in the foreground, `dvc exp run --run-all -j N` (DVC's
queue workers, as `dvc queue start -j N` starts them in the background; Ctrl+C
stops following the logs, the experiments go on: `dvc queue status`). The whole
queue runs, including experiments queued before. The overrides are composed
from conf/ first (pipeline.core.config.compose), so a misspelt key fails here, before
anything is queued.

Which seeds vary: the training's randomness, and only it.
    train.seed   the initial weights, the dropout masks and each epoch's batch
                 order (pipeline/training/trainer.py, pipeline/steps.epoch_order)
    batch.seed   which pairs of equal lengths share a batch (pipeline/corpus/batching.py)
tokenize.seed stays as it is: it picks the sentences sentencepiece learns the
vocabulary from (when tokenize.input_sentence_size > 0); keeping it makes every
seed train and score on the same tokens, so the spread measures training noise
alone, and DVC reuses the download and tokenize outputs for every seed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from pipeline.core import cli
from pipeline.core.config import compose
from tools.exp_queue import queue_command, run_command

SEEDS = ("train.seed", "batch.seed")  # the params a seed study varies, each set to the study's seed


def seed_overrides(seed: int, settings: list[str]) -> list[str]:
    """The `-S` overrides of one seed's run: the user's settings, then every seed param set to `seed`."""
    fixed = [s for s in settings if s.split("=", 1)[0].strip() in SEEDS]
    if fixed:
        raise ValueError(f"{', '.join(fixed)}: the seeds are set by --seeds, not by -S")
    return [*settings, *(f"{param}={seed}" for param in SEEDS)]


def seed_command(seed: int, settings: list[str], name: str | None = None) -> list[str]:
    """The `dvc exp run --queue` command for one seed (named NAME-seedN with a name)."""
    return queue_command(seed_overrides(seed, settings), f"{name}-seed{seed}" if name else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="one experiment per seed")
    parser.add_argument("-S", "--set-param", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="the configuration, as `dvc exp run -S` (repeatable); the default preset without")
    parser.add_argument("--name", help="experiment names NAME-seedN (DVC's own names without)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--run", action="store_true", help="then run the queue: dvc exp run --run-all")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="experiments at a time with --run (default 1)")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: each seed once")
    try:
        commands = [seed_command(seed, args.settings, args.name) for seed in args.seeds]
    except ValueError as e:
        parser.error(str(e))
    compose(seed_overrides(args.seeds[0], args.settings))  # a ParamsError names a bad key or value before anything is queued
    if args.run:
        commands.append(run_command(args.jobs))
    for cmd in commands:
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, stdout=sys.stderr)


if __name__ == "__main__":
    cli.run(main)
