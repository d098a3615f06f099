"""Typed, picklable errors. Each says the cause and the knob to turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


class RaylasticError(Exception):
    """Base class of every error raylastic raises on purpose."""


class ConfigError(RaylasticError, ValueError):
    """Bad user input, raised before any cluster resource is taken."""


@dataclass(frozen=True)
class RankFailure:
    """One worker's failure: which rank, in which membership epoch, and why."""

    rank: int
    epoch: int
    kind: str  # "error" (train function raised), "crash" (process died), "node_lost"
    message: str
    traceback: str = ""


def group_failures(failures: Sequence[RankFailure]) -> List[Tuple[List[int], str]]:
    """Group identical messages: ``[([0, 3], "ValueError: x"), ...]``, ranks sorted."""
    groups: Dict[str, List[int]] = {}
    for f in failures:
        groups.setdefault(f"{f.kind}: {f.message}", []).append(f.rank)
    return [(sorted(ranks), msg) for msg, ranks in groups.items()]


class TrainingFailedError(RaylasticError):
    """Training stopped because a failure budget was exhausted.

    ``failures`` holds every per-rank failure of the last attempt; the message groups
    identical ones ("[ranks 0,3]: ValueError: bad batch").
    """

    def __init__(self, reason: str, failures: Sequence[RankFailure] = ()):
        self.reason = reason
        self.failures = list(failures)
        lines = [reason]
        for ranks, msg in group_failures(self.failures):
            label = "rank" if len(ranks) == 1 else "ranks"
            lines.append(f"  [{label} {','.join(map(str, ranks))}]: {msg}")
        tb = next((f.traceback for f in self.failures if f.traceback), "")
        if tb:
            lines.append("First traceback:\n" + tb.rstrip())
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (TrainingFailedError, (self.reason, self.failures))


class InsufficientCapacityError(RaylasticError):
    """Fewer than ``min_workers`` could be placed for longer than ``max_wait_s``."""

    def __init__(self, min_workers: int, placed: int, waited_s: float, resources: Dict[str, float]):
        self.min_workers = min_workers
        self.placed = placed
        self.waited_s = waited_s
        self.resources = dict(resources)
        super().__init__(
            f"Only {placed} of min_workers={min_workers} workers (each {self.resources}) "
            f"could be placed in {waited_s:.0f} s (ScalingConfig.max_wait_s). Likely causes: "
            "the cluster has fewer nodes than min_workers, resources_per_worker asks for "
            "more than a node offers, or the autoscaler cannot launch nodes. Fix: add "
            "nodes, lower min_workers or resources_per_worker, or raise max_wait_s."
        )

    def __reduce__(self):
        return (
            InsufficientCapacityError,
            (self.min_workers, self.placed, self.waited_s, self.resources),
        )


class TrainingAborted(RaylasticError):
    """``fit()`` was interrupted (Ctrl-C) or the controller was asked to stop."""


class SnapshotMismatchError(RaylasticError):
    """An in-memory ``ElasticState`` snapshot does not fit the objects the train function
    registered (another model shape, another optimizer, state built for another world
    size). The controller drops the in-memory snapshots and restarts the group from the
    last committed checkpoint in storage; not counted against ``max_failures``."""


class RunInUseError(RaylasticError):
    """Another ``fit()`` holds this run's lease (``<run>/.raylastic_lease.json``), or took
    it over from this one: one ``fit()`` writes a run at a time (``checkpoint/lease.py``)."""

    def __init__(self, message: str, *, run: str = "", holder: str = "", expires_in_s: float = 0.0):
        super().__init__(message)
        self.run = run
        self.holder = holder
        self.expires_in_s = expires_in_s

    def __reduce__(self):
        return (_rebuild_run_in_use, (str(self), self.run, self.holder, self.expires_in_s))


def _rebuild_run_in_use(message: str, run: str, holder: str, expires_in_s: float) -> "RunInUseError":
    return RunInUseError(message, run=run, holder=holder, expires_in_s=expires_in_s)


class CheckpointError(RaylasticError):
    """A checkpoint could not be written, committed or read."""


def failure_reason(kind: str, budget_name: str, budget: Optional[int]) -> str:
    return (
        f"{kind} budget exhausted: FailureConfig.{budget_name}={budget}. "
        f"Fix: raise FailureConfig.{budget_name} (or -1/None for unlimited) if these "
        "failures are expected."
    )


def storage_failure(e: BaseException, uri: str) -> TrainingFailedError:
    """The run's own storage failed past its retries (a manifest or event-log write):
    what happened, that nothing committed is lost, and how to resume."""
    err = TrainingFailedError(
        f"the controller could not write to the run's storage {uri} ({type(e).__name__}: {e}). "
        "Nothing committed is lost: fix the storage (service, credentials, "
        "RunConfig(storage_retry=...) for longer outages) and call fit() again with the same "
        "RunConfig(name=...) to resume from the last committed checkpoint."
    )
    err.__cause__ = e
    return err
