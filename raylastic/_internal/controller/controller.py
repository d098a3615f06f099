"""The controller: executes the state machine in ``states.py``; policies decide.

It runs in a Ray actor that reserves no CPU or GPU, pinned (softly) to the driver's
node, so it neither needs a worker slot nor dies with a preempted worker node.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from raylastic._internal.controller.states import (
    Errored, Finished, Resizing, Running, Scheduling, check_transition, is_terminal,
)
from raylastic._internal.worker_group.pool import WorkerHandle, WorkerPool
from raylastic._internal.worker_group.worker import PollResult, WorkerStatus
from raylastic.checkpoint.manager import CheckpointManager
from raylastic.checkpoint.storage import StorageError
from raylastic.config import RunConfig, ScalingConfig, describe
from raylastic.errors import (
    InsufficientCapacityError, RankFailure, SnapshotMismatchError, TrainingAborted, TrainingFailedError,
)
from raylastic.events import EventKind, EventLog
from raylastic.policies.base import Noop, Raise, Resize, Wait
from raylastic.policies.failure import FailureCounts, FailureKind, FailurePolicy
from raylastic.policies.scaling import ElasticScalingPolicy, ScalingSnapshot
from raylastic.session import GroupSpec, RestoreInfo
from raylastic.state import restore_from_memory_possible
from raylastic._internal.stripes import covered, plan_stripes

logger = logging.getLogger("raylastic")

# How long a worker may not answer polls before it is declared lost. Ray's own health
# checks usually declare the actor dead sooner (see README: failure detection).
UNAVAILABLE_GRACE_S = 15.0
# After a rank raises, how long to look for a dead peer before calling it a real error
# (a rank whose peer vanished mid-collective raises a connection error first).
ERROR_CLASSIFY_GRACE_S = 5.0
# How long survivors get to unwind their train function before being replaced.
JOIN_TIMEOUT_S = 30.0
# After an abort (a peer lost), a rank that is computing unwinds at its next report, within
# about a step, and one blocked in a gloo collective at once (the abort shuts the group's
# connections down: process_group.abort_group). One that is not back after this long is
# stuck where no abort reaches it (its own code, an NCCL operation, a group gloo joined
# lazily). Replacing that worker (a new process, state by broadcast) costs seconds;
# waiting for the group timeout would cost a minute.
ABORT_JOIN_MIN_S = 5.0
ABORT_JOIN_STEPS = 3
# How often to ask the GCS which nodes are draining (preemption notices).
DRAIN_CHECK_INTERVAL_S = 0.5
# Process-group formation timeout.
GROUP_TIMEOUT_S = 60.0
# Graceful stop: how far ahead (seconds of steps) to place the agreed stop index, and
# how long to wait for a checkpoint boundary instead of stopping sooner.
STOP_AHEAD_S = 0.3
MAX_WAIT_FOR_BOUNDARY_S = 20.0


class Controller:
    """Ray actor body. ``run()`` blocks until training ends and returns an outcome dict."""

    def __init__(self, train_func: Callable, train_loop_config: Optional[Dict[str, Any]],
                 scaling: ScalingConfig, run: RunConfig, storage, run_rel: str, run_name: str):
        self._train_func = train_func
        self._config = train_loop_config
        self._scaling = scaling
        self._run = run
        self._storage = storage
        self._run_rel = run_rel
        self._run_name = run_name
        self._stop_requested = threading.Event()
        self._events = EventLog(storage, run_rel, verbose=run.verbose)
        self._ckpt = CheckpointManager(storage, run_rel, run.checkpoint_config.num_to_keep, self._events)
        self._scaling_policy = ElasticScalingPolicy(
            min_workers=scaling.min_workers, max_workers=scaling.max_workers,
            max_wait_s=scaling.max_wait_s,
        )
        fc = run.failure_config
        self._failure_policy = FailurePolicy(fc.max_failures, fc.max_node_failures)
        self._counts = FailureCounts()
        self._pool = WorkerPool(
            target=scaling.max_workers, resources=scaling.worker_resources(),
            use_gpu=scaling.use_gpu, storage=storage, run_rel=run_rel, run_name=run_name,
            async_upload=run.checkpoint_config.async_upload,
            persist_every=run.checkpoint_config.persist_every,
        )
        self._epoch = 0
        self._restarts = 0
        self._state: object = Scheduling(since=time.monotonic())
        self._latest_metrics: Dict[str, Any] = {}
        self._world_sizes: List[int] = []
        self._step_time_s = 0.05  # running estimate, used to place graceful stops
        self._last_rank0: Optional[tuple] = None  # (index, monotonic time)
        self._capacity = None
        if scaling.capacity is not None:
            from raylastic._internal.cluster.capacity_driver import CapacityDriver

            self._capacity = CapacityDriver(scaling.capacity, min_workers=scaling.min_workers,
                                            max_workers=scaling.max_workers, pool=self._pool,
                                            events=self._events)
        self._last_committed_seen: Optional[int] = None
        self._recoveries = 0
        self._skip_memory_restore = False  # set when an in-memory snapshot did not fit
        self._last_words: Dict[int, PollResult] = {}  # polls of workers replaced while stuck
        self._draining: Dict[str, int] = {}
        self._draining_checked_at = 0.0
        self._tb = None
        if run.tensorboard:
            from raylastic.tensorboard import TensorBoardLogger

            self._tb = TensorBoardLogger.for_run(storage, run_rel)
            self._events.add_listener(self._tb.observe_event)
        self._lock = threading.Lock()

    # -- public actor methods ------------------------------------------------------
    def request_stop(self) -> None:
        self._stop_requested.set()

    def status(self) -> Dict[str, Any]:
        with self._lock:
            st = self._state
            return {
                "state": type(st).__name__,
                "epoch": self._epoch,
                "world_size": len(st.members) if isinstance(st, Running) else 0,
                "metrics": dict(self._latest_metrics),
                "world_sizes": list(self._world_sizes),
                "index": self._last_rank0[0] if self._last_rank0 else 0,
                "recoveries": self._recoveries,
                "total_steps": self._run.total_steps,
            }

    def run(self) -> Dict[str, Any]:
        self._events.emit(
            EventKind.RUN_STARTED, f"run {self._run_name} started at {self._storage.uri}/{self._run_rel}",
            scaling=describe(self._scaling), run=_run_desc(self._run),
            resources_per_worker=self._scaling.worker_resources(),
            resume_from=self._ckpt.latest().index if self._ckpt.latest() else None,
        )
        self._ckpt.delete_uncommitted()
        if self._capacity is not None:
            self._capacity.start()
        try:
            while not is_terminal(self._state):
                if self._stop_requested.is_set():
                    self._abort_all("stop requested (Ctrl-C or shutdown)")
                    self._set_state(Errored(TrainingAborted("training was interrupted")))
                    break
                if self._capacity is not None and not self._capacity_step():
                    break
                for h in self._pool.refresh():
                    self._events.emit(EventKind.WORKER_READY, wid=h.wid, node_id=h.node_id,
                                      node_type=h.info.get("node_type"), market=h.info.get("market"))
                self._pool.fill()
                self._set_state(self._step(self._state))
        except StorageError as e:  # a manifest or retention write failed past its retries
            logger.exception("controller could not write to storage")
            self._set_state(Errored(_storage_failure(e, self._storage.uri)), check=False)
        except BaseException as e:  # noqa: BLE001 - never leave workers behind
            logger.exception("controller crashed")
            self._set_state(Errored(e), check=False)
        finally:
            for h in list(self._pool.workers.values()):
                if h.ready:
                    self._events.emit(EventKind.WORKER_RELEASED, wid=h.wid, node_id=h.node_id)
            self._pool.shutdown()
            if self._capacity is not None:
                self._capacity.release()
            if self._tb is not None:
                self._tb.close()
        return self._outcome()

    # -- state machine -------------------------------------------------------------
    def _set_state(self, new: object, check: bool = True) -> None:
        with self._lock:
            old = self._state
            if new is old:
                return
            if check:
                check_transition(old, new)
            self._state = new
        self._events.emit(EventKind.STATE, state=type(new).__name__, previous=type(old).__name__)

    def _step(self, st: object) -> object:
        if isinstance(st, Scheduling):
            return self._step_scheduling(st)
        if isinstance(st, Running):
            return self._step_running(st)
        if isinstance(st, Resizing):
            return self._step_resizing(st)
        raise AssertionError(f"no step for {st!r}")

    # -- capacity (spot / on-demand) ------------------------------------------------
    def _capacity_step(self) -> bool:
        """Run the capacity policy; False when the run must end (max_wait_s ran out)."""
        from raylastic.policies.capacity import CapacityTimeoutError

        st = self._state
        members = list(getattr(st, "members", []))
        latest = self._ckpt.latest()
        boundary = (latest is not None and latest.index != self._last_committed_seen) or \
            bool(members and all(m.snapshots for m in members))
        self._last_committed_seen = latest.index if latest else None
        self._drained(members)  # refresh the draining view the policy excludes
        # Between groups, keep the ready workers that hold in-memory snapshots: they are
        # the state the next group restores from (trimming them would force a storage read).
        protect = members if isinstance(st, Running) else [
            h for h in self._pool.workers.values() if h.ready and h.snapshots]
        try:
            migration = self._capacity.tick(members, self._draining, boundary, protect=protect)
        except CapacityTimeoutError as e:
            self._abort_all(f"capacity wait exhausted: {e}")
            self._stop_members(members, graceful=False)
            self._set_state(Errored(e))
            return False
        if migration is not None and isinstance(st, Running):
            self._set_state(self._migrate(st, migration))
        return True

    def _migrate(self, st: Running, migration) -> object:
        """Swap on-demand members for ready spot workers at this boundary."""
        od = {t.name for t in self._capacity.policy.node_types if t.market.value == "on_demand"}
        on_demand = [m for m in st.members if m.node_type in od]
        leaving = sorted(on_demand, key=lambda m: -m.prev_rank)[:migration.workers]
        for name in od:  # do not refill the slots being given back
            self._pool.targets[name] = migration.target.get(name, 0)
        return Resizing(epoch=st.epoch, members=st.members, reason=migration.reason, graceful=True,
                        target_world_size=len(st.members), started_at=time.monotonic(), leaving=leaving)

    # -- Scheduling ----------------------------------------------------------------
    def _step_scheduling(self, st: Scheduling) -> object:
        now = time.monotonic()
        spares = self._pool.ready_spares([])
        for h in self._drained(spares):  # idle workers on a node about to go away
            self._pool.remove(h, kill=True)
        spares = [h for h in spares if h.node_id not in self._draining]
        snap = ScalingSnapshot(now=now, group_size=0, ready_spares=len(spares),
                               last_ready_at=self._pool.last_ready_at, waiting_since=st.since,
                               last_wait_log_at=st.last_log_at)
        d = self._scaling_policy.decide(snap)
        if isinstance(d, Raise):
            self._events.emit(EventKind.DECISION, d.reason, decision="raise")
            return Errored(InsufficientCapacityError(
                self._scaling.min_workers, len(spares), now - st.since, self._scaling.worker_resources()))
        if isinstance(d, Wait):
            if d.log:
                self._events.emit(EventKind.CAPACITY_WAIT, d.reason, ready=len(spares))
                st.last_log_at = now
            time.sleep(self._run.poll_interval_s)
            return st
        if isinstance(d, Noop):
            time.sleep(self._run.poll_interval_s)
            return st
        assert isinstance(d, Resize)
        if self._drained(spares, fresh=True):  # a notice arrived since: decide again
            return st
        self._events.emit(EventKind.DECISION, d.reason, decision="resize", world_size=d.world_size)
        members = sorted(spares, key=lambda h: (h.prev_rank, h.wid))[: d.world_size]
        return self._form_group(members) or Scheduling(since=st.since)

    def _plan_restore(self, members: List[WorkerHandle]) -> RestoreInfo:
        """Newest state every member can get: an in-memory ElasticState snapshot all
        snapshot holders share and whose shards they cover together (holders send what
        others lack), else the last valid committed checkpoint in storage."""
        latest = self._ckpt.latest_valid()
        mem = None if self._skip_memory_restore else restore_from_memory_possible(
            {m.wid: m.snapshots for m in members}, {m.wid: m.stripes for m in members})
        if mem is not None and (latest is None or mem >= latest.index):
            return RestoreInfo(checkpoint_rel=latest.rel if latest else None, index=mem,
                               restart_count=self._restarts, memory_index=mem,
                               broadcast=any(mem not in m.snapshots or mem in m.stripes for m in members))
        return RestoreInfo(checkpoint_rel=latest.rel if latest else None,
                           index=latest.index if latest else 0, restart_count=self._restarts)

    def _form_group(self, members: List[WorkerHandle]) -> Optional[Running]:
        self._epoch += 1
        epoch = self._epoch
        members = _order_by_node(members)  # (any holder can send a restore: see stripes.assemble)
        world = len(members)
        backend = self._scaling.backend
        try:
            addr = ray.get(members[0].actor.host_store.remote(world, GROUP_TIMEOUT_S), timeout=GROUP_TIMEOUT_S)
            node_ranks, local = _local_ranks(members)
            stripes = plan_stripes([m.node_id for m in members])  # used by ElasticState(striped=True)
            specs = [
                GroupSpec(epoch=epoch, rank=r, world_size=world, local_rank=local[m.wid][0],
                          local_world_size=local[m.wid][1], node_rank=node_ranks[m.node_id],
                          master_addr=addr["addr"], master_port=addr["port"], backend=backend,
                          timeout_s=GROUP_TIMEOUT_S, stripe=stripes[r] if stripes else ())
                for r, m in enumerate(members)
            ]
            ray.get([m.actor.setup_group.remote(s) for m, s in zip(members, specs)], timeout=GROUP_TIMEOUT_S + 10)
        except (RayActorError, GetTimeoutError) as e:
            dead = self._pool.probe(members, timeout_s=2.0)
            for h in members:
                if h.wid in dead:
                    self._pool.remove(h, kill=True)
            self._events.emit(EventKind.FAILURE, f"group formation for epoch {epoch} failed: {e}; "
                              f"{len(dead)} worker(s) gone, re-forming", epoch=epoch, kind="formation")
            return None
        for r, m in enumerate(members):
            m.prev_rank = r
        restore = self._plan_restore(members)
        latest = self._ckpt.latest_valid()
        self._ckpt.begin_epoch(epoch, world)
        prev = self._world_sizes[-1] if self._world_sizes else 0
        self._world_sizes.append(world)
        self._events.emit(
            EventKind.GROUP_FORMED,
            f"epoch {epoch}: world size {prev} -> {world}"
            + (f", resuming from in-memory snapshot {restore.index}" if restore.memory_index is not None
               else f", resuming from checkpoint {latest.index}" if latest else ", fresh start"),
            epoch=epoch, world_size=world, previous_world_size=prev,
            nodes=[m.node_id for m in members], pids=[m.info.get("pid") for m in members],
            restore_index=restore.index,
            restore_path=restore.checkpoint_rel,
            stripes=[list(s) for s in stripes] if stripes else None,
        )
        if restore.memory_index is not None:
            self._events.emit(EventKind.CHECKPOINT_RESTORED, epoch=epoch, index=restore.index,
                              source="memory", broadcast=restore.broadcast,
                              striped=any(restore.index in m.stripes for m in members))
        else:
            self._say_why_not_memory(members, latest)
            if latest:
                self._events.emit(EventKind.CHECKPOINT_RESTORED, epoch=epoch, index=latest.index,
                                  path=latest.rel, source="storage")
        ray.get([m.actor.start.remote(self._train_func, self._config, s, restore)
                 for m, s in zip(members, specs)], timeout=GROUP_TIMEOUT_S)
        self._events.emit(EventKind.TRAINING_STARTED, epoch=epoch, world_size=world)
        self._skip_memory_restore = False  # the members drop the snapshots newer than restore.index
        return Running(epoch=epoch, members=members, started_at=time.monotonic(),
                       restored_index=restore.index, memory_index=restore.memory_index)

    # -- Running -------------------------------------------------------------------
    def _poll(self, st: Running, members: List[WorkerHandle]):
        """Poll every member once. Returns (results by wid, lost handles, lost causes)."""
        refs = {m.actor.poll.remote(): m for m in members}
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=max(1.0, self._run.poll_interval_s))
        results: Dict[int, PollResult] = {}
        lost: List[WorkerHandle] = []
        causes: Dict[int, BaseException] = {}
        now = time.monotonic()
        for ref in done:
            m = refs[ref]
            try:
                results[m.wid] = ray.get(ref)
                st.unavailable_since.pop(m.wid, None)
            except ActorUnavailableError:
                since = st.unavailable_since.setdefault(m.wid, now)
                if now - since > UNAVAILABLE_GRACE_S:
                    lost.append(m)
            except RayActorError as e:
                lost.append(m)
                causes[m.wid] = e
        for ref in not_done:
            m = refs[ref]
            since = st.unavailable_since.setdefault(m.wid, now)
            if now - since > UNAVAILABLE_GRACE_S:
                lost.append(m)
        return results, lost, causes

    def _step_running(self, st: Running) -> object:
        results, lost, causes = self._poll(st, st.members)
        failures: List[RankFailure] = []
        for m in st.members:
            r = results.get(m.wid)
            if r is None:
                continue
            self._ingest(st, m, r)
            if r.status == WorkerStatus.ERROR:
                failures.append(RankFailure(m.prev_rank, st.epoch, "error", r.error or "", r.traceback))
            elif r.status == WorkerStatus.FINISHED:
                st.finished[m.wid] = r.return_value
        if lost:
            return self._on_failure(st, lost, causes, failures)
        if failures and st.memory_index is not None and all(
                f.message.startswith(SnapshotMismatchError.__name__) for f in failures):
            return self._memory_snapshot_unusable(st, failures)
        if failures:
            failed = {st.members[f.rank].wid for f in failures}
            causes = self._wait_for_dead_peer([m for m in st.members if m.wid not in failed])
            dead = [m for m in st.members if m.wid in causes]
            return self._on_failure(st, dead, causes, failures)
        if len(st.finished) == len(st.members):
            rank0 = st.members[0].wid
            self._events.emit(EventKind.RUN_FINISHED, f"training finished at report {max(st.last_index.values(), default=0)}",
                              epoch=st.epoch, index=max(st.last_index.values(), default=0))
            return Finished(return_value=st.finished.get(rank0))
        if st.finished:
            time.sleep(self._run.poll_interval_s)
            return st  # the rest are finishing their last step
        drained = self._drained(st.members)
        if drained:
            nodes = sorted({m.node_id for m in drained})
            self._events.emit(EventKind.PREEMPTION_NOTICE,
                              f"preemption notice for node(s) {', '.join(n[-8:] for n in nodes)}: "
                              f"moving {len(drained)} worker(s) off before the deadline",
                              nodes=nodes, deadlines_ms=[self._draining.get(n) for n in nodes],
                              epoch=st.epoch)
            survivors = [m for m in st.members if m not in drained]
            return Resizing(epoch=st.epoch, members=st.members, reason="preemption notice",
                            graceful=True, target_world_size=len(survivors),
                            started_at=time.monotonic(), leaving=drained)
        spares = self._pool.ready_spares(st.members)
        snap = ScalingSnapshot(now=time.monotonic(), group_size=len(st.members),
                               ready_spares=len(spares), last_ready_at=self._pool.last_ready_at,
                               waiting_since=None)
        d = self._scaling_policy.decide(snap)
        if isinstance(d, Resize):
            self._events.emit(EventKind.DECISION, d.reason, decision="resize", world_size=d.world_size)
            return Resizing(epoch=st.epoch, members=st.members, reason=d.reason, graceful=True,
                            target_world_size=d.world_size, started_at=time.monotonic())
        time.sleep(self._run.poll_interval_s)
        return st

    def _memory_snapshot_unusable(self, st: Running, failures: List[RankFailure]) -> object:
        """The in-memory snapshot does not fit the train function's objects: say so, and
        restart the same members from the last committed checkpoint (not a failure)."""
        reason = failures[0].message.split(": ", 1)[-1].splitlines()[0]
        latest = self._ckpt.latest_valid()
        self._events.emit(
            EventKind.CHECKPOINT_INVALID,
            f"in-memory snapshot {st.memory_index} is unusable ({reason}); falling back to "
            + (f"committed checkpoint {latest.index}" if latest else "a fresh start (nothing committed)"),
            source="memory", index=st.memory_index, epoch=st.epoch, reason=reason,
            fallback_index=latest.index if latest else None)
        self._skip_memory_restore = True
        return Resizing(epoch=st.epoch, members=st.members, reason="in-memory snapshot unusable",
                        graceful=False, target_world_size=len(st.members), started_at=time.monotonic())

    def _drained(self, members: List[WorkerHandle], fresh: bool = False) -> List[WorkerHandle]:
        """Members on nodes Ray is draining (a preemption notice: ``ray drain-node``, the
        autoscaler/KubeRay, or raylastic's cloud-metadata watcher). Checked every 0.5 s,
        or now when ``fresh`` (before forming a group)."""
        now = time.monotonic()
        if fresh or now - self._draining_checked_at >= DRAIN_CHECK_INTERVAL_S:
            self._draining_checked_at = now
            try:
                from ray._private.state import state as gcs_state

                self._draining = dict(gcs_state.get_draining_nodes())
            except Exception as e:  # noqa: BLE001 - an older Ray or a GCS hiccup
                logger.debug("could not read draining nodes: %s", e)
        return [m for m in members if m.node_id in self._draining]

    def _ingest(self, st: Running, m: WorkerHandle, r: PollResult) -> None:
        st.last_index[m.wid] = max(st.last_index.get(m.wid, 0), r.index)
        m.snapshots = list(r.snapshots)
        m.stripes = dict(r.stripes)
        if not r.records:
            return
        self._ckpt.on_records(r.records)
        for rec in r.records:
            if rec.rank != 0:
                continue
            now = time.monotonic()
            if self._last_rank0 is not None and rec.index > self._last_rank0[0]:
                dt = (now - self._last_rank0[1]) / (rec.index - self._last_rank0[0])
                self._step_time_s = 0.8 * self._step_time_s + 0.2 * max(dt, 1e-4)
            self._last_rank0 = (rec.index, now)
            with self._lock:
                self._latest_metrics = rec.metrics
            self._events.metrics({"ts": rec.ts, "index": rec.index, "epoch": rec.epoch,
                                  "world_size": len(st.members), "metrics": rec.metrics})
            if self._tb is not None:
                self._tb.log_metrics(rec.index, rec.metrics, len(st.members), rec.ts)
            if not st.first_step_seen:
                st.first_step_seen = True
                self._events.emit(EventKind.FIRST_STEP, epoch=rec.epoch, index=rec.index,
                                  world_size=len(st.members), report_ts=rec.ts)

    def _wait_for_dead_peer(self, others: List[WorkerHandle]) -> Dict[int, Optional[BaseException]]:
        """A rank raised: was it because a peer vanished? Look for a dead peer for a while."""
        deadline = time.monotonic() + ERROR_CLASSIFY_GRACE_S
        while True:
            dead = self._pool.probe(others, timeout_s=max(0.1, min(1.0, deadline - time.monotonic())))
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.2)

    def _on_failure(self, st: Running, lost: List[WorkerHandle], causes: Dict[int, Optional[BaseException]],
                    failures: List[RankFailure]) -> object:
        """Workers were lost and/or ranks raised. A lost node makes every other error in
        the attempt collateral (peers of a vanished rank fail their collective); only
        without one does the attempt count as a real failure."""
        node_lost = [m for m in lost if not _is_crash(m, causes.get(m.wid))]
        for m in lost:
            kind = "node_lost" if m in node_lost else "crash"
            failures.append(RankFailure(m.prev_rank, st.epoch, kind, _cause_text(causes.get(m.wid))))
            self._events.emit(EventKind.WORKER_LOST, f"worker rank {m.prev_rank} on node {m.node_id[-8:]} lost ({kind})",
                              epoch=st.epoch, rank=m.prev_rank, node_id=m.node_id, cause=kind, wid=m.wid,
                              last_index=st.last_index.get(m.wid, 0))
            self._pool.remove(m, kill=True)
        kind = FailureKind.NODE_LOST if node_lost else FailureKind.ERROR
        decision = self._failure_policy.decide(kind, self._counts)
        reached = max(st.last_index.values(), default=st.restored_index)
        self._events.emit(EventKind.FAILURE, f"{kind.value} in epoch {st.epoch}: " + "; ".join(
            f"rank {f.rank} {f.kind}: {f.message.splitlines()[0] if f.message else ''}" for f in failures),
            epoch=st.epoch, failure_kind=kind.value, decision=type(decision).__name__,
            reason=decision.reason, reached_index=reached)
        survivors = [m for m in st.members if m not in lost]
        if kind is FailureKind.NODE_LOST:
            self._counts = FailureCounts(self._counts.errors, self._counts.node_losses + 1)
        else:
            self._counts = FailureCounts(self._counts.errors + 1, self._counts.node_losses)
        if isinstance(decision, Raise):
            self._stop_members(survivors, graceful=False)
            return Errored(TrainingFailedError(decision.reason, failures), failures)
        return Resizing(epoch=st.epoch, members=survivors, reason=f"{kind.value}: {decision.reason}",
                        graceful=False, target_world_size=len(survivors), started_at=time.monotonic(),
                        lost_ranks=[m.prev_rank for m in lost])

    # -- Resizing ------------------------------------------------------------------
    def _step_resizing(self, st: Resizing) -> object:
        if st.graceful:
            outcome = self._graceful_stop(st)
            if outcome is not None:
                return outcome
        else:
            self._stop_members(st.members, graceful=False)
            self._drain_survivors(st)
        self._restarts += 1
        if not st.graceful:
            self._recoveries += 1
        plan = self._plan_restore([m for m in st.members if m not in st.leaving and m.wid in self._pool.workers])
        reached = max(self._last_index_seen(st), plan.index)
        lost_steps = reached - plan.index
        source = "in-memory snapshot" if plan.memory_index is not None else "checkpoint"
        self._events.emit(
            EventKind.RESIZE,
            f"resizing from {len(self._world_sizes) and self._world_sizes[-1]} workers: {st.reason}; "
            f"restoring {source} {plan.index if plan.checkpoint_rel or plan.memory_index else 'none'} "
            f"({lost_steps} step(s) to redo)",
            epoch=st.epoch, reason=st.reason, graceful=st.graceful, survivors=len(st.members),
            reached_index=reached, restore_index=plan.index, restore_source=source, lost_steps=lost_steps,
            resize_s=time.monotonic() - st.started_at,
        )
        return Scheduling(since=time.monotonic())

    def _drain_survivors(self, st: Resizing) -> None:
        """Collect the survivors' last reports, then commit what the lost ranks could not
        have added to (see ``CheckpointManager.commit_after_loss``)."""
        running = Running(epoch=st.epoch, members=st.members, started_at=st.started_at,
                          restored_index=0, first_step_seen=True)
        results, _lost, _causes = self._poll(running, st.members)
        for m in st.members:
            if m.wid in results:
                self._ingest(running, m, results[m.wid])
            elif m.wid in self._last_words:  # replaced while stuck: its reports before that
                self._ingest(running, m, self._last_words.pop(m.wid))
        self._last_words.clear()
        if st.lost_ranks:
            self._ckpt.commit_after_loss(st.lost_ranks)

    def _last_index_seen(self, st: Resizing) -> int:
        return self._last_rank0[0] if self._last_rank0 else 0

    def _graceful_stop(self, st: Resizing) -> Optional[object]:
        """Stop every member right after the same report; None when all stopped."""
        running = Running(epoch=st.epoch, members=st.members, started_at=st.started_at,
                          restored_index=0, first_step_seen=True)
        results, lost, causes = self._poll(running, st.members)
        current = max([r.index for r in results.values()], default=0)
        for m in st.members:
            if m.wid in results:
                self._ingest(running, m, results[m.wid])
        if lost:
            return self._on_failure(running, lost, causes, [])
        snapshots = all(m.snapshots for m in st.members)
        budget = self._time_to_deadline(st.leaving)
        target = self._choose_stop_index(current, snapshots, budget)
        for _ in range(5):
            answers = ray.get([m.actor.request_stop_at.remote(target) for m in st.members], timeout=30)
            if all(a["ok"] for a in answers):
                break
            target = self._choose_stop_index(max(a["index"] for a in answers), snapshots, budget)
        self._events.emit(EventKind.DECISION, f"stopping workers after report {target} to resize",
                          decision="stop_at", stop_at=target)
        deadline = time.monotonic() + JOIN_TIMEOUT_S + max(5.0, (target - current) * self._step_time_s * 3)
        while time.monotonic() < deadline:
            results, lost, causes = self._poll(running, st.members)
            for m in st.members:
                if m.wid in results:
                    self._ingest(running, m, results[m.wid])
            if lost:
                return self._on_failure(running, lost, causes, [])
            statuses = [results[m.wid].status for m in st.members if m.wid in results]
            if len(statuses) == len(st.members) and all(s != WorkerStatus.RUNNING for s in statuses):
                if all(s == WorkerStatus.FINISHED for s in statuses):
                    self._events.emit(EventKind.RUN_FINISHED, "training finished while resizing")
                    return Finished(return_value=results[st.members[0].wid].return_value)
                errors = [RankFailure(m.prev_rank, st.epoch, "error", results[m.wid].error or "",
                                      results[m.wid].traceback)
                          for m in st.members if results[m.wid].status == WorkerStatus.ERROR]
                if errors:
                    return self._on_failure(running, [], {}, errors)
                self._stop_members(st.members, graceful=True)
                self._evacuate_state(st, target)
                for m in st.leaving:  # drained (its node goes away) or migrated to spot
                    cause = "preempted" if m.node_id in self._draining else "released"
                    self._events.emit(EventKind.WORKER_LOST, f"worker rank {m.prev_rank} {cause}: "
                                      f"off node {m.node_id[-8:]} ({st.reason})", rank=m.prev_rank,
                                      node_id=m.node_id, cause=cause, wid=m.wid)
                    self._pool.remove(m, kill=True)
                return None
            time.sleep(min(0.05, self._run.poll_interval_s))
        self._stop_members(st.members, graceful=False)
        return None

    def _time_to_deadline(self, leaving: List[WorkerHandle]) -> float:
        """Seconds until the earliest drain deadline of the leaving members (inf if none)."""
        deadlines = [self._draining.get(m.node_id) for m in leaving]
        deadlines = [d / 1000.0 for d in deadlines if d]
        return min(deadlines) - time.time() if deadlines else float("inf")

    def _say_why_not_memory(self, members: List[WorkerHandle], latest) -> None:
        """Members held in-memory snapshots, yet the group restores from storage: say why
        in the event log (a node and its snapshot peer lost, or no shared snapshot)."""
        holders = [m for m in members if m.snapshots]
        if not holders or self._skip_memory_restore:
            return
        common = set.intersection(*(set(m.snapshots) for m in holders))
        newest = max(common, default=None)
        if newest is not None and (latest is None or newest > latest.index):
            why = (f"the surviving workers' shards of snapshot {newest} do not cover the state "
                   "(a node and the node holding the second copy of its shard were both lost)")
        elif newest is None:
            why = "the surviving workers share no in-memory snapshot"
        else:
            return  # the checkpoint in storage is as new as memory: nothing lost
        self._events.emit(EventKind.DECISION, f"{why}; restoring from "
                          + (f"checkpoint {latest.index} in storage" if latest else "the start"),
                          decision="memory_restore_impossible", snapshot_index=newest,
                          fallback_index=latest.index if latest else 0)

    def _evacuate_state(self, st: Resizing, index: int) -> None:
        """Keep snapshot ``index`` when leaving members hold shards of it the staying ones
        lack: their shards move to a staying holder (over Ray), or, when every holder is
        leaving (all members were on draining nodes), the snapshot is assembled on one of
        them and written to storage before they go, so the next group loses nothing.
        (A stop normally makes every rank take a full copy; this covers the rest.)"""
        staying = [m for m in st.members if m not in st.leaving]
        holders = [m for m in st.members if index in m.snapshots]
        stay_holders = [m for m in holders if m in staying]
        if not st.leaving or not holders or (stay_holders and covered([m.holding(index) for m in stay_holders])):
            return
        target = (stay_holders or holders)[0]
        try:
            if not self._gather_shards(target, holders, index):
                return
            if target in staying:
                self._events.emit(EventKind.DECISION, f"moved the leaving workers' shards of snapshot "
                                  f"{index} to rank {target.prev_rank} before their nodes go",
                                  decision="evacuate", index=index, to_rank=target.prev_rank)
                return
            out = ray.get(target.actor.persist_snapshot.remote(index, st.epoch), timeout=JOIN_TIMEOUT_S)
            self._ckpt.commit_evacuation(index, out["rel"], out["files"], out["upload_s"])
            self._events.emit(EventKind.DECISION, f"no remaining worker holds snapshot {index}: "
                              f"persisted it to storage before the node goes", decision="evacuate",
                              index=index, upload_s=round(out["upload_s"], 3))
        except Exception as e:  # noqa: BLE001 - fall back to the last committed checkpoint
            logger.warning("could not move or persist snapshot %s before evacuation: %s", index, e)

    def _gather_shards(self, target: WorkerHandle, holders: List[WorkerHandle], index: int) -> bool:
        """Merge other holders' shards of snapshot ``index`` into ``target`` until it holds
        all of it. False (and a log line) when the holders together do not cover it."""
        if not covered([m.holding(index) for m in holders]):
            logger.warning("the holders of snapshot %s do not cover it; not moving it", index)
            return False
        for m in holders:
            if target.holding(index)[0] == 0:
                break
            if m is not target:
                self._merge_shards(m, target, index)
        if target.holding(index)[0] != 0:
            logger.warning("snapshot %s is still not whole on rank %s after merging (%s)",
                           index, target.prev_rank, target.holding(index))
            return False
        return True

    def _merge_shards(self, frm: WorkerHandle, to: WorkerHandle, index: int) -> bool:
        """Copy ``frm``'s shards of snapshot ``index`` that ``to`` lacks into ``to``'s copy
        (over Ray); ``to.stripes`` follows. False when ``frm`` adds nothing."""
        theirs, have = frm.holding(index), to.holding(index)
        if have[0] == 0 or (theirs[0] and set(theirs[1]) <= set(have[1])):
            return False
        have = tuple(ray.get(to.actor.merge_snapshot.remote(index, frm.actor.export_snapshot.remote(index)),
                             timeout=JOIN_TIMEOUT_S))
        if have[0] == 0:
            to.stripes.pop(index, None)  # a full copy now
        else:
            to.stripes[index] = have
        return True

    def _choose_stop_index(self, current: int, snapshots: bool = False,
                           budget_s: float = float("inf")) -> int:
        """A report index every rank can still reach. With in-memory snapshots every
        index is a restore point: as soon as possible. Otherwise the next checkpoint
        boundary when it comes soon enough (within 20 s, and before a drain deadline
        with a safety margin), so the new group loses no steps."""
        ahead = max(2, math.ceil(STOP_AHEAD_S / max(self._step_time_s, 1e-4)))
        target = current + ahead
        if snapshots:
            return target
        wait_s = min(MAX_WAIT_FOR_BOUNDARY_S, budget_s * 0.7 - 1.0)
        committed = self._ckpt.committed
        if len(committed) >= 2 and wait_s > 0:
            period = committed[-1].index - committed[-2].index
            if period > 0:
                boundary = committed[-1].index + period * math.ceil((target - committed[-1].index) / period)
                if (boundary - current) * self._step_time_s <= wait_s:
                    target = boundary
        return target

    def _stop_members(self, members: List[WorkerHandle], graceful: bool) -> None:
        """Make members' train threads exit; replace any that does not in time."""
        if not members:
            return
        timeout_s = JOIN_TIMEOUT_S
        aborts = {}
        if not graceful:
            aborts = {m.wid: m.actor.abort.remote(self._epoch) for m in members}
            timeout_s = max(ABORT_JOIN_MIN_S, ABORT_JOIN_STEPS * self._step_time_s)
        refs = {m.actor.join.remote(timeout_s): m for m in members}
        # The aborts too: a thread that stopped on its own can join before its abort
        # ran (actor calls run in a thread pool), and the next group must not form first.
        if aborts:
            ray.wait(list(aborts.values()), num_returns=len(aborts), timeout=timeout_s + 5)
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s + 5)
        stopped, hung = [], [(refs[ref], "did not answer") for ref in not_done]
        for ref in done:
            try:
                if ray.get(ref):
                    stopped.append(refs[ref])
                    continue
            except RayActorError:
                pass
            hung.append((refs[ref], "did not stop in time"))
        wheres = self._where_stuck([m for m, _why in hung], aborts)
        for m, why in hung:
            if self._take_last_words(m):
                self._rescue_shards(m, stopped)
            self._replace(m, why, wheres[m.wid])

    def _where_stuck(self, hung: List[WorkerHandle], aborts: Dict[int, Any]) -> Dict[int, str]:
        """What workers about to be replaced were doing, for the event log: how many
        group connections each one's abort shut down, and its train thread's innermost
        frames. Asked of all at once, under one deadline."""
        stacks = {m.wid: m.actor.train_stack.remote() for m in hung}
        ray.wait(list(stacks.values()), num_returns=len(stacks), timeout=ABORT_JOIN_MIN_S)
        out = {}
        for m in hung:
            parts = []
            for label, ref in (("abort shut {} group connection(s)", aborts.get(m.wid)),
                               ("{}", stacks[m.wid])):
                if ref is None:
                    continue
                try:
                    parts.append(label.format(ray.get(ref, timeout=0.1)))
                except Exception as e:  # noqa: BLE001 - an actor that does not answer: say so
                    parts.append(f"no answer ({type(e).__name__})")
            out[m.wid] = "\n".join(p for p in parts if p)
            logger.warning("replacing rank %s, which did not unwind: %s", m.prev_rank, out[m.wid])
        return out

    def _take_last_words(self, m: WorkerHandle) -> bool:
        """Collect the reports a worker about to be replaced made since the last poll
        (its actor answers; only its train thread is stuck), so its metrics and
        checkpoint records are not lost with it; ``_drain_survivors`` ingests them. The
        poll also refreshes what snapshots it holds. False if it does not answer."""
        try:
            last = self._last_words[m.wid] = ray.get(m.actor.poll.remote(), timeout=ABORT_JOIN_MIN_S)
        except Exception as e:  # noqa: BLE001 - a dead or unresponsive actor: nothing to save
            logger.debug("no last reports from rank %s: %s", m.prev_rank, e)
            return False
        m.snapshots, m.stripes = list(last.snapshots), dict(last.stripes)
        return True

    def _rescue_shards(self, hung: WorkerHandle, stopped: List[WorkerHandle]) -> None:
        """A worker about to be replaced (its train thread stuck in a collective) still
        answers calls, and its snapshots are intact (no optimizer step ran since): move
        the shards the stopped workers lack to one of them, so replacing it does not turn
        a memory restore into a storage read."""
        if not stopped:
            return
        try:  # fresh views: snapshots may have completed since the last poll (the hung
            # worker's came with its last words)
            views = ray.get([m.actor.holdings.remote() for m in stopped], timeout=ABORT_JOIN_MIN_S)
        except Exception as e:  # noqa: BLE001 - the restore then falls back as planned
            logger.warning("stopped ranks do not answer: %s", e)
            return
        for m, view in zip(stopped, views):
            m.snapshots, m.stripes = list(view["snapshots"]), dict(view["stripes"])
        common = [(i, m) for m in stopped for i in set(hung.snapshots) & set(m.snapshots)]
        if not common:
            return
        index, to = max(common, key=lambda p: p[0])  # the newest: the one a restore would use
        try:
            if not self._merge_shards(hung, to, index):
                return  # the receiver lacks nothing the hung worker has
        except Exception as e:  # noqa: BLE001 - the restore then falls back as planned
            logger.warning("could not move snapshot %s's shards off hung rank %s: %s", index, hung.prev_rank, e)
            return
        self._events.emit(EventKind.DECISION, f"moved hung rank {hung.prev_rank}'s shards of snapshot "
                          f"{index} to rank {to.prev_rank} before replacing it", decision="evacuate",
                          index=index, to_rank=to.prev_rank)

    def _replace(self, m: WorkerHandle, why: str, where: str = "") -> None:
        self._events.emit(EventKind.WORKER_LOST, f"worker rank {m.prev_rank} {why}; replacing it",
                          rank=m.prev_rank, node_id=m.node_id, cause="hung", wid=m.wid, stuck_at=where)
        self._pool.remove(m, kill=True)

    def _abort_all(self, reason: str) -> None:
        st = self._state
        members = getattr(st, "members", [])
        self._events.emit(EventKind.DECISION, reason, decision="abort")
        for m in members:
            try:
                m.actor.abort.remote(self._epoch)
            except Exception:  # noqa: BLE001
                pass

    # -- outcome -------------------------------------------------------------------
    def _outcome(self) -> Dict[str, Any]:
        st = self._state
        latest = self._ckpt.latest()
        error = st.error if isinstance(st, Errored) else None
        if error is not None:
            self._events.emit(EventKind.RUN_FAILED, f"run failed: {str(error).splitlines()[0]}",
                              error=type(error).__name__)
        self._events.close()
        return {
            "metrics": dict(self._latest_metrics),
            "checkpoint_rel": latest.rel if latest else None,
            "checkpoint_index": latest.index if latest else None,
            "error": error,
            "world_sizes": list(self._world_sizes),
            "return_value": st.return_value if isinstance(st, Finished) else None,
            "restarts": self._restarts,
        }


