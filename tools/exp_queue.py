"""DVC's experiment queue, as tools.seeds and tools.table3 fill and run it.

    queue_command(["experiment=wmt14_en_de_base", "average.last_n=1"], name="table3-base")
        -> dvc exp run --queue -n table3-base -S experiment=wmt14_en_de_base -S average.last_n=1
    run_command(2)  -> dvc exp run --run-all -j 2

Overrides are Hydra overrides of conf/, as `dvc exp run -S` takes them.
"""

from __future__ import annotations


def queue_command(overrides: list[str], name: str | None = None) -> list[str]:
    """The `dvc exp run --queue` command of one experiment: named `name` (DVC names it without), `-S` each override."""
    cmd = ["dvc", "exp", "run", "--queue"]
    if name:
        cmd += ["-n", name]
    for override in overrides:
        cmd += ["-S", override]
    return cmd


def run_command(jobs: int) -> list[str]:
    """Run DVC's queue in the foreground, `jobs` experiments at a time."""
    return ["dvc", "exp", "run", "--run-all", "-j", str(jobs)]
