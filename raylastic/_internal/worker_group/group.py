"""The worker group: the members, and every call the controller makes to a worker actor.

The controller decides and records; this class talks to the actors and turns what they
answer (or fail to answer) into the typed values of ``membership.py``. It also owns the
view of which nodes are draining and tells a crashed worker from a lost node: questions
about the members that only Ray can answer.

Every wait here is interruptible: ``interrupt()`` (called on Ctrl-C or
``request_stop``) is checked at least every ``SLICE_S``, and a wait it cuts short
raises :class:`Interrupted`. So a stop is seen within a second even in the middle
of a graceful stop or an evacuation (whose calls can take up to ``JOIN_TIMEOUT_S``).

The calls that stop members (abort, join, last words) are a mixin of this class:
``stopping.py``. ``tests/unit/fake_group.py`` has a fake with the same methods, to step
the controller by hand without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from raylastic._internal.cluster.drain import alive_nodes, draining_nodes
from raylastic._internal.snapshots.placement import Holding, plan_stripes
from raylastic._internal.worker_group.pool import WorkerHandle, WorkerPool
from raylastic._internal.worker_group.membership import (  # noqa: F401 - re-exported
    Formed,
    GroupFormationError,
    HungWorker,
    Interrupted,
    MembersLost,
    PollBatch,
    StopOutcome,
    local_ranks,
    order_by_node,
)
from raylastic._internal.worker_group.results import Holdings, PersistedSnapshot
from raylastic._internal.worker_group.stopping import ABORT_JOIN_MIN_S, JOIN_TIMEOUT_S, StopCalls
from raylastic.config import RunConfig, ScalingConfig
from raylastic._internal.protocol import GroupSpec, RestoreInfo

logger = logging.getLogger("raylastic")

# How long a worker may not answer polls before it is declared lost. Ray's own health
# checks usually declare the actor dead sooner (see README: failure detection).
UNAVAILABLE_GRACE_S = 15.0
GROUP_TIMEOUT_S = 60.0  # process-group formation timeout
SLICE_S = 0.25  # how often a wait checks the stop flag
DRAIN_CHECK_INTERVAL_S = 0.5  # how often to ask the GCS which nodes are draining (notices)
# A running group is watched, not polled whole every tick (``watch``): each tick polls rank 0 (metrics,
# step time), any member whose train thread ended or whose actor died, and every member at least every
# max(poll interval, members / MAX_POLLS_PER_S) seconds. A poll costs the controller ~0.5 ms of CPU per
# worker (benchmarks/control_plane.py), so 200 polls a second is ~10% of a core at any group size; up to
# 20 workers every member is still polled every 0.1 s tick.
MAX_POLLS_PER_S = 200.0
WATCH_CALL_S = 30.0  # how long one watch call (``TrainWorker.join``) waits before it is renewed


class WorkerGroup(StopCalls):
    """Owns the worker pool and every worker-actor call (see the module docstring)."""

    def __init__(self, pool: WorkerPool, poll_interval_s: float):
        self.pool = pool
        self._interrupt = threading.Event()
        self._poll_interval_s = poll_interval_s
        self._unavailable_since: Dict[int, float] = {}
        self.draining: Dict[str, int] = {}  # node id -> drain deadline (ms since epoch; 0: none)
        self._draining_checked_at = 0.0
        self.max_polls_per_s = MAX_POLLS_PER_S
        self._watch_refs: Dict[int, Any] = {}  # wid -> its pending watch call (join)
        self._full_poll_at = float("-inf")

    @classmethod
    def for_run(cls, scaling: ScalingConfig, run: RunConfig, storage, run_rel: str, run_name: str) -> "WorkerGroup":
        """The group a run's configs describe: ``max_workers`` actors kept alive or pending."""
        return cls(
            WorkerPool(
                target=cast(int, scaling.max_workers),  # set (never None) by ScalingConfig.__post_init__
                resources=scaling.worker_resources(),
                use_gpu=scaling.use_gpu,
                storage=storage,
                run_rel=run_rel,
                run_name=run_name,
                async_upload=run.checkpoint_config.async_upload,
                persist_every=run.checkpoint_config.persist_every,
                keep_s=scaling.keep_workers_s or 0.0,
            ),
            poll_interval_s=run.poll_interval_s,
        )

    # -- the pool's lifecycle ---------------------------------------------------------
    def refresh(self) -> List[WorkerHandle]:
        """Workers that became ready since the last call."""
        return self.pool.refresh()

    def fill(self) -> None:
        self.pool.fill()

    def ready_spares(self, members: Sequence[WorkerHandle]) -> List[WorkerHandle]:
        return self.pool.ready_spares(list(members))

    def ready_workers(self) -> List[WorkerHandle]:
        return [h for h in self.pool.workers.values() if h.ready]

    def is_member(self, h: WorkerHandle) -> bool:
        return h.wid in self.pool.workers

    @property
    def last_ready_at(self) -> Optional[float]:
        return self.pool.last_ready_at

    def starting(self) -> int:
        return self.pool.starting()  # placed workers whose process is starting

    def set_target(self, node_type: Optional[str], count: int) -> None:
        self.pool.targets[node_type] = count

    def remove(self, h: WorkerHandle) -> None:
        """Kill a worker's actor and forget it; ``fill`` asks for a new one (unless its
        node type's target was lowered)."""
        self._watch_refs.pop(h.wid, None)
        self.pool.remove(h, kill=True)

    def shutdown(self) -> None:
        self.pool.shutdown()

    # -- waiting -----------------------------------------------------------------------
    def interrupt(self) -> None:
        """Cut every wait short from now on (thread-safe: called from another thread)."""
        self._interrupt.set()

    def check_interrupt(self) -> None:
        if self._interrupt.is_set():
            raise Interrupted("stop requested")

    def _wait(self, refs: List[Any], timeout_s: float) -> Tuple[List[Any], List[Any]]:
        """``ray.wait`` for all of ``refs``, in slices, raising ``Interrupted`` on a stop."""
        deadline = time.monotonic() + timeout_s
        pending, done = list(refs), []
        while pending:
            self.check_interrupt()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(SLICE_S, left))
            done += ready
        return done, pending

    def _get(self, ref: Any, timeout_s: float) -> Any:
        return self._get_all([ref], timeout_s)[0]

    def _get_all(self, refs: List[Any], timeout_s: float) -> List[Any]:
        """Every answer, or the first error as soon as it arrives: a member that died
        while the others wait on it (e.g. in a rendezvous, until the group timeout) ends
        the wait at once, so the caller can drop it and go on without waiting that out."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            self.check_interrupt()
            left = deadline - time.monotonic()
            if left <= 0:
                raise GetTimeoutError(f"{len(pending)} of {len(refs)} workers gave no answer within {timeout_s} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(SLICE_S, left))
            for ref in ready:
                ray.get(ref)  # raises the member's error now
        return ray.get(refs)

    # -- forming and starting a group ----------------------------------------------------
    def setup(self, members: List[WorkerHandle], epoch: int, backend: str) -> Formed:
        """Rank the members (by node), host the rendezvous store on the first, and join
        every member to the torch process group of ``epoch``. On failure, removes the
        workers that are gone and raises ``GroupFormationError``."""
        members = order_by_node(members)
        world = len(members)
        try:
            addr = self._get(members[0].actor.host_store.remote(world, GROUP_TIMEOUT_S), GROUP_TIMEOUT_S)
            node_ranks, local = local_ranks(members)
            stripes = plan_stripes([m.node_id for m in members])  # used by ElasticState(striped=True)
            specs = [
                GroupSpec(
                    epoch=epoch,
                    rank=r,
                    world_size=world,
                    local_rank=local[m.wid][0],
                    local_world_size=local[m.wid][1],
                    node_rank=node_ranks[m.node_id],
                    master_addr=addr["addr"],
                    master_port=addr["port"],
                    backend=backend,
                    timeout_s=GROUP_TIMEOUT_S,
                    stripe=stripes[r] if stripes else (),
                    max_workers=self.pool.max_workers,
                )
                for r, m in enumerate(members)
            ]
            self._get_all([m.actor.setup_group.remote(s) for m, s in zip(members, specs)], GROUP_TIMEOUT_S + 10)
        except (RayActorError, GetTimeoutError, RayTaskError) as e:
            dead = self.probe(members, timeout_s=2.0)
            if isinstance(e, RayTaskError) and not dead:
                raise  # a member could not join and none is gone: not a loss, the run's error
            # A survivor's rendezvous can fail (a peer gone mid-join) or still be waiting on
            # a gone member: either way the group is formed again without the gone ones. A
            # survivor's stale join leaves at its roll call as soon as the next join is
            # asked for (process_group.roll_call).
            for h in members:
                if h.wid in dead:
                    self.remove(h)
            raise GroupFormationError(str(e), gone=len(dead)) from e
        for r, m in enumerate(members):
            m.prev_rank = r
        self._unavailable_since.clear()
        self._watch_refs.clear()  # calls on the last epoch's threads: answered or moot
        self._full_poll_at = float("-inf")
        return Formed(members, specs)

    def start(
        self, formed: Formed, train_func: Callable, config: Optional[Dict[str, Any]], restore: RestoreInfo
    ) -> None:
        """Enter the train function on every member; ``MembersLost`` if some are gone
        (the others may have started)."""
        self._call_all(
            formed.members,
            lambda m, s: m.actor.start.remote(train_func, config, s, restore),
            GROUP_TIMEOUT_S,
            formed.specs,
        )

    def _call_all(
        self, members: Sequence[WorkerHandle], call: Callable, timeout_s: float, args: Optional[Sequence[Any]] = None
    ) -> List[Any]:
        """``call(member[, arg])`` on every member and wait for all answers. A member
        that died or does not answer turns into ``MembersLost`` (after a probe says which
        are gone), so the caller treats it as a loss, not as a controller crash."""
        refs = [call(m, a) if args is not None else call(m) for m, a in zip(members, args or members)]
        try:
            return self._get_all(refs, timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            dead = self.probe(members, timeout_s=2.0)
            if not dead:
                raise
            raise MembersLost(PollBatch(lost=[m for m in members if m.wid in dead], causes=dead)) from e

    # -- polling and liveness ------------------------------------------------------------
    def poll(self, members: Sequence[WorkerHandle]) -> PollBatch:
        """Poll every member once (waits at most ``max(1 s, poll interval)``). A member
        that does not answer for ``UNAVAILABLE_GRACE_S`` or whose actor died is lost.
        Members' snapshot holdings are refreshed from their answers."""
        refs = {m.actor.poll.remote(): m for m in members}
        done, not_done = self._wait(list(refs), max(1.0, self._poll_interval_s))
        batch = PollBatch()
        now = time.monotonic()
        for ref in done:
            m = refs[ref]
            try:
                batch.results[m.wid] = r = ray.get(ref)
                self._unavailable_since.pop(m.wid, None)
                m.update_holdings(r.holdings)
                self.pool.warm_imports.update(r.imported)
            except ActorUnavailableError:
                self._count_silence(m, now, batch)
            except RayActorError as e:
                batch.lost.append(m)
                batch.causes[m.wid] = e
        for ref in not_done:
            self._count_silence(refs[ref], now, batch)
        return batch

    def full_poll_interval_s(self, n: int) -> float:
        """How often ``watch`` polls every one of ``n`` members."""
        return max(self._poll_interval_s, n / self.max_polls_per_s)

    def watch(self, members: Sequence[WorkerHandle]) -> PollBatch:
        """The running group's poll, at a cost that does not grow with every tick:
        rank 0 (``members[0]``) every call; a member whose train thread ended (finished,
        raised) or whose actor died, at once; every member at least every
        ``full_poll_interval_s``. Ended threads and dead actors are seen through one
        pending ``join`` call per member (Ray fails it the moment the actor dies), so a
        loss or an error is seen as fast as by polling everyone, and a large group costs
        one ``ray.wait`` per tick instead of a call per member. What waits for the full
        poll: the other ranks' reports (a checkpoint commits once all are in) and their
        snapshot holdings."""
        if self.full_poll_interval_s(len(members)) <= self._poll_interval_s:
            return self.poll(members)  # a small group: everyone every tick, as before
        for m in members:
            if m.wid not in self._watch_refs:
                try:
                    self._watch_refs[m.wid] = m.actor.join.remote(WATCH_CALL_S)
                except Exception:  # noqa: BLE001 - an actor already gone: the poll says so
                    pass
        refs = {self._watch_refs[m.wid]: m for m in members if m.wid in self._watch_refs}
        ended = ray.wait(list(refs), num_returns=len(refs), timeout=0)[0] if refs else []
        urgent = set()
        for ref in ended:
            m = refs[ref]
            del self._watch_refs[m.wid]
            try:
                if not ray.get(ref):
                    continue  # the call timed out with the thread still running: renewed next tick
            except Exception:  # noqa: BLE001 - died or unavailable: the poll classifies it
                pass
            urgent.add(m.wid)
        now = time.monotonic()
        if now - self._full_poll_at >= self.full_poll_interval_s(len(members)):
            self._full_poll_at = now
            return self.poll(members)
        return self.poll([m for i, m in enumerate(members) if i == 0 or m.wid in urgent])

    def _count_silence(self, m: WorkerHandle, now: float, batch: PollBatch) -> None:
        since = self._unavailable_since.setdefault(m.wid, now)
        if now - since > UNAVAILABLE_GRACE_S:
            batch.lost.append(m)

    def probe(self, handles: Sequence[WorkerHandle], timeout_s: float) -> Dict[int, Optional[BaseException]]:
        """Workers that are dead or do not answer within the timeout: wid -> cause."""
        if not handles:
            return {}
        refs = {h.actor.info.remote(): h for h in handles}
        done, not_done = self._wait(list(refs), timeout_s)
        dead: Dict[int, Optional[BaseException]] = {}
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as e:  # ActorDiedError / ActorUnavailableError
                dead[refs[ref].wid] = e
        for ref in not_done:
            dead[refs[ref].wid] = None
        return dead

    def wait_for_dead_peer(
        self, others: Sequence[WorkerHandle], grace_s: float, silent_is_dead: bool = True
    ) -> Dict[int, Optional[BaseException]]:
        """A rank raised: was it because a peer vanished? Look for a dead peer for up to ``grace_s``;
        returns the dead ones (wid -> cause), maybe none. One that does not answer counts only with
        ``silent_is_dead``: a live peer on a busy machine can take over a second (a false loss, seen)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = self.probe(others, timeout_s=max(0.1, min(1.0, deadline - time.monotonic())))
            dead = {wid: cause for wid, cause in dead.items() if silent_is_dead or cause is not None}
            if dead or time.monotonic() >= deadline:
                return dead
            self.check_interrupt()
            time.sleep(0.2)

    def is_crash(self, m: WorkerHandle, cause: Optional[BaseException]) -> bool:
        """A dead actor whose node is still alive crashed on its own (a real failure);
        one whose node is gone (or was preempted) is a node loss."""
        if isinstance(cause, ActorDiedError) and getattr(cause, "preempted", False):
            return False
        try:
            alive = alive_nodes()
        except Exception:  # noqa: BLE001
            return False
        return bool(m.node_id) and m.node_id in alive and isinstance(cause, ActorDiedError)

    # -- preemption notices --------------------------------------------------------------
    def drained(self, members: Sequence[WorkerHandle], fresh: bool = False) -> List[WorkerHandle]:
        """Members on nodes Ray is draining (a preemption notice: ``ray drain-node``, the
        autoscaler/KubeRay, or raylastic's cloud-metadata watcher). Checked every 0.5 s,
        or now when ``fresh`` (before forming a group)."""
        now = time.monotonic()
        if fresh or now - self._draining_checked_at >= DRAIN_CHECK_INTERVAL_S:
            self._draining_checked_at = now
            try:
                self.draining = draining_nodes()
            except Exception as e:  # noqa: BLE001 - an older Ray or a GCS hiccup
                logger.debug("could not read draining nodes: %s", e)
        return [m for m in members if m.node_id in self.draining]

    def time_to_deadline(self, leaving: Sequence[WorkerHandle]) -> float:
        """Seconds until the earliest drain deadline of ``leaving`` (inf if none)."""
        deadlines_ms = [self.draining.get(m.node_id) for m in leaving]
        deadlines = [d / 1000.0 for d in deadlines_ms if d]
        return min(deadlines) - time.time() if deadlines else float("inf")

    # -- snapshots -----------------------------------------------------------------------
    def refresh_holdings(self, members: Sequence[WorkerHandle]) -> None:
        """Ask members which snapshots they hold now (raises if one does not answer)."""
        views: List[Holdings] = self._get_all([m.actor.holdings.remote() for m in members], ABORT_JOIN_MIN_S)
        for m, view in zip(members, views):
            m.update_holdings(view)

    def merge_shards(self, frm: WorkerHandle, to: WorkerHandle, index: int) -> Holding:
        """Copy ``frm``'s shards of snapshot ``index`` into ``to``'s copy (over Ray);
        returns what ``to`` holds now, and records it on ``to``."""
        have = tuple(
            self._get(to.actor.merge_snapshot.remote(index, frm.actor.export_snapshot.remote(index)), JOIN_TIMEOUT_S)
        )
        to.set_holding(index, have)
        return have

    def persist_snapshot(self, m: WorkerHandle, index: int, epoch: int) -> PersistedSnapshot:
        return self._get(m.actor.persist_snapshot.remote(index, epoch), JOIN_TIMEOUT_S)
