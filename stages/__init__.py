"""The pipeline's stages, each a command: `python -m stages.<name> ...` (dvc.yaml), imported by nothing.

A stage's imports (torch, and dynamo in train) create millions of objects, and Python's cyclic garbage collector walks
all of them again each time enough new ones pile up: about a fifth of a train process's start. So while a stage
starts as a command (`python -m`: Python sets sys.argv[0] to "-m" while it locates the module), the collector waits;
pipeline.core.cli.run freezes what the imports left (gc.freeze: kept out of every later collection) and turns the
collector on again before the stage's main() begins. Nothing else changes: no object's life depends on the collector.
"""

import gc
import sys

if sys.argv[:1] == ["-m"]:
    gc.disable()
