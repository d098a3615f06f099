"""Controller states: one class per state carrying its data, and the allowed moves.

    Scheduling --> Running --> Resizing --> Scheduling ...
        |            |  \\          |
        v            v   v          v
     Errored     Finished Errored  Errored

``Scheduling`` waits until enough workers are ready and forms a group (a new membership
epoch), restoring the last committed checkpoint. ``Running`` polls the group.
``Resizing`` stops the group (gracefully at an agreed report for a scale-up, at once
after a failure) and hands the surviving, still-warm workers back to ``Scheduling``. A
graceful stop takes many ticks (``Resizing -> Resizing``), so a requested stop is seen
between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic.errors import RankFailure


@dataclass
class Scheduling:
    since: float
    last_log_at: Optional[float] = None


@dataclass
class Progress:
    """What one group's members have reported (carried from Running into Resizing)."""

    last_index: Dict[int, int] = field(default_factory=dict)  # wid -> last report index
    finished: Dict[int, object] = field(default_factory=dict)  # wid -> return value
    first_step_seen: bool = False

    def reached(self, default: int = 0) -> int:
        return max(self.last_index.values(), default=default)


@dataclass
class Running:
    epoch: int
    members: List[WorkerHandle]
    started_at: float
    restored_index: int
    memory_index: Optional[int] = None  # restored from this in-memory snapshot
    progress: Progress = field(default_factory=Progress)


@dataclass
class Resizing:
    epoch: int
    members: List[WorkerHandle]
    reason: str
    graceful: bool  # True: stop at an agreed report index; False: abort now
    started_at: float = 0.0
    lost_ranks: List[int] = field(default_factory=list)
    leaving: List[WorkerHandle] = field(default_factory=list)  # stop, then release (drained nodes)
    progress: Progress = field(default_factory=Progress)
    stop: Any = None  # the GracefulStop in progress (graceful_stop.py), once begun


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
