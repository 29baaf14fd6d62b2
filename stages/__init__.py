"""The pipeline's stages, each a command: `python -m stages.<name> ...` (dvc.yaml), imported by nothing.

While a stage starts as a command (`python -m`: Python sets sys.argv[0] to "-m" while it locates the module), its
imports run with the cyclic garbage collector paused; pipeline.core.cli.run resumes it before the stage's main()
(pipeline/core/collector.py).
"""

import sys

from pipeline.core import collector

if sys.argv[:1] == ["-m"]:
    collector.pause()