def _order_by_node(members: List[WorkerHandle]) -> List[WorkerHandle]:
    """Rank order: survivors keep their relative order (rank 0 stays rank 0 when it
    survives); workers on one node get consecutive ranks."""
    first_rank_on_node: Dict[str, tuple] = {}
    for m in members:
        key = (m.prev_rank, m.wid)
        first_rank_on_node[m.node_id] = min(first_rank_on_node.get(m.node_id, key), key)
    return sorted(members, key=lambda m: (first_rank_on_node[m.node_id], m.prev_rank, m.wid))


def _local_ranks(members: List[WorkerHandle]):
    node_ranks: Dict[str, int] = {}
    per_node: Dict[str, List[WorkerHandle]] = {}
    for m in members:
        node_ranks.setdefault(m.node_id, len(node_ranks))
        per_node.setdefault(m.node_id, []).append(m)
    local = {m.wid: (i, len(ms)) for ms in per_node.values() for i, m in enumerate(ms)}
    return node_ranks, local


def _is_crash(m: WorkerHandle, cause: Optional[BaseException]) -> bool:
    """A dead actor whose node is still alive crashed on its own (a real failure)."""
    if isinstance(cause, ActorDiedError) and getattr(cause, "preempted", False):
        return False
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001
        return False
    return bool(m.node_id) and m.node_id in alive and isinstance(cause, ActorDiedError)


def _storage_failure(e: BaseException, uri: str) -> TrainingFailedError:
    err = TrainingFailedError(
        f"the controller could not write to the run's storage {uri} ({type(e).__name__}: {e}). "
        "Nothing committed is lost: fix the storage (service, credentials, "
        "RunConfig(storage_retry=...) for longer outages) and call fit() again with the same "
        "RunConfig(name=...) to resume from the last committed checkpoint.")
    err.__cause__ = e
    return err


def _cause_text(cause: Optional[BaseException]) -> str:
    if cause is None:
        return "worker stopped answering"
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


def _run_desc(run: RunConfig) -> Dict[str, Any]:
    return {"name": run.name, "storage_path": run.storage_path,
            "failure_config": describe(run.failure_config),
            "checkpoint_config": describe(run.checkpoint_config)}
