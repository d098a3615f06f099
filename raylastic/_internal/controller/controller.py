"""The controller: executes the state machine in ``states.py``; policies decide.

It runs in a Ray actor that reserves no CPU or GPU, on the head node, so it neither
needs a worker slot nor dies with a preempted worker node.

One loop, ``run -> _tick -> _step_<state> -> next state``; each collaborator owns one job:

- ``WorkerGroup`` (``worker_group/group.py``): the members and every worker-actor call;
- ``MemoryRestore`` (``memory_restore.py``): where a new group restores from, and keeping
  in-memory snapshots while workers leave;
- ``GracefulStop`` (``graceful_stop.py``): stopping every rank after the same report;
- ``ReportIngest`` (``ingest.py``): the one path for workers' reports and metrics;
- policies (scaling, failure, capacity through ``CapacityDriver``, stop index): decide.

The capacity and failure steps are mixins of this class: ``capacity_steps.py``, ``failure_steps.py``.
The controller makes no actor call and imports no torch, so ``tests/unit/test_controller.py``
steps it against a fake group.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Union, cast

from raylastic._internal.protocol import TrainFunc
from raylastic._internal.cluster.capacity_driver import CapacityDriver
from raylastic._internal.controller.capacity_steps import CapacitySteps
from raylastic._internal.controller.failure_steps import FailureSteps
from raylastic._internal.controller.graceful_stop import AllFinished, Failed, GracefulStop
from raylastic._internal.controller.hooks import RunHooks
from raylastic._internal.controller.ingest import ReportIngest
from raylastic._internal.controller.memory_restore import MemoryRestore
from raylastic._internal.controller.states import (
    Errored,
    Finished,
    Resizing,
    Running,
    Scheduling,
    State,
    check_transition,
    is_terminal,
)
from raylastic._internal.worker_group.group import (
    ABORT_JOIN_MIN_S,
    GroupFormationError,
    Interrupted,
    MembersLost,
    PollBatch,
    WorkerGroup,
)
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.worker_group.results import PollResult, WorkerStatus, maybe_collateral, rank_errors
from raylastic.checkpoint.manager import CheckpointManager
from raylastic.checkpoint.storage import StorageError
from raylastic.config import RunConfig, ScalingConfig, describe, describe_run
from raylastic.errors import (
    InsufficientCapacityError,
    SnapshotMismatchError,
    TrainingAborted,
    TrainingFailedError,
    storage_failure,
)
from raylastic.events import EventKind, EventLog, LossCause
from raylastic.policies.base import Noop, Raise, Resize, Wait
from raylastic.policies.failure import FailureCounts, FailurePolicy
from raylastic.policies import from_configs
from raylastic.policies.scaling import ElasticScalingPolicy, ScalingSnapshot

logger = logging.getLogger("raylastic")

# After a rank raises, how long to look for a dead peer before calling it a real error
# (a rank whose peer vanished mid-collective raises a connection error first); only 1 s, and only
# a peer Ray says is dead (not a slow one), when no error is one a lost peer causes (``maybe_collateral``).
ERROR_CLASSIFY_GRACE_S = 5.0
PLAIN_ERROR_GRACE_S = 1.0
# After an abort (a peer lost), a rank that is computing unwinds at its next report, within
# about a step, and one blocked in a gloo collective at once (the abort shuts the group's
# connections down: process_group.abort_group). One that is not back after
# max(ABORT_JOIN_MIN_S, ABORT_JOIN_STEPS steps) is stuck where no abort reaches it (its
# own code, an NCCL operation, a group gloo joined lazily). Replacing that worker (a new
# process, state by broadcast) costs seconds; waiting for the group timeout, a minute.
ABORT_JOIN_STEPS = 3


class Controller(CapacitySteps, FailureSteps):
    """Ray actor body. ``run()`` blocks until training ends and returns an outcome dict.

    ``scaling_policy``, ``failure_policy`` and ``group`` default to the ones the configs
    describe; tests pass their own. ``hooks``: code the front end attaches (``hooks.py``)."""

    def __init__(
        self,
        train_func: Union[Callable, TrainFunc],
        train_loop_config: Optional[Dict[str, Any]],
        scaling: ScalingConfig,
        run: RunConfig,
        storage,
        run_rel: str,
        run_name: str,
        *,
        scaling_policy: Optional[ElasticScalingPolicy] = None,
        failure_policy: Optional[FailurePolicy] = None,
        group: Optional[WorkerGroup] = None,
        fit_ts: Optional[float] = None,
        epoch_floor: int = 0,
        hooks: Optional[RunHooks] = None,
    ):
        # A TrainFunc's reference is passed on as is (each worker resolves it), never loaded here.
        self._train_func = train_func.ref if isinstance(train_func, TrainFunc) else train_func
        self._config = train_loop_config
        self._scaling = scaling
        self._run = run
        self._storage = storage
        self._run_rel = run_rel
        self._run_name = run_name
        self._stop_requested = threading.Event()
        self._events = EventLog(storage, run_rel, verbose=run.verbose)
        cc = run.checkpoint_config
        self._ckpt = CheckpointManager(
            storage,
            run_rel,
            cc.num_to_keep,
            self._events,
            score_attribute=cc.score_attribute,
            score_order=cc.score_order,
        )
        self._scaling_policy = scaling_policy or from_configs(scaling)[0]  # one wait clock
        fc = run.failure_config
        self._failure_policy = failure_policy or FailurePolicy(fc.max_failures, fc.max_node_failures)
        self._counts = FailureCounts()
        self._group = group or WorkerGroup.for_run(scaling, run, storage, run_rel, run_name)
        self._tb = None
        if run.tensorboard:
            from raylastic.tensorboard import TensorBoardLogger  # optional: tensorboard / tensorboardX

            self._tb = TensorBoardLogger.for_run(storage, run_rel)
            self._events.add_listener(self._tb.observe_event)
        self._hooks = hooks or RunHooks()
        self._ingest = ReportIngest(self._ckpt, self._events, self._tb, self._hooks)
        self._memory = MemoryRestore(self._group, self._ckpt, self._events)
        self._capacity = (
            None
            if scaling.capacity is None
            else CapacityDriver(
                scaling.capacity,
                min_workers=scaling.min_workers,
                max_workers=cast(int, scaling.max_workers),  # set (never None) by ScalingConfig.__post_init__
                pool=self._group.pool,
                events=self._events,
                total_steps=run.total_steps,
                fit_ts=fit_ts,
            )
        )
        self._epoch = epoch_floor  # a resumed run continues its epoch numbering (never reuses a name)
        self._restarts = 0
        self._recoveries = 0
        self._state: State = Scheduling(since=time.monotonic())
        self._world_sizes: List[int] = []
        self._last_committed_seen: Optional[int] = None
        self._lock = threading.Lock()

    # -- public actor methods ------------------------------------------------------
    def request_stop(self) -> None:
        """Ctrl-C or shutdown: seen within a second, whatever the loop is waiting on."""
        self._stop_requested.set()
        self._group.interrupt()

    def status(self) -> Dict[str, Any]:
        with self._lock:
            st = self._state
            return {
                "state": type(st).__name__,
                "epoch": self._epoch,
                "world_size": len(st.members) if isinstance(st, Running) else 0,
                "metrics": self._ingest.latest_metrics,
                "world_sizes": list(self._world_sizes),
                "index": self._ingest.last_index,
                "recoveries": self._recoveries,
                "total_steps": self._run.total_steps,
            }

    def run(self) -> Dict[str, Any]:
        latest = self._ckpt.latest()
        self._events.emit(
            EventKind.RUN_STARTED,
            f"run {self._run_name} started at {self._storage.uri}/{self._run_rel}",
            scaling=describe(self._scaling),
            run=describe_run(self._run),
            resources_per_worker=self._scaling.worker_resources(),
            resume_from=latest.index if latest else None,
        )
        try:
            self._ckpt.delete_uncommitted()
            if self._capacity is not None:
                self._capacity.start()
            while not is_terminal(self._state):
                if self._stop_requested.is_set():
                    self._abort_all("stop requested (Ctrl-C or shutdown)")
                    self._set_state(Errored(TrainingAborted("training was interrupted")))
                    break
                try:
                    self.tick()
                except Interrupted:
                    continue  # the stop flag is set: the next turn ends the run
        except TrainingFailedError as e:  # a hook ended the run (it logged why)
            self._set_state(Errored(e), check=False)
        except StorageError as e:  # a manifest or retention write failed past its retries
            logger.exception("controller could not write to storage")
            self._set_state(Errored(storage_failure(e, self._storage.uri)), check=False)
        except BaseException as e:  # noqa: BLE001 - never leave workers behind
            logger.exception("controller crashed")
            self._set_state(Errored(e), check=False)
        finally:
            self._hooks.group_ended()  # a group the loop did not end (a no-op if it did)
            for h in self._group.ready_workers():
                self._events.emit(EventKind.WORKER_RELEASED, wid=h.wid, node_id=h.node_id)
            self._group.shutdown()
            if self._capacity is not None:
                self._capacity.release()
            if self._tb is not None:
                self._tb.close()
        return self._outcome()

    # -- the loop ------------------------------------------------------------------
    def tick(self) -> None:
        """One turn of the loop (tests step it by hand)."""
        if self._capacity is not None:
            self._capacity_step()
            if is_terminal(self._state):
                return
        for h in self._group.refresh():
            self._events.emit(
                EventKind.WORKER_READY,
                wid=h.wid,
                node_id=h.node_id,
                node_type=h.info["node_type"] if h.info else None,
                market=h.info["market"] if h.info else None,
            )
        self._group.fill()
        self._set_state(self._step(self._state))

    def _set_state(self, new: State, check: bool = True) -> None:
        if isinstance(self._state, (Running, Resizing)) and not isinstance(new, (Running, Resizing)):
            ended = self._hooks.group_ended()  # the group stopped
            if ended is not None and not isinstance(new, Errored):
                new = Errored(ended)
        with self._lock:
            old = self._state
            if new is old:
                return
            if check:
                check_transition(old, new)
            self._state = new
        self._events.emit(EventKind.STATE, state=type(new).__name__, previous=type(old).__name__)

    def _step(self, st: State) -> State:
        if isinstance(st, Scheduling):
            return self._step_scheduling(st)
        if isinstance(st, Running):
            return self._step_running(st)
        if isinstance(st, Resizing):
            return self._step_resizing(st)
        raise AssertionError(f"no step for {st!r}")

    # -- Scheduling ----------------------------------------------------------------
    def _step_scheduling(self, st: Scheduling) -> State:
        now = time.monotonic()
        spares = self._group.ready_spares([])
        leaving = self._group.drained(spares)  # idle workers on nodes about to go away
        if leaving:
            self._keep_newest_snapshot(spares, leaving)
            for h in leaving:
                self._group.remove(h)
        spares = [h for h in spares if h.node_id not in self._group.draining]
        p = self._scaling_policy  # placed workers still starting: asked only when it could matter
        starting = self._group.starting() if p.min_workers <= len(spares) < p.max_workers else 0
        d = p.decide(
            ScalingSnapshot(
                now=now,
                group_size=0,
                ready_spares=len(spares),
                starting=starting,
                last_ready_at=self._group.last_ready_at,
                waiting_since=st.since,
                last_wait_log_at=st.last_log_at,
            )
        )
        if isinstance(d, Raise):
            self._events.emit(EventKind.DECISION, d.reason, decision="raise")
            return Errored(
                InsufficientCapacityError(
                    self._scaling.min_workers, len(spares), now - st.since, self._scaling.worker_resources()
                )
            )
        if isinstance(d, (Wait, Noop)):
            if isinstance(d, Wait) and d.log:
                self._events.emit(EventKind.CAPACITY_WAIT, d.reason, ready=len(spares))
                st.last_log_at = now
            time.sleep(self._run.poll_interval_s)
            return st
        assert isinstance(d, Resize)
        if self._group.drained(spares, fresh=True):  # a notice arrived since: decide again
            return st
        self._events.emit(EventKind.DECISION, d.reason, decision="resize", world_size=d.world_size)
        members = sorted(spares, key=lambda h: (h.prev_rank, h.wid))[: d.world_size]
        return self._form_group(members) or Scheduling(since=st.since)

    def _keep_newest_snapshot(self, spares: List[WorkerHandle], leaving: List[WorkerHandle]) -> None:
        """Idle workers on draining nodes may hold the newest state (notices a moment apart:
        the group shrank for the first node, and the other two left with snapshot 3265 while
        the next group restored checkpoint 3200). Keep it, as a graceful stop does."""
        latest = self._ckpt.latest_valid()
        newest = max((i for h in leaving for i in h.snapshots), default=None)
        if newest is not None and (latest is None or newest > latest.index):
            self._memory.evacuate(spares, leaving, newest, self._epoch)

    def _form_group(self, members: List[WorkerHandle]) -> Optional[Running]:
        self._epoch += 1
        epoch = self._epoch
        try:
            formed = self._group.setup(members, epoch, self._scaling.backend)
        except GroupFormationError as e:
            self._events.emit(
                EventKind.FAILURE,
                f"group formation for epoch {epoch} failed: {e}; {e.gone} worker(s) gone, re-forming",
                epoch=epoch,
                failure_kind="formation",
                gone=e.gone,
            )
            return None
        members, world = formed.members, len(formed.members)
        latest = self._ckpt.latest_valid()
        self._memory.refresh(members)
        restore = self._memory.plan(members, self._restarts, latest)
        self._ckpt.begin_epoch(epoch, world)
        prev = self._world_sizes[-1] if self._world_sizes else 0
        self._world_sizes.append(world)
        self._events.emit(
            EventKind.GROUP_FORMED,
            f"epoch {epoch}: world size {prev} -> {world}"
            + (
                f", resuming from in-memory snapshot {restore.index}"
                if restore.memory_index is not None
                else f", resuming from checkpoint {latest.index}"
                if latest
                else ", fresh start"
            ),
            epoch=epoch,
            world_size=world,
            previous_world_size=prev,
            nodes=[m.node_id for m in members],
            pids=[m.info["pid"] if m.info else None for m in members],
            restore_index=restore.index,
            restore_path=restore.checkpoint_rel,
            stripes=[list(s) for s in formed.stripes] if formed.stripes else None,
        )
        self._memory.record(epoch, members, restore, latest)
        try:
            self._hooks.group_started(members, epoch)
            self._group.start(formed, self._train_func, self._config, restore)
        except Interrupted:  # some may have started: no train function outlives the run
            self._group.abort(members, epoch)
            raise
        except MembersLost as e:  # Running's first poll finds them gone: a loss like any other
            logger.warning("epoch %s: %s while starting; handling it as a loss", epoch, e)
        self._memory.skip_next = False  # the members drop the snapshots newer than restore.index
        self._events.emit(EventKind.TRAINING_STARTED, epoch=epoch, world_size=world)
        return Running(
            epoch=epoch,
            members=members,
            started_at=time.monotonic(),
            restored_index=restore.index,
            memory_index=restore.memory_index,
        )

    # -- Running -------------------------------------------------------------------
    def _step_running(self, st: Running) -> State:
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

    # -- Resizing ------------------------------------------------------------------
    def _step_resizing(self, st: Resizing) -> State:
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

    def _abort_all(self, reason: str) -> None:
        self._events.emit(EventKind.DECISION, reason, decision="abort")
        self._group.abort(getattr(self._state, "members", []), self._epoch)

    # -- outcome -------------------------------------------------------------------
    def _outcome(self) -> Dict[str, Any]:
        st = self._state
        latest = self._ckpt.latest()
        error = st.error if isinstance(st, Errored) else None
        if error is not None:
            self._events.emit(
                EventKind.RUN_FAILED, f"run failed: {str(error).splitlines()[0]}", error=type(error).__name__
            )
        self._events.close()
        return {
            "metrics": self._ingest.latest_metrics,
            "checkpoint_rel": latest.rel if latest else None,
            "checkpoint_index": latest.index if latest else None,
            "error": error,
            "world_sizes": list(self._world_sizes),
            "return_value": st.return_value if isinstance(st, Finished) else None,
            "restarts": self._restarts,
            "epoch": self._epoch,
        }
