"""Queue the paper's Table 3 (base, the variations A to E, big) as DVC experiments, sizes beside the paper's.

    python -m tools.table3 --dry-run     # print the `dvc exp run --queue` commands, each with its size
    python -m tools.table3               # queue them all (and print the same)
    dvc queue start -j 1                  # run the queue; then: dvc exp show

Each row is a paper preset on WMT 2014 en-de (base; big for the last row) with a
few knobs changed. Table 3 scores the development set, newstest2013 (read
valid_bleu_tokenized in metrics/eval.json and valid_ppl in metrics/train.json),
with beam search and no checkpoint averaging, so every row sets average.last_n=1.

Sizes: each command ends with a comment giving our parameter count at the
preset's vocabulary (tokenize.vocab_size = 37000), the paper's, and the shared
vocabulary sizes that would round to the paper's count (one embedding matrix,
shared by both inputs and the output, so each extra token adds d_model
parameters). No single vocabulary reproduces every row: 40932 to 41160 gives
base and every sized row of A to E (41000: base 65.1M), but there big has
218.3M, and big's 213M needs 36272 or fewer, where base has 62.7M. At 37000
(Sec. 5.1, "about 37000") base has 63.1M and big 214.2M (the paper: 65M, 213M).
The paper's sizes are thus not all of one model family at one vocabulary;
tests/tools/test_table3.py checks these figures.
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
from typing import NamedTuple

import torch

from model.config import ModelConfig
from model.transformer import Transformer
from pipeline.core.config import compose
from tools.exp_queue import queue_command


class Row(NamedTuple):
    """One row of Table 3: the preset, the knobs changed from it, the paper's dev PPL, BLEU and size (M)."""

    experiment: str
    knobs: tuple[str, ...]
    ppl: float
    bleu: float
    params_m: float | None


def heads(h: int, d: int) -> tuple[str, ...]:
    return f"model.n_heads={h}", f"model.d_k={d}", f"model.d_v={d}"


BASE, BIG = "wmt14_en_de_base", "wmt14_en_de_big"
ROWS: dict[str, Row] = {
    "base": Row(BASE, (), 4.92, 25.8, 65),
    "A-h1": Row(BASE, heads(1, 512), 5.29, 24.9, None),
    "A-h4": Row(BASE, heads(4, 128), 5.00, 25.5, None),
    "A-h16": Row(BASE, heads(16, 32), 4.91, 25.8, None),
    "A-h32": Row(BASE, heads(32, 16), 5.01, 25.4, None),
    "B-dk16": Row(BASE, ("model.d_k=16",), 5.16, 25.1, 58),
    "B-dk32": Row(BASE, ("model.d_k=32",), 5.01, 25.4, 60),
    "C-N2": Row(BASE, ("model.n_layers=2",), 6.11, 23.7, 36),
    "C-N4": Row(BASE, ("model.n_layers=4",), 5.19, 25.3, 50),
    "C-N8": Row(BASE, ("model.n_layers=8",), 4.88, 25.5, 80),
    "C-d256": Row(BASE, ("model.d_model=256", "model.d_k=32", "model.d_v=32"), 5.75, 24.5, 28),
    "C-d1024": Row(BASE, ("model.d_model=1024", "model.d_k=128", "model.d_v=128"), 4.66, 26.0, 168),
    "C-dff1024": Row(BASE, ("model.d_ff=1024",), 5.12, 25.4, 53),
    "C-dff4096": Row(BASE, ("model.d_ff=4096",), 4.75, 26.2, 90),
    "D-drop0.0": Row(BASE, ("model.dropout=0.0",), 5.77, 24.6, None),
    "D-drop0.2": Row(BASE, ("model.dropout=0.2",), 4.95, 25.5, None),
    "D-ls0.0": Row(BASE, ("train.label_smoothing=0.0",), 4.67, 25.3, None),
    "D-ls0.2": Row(BASE, ("train.label_smoothing=0.2",), 5.47, 25.7, None),
    "E-learned": Row(BASE, ("model.positional_encoding=learned",), 4.92, 25.7, None),
    "big": Row(BIG, (), 4.33, 26.4, 213),
}


def row_overrides(row: Row) -> list[str]:
    """The `-S` overrides of one row: its preset, no checkpoint averaging (Table 3), its knobs."""
    return [f"experiment={row.experiment}", "average.last_n=1", *row.knobs]


def row_command(name: str, row: Row) -> list[str]:
    """The `dvc exp run --queue` command for one row, named table3-NAME."""
    return queue_command(row_overrides(row), f"table3-{name}")


def n_params(model: ModelConfig, vocab_size: int) -> int:
    """Parameters of the Transformer of this shape and vocabulary (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(model, vocab_size).parameters())


def vocab_for(model: ModelConfig, params_m: float) -> tuple[int, int]:
    """The shared vocabulary sizes whose parameter count rounds to `params_m` million (each token adds d_model)."""
    body = n_params(model, 1) - model.d_model
    lo, hi = ((params_m - 0.5) * 1e6 - body) / model.d_model, ((params_m + 0.5) * 1e6 - body) / model.d_model
    return math.ceil(lo), math.floor(hi)


def size_note(row: Row) -> str:
    """`# ours ...M at vocab V; paper ...M (vocab lo-hi rounds to it)` for one row."""
    params = compose(row_overrides(row))
    model, vocab = ModelConfig(**params["model"]), params["tokenize"]["vocab_size"]
    note = f"# ours {n_params(model, vocab) / 1e6:.1f}M at vocab {vocab}"
    if row.params_m is None:
        return note + "; paper: not listed"
    lo, hi = vocab_for(model, row.params_m)
    return note + f"; paper {row.params_m:g}M (vocab {lo}-{hi} rounds to it)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    for name, row in ROWS.items():
        cmd = row_command(name, row)
        print(f"{shlex.join(cmd)}  {size_note(row)}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, stdout=sys.stderr)


if __name__ == "__main__":
    main()
