"""The controller's Resizing step: stop the group (at an agreed report, or at once after a
failure), replace the members that do not stop, let the leaving ones go, and say what the
next group restores from. Part of ``Controller`` (a mixin, so that ``controller.py`` stays
one screenful per state); it uses the controller's collaborators.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List

from raylastic._internal.controller.graceful_stop import AllFinished, Failed, GracefulStop
from raylastic._internal.controller.states import Finished, Resizing, Scheduling, State
from raylastic._internal.worker_group.stopping import ABORT_JOIN_MIN_S
from raylastic.events import EventKind, LossCause

if TYPE_CHECKING:
    from raylastic._internal.controller.ingest import ReportIngest
    from raylastic._internal.controller.memory_restore import MemoryRestore
    from raylastic._internal.worker_group.group import PollBatch, WorkerGroup
    from raylastic._internal.worker_group.pool import WorkerHandle
    from raylastic._internal.worker_group.results import PollResult
    from raylastic.checkpoint.manager import CheckpointManager
    from raylastic.config import RunConfig
    from raylastic.errors import RankFailure
    from raylastic.events import EventLog

# After an abort (a peer lost), a rank that is computing unwinds at its next report, within
# about a step, and one blocked in a gloo collective at once (the abort shuts the group's
# connections down: process_group.abort_group). One that is not back after
# max(ABORT_JOIN_MIN_S, ABORT_JOIN_STEPS steps) is stuck where no abort reaches it (its
# own code, an NCCL operation, a group gloo joined lazily). Replacing that worker (a new
# process, state by broadcast) costs seconds; waiting for the group timeout, a minute.
ABORT_JOIN_STEPS = 3


class ResizeSteps:
    """Mixed into ``Controller``; not used on its own."""

    # The controller's collaborators and state this mixin uses (set by Controller).
    _group: WorkerGroup
    _ingest: ReportIngest
    _events: EventLog
    _ckpt: CheckpointManager
    _memory: MemoryRestore
    _run: RunConfig
    _epoch: int
    _restarts: int
    _recoveries: int
    _world_sizes: List[int]

    if TYPE_CHECKING:

        def _on_failure(self, st: Any, batch: PollBatch, failures: List[RankFailure]) -> State: ...
        def _worker_lost(self, m: WorkerHandle, cause: LossCause, message: str, **fields: Any) -> None: ...

    def _step_resizing(self, st: Resizing) -> State:
        """Stop the group (``graceful``: every rank after the same report, over many ticks,
        so a requested stop is seen between them; else abort now), then say what the next
        group restores from and hand the survivors back to Scheduling."""
        if st.graceful:
            if st.stop is None:
                st.stop = GracefulStop(
                    st,
                    self._group,
                    self._ingest,
                    self._events,
                    lambda: [c.index for c in self._ckpt.committed],
                    self._run.poll_interval_s,
                )
            outcome = st.stop.tick()
            if outcome is None:
                return st  # still stopping: the loop checks for Ctrl-C between ticks
            if isinstance(outcome, Failed):
                return self._on_failure(st, outcome.batch, list(outcome.failures))
            if isinstance(outcome, AllFinished):
                self._events.emit(EventKind.RUN_FINISHED, "training finished while resizing")
                return Finished(return_value=outcome.return_value)
            if outcome.timed_out:  # some rank never reached the stop index: abort instead
                self._drain_survivors(st, self._stop_members(st.members, graceful=False))
                self._release_leaving(st)
            else:
                self._stop_members(st.members, graceful=True)
                self._memory.evacuate(st.members, st.leaving, outcome.index, st.epoch)
                self._release_leaving(st)
        else:
            last_words = self._stop_members(st.members, graceful=False)
            self._drain_survivors(st, last_words)
        self._restarts += 1
        if not st.graceful:
            self._recoveries += 1
        staying = [m for m in st.members if m not in st.leaving and self._group.is_member(m)]
        plan = self._memory.plan(staying, self._restarts, self._ckpt.latest_valid())
        reached = max(self._ingest.last_index, plan.index)
        lost_steps = reached - plan.index
        source = "in-memory snapshot" if plan.memory_index is not None else "checkpoint"
        self._events.emit(
            EventKind.RESIZE,
            f"resizing from {len(self._world_sizes) and self._world_sizes[-1]} workers: {st.reason}; "
            f"restoring {source} {plan.index if plan.checkpoint_rel or plan.memory_index else 'none'} "
            f"({lost_steps} step(s) to redo)",
            epoch=st.epoch,
            reason=st.reason,
            graceful=st.graceful,
            survivors=len(st.members),
            reached_index=reached,
            restore_index=plan.index,
            restore_source=source,
            lost_steps=lost_steps,
            resize_s=time.monotonic() - st.started_at,
        )
        return Scheduling(since=time.monotonic())

    def _release_leaving(self, st: Resizing) -> None:
        """Let the leaving members of a stopped group go (drained nodes, migrations);
        one replaced while stuck already has its ``worker_lost``."""
        for m in st.leaving:
            if not self._group.is_member(m):
                continue
            cause = LossCause.PREEMPTED if m.node_id in self._group.draining else LossCause.RELEASED
            self._worker_lost(
                m, cause, f"worker rank {m.prev_rank} {cause.value}: off node {m.node_id[-8:]} ({st.reason})"
            )

    def _stop_members(self, members: List[WorkerHandle], graceful: bool) -> Dict[int, PollResult]:
        """Make members' train threads exit; replace any that does not in time, after
        moving the snapshot shards only it holds. Returns the replaced ones' last words."""
        abort_join_s = max(ABORT_JOIN_MIN_S, ABORT_JOIN_STEPS * self._ingest.step_time_s)
        out = self._group.stop(members, self._epoch, graceful, abort_join_s)
        last_words = {}
        for h in out.hung:
            if h.last_words is not None:
                last_words[h.member.wid] = h.last_words
                self._memory.rescue(h.member, out.stopped)
            self._worker_lost(
                h.member, LossCause.HUNG, f"worker rank {h.member.prev_rank} {h.why}; replacing it", stuck_at=h.stuck_at
            )
        return last_words

    def _drain_survivors(self, st: Resizing, last_words: Dict[int, PollResult]) -> None:
        """Collect the survivors' last reports (a replaced worker's from its last words),
        then commit what the lost ranks could not have added to (see
        ``CheckpointManager.commit_after_loss``)."""
        batch = self._group.poll(st.members)
        self._ingest.ingest(st.progress, st.members, {**last_words, **batch.results}, first_step=False)
        if st.lost_ranks:
            self._ckpt.commit_after_loss(st.lost_ranks)
