"""The whole machine's CPU use so far, for the benchmarks' load figures and the suite's
per-test profile (``RAYLASTIC_TEST_PROFILE``). The machine's, not a process tree's: a run's
Ray processes (raylets, workers, the controller) are not children of the driver."""

from __future__ import annotations

import os
from typing import Tuple


def cpu_seconds() -> Tuple[float, float]:
    """(busy, total) CPU-seconds of every core since boot, from ``/proc/stat``: user, nice,
    system, idle, iowait, irq, softirq and steal (guest time is already in user and nice);
    idle and iowait are the idle part."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(ticks)
    return (total - ticks[3] - ticks[4]) / hz, total / hz


__all__ = ["cpu_seconds"]
