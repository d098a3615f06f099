"""Capacity policy: how many workers to request of which node type (spot vs on-demand).

Pure: a frozen :class:`CapacitySnapshot` and the :class:`CapacityState` returned by the
previous call go in; a :class:`CapacityStep` (one decision + the next state) comes out. No
Ray, no clock, no I/O, so every rule is unit-tested in milliseconds.

Rules (``prefer="spot"``), checked every tick in this order:

1. Fewer than ``min_workers`` worker slots ready (spot + on-demand) for ``max_wait_s``:
   :class:`GiveUp` (a ``Raise`` like the other policies' give-up decision; its
   ``error()`` is the :class:`CapacityTimeoutError` the run ends with).
2. ``return_to_spot`` and spare ready spot slots while on-demand workers are in the group:
   at a checkpoint boundary, :class:`MigrateToSpot` (swap on-demand workers for spot ones).
3. The standing autoscaler request should change: :class:`RequestCapacity`, or
   :class:`ReleaseOnDemand` when it drops on-demand slots. The wanted request is
   ``max_workers`` spot slots (the autoscaler keeps trying spot) plus, once spot has been
   short (ready spot < ``max_workers``) for ``fallback_after_s``, on-demand slots for the
   shortfall, at most ``max_on_demand_workers``. On-demand workers still in the group stay
   requested until they have been migrated away. With ``return_to_spot=False`` the spot
   target is ``max_workers`` minus the on-demand workers kept.
4. Otherwise :class:`Noop`.

``prefer="on_demand"`` requests ``min(max_workers, max_on_demand_workers)`` on-demand slots
and no spot: the baseline to compare cost against.

Driving it from a controller loop (every ~0.5 s)::

    from ray.autoscaler.sdk import request_resources

    policy = CapacityPolicy(prefer="spot", fallback_after_s=120, max_on_demand_workers=2,
                            max_wait_s=900,
                            prices=PriceTable.from_mapping({"spot": 0.9, "on_demand": 3.0}))
    policy.validate_scaling(min_workers=2, max_workers=4)     # before taking resources
    event_log.append(policy.to_record())                       # config + prices
    state, requested = CapacityState(), {}
    while not finished:
        snap = CapacitySnapshot(
            now_s=time.monotonic(), min_workers=2, max_workers=4,
            ready=inventory.ready_slots_by_node_type(),   # excludes draining nodes
            in_group=group.workers_by_node_type(),
            requested=requested,
            at_checkpoint_boundary=checkpoints.just_committed())
        step = policy.decide(snap, state)
        state, d = step.state, step.decision
        if isinstance(d, GiveUp):
            raise d.error()
        if isinstance(d, (RequestCapacity, ReleaseOnDemand)):
            request_resources(**policy.request_args(d.counts))   # replaces the old request
            requested = dict(d.counts)
        elif isinstance(d, MigrateToSpot):
            group.reconfigure(d.target)          # new epoch, from the checkpoint just saved
        if not isinstance(d, Noop):
            event_log.append(d.to_event())
        time.sleep(0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from raylastic.policies.base import Noop, Raise
from raylastic.policies.node_types import (
    DEFAULT_NODE_TYPES,
    Market,
    NodeType,
    PriceTable,
    UnknownNodeTypeError,
)


class CapacityTimeoutError(RuntimeError):
    """Fewer than ``min_workers`` worker slots were available for ``max_wait_s``."""

    def __init__(self, *, max_wait_s: float, waited_s: float, available: int,
                 min_workers: int, ready: Optional[Mapping[str, int]] = None,
                 max_on_demand_workers: Optional[int] = None) -> None:
        self.max_wait_s = max_wait_s
        self.waited_s = waited_s
        self.available = available
        self.min_workers = min_workers
        self.ready = dict(ready or {})
        self.max_on_demand_workers = max_on_demand_workers
        super().__init__(
            f"only {available} of min_workers={min_workers} worker slots available for "
            f"{waited_s:.1f} s (max_wait_s={max_wait_s}); ready by node type: {self.ready}. "
            "Likely causes: a spot drought with too few on-demand workers allowed "
            f"(max_on_demand_workers={max_on_demand_workers}), node types' max_workers in "
            "the cluster config too low, or no autoscaler running. Fix: raise max_wait_s "
            "or max_on_demand_workers, or lower min_workers."
        )

    def __reduce__(self):
        return (_rebuild_timeout, (self.max_wait_s, self.waited_s, self.available,
                                   self.min_workers, self.ready, self.max_on_demand_workers))


def _rebuild_timeout(max_wait_s, waited_s, available, min_workers, ready, max_od):
    return CapacityTimeoutError(max_wait_s=max_wait_s, waited_s=waited_s, available=available,
                                min_workers=min_workers, ready=ready,
                                max_on_demand_workers=max_od)


class CapacityPhase(str, Enum):
    """Where the policy stands (informational: logged with decisions, asserted in tests)."""

    SPOT = "spot"                      # spot covers max_workers, no on-demand in use
    SPOT_SHORT = "spot_short"          # spot short, fallback_after_s not reached yet
    FALLBACK = "fallback"              # on-demand requested or in use
    RETURNING = "returning"            # spot is back; on-demand waits to be migrated/released
    ON_DEMAND_ONLY = "on_demand_only"  # prefer="on_demand"


@dataclass(frozen=True, kw_only=True)
class RequestCapacity:
    """Replace the standing autoscaler request with ``counts`` worker slots per node type."""

    counts: Dict[str, int]
    reason: str

    def to_event(self) -> Dict[str, Any]:
        return {"kind": "capacity.request", "counts": dict(self.counts), "reason": self.reason}


@dataclass(frozen=True, kw_only=True)
class ReleaseOnDemand:
    """Drop ``workers`` on-demand slots from the request; ``counts`` is the new request."""

    workers: int
    counts: Dict[str, int]
    reason: str

    def to_event(self) -> Dict[str, Any]:
        return {"kind": "capacity.release_on_demand", "workers": self.workers,
                "counts": dict(self.counts), "reason": self.reason}


@dataclass(frozen=True, kw_only=True)
class MigrateToSpot:
    """At this checkpoint boundary, re-form the group as ``target`` workers per node type,
    moving ``workers`` of them from on-demand to spot."""

    workers: int
    target: Dict[str, int]
    reason: str

    def to_event(self) -> Dict[str, Any]:
        return {"kind": "capacity.migrate_to_spot", "workers": self.workers,
                "target": dict(self.target), "reason": self.reason}


@dataclass(frozen=True)
class GiveUp(Raise):
    """Fewer than ``min_workers`` slots for ``max_wait_s``: end the run with ``error()``."""

    max_wait_s: float
    waited_s: float
    available: int
    min_workers: int
    ready: Mapping[str, int]
    max_on_demand_workers: Optional[int]

    def error(self) -> CapacityTimeoutError:
        return CapacityTimeoutError(max_wait_s=self.max_wait_s, waited_s=self.waited_s,
                                    available=self.available, min_workers=self.min_workers,
                                    ready=self.ready, max_on_demand_workers=self.max_on_demand_workers)

    def to_event(self) -> Dict[str, Any]:
        return {"kind": "capacity.give_up", "waited_s": self.waited_s, "available": self.available,
                "reason": self.reason}


CapacityDecision = Union[Noop, RequestCapacity, ReleaseOnDemand, MigrateToSpot, GiveUp]


@dataclass(frozen=True, kw_only=True)
class CapacitySnapshot:
    """What the policy looks at. Times are seconds on one monotonic clock.

    ``ready``: schedulable worker slots per node type (nodes with a preemption notice
    excluded), in the group or not. ``in_group``: workers of the running group per node
    type. ``requested``: the standing autoscaler request per node type (what the last
    executed decision asked for). Missing node types count as 0.
    """

    now_s: float
    min_workers: int
    max_workers: int
    ready: Mapping[str, int] = field(default_factory=dict)
    in_group: Mapping[str, int] = field(default_factory=dict)
    requested: Mapping[str, int] = field(default_factory=dict)
    at_checkpoint_boundary: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.now_s, (int, float)) and math.isfinite(self.now_s)):
            raise ValueError(f"CapacitySnapshot.now_s={self.now_s!r} must be a finite number")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(
                f"CapacitySnapshot: need 0 <= min_workers ({self.min_workers}) <= "
                f"max_workers ({self.max_workers}) and max_workers >= 1"
            )
        for what in ("ready", "in_group", "requested"):
            counts = dict(getattr(self, what))
            for name, n in counts.items():
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"CapacitySnapshot.{what}[{name!r}]={n!r} must be an int >= 0")
            object.__setattr__(self, what, counts)


@dataclass(frozen=True)
class CapacityState:
    """The policy's memory between calls; start with ``CapacityState()``, then pass back
    the ``state`` of the previous :class:`CapacityStep`."""

    spot_short_since_s: Optional[float] = None
    below_min_since_s: Optional[float] = None


@dataclass(frozen=True)
class CapacityStep:
    decision: CapacityDecision
    state: CapacityState
    phase: CapacityPhase


@dataclass(frozen=True, kw_only=True)
class CapacityPolicy:
    """Spot/on-demand capacity configuration and decision rule (see the module docstring).

    - ``prefer``: ``"spot"`` (fall back to on-demand) or ``"on_demand"`` (on-demand only).
    - ``fallback_after_s``: how long spot must stay short (ready spot slots < max_workers,
      node boot time included) before on-demand is requested.
    - ``max_on_demand_workers``: cap on on-demand slots; ``None`` means up to max_workers.
    - ``return_to_spot``: move on-demand workers back to spot at a checkpoint boundary
      once spot slots are ready, then release the on-demand request.
    - ``max_wait_s``: give up (:class:`CapacityTimeoutError`) when fewer than min_workers
      slots are ready for this long. Finite by design.
    - ``node_types``: exactly one spot and one on-demand :class:`NodeType`.
    - ``prices``: optional :class:`PriceTable`; when given it must price every node type
      this policy can use (checked here, before any resources are taken).
    """

    prefer: Market = Market.SPOT
    fallback_after_s: float = 120.0
    max_on_demand_workers: Optional[int] = None
    return_to_spot: bool = True
    max_wait_s: float = 1800.0
    node_types: Tuple[NodeType, ...] = DEFAULT_NODE_TYPES
    prices: Optional[PriceTable] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefer", Market.parse(self.prefer, "CapacityPolicy.prefer"))
        for name in ("fallback_after_s", "max_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"CapacityPolicy.{name}={v!r} must be a finite number of seconds")
        if self.fallback_after_s < 0:
            raise ValueError(
                f"CapacityPolicy.fallback_after_s ({self.fallback_after_s}) must be >= 0; "
                "use 0 to request on-demand as soon as spot is short"
            )
        if self.max_wait_s <= 0:
            raise ValueError(f"CapacityPolicy.max_wait_s ({self.max_wait_s}) must be > 0")
        cap = self.max_on_demand_workers
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(
                f"CapacityPolicy.max_on_demand_workers ({cap!r}) must be an int >= 0, or None "
                "for up to max_workers"
            )
        if self.prefer is Market.SPOT and cap != 0 and self.max_wait_s <= self.fallback_after_s:
            raise ValueError(
                f"CapacityPolicy.max_wait_s ({self.max_wait_s}) <= fallback_after_s "
                f"({self.fallback_after_s}): the run would give up before trying on-demand; "
                "raise max_wait_s or lower fallback_after_s"
            )
        if self.prefer is Market.ON_DEMAND and cap == 0:
            raise ValueError(
                "CapacityPolicy: prefer='on_demand' with max_on_demand_workers=0 can never get "
                "a worker; raise max_on_demand_workers or use prefer='spot'"
            )
        self._check_node_types()
        if self.prices is not None:
            self.prices.require(t.name for t in self.used_node_types())

    def _check_node_types(self) -> None:
        types = tuple(self.node_types)
        object.__setattr__(self, "node_types", types)
        for t in types:
            if not isinstance(t, NodeType):
                raise ValueError(f"CapacityPolicy.node_types: {t!r} is not a NodeType")
        names = [t.name for t in types]
        if len(set(names)) != len(names):
            raise ValueError(f"CapacityPolicy.node_types: duplicate names in {names}")
        for market in Market:
            of_market = [t.name for t in types if t.market is market]
            if len(of_market) != 1:
                raise ValueError(
                    f"CapacityPolicy.node_types needs exactly one {market.value} node type, "
                    f"got {of_market or 'none'}; pass node_types=(NodeType(name=..., "
                    "market='spot'), NodeType(name=..., market='on_demand'))"
                )

    # -- lookups -----------------------------------------------------------------------
    def node_type(self, name: str) -> NodeType:
        for t in self.node_types:
            if t.name == name:
                return t
        raise UnknownNodeTypeError(
            f"unknown node type {name!r}; CapacityPolicy.node_types defines "
            f"{[t.name for t in self.node_types]}"
        )

    @property
    def spot(self) -> NodeType:
        return next(t for t in self.node_types if t.market is Market.SPOT)

    @property
    def on_demand(self) -> NodeType:
        return next(t for t in self.node_types if t.market is Market.ON_DEMAND)

    def used_node_types(self) -> Tuple[NodeType, ...]:
        if self.prefer is Market.ON_DEMAND:
            return (self.on_demand,)
        if self.max_on_demand_workers == 0:
            return (self.spot,)
        return (self.spot, self.on_demand)

    def validate_scaling(self, *, min_workers: int, max_workers: int) -> None:
        """Check this policy against the run's worker range; call before taking resources."""
        cap = self.max_on_demand_workers
        if cap is not None and cap > max_workers:
            raise ValueError(
                f"CapacityPolicy.max_on_demand_workers ({cap}) > max_workers ({max_workers}); "
                f"lower max_on_demand_workers to at most {max_workers}"
            )
        if self.prefer is Market.ON_DEMAND and cap is not None and cap < min_workers:
            raise ValueError(
                f"prefer='on_demand' with max_on_demand_workers ({cap}) < min_workers "
                f"({min_workers}) can never start; raise max_on_demand_workers"
            )

    def request_args(self, counts: Mapping[str, int]) -> Dict[str, List[Dict[str, Any]]]:
        """Keyword arguments for ``ray.autoscaler.sdk.request_resources``: one bundle (and
        one label selector) per requested worker slot."""
        bundles: List[Dict[str, Any]] = []
        selectors: List[Dict[str, str]] = []
        for name, n in counts.items():
            t = self.node_type(name)
            bundles.extend(t.bundle() for _ in range(n))
            selectors.extend(t.label_selector() for _ in range(n))
        return {"bundles": bundles, "bundle_label_selectors": selectors}

    def to_record(self) -> Dict[str, Any]:
        """The configuration as a plain record for the event log."""
        return {
            "kind": "capacity.config", "prefer": self.prefer.value,
            "fallback_after_s": self.fallback_after_s,
            "max_on_demand_workers": self.max_on_demand_workers,
            "return_to_spot": self.return_to_spot, "max_wait_s": self.max_wait_s,
            "node_types": {t.name: {"market": t.market.value, "resource": t.resource_key,
                                    "labels": t.labels, "worker_resources": t.worker_resources}
                           for t in self.node_types},
            "prices": self.prices.to_record() if self.prices is not None else None,
        }

    # -- the decision rule -------------------------------------------------------------
    def decide(self, snap: CapacitySnapshot, state: Optional[CapacityState] = None) -> CapacityStep:
        """One tick. A decision, :class:`GiveUp` included; raises only on bad input
        (:class:`UnknownNodeTypeError`, ``ValueError``)."""
        state = state or CapacityState()
        self.validate_scaling(min_workers=snap.min_workers, max_workers=snap.max_workers)
        for what in ("ready", "in_group", "requested"):
            for name in getattr(snap, what):
                self.node_type(name)
        below_since = self._below_min_since(snap, state)
        if below_since is not None and snap.now_s - below_since >= self.max_wait_s:
            return CapacityStep(self._give_up(snap, snap.now_s - below_since),
                                CapacityState(state.spot_short_since_s, below_since), self._phase_now(state))
        if self.prefer is Market.ON_DEMAND:
            od, M = self.on_demand.name, snap.max_workers
            want = {self.spot.name: 0, od: min(self._cap(M), M)}
            d = self._request_change(snap, want, f"prefer='on_demand': {want[od]} on-demand "
                                     f"worker(s) (max_workers={M}, max_on_demand_workers="
                                     f"{self.max_on_demand_workers})")
            return CapacityStep(d, CapacityState(None, below_since), CapacityPhase.ON_DEMAND_ONLY)
        return self._decide_spot(snap, state, below_since)

    def _cap(self, max_workers: int) -> int:
        cap = self.max_on_demand_workers
        return max_workers if cap is None else cap

    def _available(self, snap: CapacitySnapshot) -> int:
        return min(snap.max_workers, sum(snap.ready.get(t.name, 0) for t in self.node_types))

    def _below_min_since(self, snap: CapacitySnapshot, state: CapacityState) -> Optional[float]:
        """Rule 1's clock: since when fewer than min_workers slots are ready (or None)."""
        if self._available(snap) >= snap.min_workers:
            return None
        return state.below_min_since_s if state.below_min_since_s is not None else snap.now_s

    def _give_up(self, snap: CapacitySnapshot, waited_s: float) -> GiveUp:
        available = self._available(snap)
        return GiveUp(
            f"only {available} of min_workers={snap.min_workers} worker slots available for "
            f"{waited_s:.1f} s (max_wait_s={self.max_wait_s})",
            max_wait_s=self.max_wait_s, waited_s=waited_s, available=available,
            min_workers=snap.min_workers, ready=dict(snap.ready),
            max_on_demand_workers=self.max_on_demand_workers)

    def _phase_now(self, state: CapacityState) -> CapacityPhase:
        if self.prefer is Market.ON_DEMAND:
            return CapacityPhase.ON_DEMAND_ONLY
        return CapacityPhase.SPOT_SHORT if state.spot_short_since_s is not None else CapacityPhase.SPOT

    def _decide_spot(self, snap: CapacitySnapshot, state: CapacityState,
                     below_since: Optional[float]) -> CapacityStep:
        sp, od, M = self.spot.name, self.on_demand.name, snap.max_workers
        ready_s = snap.ready.get(sp, 0)
        grp_s, grp_d = snap.in_group.get(sp, 0), snap.in_group.get(od, 0)

        short = ready_s < (M if self.return_to_spot else M - grp_d)
        since = state.spot_short_since_s if state.spot_short_since_s is not None else snap.now_s
        short_since = since if short else None
        new_state = CapacityState(short_since, below_since)
        short_for = snap.now_s - short_since if short_since is not None else 0.0
        fallback = short and short_for >= self.fallback_after_s

        # Rule 2: move on-demand workers back to spot at a checkpoint boundary.
        target_s = min(ready_s, M)
        target_d = min(grp_d, M - target_s)
        moves = grp_d - target_d
        returning = self.return_to_spot and grp_d > 0 and target_s > grp_s and moves > 0
        if returning and snap.at_checkpoint_boundary:
            return CapacityStep(MigrateToSpot(
                workers=moves, target={sp: target_s, od: target_d},
                reason=f"spot capacity back ({ready_s} spot slot(s) ready, {grp_s} in use): "
                       f"moving {moves} worker(s) off on-demand at this checkpoint boundary; "
                       "return_to_spot=True"), new_state, CapacityPhase.RETURNING)

        # Rule 3: keep the standing autoscaler request right.
        want_d = max(min(self._cap(M), M - ready_s) if fallback else 0, grp_d)
        want = {sp: M if self.return_to_spot else M - want_d, od: want_d}
        if fallback:
            why = (f"spot short for {short_for:.1f} s >= fallback_after_s="
                   f"{self.fallback_after_s}: {ready_s} of {M} spot slot(s) ready; "
                   f"{want_d} on-demand (max_on_demand_workers={self.max_on_demand_workers})")
        elif grp_d:
            why = f"{grp_d} on-demand worker(s) still in the group; spot slots ready {ready_s}/{M}"
        else:
            why = f"spot preferred: {M} spot slot(s) (max_workers={M})"
        d = self._request_change(snap, want, why)

        if returning or (not short and (want_d or snap.requested.get(od, 0))):
            phase = CapacityPhase.RETURNING if self.return_to_spot else CapacityPhase.FALLBACK
            if returning and isinstance(d, Noop):
                d = Noop(f"spot is back; waiting for a checkpoint boundary to move {moves} "
                         "worker(s) off on-demand")
        elif fallback or grp_d:
            phase = CapacityPhase.FALLBACK
        elif short:
            phase = CapacityPhase.SPOT_SHORT
            if isinstance(d, Noop):
                d = Noop(f"spot short for {short_for:.1f} s (< fallback_after_s="
                         f"{self.fallback_after_s}): {ready_s} of {M} spot slot(s) ready")
        else:
            phase = CapacityPhase.SPOT
        return CapacityStep(d, new_state, phase)

    def _request_change(self, snap: CapacitySnapshot, want: Dict[str, int],
                        why: str) -> CapacityDecision:
        have = {name: snap.requested.get(name, 0) for name in want}
        if want == have:
            return Noop()
        od = self.on_demand.name
        if want[od] < have[od]:
            released = have[od] - want[od]
            return ReleaseOnDemand(workers=released, counts=want,
                                   reason=f"releasing {released} on-demand slot(s): {why}")
        return RequestCapacity(counts=want, reason=f"requesting {want}: {why}")
