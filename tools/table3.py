"""Queue the paper's Table 3 model variations (rows A to E) as DVC experiments.

    python -m tools.table3 --dry-run     # print the `dvc exp run --queue` commands
    python -m tools.table3               # queue them all
    dvc queue start -j 1                  # run the queue; then: dvc exp show

Each variation is the base preset on WMT 2014 en-de with a few knobs changed.
Table 3 scores the development set (newstest2013) with beam search and no
checkpoint averaging, so every variation also sets `average.last_n=1`.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

BASE = ["experiment=wmt14_en_de_base", "average.last_n=1"]


def heads(h: int, d: int) -> list[str]:
    return [f"model.n_heads={h}", f"model.d_k={d}", f"model.d_v={d}"]


# Row -> knobs changed from base, with the paper's dev PPL, BLEU and params (M) (Table 3).
VARIATIONS: dict[str, tuple[list[str], tuple[float, float, float | None]]] = {
    "A-h1": (heads(1, 512), (5.29, 24.9, None)),
    "A-h4": (heads(4, 128), (5.00, 25.5, None)),
    "A-h16": (heads(16, 32), (4.91, 25.8, None)),
    "A-h32": (heads(32, 16), (5.01, 25.4, None)),
    "B-dk16": (["model.d_k=16"], (5.16, 25.1, 58)),
    "B-dk32": (["model.d_k=32"], (5.01, 25.4, 60)),
    "C-N2": (["model.n_layers=2"], (6.11, 23.7, 36)),
    "C-N4": (["model.n_layers=4"], (5.19, 25.3, 50)),
    "C-N8": (["model.n_layers=8"], (4.88, 25.5, 80)),
    "C-d256": (["model.d_model=256", "model.d_k=32", "model.d_v=32"], (5.75, 24.5, 28)),
    "C-d1024": (["model.d_model=1024", "model.d_k=128", "model.d_v=128"], (4.66, 26.0, 168)),
    "C-dff1024": (["model.d_ff=1024"], (5.12, 25.4, 53)),
    "C-dff4096": (["model.d_ff=4096"], (4.75, 26.2, 90)),
    "D-drop0.0": (["model.dropout=0.0"], (5.77, 24.6, None)),
    "D-drop0.2": (["model.dropout=0.2"], (4.95, 25.5, None)),
    "D-ls0.0": (["train.label_smoothing=0.0"], (4.67, 25.3, None)),
    "D-ls0.2": (["train.label_smoothing=0.2"], (5.47, 25.7, None)),
    "E-learned": (["model.positional_encoding=learned"], (4.92, 25.7, None)),
}


def queue_command(name: str, overrides: list[str]) -> list[str]:
    """The `dvc exp run --queue` command for one variation."""
    cmd = ["dvc", "exp", "run", "--queue", "-n", f"table3-{name}"]
    for override in BASE + overrides:
        cmd += ["-S", override]
    return cmd


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    for name, (overrides, _) in VARIATIONS.items():
        cmd = queue_command(name, overrides)
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, stdout=sys.stderr)


if __name__ == "__main__":
    main()
