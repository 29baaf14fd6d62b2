"""python -m tools.inspect PATH ...: tools/inspect/main.py."""

import sys

from tools.inspect.main import main

sys.exit(main())
