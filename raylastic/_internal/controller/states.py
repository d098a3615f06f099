"""Controller states: one class per state carrying its data, and the allowed moves.

    Scheduling --> Running --> Resizing --> Scheduling ...
        |            |  \\          |
        v            v   v          v
     Errored     Finished Errored  Errored

``Scheduling`` waits until enough workers are ready and forms a group (a new membership
epoch), restoring the last committed checkpoint. ``Running`` polls the group.
``Resizing`` stops the group (gracefully at an agreed report for a scale-up, at once
after a failure) and hands the surviving, still-warm workers back to ``Scheduling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Type

from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic.errors import RankFailure


@dataclass
class Scheduling:
    since: float
    last_log_at: Optional[float] = None


@dataclass
class Running:
    epoch: int
    members: List[WorkerHandle]
    started_at: float
    restored_index: int
    memory_index: Optional[int] = None  # restored from this in-memory snapshot
    last_index: Dict[int, int] = field(default_factory=dict)  # wid -> last report index
    finished: Dict[int, object] = field(default_factory=dict)  # wid -> return value
    first_step_seen: bool = False
    unavailable_since: Dict[int, float] = field(default_factory=dict)


@dataclass
class Resizing:
    epoch: int
    members: List[WorkerHandle]
    reason: str
    graceful: bool  # True: stop at an agreed report index; False: abort now
    target_world_size: int = 0
    stop_at: Optional[int] = None
    started_at: float = 0.0
    lost_ranks: List[int] = field(default_factory=list)
    leaving: List[WorkerHandle] = field(default_factory=list)  # stop, then release (drained nodes)


@dataclass
class Finished:
    return_value: object = None


@dataclass
class Errored:
    error: BaseException
    failures: List[RankFailure] = field(default_factory=list)


State = object

TRANSITIONS: Dict[Type, tuple] = {
    Scheduling: (Scheduling, Running, Errored),
    Running: (Running, Resizing, Finished, Errored),
    Resizing: (Resizing, Scheduling, Finished, Errored),
    Finished: (),
    Errored: (),
}


def check_transition(old: State, new: State) -> None:
    allowed = TRANSITIONS[type(old)]
    if type(new) not in allowed:
        raise AssertionError(f"illegal controller transition {type(old).__name__} -> {type(new).__name__}")


def is_terminal(state: State) -> bool:
    return isinstance(state, (Finished, Errored))
