"""Seeded chaos schedules: which faults a chaos run injects, when, and to which victim.

Why apart from :mod:`raylastic.testing.chaos`: a schedule is a pure value drawn from a seed
(no cluster, no Ray, no processes), so it is built, checked and printed on its own (the
unit tests do, without Ray), and a failing run is reproduced from its seed alone.
:class:`~raylastic.testing.chaos.ChaosInjector` plays it against a live cluster; what each
:class:`FaultKind` does there is described in that module, which re-exports every name
defined here.
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["FaultKind", "Fault", "ChaosSchedule", "NODE_LOSS_KINDS"]


class FaultKind(str, enum.Enum):
    KILL_NODE = "kill_node"
    DRAIN_NODE = "drain_node"
    KILL_WORKER = "kill_worker"
    KILL_DURING_UPLOAD = "kill_during_upload"
    KILL_TWO_NODES = "kill_two_nodes"
    STOP_STORAGE = "stop_storage"
    ADD_NODE = "add_node"

    @property
    def nodes_removed(self) -> int:
        return {
            FaultKind.KILL_NODE: 1,
            FaultKind.DRAIN_NODE: 1,
            FaultKind.KILL_DURING_UPLOAD: 1,
            FaultKind.KILL_TWO_NODES: 2,
        }.get(self, 0)


NODE_LOSS_KINDS = tuple(k for k in FaultKind if k.nodes_removed)


@dataclass(frozen=True)
class Fault:
    """One fault: ``at_s`` seconds after the injector's ``t0``; ``deadline_s`` (drains) and
    ``outage_s`` (storage) are drawn from the seed too; ``pick`` chooses the victim rank(s)
    deterministically among the group's ranks."""

    at_s: float
    kind: FaultKind
    deadline_s: Optional[float] = None
    outage_s: Optional[float] = None
    pick: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {k: (v.value if isinstance(v, FaultKind) else v) for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ChaosSchedule:
    """An ordered tuple of faults, valid for a cluster of ``nodes`` worker nodes: a node is
    only removed while at least ``min_nodes`` stay, only added while fewer than ``nodes``
    are up, and it ends with the cluster back at ``nodes``."""

    seed: int
    faults: Tuple[Fault, ...]
    nodes: int
    min_nodes: int = 1

    @classmethod
    def from_seed(
        cls,
        seed: int,
        num_faults: int,
        interval_s: Tuple[float, float] = (20.0, 30.0),
        *,
        nodes: int = 3,
        min_nodes: int = 1,
        first_at_s: Optional[float] = None,
        kinds: Sequence[FaultKind] = tuple(FaultKind),
        drain_deadline_s: Tuple[float, float] = (2.0, 10.0),
        outage_s: float = 10.0,
    ) -> "ChaosSchedule":
        """``num_faults`` faults, one every ``interval_s`` (uniform), kinds cycling through
        shuffled bags of ``kinds`` so every kind appears before any repeats, skipping a kind
        the node count does not allow at that point (``add_node`` is drawn when no other
        kind fits). The last faults add nodes back until ``nodes`` are up (counted in
        ``num_faults``)."""
        lo, hi = interval_s
        if not (0 < lo <= hi):
            raise ValueError(f"interval_s ({interval_s}) must be (low, high) with 0 < low <= high")
        if num_faults < 1:
            raise ValueError(f"num_faults ({num_faults}) must be >= 1")
        if not (1 <= min_nodes < nodes):
            raise ValueError(f"min_nodes ({min_nodes}) must be >= 1 and < nodes ({nodes})")
        kinds = [FaultKind(k) for k in kinds]
        if not kinds:
            raise ValueError("kinds must name at least one FaultKind")
        rng = random.Random(seed)
        up, t, out, bag = nodes, (first_at_s if first_at_s is not None else rng.uniform(lo, hi)), [], list[FaultKind]()
        for i in range(num_faults):
            remaining = num_faults - i
            if nodes - up >= remaining:  # the rest must bring the cluster back
                kind = FaultKind.ADD_NODE
            else:
                fits: List[FaultKind] = []
                for _ in range(2):  # what is left of this bag, else a fresh bag behind it
                    fits = [k for k in bag if _fits(k, up, nodes, min_nodes, remaining)]
                    if fits:
                        break
                    fresh = list(kinds)
                    rng.shuffle(fresh)
                    bag += fresh
                fits = fits or [k for k in kinds if _fits(k, up, nodes, min_nodes, remaining)]
                if not fits:
                    raise ValueError(f"no kind of {[k.value for k in kinds]} fits {up} of {nodes} node(s)")
                kind = fits[0]
                if kind in bag:
                    bag.remove(kind)
            up += -kind.nodes_removed if kind is not FaultKind.ADD_NODE else 1
            out.append(_draw(rng, t, kind, drain_deadline_s, outage_s))
            t += rng.uniform(lo, hi)
        return cls(seed=seed, faults=tuple(out), nodes=nodes, min_nodes=min_nodes)

    @classmethod
    def from_kinds(
        cls,
        seed: int,
        kinds: Sequence[FaultKind],
        interval_s: Tuple[float, float] = (20.0, 30.0),
        *,
        nodes: int = 3,
        min_nodes: int = 1,
        first_at_s: Optional[float] = None,
        drain_deadline_s: Tuple[float, float] = (2.0, 10.0),
        outage_s: float = 10.0,
    ) -> "ChaosSchedule":
        """These faults in this order (times, deadlines and victims drawn from ``seed``);
        raises if the order would remove a node below ``min_nodes`` or add one above ``nodes``."""
        lo, hi = interval_s
        if not (0 < lo <= hi):
            raise ValueError(f"interval_s ({interval_s}) must be (low, high) with 0 < low <= high")
        rng = random.Random(seed)
        up, t, out = nodes, (first_at_s if first_at_s is not None else rng.uniform(lo, hi)), []
        for i, kind in enumerate(FaultKind(k) for k in kinds):
            up += 1 if kind is FaultKind.ADD_NODE else -kind.nodes_removed
            if not (min_nodes <= up <= nodes):
                raise ValueError(f"fault {i} ({kind.value}) leaves {up} node(s); allowed: {min_nodes}..{nodes}")
            out.append(_draw(rng, t, kind, drain_deadline_s, outage_s))
            t += rng.uniform(lo, hi)
        return cls(seed=seed, faults=tuple(out), nodes=nodes, min_nodes=min_nodes)

    def describe(self) -> str:
        return "\n".join(
            f"{f.at_s:7.1f} s  {f.kind.value}"
            + (f" (deadline {f.deadline_s} s)" if f.deadline_s else "")
            + (f" ({f.outage_s:g} s)" if f.outage_s else "")
            for f in self.faults
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "seed": self.seed,
            "nodes": self.nodes,
            "min_nodes": self.min_nodes,
            "faults": [f.to_json() for f in self.faults],
        }


def _draw(
    rng: random.Random, t: float, kind: FaultKind, drain_deadline_s: Tuple[float, float], outage_s: float
) -> Fault:
    """The fault of ``kind`` at ``t``: its victim pick (and a drain's deadline) drawn from
    ``rng``, in the order both schedules have always drawn them (a seed's schedule stays)."""
    return Fault(
        at_s=round(t, 2),
        kind=kind,
        pick=rng.randrange(1 << 16),
        deadline_s=round(rng.uniform(*drain_deadline_s), 2) if kind is FaultKind.DRAIN_NODE else None,
        outage_s=outage_s if kind is FaultKind.STOP_STORAGE else None,
    )


def _fits(kind: FaultKind, up: int, nodes: int, min_nodes: int, remaining: int) -> bool:
    if kind is FaultKind.ADD_NODE:
        return up < nodes
    after = up - kind.nodes_removed
    # leave min_nodes, and enough faults after this one to add the removed nodes back
    return after >= min_nodes and nodes - after <= remaining - 1
