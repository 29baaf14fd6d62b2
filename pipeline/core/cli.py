"""What every stage's command line shares: its path arguments, --params, log lines, and one line per failure.

    if __name__ == "__main__":
        cli.run(main)

runs a stage's main(). An expected failure (pipeline.core.errors.PipelineError, or
an OSError naming a file) ends as one line on stderr, `<stage>: error:
<message>`, and exit status 2; Ctrl-C as one line, `<stage>: interrupted...`,
and status 130. Anything else is a bug and keeps its traceback (exit 1), as
does every failure when TRANSFORMER_TRACEBACK=1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from pipeline.core import collector, signals
from pipeline.core.switches import switch
from pipeline.core.errors import PipelineError

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
TRACEBACK_ENV = "TRANSFORMER_TRACEBACK"
EXIT_ERROR, EXIT_INTERRUPTED = 2, 130  # 130 = 128 + SIGINT, as a shell reports Ctrl-C
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each process: where it looks for a failure's message


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


def run(main: Callable[[], None]) -> None:
    """Run a stage's main() as its command: expected failures and Ctrl-C end as one line on stderr (module doc)."""
    stage = Path(main.__code__.co_filename).stem
    collector.resume()  # paused while the stage's command imported its modules (stages/__init__.py)
    try:
        with signals.stopping():
            main()
    except PipelineError as e:
        _fail(stage, "error", str(e), EXIT_ERROR)
    except OSError as e:
        if e.filename is None:
            raise
        _fail(stage, "error", f"{e.filename}: {e.strerror or e}", EXIT_ERROR)
    except KeyboardInterrupt as e:
        _fail(stage, "interrupted", str(e) or "stopped by Ctrl-C", EXIT_INTERRUPTED)


def _fail(stage: str, what: str, message: str, status: int) -> NoReturn:
    """Print `<stage>: <what>: <message>` (or, with TRANSFORMER_TRACEBACK=1, re-raise), record it for torchrun, exit."""
    if switch(TRACEBACK_ENV):
        raise
    line = f"{stage}: {what}: {message}"
    if error_file := os.environ.get(ERROR_FILE_ENV):  # torchrun's format; pipeline.device.distributed.launch prints it last
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    logging.shutdown()  # flush the log lines before the last one
    print(line, file=sys.stderr, flush=True)
    sys.exit(status)
