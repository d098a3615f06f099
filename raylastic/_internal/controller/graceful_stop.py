"""A graceful stop: every member stops right after the same report, over many ticks.

Used for a scale-up, a preemption notice and a migration: nothing is lost, because the
stop index is a restore point (an in-memory snapshot, or a checkpoint boundary). The
stop index itself is chosen by a pure policy (``policies/stop_index.py``).

A stop can take tens of seconds (waiting for a checkpoint boundary, a slow step). It is
a state, not a loop inside one step: each ``tick()`` polls once and returns, so the
controller's loop sees a requested stop (Ctrl-C) between ticks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from raylastic._internal.controller.ingest import ReportIngest
from raylastic._internal.controller.states import Resizing
from raylastic._internal.worker_group.group import JOIN_TIMEOUT_S, MembersLost, PollBatch, WorkerGroup
from raylastic._internal.worker_group.results import WorkerStatus, rank_errors
from raylastic.errors import RankFailure
from raylastic.events import EventKind, EventLog
from raylastic.policies.stop_index import choose_stop_index

# How often to ask for a new stop index when some rank is already past the proposed one.
MAX_STOP_PROPOSALS = 5


@dataclass(frozen=True)
class Stopped:
    """Every member stopped after ``index`` (``timed_out``: not all did in time)."""

    index: int
    timed_out: bool = False


@dataclass(frozen=True)
class Failed:
    """Members were lost or ranks raised during the stop."""

    batch: PollBatch
    failures: List[RankFailure] = field(default_factory=list)


@dataclass(frozen=True)
class AllFinished:
    """The train function returned on every rank before the stop index."""

    return_value: object


Outcome = object  # Stopped | Failed | AllFinished


class GracefulStop:
    def __init__(
        self,
        st: Resizing,
        group: WorkerGroup,
        ingest: ReportIngest,
        events: EventLog,
        committed: Callable[[], Sequence[int]],
        poll_interval_s: float,
    ):
        self._st = st
        self._group = group
        self._ingest = ingest
        self._events = events
        self._committed = committed
        self._poll_interval_s = poll_interval_s
        self.target: Optional[int] = None
        self._deadline = 0.0

    def tick(self) -> Optional[Outcome]:
        """Poll once; None while members are still on their way to the stop index."""
        st = self._st
        batch = self._group.poll(st.members)
        self._ingest.ingest(st.progress, st.members, batch.results, first_step=False)
        if batch.lost:
            return Failed(batch)
        if self.target is None:
            try:
                self._begin(max([r.index for r in batch.results.values()], default=0))
            except MembersLost as e:  # one died between the poll and the request
                return Failed(e.batch)
            return None
        statuses = [batch.results[m.wid].status for m in st.members if m.wid in batch.results]
        if len(statuses) == len(st.members) and all(s != WorkerStatus.RUNNING for s in statuses):
            return self._settled(batch)
        if time.monotonic() >= self._deadline:
            return Stopped(self.target, timed_out=True)
        time.sleep(min(0.05, self._poll_interval_s))
        return None

    def _begin(self, current: int) -> None:
        """Agree on a stop index every member can still reach."""
        st = self._st
        snapshots = all(m.snapshots for m in st.members)
        budget = self._group.time_to_deadline(st.leaving)

        def choose(at: int) -> int:
            return choose_stop_index(
                at,
                step_time_s=self._ingest.step_time_s,
                snapshots=snapshots,
                budget_s=budget,
                committed=self._committed(),
            )

        target = choose(current)
        agreed = False
        for _ in range(MAX_STOP_PROPOSALS):
            answers = self._group.request_stop_at(st.members, target)
            agreed = all(a.ok for a in answers)
            if agreed:
                break
            target = choose(max(a.index for a in answers))
        self.target = target
        if not agreed:
            # A rank already stopped at an earlier proposal, or runs ahead of every one:
            # the others would wait for it in a collective. Abort now (the next tick's
            # timed-out stop) rather than after the stop's deadline, tens of seconds on.
            self._events.emit(
                EventKind.DECISION,
                f"no report every rank can still stop after (last proposed {target}): aborting the group instead",
                decision="abort",
            )
            self._deadline = time.monotonic()
            return
        self._events.emit(
            EventKind.DECISION, f"stopping workers after report {target} to resize", decision="stop_at", stop_at=target
        )
        self._deadline = time.monotonic() + JOIN_TIMEOUT_S + max(5.0, (target - current) * self._ingest.step_time_s * 3)

    def _settled(self, batch: PollBatch) -> Outcome:
        st = self._st
        statuses = [batch.results[m.wid].status for m in st.members]
        if all(s == WorkerStatus.FINISHED for s in statuses):
            return AllFinished(batch.results[st.members[0].wid].return_value)
        errors = rank_errors(st.members, batch.results, st.epoch)
        if errors:
            return Failed(PollBatch(), errors)
        assert self.target is not None  # settled only after _begin chose the stop index
        return Stopped(self.target)
