"""Helpers over what worker actors answer the controller. The types themselves (typed
values, not loose dicts) live in ``_internal/protocol.py`` and are re-exported here, where
callers have always found them.

Torch-free and Ray-free, so the controller (and its fake group in unit tests) can use
them without importing either.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

from raylastic._internal.protocol import (  # noqa: F401 - re-exported
    Holdings,
    PersistedSnapshot,
    PollResult,
    StopAnswer,
    WorkerStatus,
)
from raylastic.errors import RankFailure


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
