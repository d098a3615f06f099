"""The controller's failure steps: a rank raised, a worker or node was lost, or an
in-memory snapshot did not fit. Part of ``Controller`` (a mixin, so that
``controller.py`` stays one screenful per state); it uses the controller's collaborators.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List

from raylastic._internal.controller.states import Errored, Resizing, Running, State
from raylastic._internal.worker_group.group import PollBatch
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.worker_group.results import cause_text, rank_errors
from raylastic.errors import RankFailure, TrainingAborted, TrainingFailedError
from raylastic.events import EventKind, LossCause
from raylastic.policies.base import Raise
from raylastic.policies.failure import FailureCounts, FailureKind, FailurePolicy

if TYPE_CHECKING:
    from raylastic._internal.controller.hooks import RunHooks
    from raylastic._internal.controller.ingest import ReportIngest
    from raylastic._internal.controller.memory_restore import MemoryRestore
    from raylastic._internal.worker_group.group import WorkerGroup
    from raylastic._internal.worker_group.results import PollResult
    from raylastic.checkpoint.manager import CheckpointManager
    from raylastic.config import RunConfig
    from raylastic.events import EventLog

# After a rank raised (no peer lost), how long at most to go on collecting the group's
# reports before ending the attempt, while a report index up to the failed ranks' last
# one is still incomplete (some ranks' records in, not all): typically a slower rank's
# checkpoint whose upload was still running when the error arrived. In Ray Train every
# report() is a collective that returns once its checkpoint is registered, so a rank
# that raises right after a report never loses its peers' checkpoint of that report.
LAST_REPORTS_GRACE_S = 5.0


class FailureSteps:
    """Mixed into ``Controller``; not used on its own."""

    # The controller's collaborators and methods this mixin uses (set by Controller).
    _memory: MemoryRestore
    _group: WorkerGroup
    _events: EventLog
    _failure_policy: FailurePolicy
    _counts: FailureCounts
    _stop_requested: threading.Event
    _hooks: RunHooks
    _ingest: ReportIngest
    _ckpt: CheckpointManager
    _run: RunConfig

    if TYPE_CHECKING:

        def _stop_members(self, members: List[WorkerHandle], graceful: bool) -> Dict[int, PollResult]: ...

    def _memory_snapshot_unusable(self, st: Running, failures: List[RankFailure]) -> State:
        """The in-memory snapshot does not fit the train function's objects: say so, and
        restart the same members from the last committed checkpoint (not a failure)."""
        assert st.memory_index is not None  # only for a group restored from memory
        self._memory.mark_unusable(st.memory_index, st.epoch, failures[0].message.split(": ", 1)[-1].splitlines()[0])
        return Resizing(
            epoch=st.epoch,
            members=st.members,
            reason="in-memory snapshot unusable",
            graceful=False,
            started_at=time.monotonic(),
            progress=st.progress,
        )

    def _collect_last_reports(self, st: Running, failures: List[RankFailure]) -> PollBatch:
        """Ranks raised and no peer is lost: before the attempt ends, keep polling the group
        (at most ``LAST_REPORTS_GRACE_S``) while a report index up to the failed ranks' last
        one is incomplete, so that the reports the others made before the error (a
        checkpoint still uploading on a slower rank) reach the checkpoint manager and
        commit. Ranks that raise meanwhile join ``failures``. Returns the poll that found a
        member lost (the caller handles it as a loss), else an empty batch."""
        failed = {f.rank for f in failures}
        last = min((st.progress.last_index.get(m.wid, 0) for m in st.members if m.prev_rank in failed), default=0)
        deadline = time.monotonic() + LAST_REPORTS_GRACE_S
        while self._ckpt.incomplete_through(last) and time.monotonic() < deadline:
            time.sleep(self._run.poll_interval_s)
            batch = self._group.poll(st.members)
            self._ingest.ingest(st.progress, st.members, batch.results)
            failures += [f for f in rank_errors(st.members, batch.results, st.epoch) if f.rank not in failed]
            failed |= {f.rank for f in failures}
            if batch.lost:
                return batch
        return PollBatch()

    def _on_failure(self, st: Any, batch: PollBatch, failures: List[RankFailure]) -> State:
        """Workers were lost and/or ranks raised (``st``: Running, or Resizing during a
        graceful stop). A lost node makes every other error in the attempt collateral
        (peers of a vanished rank fail their collective); only without one does the
        attempt count as a real failure."""
        node_lost = [m for m in batch.lost if not self._group.is_crash(m, batch.causes.get(m.wid))]
        for m in batch.lost:
            cause = LossCause.NODE_LOST if m in node_lost else LossCause.CRASH
            failures.append(RankFailure(m.prev_rank, st.epoch, cause.value, cause_text(batch.causes.get(m.wid))))
            self._worker_lost(
                m,
                cause,
                f"worker rank {m.prev_rank} on node {m.node_id[-8:]} lost ({cause.value})",
                epoch=st.epoch,
                last_index=st.progress.last_index.get(m.wid, 0),
            )
        self._hooks.failed(failures)
        kind = FailureKind.NODE_LOST if node_lost else FailureKind.ERROR
        decision = self._failure_policy.decide(kind, self._counts)
        reached = st.progress.reached(default=st.restored_index if isinstance(st, Running) else 0)
        self._events.emit(
            EventKind.FAILURE,
            f"{kind.value} in epoch {st.epoch}: "
            + "; ".join(f"rank {f.rank} {f.kind}: {f.message.splitlines()[0] if f.message else ''}" for f in failures),
            epoch=st.epoch,
            failure_kind=kind.value,
            decision=type(decision).__name__,
            reason=decision.reason,
            reached_index=reached,
        )
        survivors = [m for m in st.members if m not in batch.lost]
        if kind is FailureKind.NODE_LOST:
            self._counts = FailureCounts(self._counts.errors, self._counts.node_losses + 1)
        else:
            self._counts = FailureCounts(self._counts.errors + 1, self._counts.node_losses)
        if isinstance(decision, Raise):
            self._stop_members(survivors, graceful=False)
            return Errored(TrainingFailedError(decision.reason, failures), failures)
        if decision.delay_s > 0 and self._stop_requested.wait(decision.delay_s):
            self._stop_members(survivors, graceful=False)
            return Errored(TrainingAborted("training was stopped while waiting to retry"), failures)
        return Resizing(
            epoch=st.epoch,
            members=survivors,
            reason=f"{kind.value}: {decision.reason}",
            graceful=False,
            started_at=time.monotonic(),
            lost_ranks=[m.prev_rank for m in batch.lost],
            progress=st.progress,
        )

    def _worker_lost(self, m: WorkerHandle, cause: LossCause, message: str, **fields: Any) -> None:
        """The one way a member leaves mid-run: recorded, then its actor is killed."""
        self._events.emit(
            EventKind.WORKER_LOST, message, rank=m.prev_rank, node_id=m.node_id, cause=cause.value, wid=m.wid, **fields
        )
        self._group.remove(m)
