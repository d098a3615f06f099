"""The per-step sleeps of the test train functions.

Why: a test that loses a node and adds it back needs each group to train long enough for
its event to land (the kill at a report, the node added back joining before the run
ends), but the group that follows the last event needs no window at all, and on the Ray
tests' critical path its sleeps were seconds per test. A test touches the file named by
``config["regrown_flag"]`` right after adding the node back; from then on a group of
``config["fast_at_world"]`` (default 3) or more workers steps without sleeping. The group
still smaller keeps its sleep: it is the window the added node joins in. (A test whose
groups all have the same size touches it after its last event, with ``fast_at_world``
that size.)
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping


def regrown(config: Mapping[str, Any], world: int) -> bool:
    """The test added the node back (its flag file exists) and this group has grown."""
    flag = config.get("regrown_flag")
    return bool(flag) and world >= int(config.get("fast_at_world", 3)) and os.path.exists(str(flag))


def step_sleep(config: Mapping[str, Any], world: int, seconds: float) -> float:
    """``seconds``, or 0 for a regrown group (see the module docstring)."""
    return 0.0 if seconds and regrown(config, world) else seconds


def pace(config: Mapping[str, Any], world: int, seconds: float) -> None:
    """Sleep ``seconds`` after a step, unless this group is a regrown one."""
    seconds = step_sleep(config, world, seconds)
    if seconds:
        time.sleep(seconds)


__all__ = ["regrown", "step_sleep", "pace"]
