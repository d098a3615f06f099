"""Where a graceful stop ends: the report index every rank stops right after.

Pure (no Ray, no clock): the controller passes what it knows, this returns an index.
"""

from __future__ import annotations

import math
from typing import Sequence

# How far ahead (seconds of steps) to place the stop, so every rank can still reach it.
STOP_AHEAD_S = 0.3
# How long to wait for a checkpoint boundary instead of stopping sooner.
MAX_WAIT_FOR_BOUNDARY_S = 20.0


def choose_stop_index(
    current: int,
    *,
    step_time_s: float,
    snapshots: bool = False,
    budget_s: float = float("inf"),
    committed: Sequence[int] = (),
) -> int:
    """A report index every rank can still reach, from ``current`` (the furthest any
    rank has reported). With in-memory snapshots every index is a restore point: as
    soon as possible, ``STOP_AHEAD_S`` of steps ahead and at least the report the
    ranks are working towards now (a rank that reports it before the request arrives
    answers that it is past, and the controller proposes a later one). At least two
    ahead where two steps still fit in 70% of a drain deadline ``budget_s`` less 1 s
    (one proposal round is then nearly always enough); one where they do not: a 10 s
    notice with 5 s steps must stop after the step in flight, or the node is gone
    before the group stops and the step is lost with it. Without snapshots: the next
    checkpoint boundary (from the spacing of the last two ``committed`` indices) when
    it comes within ``MAX_WAIT_FOR_BOUNDARY_S`` and before that share of the deadline,
    so the new group loses no steps."""
    usable_s = budget_s * 0.7 - 1.0  # of the drain deadline: what a stop may still spend
    ahead = max(2 if 2 * step_time_s <= usable_s else 1, math.ceil(STOP_AHEAD_S / max(step_time_s, 1e-4)))
    target = current + ahead
    if snapshots:
        return target
    wait_s = min(MAX_WAIT_FOR_BOUNDARY_S, usable_s)
    if len(committed) >= 2 and wait_s > 0:
        period = committed[-1] - committed[-2]
        if period > 0:
            boundary = committed[-1] + period * math.ceil((target - committed[-1]) / period)
            if (boundary - current) * step_time_s <= wait_s:
                target = boundary
    return target
