"""Inspect any stage's output as a person would: a readable summary, and pictures where a look beats reading.

    python -m tools.inspect PATH [--out DIR] [-n N] [--params params.yaml] [--split test]
                            [--raw DIR] [--tokenized DIR] [--translations DIR]

Not a DVC stage. Recognises which output PATH is by its files (or, when they
are missing, by its name) and prints its view; pictures (PNG) and tables (CSV)
go to --out, by default reports/inspect/<layout>/:

    raw            data/raw: lines per split and language, sample pairs, words per line (words.png)
    tokenized      data/tokenized: vocabulary and frequent pieces, samples as pieces, tokens per sentence
                   (tokens.png), round trip against data/raw, dropped pairs by reason
    batches        data/batches: batches, sentences and real tokens per batch, padding efficiency overall
                   and per length bucket (batches.png); lengths from data/tokenized
    checkpoints    data/checkpoints: step, wall time, tokens, valid ppl, seal of each; those `average` takes
    model          data/model: parameters by component, the checkpoints averaged, the config
    export         data/export: its seal and provenance checked (as translate checks them), quantization, files
    translations   data/translations: source / reference / hypothesis, the worst by sentence chrF,
                   length ratios (length_ratio.png), outputs that hit the length limit
    eval           metrics/eval.json: the metrics and signatures; sentence BLEU and chrF (sentences.csv,
                   sentence_chrf.png)

Siblings (data/raw beside data/tokenized, data/ beside metrics/) are found
where the pipeline puts them, or given with --raw, --tokenized, --translations.
An output that is missing or corrupt gives one line on stderr naming the file
and what was expected, and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from pipeline.core import cli
from tools.inspect.common import TEXT_FILE, Options

log = logging.getLogger(__name__)

# layout -> (the module and function of its view, the files that identify it), in the order they are tried.
# A view's module is imported only when it is shown: torch alone takes 1.5 s to import, which the raw view
# does not need.
LAYOUTS: dict[str, tuple[str, str, str]] = {
    "eval": ("tools.inspect.output", "show_eval", "eval.json (metrics/eval.json, or the directory holding it)"),
    "export": ("tools.inspect.export", "show_export", "model.bin and seal.sha256 (data/export)"),
    "tokenized": ("tools.inspect.tokens", "show_tokenized", "meta.json and spm.model (data/tokenized)"),
    "batches": ("tools.inspect.data", "show_batches", "{split}.index.npy and {split}.bounds.npy (data/batches)"),
    "checkpoints": ("tools.inspect.training", "show_checkpoints", "step_XXXXXXXX.pt files (data/checkpoints)"),
    "model": ("tools.inspect.training", "show_model", "model.pt and averaged.json (data/model)"),
    "raw": ("tools.inspect.data", "show_raw", "train/valid/test.<lang> text files (data/raw)"),
    "translations": ("tools.inspect.output", "show_translations",
                     "valid/test.<lang> text files and no train.* (data/translations)"),
}
def detect(path: Path) -> str | None:
    """The layout of `path` by its files, else by its name (so a stage output with files missing still gets its
    view, which names them); None when neither says."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    texts = {m.group(1) for name in names if (m := TEXT_FILE.match(name))}
    by_files = {
        "eval": "eval.json" in names,
        "export": {"model.bin", "seal.sha256", "disabled.json"} & names,
        "tokenized": {"meta.json", "spm.model"} & names,
        "batches": any(name.endswith((".index.npy", ".bounds.npy")) for name in names),
        "checkpoints": any(name.startswith("step_") and name.endswith(".pt") for name in names),
        "model": {"model.pt", "averaged.json"} & names,
        "raw": "train" in texts,
        "translations": bool(texts) and "train" not in texts,
    }
    found = [layout for layout, hit in by_files.items() if hit]
    if found:
        return found[0]
    name = "eval" if path.name == "eval.json" else path.name  # data/<layout>, metrics/eval.json
    return name if name in LAYOUTS else None


def one_line(error: BaseException) -> str:
    """The error's message on one line, as short as a terminal line or two."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a stage output: data/raw, data/tokenized, ..., metrics/eval.json")
    parser.add_argument("--out", type=Path, help="where pictures and tables go (default reports/inspect/<layout>)")
    parser.add_argument("-n", type=int, default=5, help="sample sentences to show (default 5)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--split", default="test", choices=("test", "valid"), help="translations: the split shown")
    for name in ("raw", "tokenized", "translations"):
        parser.add_argument(f"--{name}", type=Path, help=f"data/{name}, when not beside PATH")
    parser.add_argument("--mlflow-run", metavar="RUN_ID", help="also log the view (its text, pictures and tables) "
                        "to this run of $MLFLOW_TRACKING_URI's store, under inspect/<layout>/")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n {args.n}: expected at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Print the view of PATH; 0, or 1 with one line on stderr when the output is missing, corrupt or unknown."""
    args = parse_args(argv)
    cli.setup_logging(logging.INFO if args.verbose else logging.WARNING)
    layout = detect(args.path)
    if layout is None:
        known = "; ".join(f"{name}: {files}" for name, (_, _, files) in LAYOUTS.items())
        inside = [str(p) for p in sorted(args.path.iterdir()) if detect(p)] if args.path.is_dir() else []
        why = ("not found" if not args.path.exists() else f"holds the stage outputs {', '.join(inside)}" if inside
               else "not a stage output this tool knows")
        print(f"inspect: {args.path}: {why}; recognised layouts are {known}", file=sys.stderr)
        return 1
    module, function, _ = LAYOUTS[layout]
    view: Callable[[Path, Options], None] = getattr(importlib.import_module(module), function)
    opts = Options(out=args.out or Path("reports/inspect") / layout, n=args.n, params=args.params, split=args.split,
                   raw=args.raw, tokenized=args.tokenized, translations=args.translations)
    log.info("%s: the %s view", args.path, layout)
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(Tee(sys.stdout, text)):
            view(args.path, opts)
    except (OSError, ValueError, KeyError) as e:  # the project's errors (JSON's and InspectError are ValueErrors)
        sys.stdout.flush()
        print(f"inspect: {one_line(e)}", file=sys.stderr)
        return 1
    if args.mlflow_run:
        from mlflow import MlflowClient

        from pipeline.core.views import log_view

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines (creating a store's tables): noise here
        try:
            log_view(MlflowClient(os.environ.get("MLFLOW_TRACKING_URI")), args.mlflow_run, layout, opts.out,
                     text.getvalue())
        except Exception as e:  # MLflow's errors have no common base: any failure to log is this one line
            print(f"inspect: could not log the {layout} view to MLflow run {args.mlflow_run}: {one_line(e)}",
                  file=sys.stderr)
            return 1
    return 0


class Tee(io.TextIOBase):
    """Writes go to every stream given (the terminal, and the text logged with --mlflow-run)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, s: str) -> int:
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
