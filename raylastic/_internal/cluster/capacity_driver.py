"""Carries out ``CapacityPolicy`` decisions: autoscaler requests and per-type worker pools.

The policy (pure, ``raylastic.policies.capacity``) decides how many worker slots of each
node type to ask for; this driver turns that into a standing
``ray.autoscaler.sdk.request_resources`` request (one bundle per slot, with label
selectors) and into the worker pool's per-node-type targets (pending actors that need the
type's custom resource, so Ray places them on, and an autoscaler launches, that type).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Union

from ray.autoscaler.sdk import request_resources

from raylastic.events import EventKind, EventLog
from raylastic.policies.capacity import (
    CapacityPolicy, CapacitySnapshot, CapacityState, GiveUp, MigrateToSpot, ReleaseOnDemand, RequestCapacity,
)
from raylastic.policies.node_types import Market

logger = logging.getLogger("raylastic")

TICK_S = 0.5


class CapacityDriver:
    def __init__(self, policy: CapacityPolicy, *, min_workers: int, max_workers: int, pool,
                 events: EventLog):
        self.policy = policy
        self._min, self._max = min_workers, max_workers
        self._pool = pool
        self._events = events
        self._state = CapacityState()
        self.requested: Dict[str, int] = {}
        self._last_tick = 0.0
        self.phase = None

    def start(self) -> None:
        """Record the configuration and prices (cost is computed from the event log)."""
        record = self.policy.to_record()
        self._events.emit(EventKind.DECISION, f"capacity policy: prefer {record['prefer']}, "
                          f"fallback after {record['fallback_after_s']} s", decision="capacity_config",
                          capacity=record)
        if self.policy.prices is not None:
            markets = {t.name: t.market.value for t in self.policy.node_types}
            on_demand = [t.name for t in self.policy.node_types if t.market is Market.ON_DEMAND]
            prices = self.policy.prices.to_record()
            self._events.emit(EventKind.PRICE_TABLE, usd_per_hour=prices.get("usd_per_hour", prices),
                              markets=markets, on_demand_type=on_demand[0] if on_demand else None,
                              source=prices.get("source", "CapacityPolicy.prices"))
        self._pool.set_targets({}, protect=[])  # nothing is ready yet: nothing to report

    def tick(self, members: List, draining: Dict[str, int], at_boundary: bool,
             protect: Optional[List] = None) -> Optional[Union[MigrateToSpot, GiveUp]]:
        """One policy step (at most every 0.5 s). Returns what the controller must carry
        out itself: a migration, or giving up (``max_wait_s`` ran out)."""
        now = time.monotonic()
        if now - self._last_tick < TICK_S:
            return None
        self._last_tick = now
        ready: Dict[str, int] = {}
        for h in self._pool.workers.values():
            if h.ready and h.node_type is not None and h.node_id not in draining:
                ready[h.node_type] = ready.get(h.node_type, 0) + 1
        in_group: Dict[str, int] = {}
        for m in members:
            if m.node_type is not None:
                in_group[m.node_type] = in_group.get(m.node_type, 0) + 1
        snap = CapacitySnapshot(now_s=now, min_workers=self._min, max_workers=self._max, ready=ready,
                                in_group=in_group, requested=self.requested, at_checkpoint_boundary=at_boundary)
        step = self.policy.decide(snap, self._state)
        self._state, d, self.phase = step.state, step.decision, step.phase
        if isinstance(d, (RequestCapacity, ReleaseOnDemand)):
            self._request(d.counts, members if protect is None else protect)
            self._events.emit(EventKind.DECISION, d.reason, decision=d.to_event()["kind"],
                              counts=dict(d.counts), phase=step.phase.value)
            return None
        if isinstance(d, GiveUp):
            self._events.emit(EventKind.DECISION, d.reason, decision=d.to_event()["kind"],
                              waited_s=round(d.waited_s, 1), phase=step.phase.value)
            return d
        if isinstance(d, MigrateToSpot):
            self._events.emit(EventKind.DECISION, d.reason, decision="capacity.migrate_to_spot",
                              target=dict(d.target), workers=d.workers, phase=step.phase.value)
            return d
        return None

    def _request(self, counts: Dict[str, int], members: List) -> None:
        try:
            request_resources(**self.policy.request_args(counts))
        except Exception as e:  # noqa: BLE001 - no autoscaler (a static cluster): pools still work
            logger.info("request_resources failed (%s); relying on pending actors", e)
        self.requested = dict(counts)
        for h in self._pool.set_targets(dict(counts), protect=members):
            # the report's node-hours end a node's interval at this event
            self._events.emit(EventKind.WORKER_RELEASED, wid=h.wid, node_id=h.node_id,
                              node_type=h.node_type, reason="capacity target lowered")

    def release(self) -> None:
        """The run ended: drop the standing request so the autoscaler can scale down."""
        if not self.requested:
            return
        try:
            request_resources(bundles=[])
        except Exception:  # noqa: BLE001
            pass
        self.requested = {}
