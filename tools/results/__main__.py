"""python -m tools.results record|tables ...: tools/results/main.py; a bad record or run is one line, exit 2."""

import sys

from pipeline.core.errors import PipelineError
from tools.results.main import main

try:
    sys.exit(main())
except PipelineError as e:
    print(f"results: error: {e}", file=sys.stderr)
    sys.exit(2)
