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

The Running, Resizing, capacity and failure steps are mixins of this class: ``running_steps.py``,
``resize_steps.py``, ``capacity_steps.py``, ``failure_steps.py``.
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
from raylastic._internal.controller.hooks import RunHooks
from raylastic._internal.controller.ingest import ReportIngest
from raylastic._internal.controller.memory_restore import MemoryRestore
from raylastic._internal.controller.resize_steps import ResizeSteps
from raylastic._internal.controller.running_steps import RunningSteps
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
    GroupFormationError,
    Interrupted,
    MembersLost,
    WorkerGroup,
)
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic.checkpoint.manager import CheckpointManager
from raylastic.checkpoint.storage import StorageError
from raylastic.config import RunConfig, ScalingConfig, describe, describe_run
from raylastic.errors import (
    InsufficientCapacityError,
    TrainingAborted,
    TrainingFailedError,
    storage_failure,
)
from raylastic.events import EventKind, EventLog
from raylastic.policies.base import Noop, Raise, Resize, Wait
from raylastic.policies.failure import FailureCounts, FailurePolicy
from raylastic.policies import from_configs
from raylastic.policies.scaling import ElasticScalingPolicy, ScalingSnapshot

logger = logging.getLogger("raylastic")


class Controller(RunningSteps, ResizeSteps, CapacitySteps, FailureSteps):
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

    # -- stopping the run ----------------------------------------------------------
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
