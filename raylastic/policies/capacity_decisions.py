"""The values a :class:`~raylastic.policies.capacity.CapacityPolicy` takes and returns:
the snapshot it looks at, the state it carries between ticks, and what it decides
(requests, releases, migrations and the two ways a spot run gives up). Each decision
carries its reason and, for the event log, the numbers the rule used (``numbers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import math
from typing import Any, Dict, Mapping, Optional, Union

from raylastic.errors import InsufficientCapacityError
from raylastic.policies.base import Noop, Raise
from raylastic.policies.objective import WorkProgress


class CapacityTimeoutError(InsufficientCapacityError, RuntimeError):
    """Fewer than ``min_workers`` worker slots were available for ``max_wait_s``."""

    def __init__(
        self,
        *,
        max_wait_s: float,
        waited_s: float,
        available: int,
        min_workers: int,
        ready: Optional[Mapping[str, int]] = None,
        max_on_demand_workers: Optional[int] = None,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.waited_s = waited_s
        self.available = available
        self.min_workers = min_workers
        self.ready = dict(ready or {})
        self.max_on_demand_workers = max_on_demand_workers
        Exception.__init__(
            self,
            f"only {available} of min_workers={min_workers} worker slots available for "
            f"{waited_s:.1f} s (max_wait_s={max_wait_s}); ready by node type: {self.ready}. "
            "Likely causes: a spot drought with too few on-demand workers allowed "
            f"(max_on_demand_workers={max_on_demand_workers}), node types' max_workers in "
            "the cluster config too low, or no autoscaler running. Fix: raise max_wait_s "
            "or max_on_demand_workers, or lower min_workers.",
        )

    def __reduce__(self):
        return (
            _rebuild_timeout,
            (self.max_wait_s, self.waited_s, self.available, self.min_workers, self.ready, self.max_on_demand_workers),
        )


def _rebuild_timeout(max_wait_s, waited_s, available, min_workers, ready, max_od):
    return CapacityTimeoutError(
        max_wait_s=max_wait_s,
        waited_s=waited_s,
        available=available,
        min_workers=min_workers,
        ready=ready,
        max_on_demand_workers=max_od,
    )


class CapacityPhase(str, Enum):
    """Where the policy stands (informational: logged with decisions, asserted in tests)."""

    SPOT = "spot"  # spot covers max_workers, no on-demand in use
    SPOT_SHORT = "spot_short"  # spot short, fallback_after_s not reached yet
    FALLBACK = "fallback"  # on-demand requested or in use
    RETURNING = "returning"  # spot is back; on-demand waits to be migrated/released
    ON_DEMAND_ONLY = "on_demand_only"  # prefer="on_demand"


@dataclass(frozen=True, kw_only=True)
class RequestCapacity:
    """Replace the standing autoscaler request with ``counts`` worker slots per node type."""

    counts: Dict[str, int]
    reason: str
    numbers: Dict[str, Any] = field(default_factory=dict)

    def to_event(self) -> Dict[str, Any]:
        return {
            "kind": "capacity.request",
            "counts": dict(self.counts),
            "reason": self.reason,
            "numbers": dict(self.numbers),
        }


@dataclass(frozen=True, kw_only=True)
class ReleaseOnDemand:
    """Drop ``workers`` on-demand slots from the request; ``counts`` is the new request."""

    workers: int
    counts: Dict[str, int]
    reason: str
    numbers: Dict[str, Any] = field(default_factory=dict)

    def to_event(self) -> Dict[str, Any]:
        return {
            "kind": "capacity.release_on_demand",
            "workers": self.workers,
            "counts": dict(self.counts),
            "reason": self.reason,
            "numbers": dict(self.numbers),
        }


@dataclass(frozen=True, kw_only=True)
class MigrateToSpot:
    """At this checkpoint boundary, re-form the group as ``target`` workers per node type,
    moving ``workers`` of them from on-demand to spot."""

    workers: int
    target: Dict[str, int]
    reason: str
    numbers: Dict[str, Any] = field(default_factory=dict)

    def to_event(self) -> Dict[str, Any]:
        return {
            "kind": "capacity.migrate_to_spot",
            "workers": self.workers,
            "target": dict(self.target),
            "reason": self.reason,
            "numbers": dict(self.numbers),
        }


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
        return CapacityTimeoutError(
            max_wait_s=self.max_wait_s,
            waited_s=self.waited_s,
            available=self.available,
            min_workers=self.min_workers,
            ready=self.ready,
            max_on_demand_workers=self.max_on_demand_workers,
        )

    def to_event(self) -> Dict[str, Any]:
        return {
            "kind": "capacity.give_up",
            "waited_s": self.waited_s,
            "available": self.available,
            "reason": self.reason,
        }


class DeadlineUnreachableError(InsufficientCapacityError):
    """No plan of spot and on-demand workers can finish the run by ``deadline_s``."""

    def __init__(self, deadline_s: float, numbers: Mapping[str, Any]) -> None:  # noqa: D107
        self.deadline_s = deadline_s
        self.numbers = dict(numbers)
        Exception.__init__(self, _deadline_message(deadline_s, self.numbers))

    def __reduce__(self):
        return (DeadlineUnreachableError, (self.deadline_s, self.numbers))


def _deadline_message(deadline_s: float, n: Mapping[str, Any]) -> str:
    return (
        f"the run cannot finish by deadline_s={deadline_s:g}: {n.get('remaining_steps')} steps "
        f"left at {n.get('elapsed_s')} s; even max_workers from now would finish at "
        f"{n.get('best_finish_s')} s. Numbers: {dict(n)}. Fix: raise deadline_s, raise "
        "max_workers or max_on_demand_workers, or drop deadline_s to finish late."
    )


@dataclass(frozen=True)
class DeadlineUnreachable(Raise):
    """End the run early: the deadline cannot be met (``error()`` says by how much)."""

    deadline_s: float
    numbers: Mapping[str, Any]

    def error(self) -> DeadlineUnreachableError:
        return DeadlineUnreachableError(self.deadline_s, self.numbers)

    def to_event(self) -> Dict[str, Any]:
        return {"kind": "capacity.deadline_unreachable", "reason": self.reason, "numbers": dict(self.numbers)}


CapacityDecision = Union[Noop, RequestCapacity, ReleaseOnDemand, MigrateToSpot, GiveUp, DeadlineUnreachable]


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
    progress: Optional[WorkProgress] = None  # for the cost and deadline rules

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
    spot_low_since_s: Optional[float] = None  # ready spot < min_workers since (cost rule)
    unreachable_since_s: Optional[float] = None  # deadline reported unreachable since


@dataclass(frozen=True)
class CapacityStep:
    decision: CapacityDecision
    state: CapacityState
    phase: CapacityPhase
