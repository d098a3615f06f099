"""Carries out ``CapacityPolicy`` decisions: autoscaler requests and per-type worker pools.

The policy (pure, ``raylastic.policies.capacity``) decides how many worker slots of each
node type to ask for; this driver turns that into a standing
``ray.autoscaler.sdk.request_resources`` request (one bundle per slot, with label
selectors) and into the worker pool's per-node-type targets (pending actors that need the
type's custom resource, so Ray places them on, and an autoscaler launches, that type).

It also gives the policy what the cost and deadline rules need (the run's progress and
its measured steps per second by world size), and watches the nodes the run stops using:
a released node is billed until it leaves the cluster, so ``node_gone`` records when it
did (the report's "released but billed" time, docs/release.md for how to make it short).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple, Union

from ray.autoscaler.sdk import request_resources

from raylastic._internal.cluster.drain import alive_nodes
from raylastic.events import EventKind, EventLog
from raylastic.policies.capacity import (
    CapacityPolicy,
    CapacitySnapshot,
    CapacityState,
    DeadlineUnreachable,
    GiveUp,
    MigrateToSpot,
    ReleaseOnDemand,
    RequestCapacity,
)
from raylastic.policies.capacity_decisions import CapacityPhase
from raylastic.policies.objective import WorkProgress
from raylastic.policies.node_types import Market

logger = logging.getLogger("raylastic")

TICK_S = 0.5
RATE_WINDOW_S = 2.0  # measure steps/s over at least this long at one world size
NODE_CHECK_S = 1.0  # how often nodes the run let go are checked for having left


class CapacityDriver:
    def __init__(
        self,
        policy: CapacityPolicy,
        *,
        min_workers: int,
        max_workers: int,
        pool,
        events: EventLog,
        total_steps: Optional[int] = None,
        fit_ts: Optional[float] = None,
    ):
        self.policy = policy
        self._min, self._max = min_workers, max_workers
        self._pool = pool
        self._events = events
        self._state = CapacityState()
        self.requested: Dict[str, int] = {}
        self._last_tick = 0.0
        self.phase: Optional[CapacityPhase] = None
        self._total_steps = total_steps
        self._fit_ts = fit_ts if fit_ts is not None else time.time()
        self._rates: Dict[int, float] = {}  # steps/s by world size
        self._windows: Dict[int, Tuple[Optional[float], int]] = {}  # world -> (rate, windows)
        self._trained_s = self._idle_s = 0.0  # since training first started
        self._last_account: Optional[Tuple[bool, float]] = None
        self._mark: Optional[Tuple[int, float, int, bool]] = None  # (world, t, index, warm-up)
        self._held: Dict[str, Tuple[Optional[str], Optional[float]]] = {}  # node -> (type, let go at)
        self._last_node_check = 0.0

    def start(self) -> None:
        """Record the configuration and prices (cost is computed from the event log)."""
        record = self.policy.to_record()
        self._events.emit(
            EventKind.DECISION,
            f"capacity policy: prefer {record['prefer']}, fallback after {record['fallback_after_s']} s",
            decision="capacity_config",
            capacity=record,
        )
        if self.policy.prices is not None:
            markets = {t.name: t.market.value for t in self.policy.node_types}
            on_demand = [t.name for t in self.policy.node_types if t.market is Market.ON_DEMAND]
            prices = self.policy.prices.to_record()
            self._events.emit(
                EventKind.PRICE_TABLE,
                usd_per_hour=prices.get("usd_per_hour", prices),
                markets=markets,
                on_demand_type=on_demand[0] if on_demand else None,
                source=prices.get("source", "CapacityPolicy.prices"),
            )
        self._pool.set_targets({}, protect=[])  # nothing is ready yet: nothing to report

    def tick(
        self,
        members: List,
        draining: Dict[str, int],
        at_boundary: bool,
        protect: Optional[List] = None,
        index: int = 0,
        training: bool = False,
    ) -> Optional[Union[MigrateToSpot, GiveUp, DeadlineUnreachable]]:
        """One policy step (at most every 0.5 s). Returns what the controller must carry
        out itself: a migration, or giving up (``max_wait_s`` ran out, or the deadline
        cannot be met). ``index``: rank 0's last report; ``training``: the group is
        stepping (its rate is measured)."""
        now = time.monotonic()
        if now - self._last_tick < TICK_S:
            return None
        self._last_tick = now
        self._measure(now, len(members) if training else 0, index)
        self._account(now, training)
        self._trim(members if protect is None else protect)
        self._watch_nodes(now)
        ready: Dict[str, int] = {}
        for h in self._pool.workers.values():
            if h.ready and h.node_type is not None and h.node_id not in draining:
                ready[h.node_type] = ready.get(h.node_type, 0) + 1
        in_group: Dict[str, int] = {}
        for m in members:
            if m.node_type is not None:
                in_group[m.node_type] = in_group.get(m.node_type, 0) + 1
        progress = WorkProgress(
            elapsed_s=time.time() - self._fit_ts,
            steps_done=index,
            total_steps=self._total_steps,
            steps_per_s=self._rates,
            efficiency=self.efficiency,
        )
        snap = CapacitySnapshot(
            now_s=now,
            min_workers=self._min,
            max_workers=self._max,
            ready=ready,
            in_group=in_group,
            requested=self.requested,
            at_checkpoint_boundary=at_boundary,
            progress=progress,
        )
        step = self.policy.decide(snap, self._state)
        self._state, d, self.phase = step.state, step.decision, step.phase
        if isinstance(d, (RequestCapacity, ReleaseOnDemand)):
            self._events.emit(
                EventKind.DECISION,
                d.reason,
                decision=d.to_event()["kind"],
                counts=dict(d.counts),
                phase=step.phase.value,
                numbers=dict(d.numbers),
            )
            self._request(d.counts, members if protect is None else protect)
            return None
        if isinstance(d, GiveUp):
            self._events.emit(
                EventKind.DECISION,
                d.reason,
                decision=d.to_event()["kind"],
                waited_s=round(d.waited_s, 1),
                phase=step.phase.value,
            )
            return d
        if isinstance(d, DeadlineUnreachable):
            self._events.emit(
                EventKind.DECISION,
                d.reason,
                decision=d.to_event()["kind"],
                phase=step.phase.value,
                numbers=dict(d.numbers),
            )
            return d
        if isinstance(d, MigrateToSpot):
            self._events.emit(
                EventKind.DECISION,
                d.reason,
                decision="capacity.migrate_to_spot",
                target=dict(d.target),
                workers=d.workers,
                phase=step.phase.value,
                numbers=dict(d.numbers),
            )
            return d
        return None

    @property
    def efficiency(self) -> float:
        """Share of the time since training first started spent training (at least 0.5:
        a long wait says little about the steps still to come; 1.0 before training)."""
        total = self._trained_s + self._idle_s
        return max(0.5, self._trained_s / total) if total > 0 and self._trained_s > 0 else 1.0

    def _account(self, now: float, training: bool) -> None:
        """The time since the last tick goes to what the group was doing then."""
        if self._last_account is not None:
            was_training, since = self._last_account
            if was_training:
                self._trained_s += now - since
            elif self._trained_s > 0:
                self._idle_s += now - since
        self._last_account = (training, now)

    def _measure(self, now: float, world: int, index: int) -> None:
        """Steps per second at this world size, over windows of >= RATE_WINDOW_S while the
        group trains. A resize, a restore or a pause starts over, and the first window
        after it is a warm-up (first steps, restores) and not counted. A world size's rate
        is given to the policy once two windows agree enough to average."""
        if world <= 0:
            self._mark = None
            return
        if self._mark is None or self._mark[0] != world or index < self._mark[2]:
            self._mark = (world, now, index, True)
            return
        _, t0, i0, warmup = self._mark
        if now - t0 >= RATE_WINDOW_S and index > i0:
            if not warmup:
                rate = (index - i0) / (now - t0)
                old, n = self._windows.get(world, (None, 0))
                smoothed = rate if old is None else 0.5 * old + 0.5 * rate
                self._windows[world] = (smoothed, n + 1)
                if n + 1 >= 2:
                    self._rates[world] = smoothed
            self._mark = (world, now, index, False)

    def _watch_nodes(self, now: float) -> None:
        """Record ``node_gone`` when a node the run held a worker on has left the cluster."""
        held_now = {h.node_id: h.node_type for h in self._pool.workers.values() if h.ready and h.node_id}
        for node, ntype in held_now.items():
            self._held[node] = (ntype, None)
        let_go = [n for n in self._held if n not in held_now]
        for node in let_go:
            ntype, since = self._held[node]
            if since is None:
                self._held[node] = (ntype, time.time())
        if not let_go or now - self._last_node_check < NODE_CHECK_S:
            return
        self._last_node_check = now
        try:
            alive = alive_nodes()
        except Exception:  # noqa: BLE001 - no cluster view this tick: try again later
            return
        for node in let_go:
            if node not in alive:
                ntype, since = self._held.pop(node)
                self._events.emit(
                    EventKind.NODE_GONE,
                    node_id=node,
                    node_type=ntype,
                    released_ts=since,
                    billed_after_release_s=round(time.time() - since, 2) if since else None,
                )

    def _trim(self, keep: List) -> None:
        """Release workers above the standing request that were kept only while they held
        state the group needed (protection lapses when the group has newer snapshots)."""
        if self.requested:
            self._release(self._pool.set_targets(dict(self.requested), protect=keep))

    def _request(self, counts: Dict[str, int], members: List) -> None:
        try:
            args = self.policy.request_args(counts)
            request_resources(bundles=args["bundles"], bundle_label_selectors=args["bundle_label_selectors"])
        except Exception as e:  # noqa: BLE001 - no autoscaler (a static cluster): pools still work
            logger.info("request_resources failed (%s); relying on pending actors", e)
        self.requested = dict(counts)
        self._release(self._pool.set_targets(dict(counts), protect=members))

    def _release(self, released: List) -> None:
        for h in released:
            # the report's node-hours end a node's interval at this event
            self._events.emit(
                EventKind.WORKER_RELEASED,
                wid=h.wid,
                node_id=h.node_id,
                node_type=h.node_type,
                reason="capacity target lowered",
            )

    def release(self) -> None:
        """The run ended: drop the standing request so the autoscaler can scale down."""
        if not self.requested:
            return
        try:
            request_resources(bundles=[])
        except Exception:  # noqa: BLE001
            pass
        self.requested = {}
