"""The environment's on/off switches read one way (pipeline/core/switches.py), whichever module reads them."""

from __future__ import annotations

import pytest

from pipeline.core import cli, tracking, views
from pipeline.core.switches import switch
from pipeline.device import slurm
from pipeline.weights import checkpoint

SWITCHES = {tracking.ENV: (tracking.switched_on, True), views.ENV: (views.enabled, True),
            slurm.ENV: (slurm.requested, False)}


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("OFF", False), (" False ", False), ("no", False),
                                       ("1", True), ("yes", True), ("true", True), ("on", True)])
def test_a_switch_is_on_or_off_by_its_value_in_any_case(monkeypatch, value, on):
    for name in (*SWITCHES, cli.TRACEBACK_ENV, checkpoint.ACROSS_CODE_CHANGE_ENV):
        monkeypatch.setenv(name, value)
        assert switch(name) is on and switch(name, default=True) is on, name
    for name, (read, _) in SWITCHES.items():
        assert read() is on, name


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_empty_is_the_switchs_default(monkeypatch, value):
    for name, (read, default) in SWITCHES.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert read() is default, name
