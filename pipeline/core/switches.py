"""The environment's on/off switches (PIPELINE_TRACKING, PIPELINE_VIEWS, TRANSFORMER_TRACEBACK, TRANSFORMER_SLURM,
RESUME_ACROSS_CODE_CHANGE), read one way: unset or empty is the switch's default; 0, false, no or off, in any case,
turn it off; any other value turns it on.

    switch("PIPELINE_TRACKING", default=True) -> bool
"""

from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in OFF
