"""The frozen values a report is made of.

They live apart from the code that computes them (``_walk``, ``_timeline``, ``model``) so
that every pass can build them and ``render``/``plots`` can read them without importing one
another: the modules of this package form a chain, never a cycle.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

SCHEMA_VERSION = 1

# --json prints exactly these keys in this order (a test freezes them): tools parse it.
JSON_KEYS = (
    "schema_version",
    "run_path",
    "status",
    "error",
    "start_ts",
    "end_ts",
    "wall_s",
    "productive_step_s",
    "goodput",
    "steps",
    "world_size_timeline",
    "recoveries",
    "resizes",
    "checkpoints",
    "node_hours",
    "prices",
    "cost_usd",
    "on_demand_type",
    "on_demand_cost_usd",
    "savings_usd",
    "savings_pct",
    "productive_worker_s",
    "notes",
    "bill",
)


@dataclass(frozen=True)
class Segment:
    """One membership epoch: ``world_size`` workers trained from ``start_s`` to ``end_s``."""

    epoch: int
    world_size: int
    start_s: float
    end_s: float
    restore_index: int
    ended_by: str


@dataclass(frozen=True)
class Recovery:
    """Workers lost (or a rank failed) -> training resumed. Losses before training resumed
    are merged into one recovery. Planned moves (a worker released or moved off a draining
    node during a graceful stop) are not losses: they are part of their graceful
    :class:`Resize`."""

    at_s: float
    cause: str
    nodes: Tuple[str, ...]
    detection_s: float
    recovery_s: Optional[float]
    steps_lost: int
    reached_index: Optional[int]
    restore_index: Optional[int]
    world_size_before: Optional[int]
    world_size_after: Optional[int]
    reason: str


@dataclass(frozen=True)
class Resize:
    """One ``resize`` event: graceful (scale-up, a planned move, a drained node) or after a
    failure (then also part of a :class:`Recovery`)."""

    at_s: float
    graceful: bool
    from_world_size: Optional[int]
    to_world_size: Optional[int]
    lost_steps: int
    resize_s: Optional[float]
    pause_s: Optional[float]
    reached_index: Optional[int]
    reason: str


@dataclass(frozen=True)
class NodeTypeUsage:
    market: Optional[str]
    nodes: int
    hours: float
    usd_per_hour: Optional[float]
    cost_usd: Optional[float]


@dataclass(frozen=True)
class PhaseCost:
    """Billed node-seconds of one bill bucket, and their cost (None: a price is unknown)."""

    node_s: float
    usd: Optional[float]


@dataclass(frozen=True)
class Bill:
    """The bill split by what the nodes were doing (``bill.BUCKETS``): per node type and
    in total, each bucket's :class:`PhaseCost`. The buckets add up to the node-hours."""

    by_node_type: Dict[str, Dict[str, PhaseCost]] = field(default_factory=dict)
    total: Dict[str, PhaseCost] = field(default_factory=dict)


@dataclass(frozen=True)
class Series:
    """Plot data (not part of --json)."""

    loss: Tuple[Tuple[float, int, float, bool], ...]  # (t_s, index, value, kept)
    cost: Tuple[Tuple[float, float, Optional[float], Optional[float]], ...]  # t, node-h, cost, baseline
    loss_key: str = "loss"


@dataclass(frozen=True)
class RunReport:
    run_path: str
    status: str  # finished | failed | incomplete
    error: Optional[str]
    start_ts: float
    end_ts: float
    wall_s: float
    productive_step_s: float
    goodput: Optional[float]
    steps: Dict[str, Optional[int]]
    world_size_timeline: Tuple[Segment, ...]
    recoveries: Tuple[Recovery, ...]
    resizes: Tuple[Resize, ...]
    checkpoints: Dict[str, Any]
    node_hours: Dict[str, NodeTypeUsage]
    prices: Optional[Dict[str, Any]]
    cost_usd: Optional[float]
    on_demand_type: Optional[str]
    on_demand_cost_usd: Optional[float]
    savings_usd: Optional[float]
    savings_pct: Optional[float]
    productive_worker_s: float
    notes: Tuple[str, ...]
    bill: Bill = field(default_factory=Bill)
    series: Series = field(repr=False, compare=False, default=Series((), ()))

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict with the keys of :data:`JSON_KEYS`, in that order. A number
        that is not finite (a sum that overflowed, e.g. with an absurd --prices) becomes
        None: JSON has no NaN or Infinity, and tools parsing --json must not see them."""
        d = asdict(self)
        d.pop("series")
        d["schema_version"] = SCHEMA_VERSION
        d["notes"] = list(self.notes)
        return {k: strict_json(d[k]) for k in JSON_KEYS}


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value
