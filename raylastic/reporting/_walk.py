"""The membership-epoch walk: one pass over a run's events that finds each group's span
(the world-size timeline), the recoveries from losses, and every resize.

A recovery is downtime caused by a *loss*: a worker that died (``node_lost``, ``crash``),
was replaced while hung (``hung``), or a rank that raised (``failure``). It opens at the
loss and closes at the next group's first step. A worker the controller moved off on
purpose during a graceful stop is not a loss: ``released`` (the capacity policy migrated
it, e.g. off on-demand when spot came back) or ``preempted`` (its node announced a drain
and the group stopped before the deadline). Those moves belong to the graceful ``resize``
that follows them, as the controller itself counts them (no recovery, ``graceful=True``).
Formulas: docs/report.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic.events import EventKind, LossCause
from raylastic.reporting.records import Recovery, Resize, Segment

Event = Mapping[str, Any]
SKEW_S = 2.0  # tolerated clock skew between rank 0 (metrics ts) and the controller

# worker_lost causes the controller emits when it moves a worker off on purpose during a
# graceful stop: part of a graceful resize, never a recovery.
PLANNED_CAUSES = frozenset(c.value for c in LossCause if c.planned)

_KINDS: Dict[Any, EventKind] = {k.value: k for k in EventKind}  # looked up with whatever a record holds


def kind_of(e: Event) -> Optional[EventKind]:
    """The event's kind as an :class:`EventKind` (None for kinds it does not know)."""
    return _KINDS.get(e.get("kind"))


