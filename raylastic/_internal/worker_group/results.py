"""What worker actors answer the controller: typed values, not loose dicts.

Torch-free and Ray-free, so the controller (and its fake group in unit tests) can use
them without importing either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from raylastic._internal.holdings import Holding
from raylastic.errors import RankFailure
from raylastic.session import ReportRecord


class WorkerStatus:
    IDLE = "idle"
    RUNNING = "running"
    FINISHED = "finished"  # train function returned
    STOPPED = "stopped"  # unwound for a resize (StopTraining) or aborted
    ERROR = "error"  # train function raised


@dataclass(frozen=True)
class Holdings:
    """Complete in-memory snapshots a worker holds, and which of them are striped."""

    snapshots: List[int] = field(default_factory=list)
    stripes: Dict[int, Holding] = field(default_factory=dict)  # index -> holding, if not whole


@dataclass
class PollResult:
    status: str
    epoch: int
    records: List[ReportRecord] = field(default_factory=list)
    error: Optional[str] = None
    traceback: str = ""
    index: int = 0
    return_value: Any = None
    holdings: Holdings = field(default_factory=Holdings)


@dataclass(frozen=True)
class StopAnswer:
    """Answer to ``request_stop_at(index)``: ``ok`` False when the worker is already past
    ``index`` (then ``index`` is where it is, to pick a later stop)."""

    ok: bool
    index: int


@dataclass(frozen=True)
class PersistedSnapshot:
    """An in-memory snapshot written to storage by ``persist_snapshot``."""

    rel: str
    files: List[Any]
    upload_s: float


def rank_errors(members: Sequence[Any], results: Mapping[int, PollResult], epoch: int) -> List[RankFailure]:
    """The ranks among ``members`` whose train function raised, as the failure policy
    and ``TrainingFailedError`` see them."""
    return [RankFailure(m.prev_rank, epoch, "error", results[m.wid].error or "", results[m.wid].traceback)
            for m in members if m.wid in results and results[m.wid].status == WorkerStatus.ERROR]


def cause_text(cause: Optional[BaseException]) -> str:
    """One line saying why a worker was lost (None: it stopped answering)."""
    if cause is None:
        return "worker stopped answering"
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__
