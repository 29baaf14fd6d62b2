"""The command line of tools.results (the package's doc says what each subcommand does)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.core import cli
from pipeline.core.files import write_text
from tools.results import record, store, tables

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    import tools.results

    p = argparse.ArgumentParser(prog="python -m tools.results", description=tools.results.__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="append the line of the finished pipeline run in --repo")
    rec.add_argument("--repo", type=Path, default=Path("."), help="the run's repository (default: here)")
    rec.add_argument("--record", type=Path, default=ROOT / store.RECORD, help="the record to append to")
    rec.add_argument("--command", dest="ran", default="make run", help="how the run was started (default: make run)")
    rec.add_argument("--recipe", default=tables.DEFAULT, help=f"what ran, as the tables name it ({tables.DEFAULT!r})")
    rec.add_argument("--baseline", help="for a lever: the recipe it is measured against, seed by seed")
    rec.add_argument("--sitting", help="an id shared by the runs made in one sitting on this machine")
    rec.add_argument("--id", dest="run_id", help="the line's id (default: date, commit, seed)")
    rec.add_argument("--tracking-uri", help="the MLflow store the stages logged to (default: the repo's mlflow.db)")
    tab = sub.add_parser("tables", help="rewrite the marked tables of README.md and docs/results.md")
    tab.add_argument("--record", type=Path, default=ROOT / store.RECORD)
    tab.add_argument("--root", type=Path, default=ROOT, help="where README.md and docs/ are (default: this checkout)")
    tab.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each place that differs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cli.setup_logging()
    if args.command == "record":
        line = record.line(args.repo, command=args.ran, recipe=args.recipe, sitting=args.sitting,
                           baseline=args.baseline, run_id=args.run_id, uri=args.tracking_uri)
        store.append(args.record, line)
        print(f"{args.record}: appended {line['id']} ({line['recipe']}, seed {line['seed']}, "
              f"{tables.machine(line)}, test sacreBLEU {line['test']['bleu']}, stopped by {line['stopped_by']})")
        return 0
    lines = store.read(args.record)
    if args.check:
        wrong = tables.differences(args.root, lines)
        for problem in wrong:
            print(f"{problem}; run `python -m tools.results tables`", file=sys.stderr)
        return 1 if wrong else 0
    for rel in tables.PLACES:
        path = args.root / rel
        text = path.read_text(encoding="utf-8")
        if (new := tables.fill(text, lines)) != text:
            write_text(path, new)
            print(f"{rel}: tables rewritten from {args.record}")
    return 0
