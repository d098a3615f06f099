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
    return [
        RankFailure(m.prev_rank, epoch, "error", results[m.wid].error or "", results[m.wid].traceback)
        for m in members
        if m.wid in results and results[m.wid].status == WorkerStatus.ERROR
    ]


def cause_text(cause: Optional[BaseException]) -> str:
    """One line saying why a worker was lost (None: it stopped answering)."""
    if cause is None:
        return "worker stopped answering"
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


# What a rank raises when a peer vanished under it (a collective, the TCP store, a peer
# copy): torch.distributed's errors, socket errors, timeouts, by the type name the worker
# reports, or any message naming the transport.
COLLATERAL_TYPES = frozenset(
    {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "DistQueueEmptyError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "TimeoutError",
        "OSError",
        "JoinCancelled",
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
    }
)
COLLATERAL_WORDS = (
    "gloo",
    "nccl",
    "connection",
    "peer",
    "socket",
    "broken pipe",
    "timed out",
    "timeout",
    "store",
    "process group",
    "collective",
    "abort",
    "actor",
)


def maybe_collateral(f: RankFailure) -> bool:
    """Could this error come from a peer that vanished (so the controller should look for
    a dead peer before calling it a real error)? False for a plain error of the train
    function, e.g. ``ValueError: bad batch``: a lost peer does not raise those, so the
    run need not wait the full classification grace to fail with it."""
    name = f.message.partition(":")[0].strip().rsplit(".", 1)[-1]
    return name in COLLATERAL_TYPES or any(w in f.message.lower() for w in COLLATERAL_WORDS)
