"""Capacity policy: how many workers to request of which node type (spot vs on-demand).

Pure: a frozen :class:`CapacitySnapshot` and the :class:`CapacityState` returned by the
previous call go in; a :class:`CapacityStep` (one decision + the next state) comes out. No
Ray, no clock, no I/O, so every rule is unit-tested in milliseconds.

``prefer="spot"`` asks the autoscaler for ``max_workers`` spot slots and adds on-demand
slots by the ``objective`` (the arithmetic is in :mod:`raylastic.policies.objective`):

- ``"cost"`` (the default: it was cheapest per sample on every trace of
  ``benchmarks/spot_economics.py`` and, there, never slower than Ray Train): on-demand only
  while spot alone is below ``min_workers`` and filling that gap is cheaper per sample than
  waiting (:func:`~raylastic.policies.objective.cost_fill`), or once spot has been below
  ``min_workers`` for ``spot_wait_s``. Never past ``min_workers``.
- ``"time"``: once spot has been short (ready spot < ``max_workers``) for
  ``fallback_after_s``, on-demand for the whole shortfall, up to ``max_on_demand_workers``.
- ``deadline_s`` (with either objective): on-demand as the deadline planner asks
  (:func:`~raylastic.policies.objective.deadline_need`); :class:`DeadlineUnreachable`
  ends the run early when no plan can make it.

Checked every tick, in this order:

1. Fewer than ``min_workers`` slots ready (any type) for ``max_wait_s``: :class:`GiveUp`.
   The deadline reported unreachable for ``unreachable_after_s``: :class:`DeadlineUnreachable`.
2. More on-demand workers in the group than wanted (spot is back, the deadline has slack
   again) and the group stays >= ``min_workers`` without them: at a checkpoint boundary,
   :class:`MigrateToSpot` (re-form with ready spot workers in their place, or without them).
3. The standing autoscaler request should change: :class:`RequestCapacity`, or
   :class:`ReleaseOnDemand` when it drops on-demand slots. On-demand workers still in the
   group stay requested until they have been migrated away.
4. Otherwise :class:`Noop`.

``prefer="on_demand"`` requests ``min(max_workers, max_on_demand_workers)`` on-demand slots
and no spot: the baseline to compare cost against. The controller drives the policy every
0.5 s (``raylastic._internal.cluster.capacity_driver``) and logs every decision that is not
a ``Noop`` with its reason and ``numbers``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from raylastic.policies.base import Noop
from raylastic.policies.capacity_checks import check_policy, check_scaling
from raylastic.policies.capacity_decisions import (  # noqa: F401 - re-exported
    CapacityDecision,
    CapacityPhase,
    CapacitySnapshot,
    CapacityState,
    CapacityStep,
    CapacityTimeoutError,
    DeadlineUnreachable,
    DeadlineUnreachableError,
    GiveUp,
    MigrateToSpot,
    ReleaseOnDemand,
    RequestCapacity,
)
from raylastic.policies.node_types import (
    DEFAULT_NODE_TYPES,
    Market,
    NodeType,
    PriceTable,
    UnknownNodeTypeError,
)
from raylastic.policies.objective import Objective, OnDemandPlan, cost_fill, deadline_need


@dataclass(frozen=True, kw_only=True)
class CapacityPolicy:
    """Spot/on-demand capacity configuration and decision rule (see the module docstring).

    - ``prefer``: ``"spot"`` (on-demand as the objective says) or ``"on_demand"`` (only).
    - ``objective``: ``"cost"`` (cheapest per trained sample, the default) or ``"time"``
      (fill any spot shortfall with on-demand, up to ``max_workers``).
    - ``deadline_s``: seconds from ``fit()`` by which the run must finish its
      ``RunConfig.total_steps``; on-demand is added only as much and as long as the
      deadline needs. ``deadline_margin``: the safety margin, a fraction of
      ``deadline_s``. ``on_demand_boot_s``: how long a new node takes to join.
    - ``fallback_after_s``: how long spot must stay short before on-demand is requested
      (``"time"``: short of ``max_workers``; ``"cost"``: below ``min_workers``).
    - ``spot_wait_s`` (``"cost"``): below ``min_workers`` on spot this long, fill to
      ``min_workers`` with on-demand even when waiting looks cheaper (spot may not return);
      None: half of ``max_wait_s``.
    - ``fixed_usd_per_hour``: what the run pays per hour whatever its size (head node,
      licences): makes finishing sooner worth something to the cost rule.
    - ``max_on_demand_workers``: cap on on-demand slots; ``None`` means up to max_workers.
    - ``return_to_spot``: move on-demand workers back to spot (or drop them) at a
      checkpoint boundary once they are no longer wanted, then release them.
    - ``max_wait_s``: give up (:class:`CapacityTimeoutError`) when fewer than min_workers
      slots are ready for this long. Finite by design.
    - ``node_types``: exactly one spot and one on-demand :class:`NodeType`.
    - ``prices``: optional :class:`PriceTable`; when given it must price every node type
      this policy can use (checked here, before any resources are taken). The cost rule
      needs it; without it spot is assumed cheaper and on-demand fills only after
      ``spot_wait_s``.
    """

    prefer: Market = Market.SPOT
    objective: Objective = Objective.COST
    deadline_s: Optional[float] = None
    deadline_margin: float = 0.1
    on_demand_boot_s: float = 180.0
    fallback_after_s: float = 120.0
    spot_wait_s: Optional[float] = None
    fixed_usd_per_hour: float = 0.0
    max_on_demand_workers: Optional[int] = None
    return_to_spot: bool = True
    max_wait_s: float = 1800.0
    node_types: Tuple[NodeType, ...] = DEFAULT_NODE_TYPES
    prices: Optional[PriceTable] = None

    def __post_init__(self) -> None:
        # Every error is a ConfigError (a ValueError) naming CapacityPolicy.<field> and the
        # fix; the rules are in raylastic.policies.capacity_checks.
        check_policy(self)

    @property
    def unreachable_after_s(self) -> float:
        """How long the deadline must look unreachable before the run ends: 5% of the
        deadline, at least 1 s (one rate measurement does not end a run)."""
        return max(1.0, 0.05 * (self.deadline_s or 0.0))

    @property
    def spot_wait_after_s(self) -> float:
        """``spot_wait_s``, or half of ``max_wait_s`` when unset."""
        return self.max_wait_s / 2 if self.spot_wait_s is None else float(self.spot_wait_s)

    # -- lookups -----------------------------------------------------------------------
    def node_type(self, name: str) -> NodeType:
        for t in self.node_types:
            if t.name == name:
                return t
        raise UnknownNodeTypeError(
            f"unknown node type {name!r}; CapacityPolicy.node_types defines {[t.name for t in self.node_types]}"
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
        check_scaling(self.prefer, self.max_on_demand_workers, min_workers=min_workers, max_workers=max_workers)

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
            "kind": "capacity.config",
            "prefer": self.prefer.value,
            "objective": self.objective.value,
            "deadline_s": self.deadline_s,
            "deadline_margin": self.deadline_margin,
            "on_demand_boot_s": self.on_demand_boot_s,
            "spot_wait_s": self.spot_wait_after_s,
            "fixed_usd_per_hour": self.fixed_usd_per_hour,
            "fallback_after_s": self.fallback_after_s,
            "max_on_demand_workers": self.max_on_demand_workers,
            "return_to_spot": self.return_to_spot,
            "max_wait_s": self.max_wait_s,
            "node_types": {
                t.name: {
                    "market": t.market.value,
                    "resource": t.resource_key,
                    "labels": t.labels,
                    "worker_resources": t.worker_resources,
                }
                for t in self.node_types
            },
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
            return CapacityStep(
                self._give_up(snap, snap.now_s - below_since),
                replace(state, below_min_since_s=below_since),
                self._phase_now(state),
            )
        if self.prefer is Market.ON_DEMAND:
            od, M = self.on_demand.name, snap.max_workers
            want = {self.spot.name: 0, od: min(self._cap(M), M)}
            d = self._request_change(
                snap,
                want,
                f"prefer='on_demand': {want[od]} on-demand "
                f"worker(s) (max_workers={M}, max_on_demand_workers="
                f"{self.max_on_demand_workers})",
            )
            return CapacityStep(d, CapacityState(None, below_since), CapacityPhase.ON_DEMAND_ONLY)
        if self.deadline_s is not None and snap.progress is not None and snap.progress.total_steps is None:
            raise ValueError("CapacityPolicy.deadline_s needs the run's length: set RunConfig.total_steps")
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
            max_wait_s=self.max_wait_s,
            waited_s=waited_s,
            available=available,
            min_workers=snap.min_workers,
            ready=dict(snap.ready),
            max_on_demand_workers=self.max_on_demand_workers,
        )

    def _phase_now(self, state: CapacityState) -> CapacityPhase:
        if self.prefer is Market.ON_DEMAND:
            return CapacityPhase.ON_DEMAND_ONLY
        return CapacityPhase.SPOT_SHORT if state.spot_short_since_s is not None else CapacityPhase.SPOT

    def _decide_spot(self, snap: CapacitySnapshot, state: CapacityState, below_since: Optional[float]) -> CapacityStep:
        sp, od, M, m, now = self.spot.name, self.on_demand.name, snap.max_workers, snap.min_workers, snap.now_s
        ready_s = min(snap.ready.get(sp, 0), M)
        grp_s, grp_d = snap.in_group.get(sp, 0), snap.in_group.get(od, 0)
        short = ready_s < (M if self.return_to_spot else M - grp_d)
        short_since = _since(state.spot_short_since_s, now) if short else None
        low_since = _since(state.spot_low_since_s, now) if ready_s < m else None
        plan, keep_d = self._plan(snap, ready_s, grp_d, short_since, low_since)
        unreachable = _since(state.unreachable_since_s, now) if plan.unreachable else None
        new_state = CapacityState(short_since, below_since, low_since, unreachable)
        if unreachable is not None and now - unreachable >= self.unreachable_after_s:
            return CapacityStep(
                DeadlineUnreachable(plan.reason, deadline_s=float(self.deadline_s or 0.0), numbers=plan.numbers),
                new_state,
                CapacityPhase.FALLBACK,
            )

        # Rule 2: on-demand workers no longer wanted leave the group at a checkpoint boundary.
        target_s = min(ready_s, M - keep_d)
        moves = grp_d - keep_d
        shrink_ok = target_s > grp_s or (self.deadline_s is not None and target_s >= grp_s)
        returning = self.return_to_spot and moves > 0 and target_s + keep_d >= max(m, 1) and shrink_ok
        if returning and snap.at_checkpoint_boundary:
            return CapacityStep(
                MigrateToSpot(
                    workers=moves,
                    target={sp: target_s, od: keep_d},
                    numbers=plan.numbers,
                    reason=f"{moves} on-demand worker(s) no longer wanted ({plan.reason}; {ready_s} spot "
                    f"slot(s) ready, {grp_s} in use): re-forming with {target_s} spot + {keep_d} "
                    "on-demand at this checkpoint boundary; return_to_spot=True",
                ),
                new_state,
                CapacityPhase.RETURNING,
            )

        # Rule 3: keep the standing autoscaler request right.
        want_d = max(plan.workers, grp_d)
        want = {sp: M if self.return_to_spot else M - want_d, od: want_d}
        why = (
            plan.reason
            if plan.workers or not grp_d
            else f"{grp_d} on-demand worker(s) still in the group; spot slots ready {ready_s}/{M}"
        )
        d = self._request_change(snap, want, why, plan.numbers)
        if returning or (not short and (want_d or snap.requested.get(od, 0))):
            phase = CapacityPhase.RETURNING if self.return_to_spot else CapacityPhase.FALLBACK
            if returning and isinstance(d, Noop):
                d = Noop(f"waiting for a checkpoint boundary to move {moves} worker(s) off on-demand")
        elif want_d:
            phase = CapacityPhase.FALLBACK
        elif short:
            phase = CapacityPhase.SPOT_SHORT
            if isinstance(d, Noop):
                d = Noop(f"spot short ({ready_s} of {M} spot slot(s) ready): {plan.reason}")
        else:
            phase = CapacityPhase.SPOT
        return CapacityStep(d, new_state, phase)

    def _plan(
        self, snap: CapacitySnapshot, ready_s: int, grp_d: int, short_since: Optional[float], low_since: Optional[float]
    ) -> Tuple[OnDemandPlan, int]:
        """The on-demand workers wanted now (objective, then deadline) and how many of the
        group's on-demand workers to keep."""
        M, m, now, cap = snap.max_workers, snap.min_workers, snap.now_s, self._cap(snap.max_workers)
        if self.objective is Objective.TIME:
            short_for = now - short_since if short_since is not None else 0.0
            n = min(cap, M - ready_s) if short_since is not None and short_for >= self.fallback_after_s else 0
            plan = OnDemandPlan(
                n,
                f"objective='time': spot short for {short_for:.1f} s "
                f"(fallback_after_s={self.fallback_after_s}): {ready_s} of {M} spot "
                f"slot(s) ready; {n} on-demand (max_on_demand_workers="
                f"{self.max_on_demand_workers})"
                if short_since is not None
                else f"spot covers max_workers={M}",
            )
            keep = min(grp_d, M - ready_s)
        else:
            low_for = now - low_since if low_since is not None else 0.0
            prices = self.prices.usd_per_hour if self.prices is not None else {}
            plan = cost_fill(
                spot=ready_s,
                min_workers=m,
                max_workers=M,
                p_spot=prices.get(self.spot.name),
                p_od=prices.get(self.on_demand.name),
                fixed_usd_h=self.fixed_usd_per_hour,
                progress=snap.progress,
                max_fill=cap,
            )
            if low_since is not None and low_for < self.fallback_after_s:
                plan = OnDemandPlan(
                    0,
                    f"spot below min_workers for {low_for:.1f} s (< fallback_after_s={self.fallback_after_s})",
                    plan.numbers,
                )
            elif low_since is not None and low_for >= self.spot_wait_after_s and not plan.workers:
                n = min(cap, m - ready_s)
                plan = OnDemandPlan(
                    n if ready_s + n >= m else 0,
                    f"spot below min_workers for {low_for:.1f} s >= spot_wait_s="
                    f"{self.spot_wait_after_s:g}: filling to min_workers with {n} on-demand",
                    plan.numbers,
                )
            keep = min(grp_d, max(0, m - ready_s))
        plan = OnDemandPlan(plan.workers, f"objective='{self.objective.value}': {plan.reason}", plan.numbers)
        if self.deadline_s is None:
            return plan, keep
        on_demand_now = max(grp_d, snap.requested.get(self.on_demand.name, 0))
        need = deadline_need(
            spot=ready_s,
            on_demand_now=on_demand_now,
            min_workers=m,
            max_workers=M,
            max_on_demand=cap,
            deadline_s=self.deadline_s,
            margin_s=self.deadline_margin * self.deadline_s,
            boot_s=self.on_demand_boot_s,
            progress=snap.progress,
        )
        if need is None or (need.workers <= plan.workers and not need.unreachable):
            if need is None:
                return plan, keep
            return OnDemandPlan(
                plan.workers, f"{plan.reason}; deadline: {need.reason}", {**plan.numbers, **need.numbers}
            ), max(keep, min(grp_d, need.workers))
        return (
            OnDemandPlan(
                need.workers,
                f"deadline_s={self.deadline_s:g}: {need.reason}",
                {**plan.numbers, **need.numbers},
                need.unreachable,
            ),
            max(keep, min(grp_d, need.workers)),
        )

    def _request_change(
        self, snap: CapacitySnapshot, want: Dict[str, int], why: str, numbers: Optional[Dict[str, Any]] = None
    ) -> CapacityDecision:
        have = {name: snap.requested.get(name, 0) for name in want}
        if want == have:
            return Noop()
        od = self.on_demand.name
        if want[od] < have[od]:
            released = have[od] - want[od]
            return ReleaseOnDemand(
                workers=released,
                counts=want,
                numbers=dict(numbers or {}),
                reason=f"releasing {released} on-demand slot(s): {why}",
            )
        return RequestCapacity(counts=want, reason=f"requesting {want}: {why}", numbers=dict(numbers or {}))


def _since(previous: Optional[float], now: float) -> float:
    return previous if previous is not None else now
