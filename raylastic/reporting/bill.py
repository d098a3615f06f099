"""The bill by phase: every billed node-second, put in exactly one bucket by what the
run was doing at that moment, per node type, in node-seconds and dollars.

Why: the total cost says what a run paid, not what it paid *for*. An elastic run pays
for nodes while it waits for capacity, while it re-forms a group and restores after a
loss or a resize, and for nodes it already gave back but the autoscaler has not removed
yet. Splitting the bill shows which of these to attack (a shorter ``fallback_after_s``,
faster restores, a shorter idle timeout) and what each would save.

Buckets (docs/report.md, Bill by phase):

- ``training``: the controller is ``Running`` and the epoch's ``first_step`` was seen;
- ``recovering``: ``Resizing``, or ``Running`` before that epoch's ``first_step``
  (the group is starting and restoring);
- ``waiting``: ``Scheduling`` (fewer workers ready than the run needs, and forming the
  next group), and ``Finished`` / ``Errored`` until the workers are released;
- ``released``: after the run released the node until its ``node_gone``.

The controller's phase comes from its ``state`` events. A log without them (older runs)
has it inferred from the membership events, which the report's notes then say.
A pure function of the event log and the node intervals of ``_nodes``; no Ray, no torch.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic.events import EventKind
from raylastic.reporting._nodes import NodeIntervals
from raylastic.reporting._walk import Event, kind_of
from raylastic.reporting.records import Bill, PhaseCost

TRAINING, WAITING, RECOVERING, RELEASED = "training", "waiting", "recovering", "released"
BUCKETS = (TRAINING, WAITING, RECOVERING, RELEASED)  # the --json and table order

# The controller's states (``state`` events; raylastic/_internal/controller/states.py).
SCHEDULING, RUNNING, RESIZING = "Scheduling", "Running", "Resizing"

# Without state events: events that stop a running group (-> Resizing), and the ends.
_STOPS = (EventKind.WORKER_LOST, EventKind.FAILURE, EventKind.PREEMPTION_NOTICE)
_ENDS = {EventKind.RUN_FINISHED: "Finished", EventKind.RUN_FAILED: "Errored"}

Phase = Tuple[float, str]  # (from ts on, bucket)


def bucket_of(state: str, first_step_seen: bool) -> str:
    """The bucket of a held node's second while the controller is in ``state``."""
    if state == RUNNING:
        return TRAINING if first_step_seen else RECOVERING
    if state == RESIZING:
        return RECOVERING
    return WAITING  # Scheduling; Finished / Errored until the release; unknown states


def has_states(events: Sequence[Event]) -> bool:
    """Whether the log records the controller's state transitions (newer runs do)."""
    return any(kind_of(e) is EventKind.STATE for e in events)


def phases(events: Sequence[Event]) -> List[Phase]:
    """Where the bucket of a held second changes: (ts, bucket), ts non-decreasing.
    Before the first entry (and after each ``run_started``) it is ``waiting``."""
    inferred = not has_states(events)
    state, first_step, epoch = SCHEDULING, False, None
    out: List[Phase] = []
    last_ts = float("-inf")
    for e in events:
        kind = kind_of(e)
        last_ts = max(last_ts, float(e["ts"]))  # clocks may step back: keep the order
        if kind is EventKind.RUN_STARTED:  # a (resumed) controller starts in Scheduling
            state, first_step, epoch = SCHEDULING, False, None
        elif kind is EventKind.STATE:
            state = str(e.get("state") or "")
        elif kind is EventKind.GROUP_FORMED:
            epoch, first_step = e.get("epoch"), False
            state = RUNNING if inferred else state
        elif kind is EventKind.FIRST_STEP:
            first_step = first_step or epoch is None or e.get("epoch") in (None, epoch)
        elif inferred:
            state = _inferred(kind, e, state)
        bucket = bucket_of(state, first_step)
        if (out[-1][1] if out else WAITING) != bucket:
            out.append((last_ts, bucket))
    return out


def _inferred(kind: Optional[EventKind], e: Event, state: str) -> str:
    """The controller's next state, read off the other events (logs without ``state``)."""
    if kind in _ENDS:
        return _ENDS[kind]
    if kind is EventKind.RESIZE:  # the old group stopped: the next one is being scheduled
        return SCHEDULING
    stop_at = kind is EventKind.DECISION and e.get("decision") == "stop_at"
    if state == RUNNING and (kind in _STOPS or stop_at):
        return RESIZING
    return state


def split(interval_start: float, interval_end: float, points: Sequence[Phase]) -> Dict[str, float]:
    """Seconds of [start, end] in each bucket of the phase timeline ``points``."""
    out: Dict[str, float] = defaultdict(float)
    times = [t for t, _ in points]
    k = bisect.bisect_right(times, interval_start)
    current = points[k - 1][1] if k else WAITING
    t = interval_start
    while t < interval_end:
        nxt = times[k] if k < len(times) else interval_end
        stop = min(interval_end, max(t, nxt))
        out[current] += stop - t
        t = stop
        if k >= len(times):
            break
        current, k = points[k][1], k + 1
    return dict(out)


def bill_by_phase(
    events: Sequence[Event], nodes: NodeIntervals, usd_per_hour: Mapping[str, Optional[float]], priced: bool
) -> Bill:
    """Every billed node-second of ``nodes`` in one bucket, per node type and in total.

    ``usd_per_hour``: each node type's price (None: unknown). ``priced``: a price table
    exists at all. A type without a price has ``usd`` None, and so has every total then
    (the same rule as ``cost_usd``, which the dollar buckets add up to)."""
    points = phases(events)
    seconds: Dict[str, Dict[str, float]] = defaultdict(lambda: dict.fromkeys(BUCKETS, 0.0))
    for ntype, start, end in nodes.intervals:
        for bucket, s in split(start, end, points).items():
            seconds[ntype][bucket] += s
    for ntype, start, end in nodes.released:
        seconds[ntype][RELEASED] += end - start
    by_type = {t: _priced(seconds[t], usd_per_hour.get(t) if priced else None) for t in sorted(seconds)}
    all_priced = priced and all(usd_per_hour.get(t) is not None for t in by_type)
    total = {}
    for b in BUCKETS:
        usd = sum(by_type[t][b].usd or 0.0 for t in by_type) if all_priced else None
        total[b] = PhaseCost(sum(by_type[t][b].node_s for t in by_type), usd)
    return Bill(by_type, total)


def _priced(seconds: Mapping[str, float], usd_per_hour: Optional[float]) -> Dict[str, PhaseCost]:
    return {
        b: PhaseCost(seconds[b], seconds[b] / 3600.0 * usd_per_hour if usd_per_hour is not None else None)
        for b in BUCKETS
    }
