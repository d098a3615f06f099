"""The controller's Running step: watch the group, and hand what it sees on (a loss or an
error to the failure steps, a preemption notice or a scaling decision to Resizing, every
rank done to Finished). Part of ``Controller`` (a mixin, so that ``controller.py`` stays
one screenful per state); it uses the controller's collaborators.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List

from raylastic._internal.controller.states import Finished, Resizing, Running, State
from raylastic._internal.worker_group.group import PollBatch
from raylastic._internal.worker_group.results import WorkerStatus, maybe_collateral, rank_errors
from raylastic.errors import RankFailure, SnapshotMismatchError
from raylastic.events import EventKind
from raylastic.policies.base import Resize
from raylastic.policies.scaling import ScalingSnapshot

if TYPE_CHECKING:
    from raylastic._internal.controller.ingest import ReportIngest
    from raylastic._internal.worker_group.group import WorkerGroup
    from raylastic.config import RunConfig
    from raylastic.events import EventLog
    from raylastic.policies.scaling import ElasticScalingPolicy

# After a rank raises, how long to look for a dead peer before calling it a real error
# (a rank whose peer vanished mid-collective raises a connection error first); only 1 s, and only
# a peer Ray says is dead (not a slow one), when no error is one a lost peer causes (``maybe_collateral``).
ERROR_CLASSIFY_GRACE_S = 5.0
PLAIN_ERROR_GRACE_S = 1.0


class RunningSteps:
    """Mixed into ``Controller``; not used on its own."""

    # The controller's collaborators and methods this mixin uses (set by Controller).
    _group: WorkerGroup
    _ingest: ReportIngest
    _events: EventLog
    _run: RunConfig
    _scaling_policy: ElasticScalingPolicy

    if TYPE_CHECKING:

        def _on_failure(self, st: Any, batch: PollBatch, failures: List[RankFailure]) -> State: ...
        def _memory_snapshot_unusable(self, st: Running, failures: List[RankFailure]) -> State: ...
        def _collect_last_reports(self, st: Running, failures: List[RankFailure]) -> PollBatch: ...

    def _step_running(self, st: Running) -> State:
        """One poll of the running group (``WorkerGroup.watch``), then what it calls for:
        the first of a loss or error, every rank finished, a preemption notice, a resize."""
        batch = self._group.watch(st.members)
        self._ingest.ingest(st.progress, st.members, batch.results)
        failures = rank_errors(st.members, batch.results, st.epoch)
        for wid, r in batch.results.items():
            if r.status == WorkerStatus.FINISHED:
                st.progress.finished[wid] = r.return_value
        if batch.lost:
            return self._on_failure(st, batch, failures)
        if (
            failures
            and st.memory_index is not None
            and all(f.message.startswith(SnapshotMismatchError.__name__) for f in failures)
        ):
            return self._memory_snapshot_unusable(st, failures)
        if failures:
            failed = {st.members[f.rank].wid for f in failures}
            collateral = any(map(maybe_collateral, failures))
            grace = ERROR_CLASSIFY_GRACE_S if collateral else PLAIN_ERROR_GRACE_S
            dead = self._group.wait_for_dead_peer([m for m in st.members if m.wid not in failed], grace, collateral)
            if not dead:  # a real error: the others' reports made before it still count
                batch = self._collect_last_reports(st, failures)
                return self._on_failure(st, batch, failures)
            return self._on_failure(st, PollBatch(lost=[m for m in st.members if m.wid in dead], causes=dead), failures)
        if len(st.progress.finished) == len(st.members):
            index = st.progress.reached()
            self._events.emit(
                EventKind.RUN_FINISHED, f"training finished at report {index}", epoch=st.epoch, index=index
            )
            return Finished(return_value=st.progress.finished.get(st.members[0].wid))
        if st.progress.finished:
            time.sleep(self._run.poll_interval_s)
            return st  # the rest are finishing their last step
        drained = self._group.drained(st.members)
        if drained:
            nodes = sorted({m.node_id for m in drained})
            self._events.emit(
                EventKind.PREEMPTION_NOTICE,
                f"preemption notice for node(s) {', '.join(n[-8:] for n in nodes)}: "
                f"moving {len(drained)} worker(s) off before the deadline",
                nodes=nodes,
                deadlines_ms=[self._group.draining.get(n) for n in nodes],
                epoch=st.epoch,
            )
            return Resizing(
                epoch=st.epoch,
                members=st.members,
                reason="preemption notice",
                graceful=True,
                started_at=time.monotonic(),
                leaving=drained,
                progress=st.progress,
            )
        snap = ScalingSnapshot(
            now=time.monotonic(),
            group_size=len(st.members),
            ready_spares=len(self._group.ready_spares(st.members)),
            last_ready_at=self._group.last_ready_at,
            waiting_since=None,
        )
        d = self._scaling_policy.decide(snap)
        if isinstance(d, Resize):
            self._events.emit(EventKind.DECISION, d.reason, decision="resize", world_size=d.world_size)
            return Resizing(
                epoch=st.epoch,
                members=st.members,
                reason=d.reason,
                graceful=True,
                started_at=time.monotonic(),
                progress=st.progress,
            )
        time.sleep(self._run.poll_interval_s)
        return st