def sessions(events: Sequence[Event], metrics: Sequence[Event]) -> List[Tuple[float, float]]:
    """(start_ts, end_ts) of each controller session: a ``run_started`` starts one (a resumed
    run appends a second). The idle gap between a crash and a resume is not wall time, nor
    is the wait for released nodes to leave the cluster (``node_gone``) after the run."""
    starts = [i for i, e in enumerate(events) if kind_of(e) is EventKind.RUN_STARTED and i > 0]
    bounds = [0] + starts + [len(events)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        start = float(events[a]["ts"])
        end = next((float(e["ts"]) for e in reversed(events[a:b]) if kind_of(e) is not EventKind.NODE_GONE), start)
        nxt = float(events[b]["ts"]) if b < len(events) else float("inf")
        end = max([end] + [float(m["ts"]) for m in metrics if start <= float(m["ts"]) < nxt])
        out.append((start, end))
    return out


@dataclass
class Group:
    """A membership epoch as the walk sees it (times are absolute timestamps)."""

    epoch: int
    world_size: int
    start_ts: float
    restore_index: int
    end_ts: Optional[float] = None
    ended_by: str = ""


@dataclass
class _OpenRecovery:
    at_ts: float
    cause: str
    nodes: List[str] = field(default_factory=list)
    failure_ts: Optional[float] = None
    steps_lost: int = 0
    reached_index: Optional[int] = None
    restore_index: Optional[int] = None
    world_size_before: Optional[int] = None
    world_size_after: Optional[int] = None
    reason: str = ""


@dataclass
class _OpenResize:
    """A resize whose next group (``to``) or first step (``pause_s``) may not be seen yet."""

    event: Event
    from_world_size: Optional[int]
    stop_ts: float  # when rank 0 reported the step the old group stopped at
    to_world_size: Optional[int] = None
    pause_s: Optional[float] = None


@dataclass
class Walk:
    groups: List[Group]
    segments: List[Segment]
    recoveries: List[Recovery]
    resizes: List[Resize]


def walk(events: Sequence[Event], metrics: Sequence[Event], sess: List[Tuple[float, float]], t0: float) -> Walk:
    """Membership epochs, recoveries (losses only) and resizes, in one pass over the events."""
    return _Walker(metrics, sess, t0).run(events)


class _Walker:
    """Reads events in order. Its state at any point:

    - ``current``: the group training now; None between a stop and the next group_formed;
    - ``stopped``: the group that ended last, until a resize takes it as its "from" (a
      loss or planned move ends a group before its resize event comes);
    - ``recovery``: the recovery in progress (a loss seen, training not resumed yet);
    - ``resizes``: every resize so far; the latest ones may still wait for their next group
      and first step.
    """

    def __init__(self, metrics: Sequence[Event], sess: List[Tuple[float, float]], t0: float):
        self.sess, self.t0 = sess, t0
        self.session_no = 0
        self.groups: List[Group] = []
        self.current: Optional[Group] = None
        self.stopped: Optional[Group] = None
        self.recovery: Optional[_OpenRecovery] = None
        self.recoveries: List[Recovery] = []
        self.resizes: List[_OpenResize] = []
        self.last_report_ts = _last_report_lookup(metrics)
        self.handlers: Dict[EventKind, Callable[[Event, float], None]] = {
            EventKind.RUN_STARTED: self.on_run_started,
            EventKind.WORKER_LOST: self.on_worker_lost,
            EventKind.FAILURE: self.on_failure,
            EventKind.RESIZE: self.on_resize,
            EventKind.GROUP_FORMED: self.on_group_formed,
            EventKind.FIRST_STEP: self.on_first_step,
            EventKind.RUN_FINISHED: self.on_run_end,
            EventKind.RUN_FAILED: self.on_run_end,
        }

    def run(self, events: Sequence[Event]) -> Walk:
        for i, e in enumerate(events):
            kind = kind_of(e)
            if kind is EventKind.RUN_STARTED and i == 0:
                continue  # the first session's start: nothing is open yet
            handler = self.handlers.get(kind) if kind is not None else None
            if handler is not None:
                handler(e, float(e["ts"]))
        self.end_group(self.sess[-1][1], "end of log")
        self.close_recovery(None)
        t0 = self.t0
        segments = [
            Segment(g.epoch, g.world_size, g.start_ts - t0, (g.end_ts or g.start_ts) - t0, g.restore_index, g.ended_by)
            for g in self.groups
        ]
        return Walk(self.groups, segments, self.recoveries, [_resize(rz, t0) for rz in self.resizes])

    # -- one method per event kind ---------------------------------------------------

    def on_run_started(self, e: Event, ts: float) -> None:
        """A resumed controller: whatever the last session left open ends with it."""
        self.end_group(self.sess[self.session_no][1], "controller stopped")
        self.close_recovery(None)
        self.stopped = None
        self.session_no += 1

    def on_worker_lost(self, e: Event, ts: float) -> None:
        cause = str(e.get("cause") or "lost")
        if cause not in PLANNED_CAUSES:
            rec = self.open_recovery(e, cause)
            if cause not in rec.cause.split("+"):
                rec.cause += "+" + cause
            if e.get("node_id") and e["node_id"] not in rec.nodes:
                rec.nodes.append(str(e["node_id"]))
        self.end_group(ts, cause)

    def on_failure(self, e: Event, ts: float) -> None:
        rec = self.open_recovery(e, str(e.get("failure_kind") or "error"))
        if rec.failure_ts is None:
            rec.failure_ts = ts
            rec.reason = str(e.get("reason") or e.get("message") or "")
            rec.reached_index = e.get("reached_index")
        self.end_group(ts, rec.cause)

    def on_resize(self, e: Event, ts: float) -> None:
        """A graceful resize is a recovery's only while one is already open (the downtime
        goes on); one after a failure always is (its lost steps are the recovery's)."""
        ended = self.current or self.stopped
        self.stopped = None
        self.resizes.append(
            _OpenResize(e, ended.world_size if ended else None, self.last_report_ts(e.get("reached_index"), ts))
        )
        graceful = bool(e.get("graceful"))
        cause = "resize"
        if not graceful or self.recovery is not None:
            rec = self.open_recovery(e, "resize")
            cause = cause if graceful else rec.cause
            rec.steps_lost += int(e.get("lost_steps") or 0)
            rec.restore_index = e.get("restore_index")
            if rec.reached_index is None:
                rec.reached_index = e.get("reached_index")
        self.end_group(ts, cause)

    def on_group_formed(self, e: Event, ts: float) -> None:
        self.end_group(ts, "regrouped")
        self.current = Group(
            int(e.get("epoch") or 0), int(e.get("world_size") or 0), ts, int(e.get("restore_index") or 0)
        )
        self.groups.append(self.current)
        if self.recovery is not None:
            self.recovery.world_size_after = self.current.world_size
        for rz in self.resizes:
            if rz.to_world_size is None:
                rz.to_world_size = self.current.world_size

    def on_first_step(self, e: Event, ts: float) -> None:
        """Training resumed: rank 0's clock when it reported (``report_ts``) ends the pause."""
        report_ts = float(e.get("report_ts") or ts)
        self.close_recovery(report_ts)
        for rz in self.resizes:
            if rz.pause_s is None:
                rz.pause_s = report_ts - rz.stop_ts

    def on_run_end(self, e: Event, ts: float) -> None:
        self.end_group(ts, "finished" if kind_of(e) is EventKind.RUN_FINISHED else "failed")
        self.close_recovery(None)

    # -- state changes -------------------------------------------------------------------

    def end_group(self, ts: float, why: str) -> None:
        if self.current is not None:
            self.current.end_ts, self.current.ended_by = ts, why
            self.stopped, self.current = self.current, None

    def open_recovery(self, e: Event, cause: str) -> _OpenRecovery:
        """The recovery in progress, opened at ``e`` if none is: later losses join it."""
        if self.recovery is None:
            self.recovery = _OpenRecovery(
                at_ts=float(e["ts"]), cause=cause, world_size_before=self.current.world_size if self.current else None
            )
        return self.recovery

    def close_recovery(self, recovered_ts: Optional[float]) -> None:
        """Training resumed at ``recovered_ts`` (None: the run or session ended first)."""
        rec, self.recovery = self.recovery, None
        if rec is None:
            return
        self.recoveries.append(
            Recovery(
                at_s=rec.at_ts - self.t0,
                cause=rec.cause,
                nodes=tuple(rec.nodes),
                detection_s=max(0.0, rec.failure_ts - rec.at_ts) if rec.failure_ts is not None else 0.0,
                recovery_s=(recovered_ts - rec.at_ts) if recovered_ts is not None else None,
                steps_lost=rec.steps_lost,
                reached_index=rec.reached_index,
                restore_index=rec.restore_index,
                world_size_before=rec.world_size_before,
                world_size_after=rec.world_size_after,
                reason=rec.reason,
            )
        )


def _resize(rz: _OpenResize, t0: float) -> Resize:
    e = rz.event
    return Resize(
        at_s=float(e["ts"]) - t0,
        graceful=bool(e.get("graceful")),
        from_world_size=rz.from_world_size,
        to_world_size=rz.to_world_size,
        lost_steps=int(e.get("lost_steps") or 0),
        resize_s=e.get("resize_s"),
        pause_s=rz.pause_s,
        reached_index=e.get("reached_index"),
        reason=str(e.get("reason") or e.get("message") or ""),
    )


def _last_report_lookup(metrics: Sequence[Event]) -> Callable[[Optional[int], float], float]:
    """ts of the last report of ``index`` made before ``ts`` (the step a group stopped at)."""
    by_index: Dict[int, List[float]] = defaultdict(list)
    for m in metrics:
        by_index[m["index"]].append(float(m["ts"]))

    def find(index: Optional[int], ts: float) -> float:
        cands = [t for t in by_index.get(index, []) if t <= ts + SKEW_S] if index is not None else []
        return max(cands) if cands else ts

    return find
