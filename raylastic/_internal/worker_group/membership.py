"""The values the worker group hands the controller, and how members are ranked.

Split from ``group.py`` (which talks to the actors) so that the types a poll, a formation
or a stop produces, and the pure rank-order rules, can be read and tested without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.worker_group.results import PollResult
from raylastic._internal.protocol import GroupSpec


class Interrupted(Exception):
    """A stop was requested while the group was waiting on its workers."""


class MembersLost(Exception):
    """A call to every member failed because some are gone (``batch.lost``)."""

    def __init__(self, batch: "PollBatch"):
        super().__init__(f"{len(batch.lost)} worker(s) gone")
        self.batch = batch


class GroupFormationError(Exception):
    """The process group could not be formed; ``gone`` workers were removed."""

    def __init__(self, message: str, gone: int):
        super().__init__(message)
        self.gone = gone


@dataclass
class PollBatch:
    """One poll of some members: answers by wid, members declared lost and why."""

    results: Dict[int, PollResult] = field(default_factory=dict)
    lost: List[WorkerHandle] = field(default_factory=list)
    causes: Dict[int, Optional[BaseException]] = field(default_factory=dict)


@dataclass(frozen=True)
class Formed:
    """A group set up for one membership epoch: members in rank order, their specs."""

    members: List[WorkerHandle]
    specs: List[GroupSpec]

    @property
    def stripes(self) -> Optional[List[Tuple[int, ...]]]:
        return [s.stripe for s in self.specs] if any(s.stripe for s in self.specs) else None


@dataclass(frozen=True)
class HungWorker:
    """A member whose train thread did not unwind: why, where it was stuck, and its
    last poll (None when the actor did not answer either)."""

    member: WorkerHandle
    why: str
    stuck_at: str
    last_words: Optional[PollResult]


@dataclass(frozen=True)
class StopOutcome:
    stopped: List[WorkerHandle]
    hung: List[HungWorker]


def order_by_node(members: List[WorkerHandle]) -> List[WorkerHandle]:
    """Rank order: survivors keep their relative order (rank 0 stays rank 0 when it
    survives); workers on one node get consecutive ranks."""
    first_rank_on_node: Dict[str, tuple] = {}
    for m in members:
        key = (m.prev_rank, m.wid)
        first_rank_on_node[m.node_id] = min(first_rank_on_node.get(m.node_id, key), key)
    return sorted(members, key=lambda m: (first_rank_on_node[m.node_id], m.prev_rank, m.wid))


def local_ranks(members: List[WorkerHandle]):
    """Node rank of each node, and (local rank, local world size) of each member."""
    node_ranks: Dict[str, int] = {}
    per_node: Dict[str, List[WorkerHandle]] = {}
    for m in members:
        node_ranks.setdefault(m.node_id, len(node_ranks))
        per_node.setdefault(m.node_id, []).append(m)
    local = {m.wid: (i, len(ms)) for ms in per_node.values() for i, m in enumerate(ms)}
    return node_ranks, local
