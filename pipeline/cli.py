"""What every stage's command line shares: its path arguments, --params, and log lines with timestamps."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def stage_parser(doc: str, *paths: str) -> argparse.ArgumentParser:
    """A parser described by the first line of the stage's docstring, with a required --<name> PATH for each
    of `paths` and --params (default params.yaml); stages add their own options to it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name in paths:
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    return parser


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)


def start(doc: str, argv: list[str] | None, *paths: str) -> argparse.Namespace:
    """What a stage's main() begins with: parse its path arguments (see stage_parser), then log with timestamps."""
    args = stage_parser(doc, *paths).parse_args(argv)
    setup_logging()
    return args
