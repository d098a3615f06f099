"""Ray Train's error types for failures of a ``raylastic.TorchTrainer`` run.

Why: a script written for Ray Train catches ``ray.train.TrainingFailedError`` (or its
``WorkerGroupError`` / ``ControllerError``) around ``fit()``, and reads the worker's error
first in the message. raylastic's ``TrainingFailedError`` is neither, and its message
starts with the budget that ran out. The shim re-raises the failure as one class that is
both: ``except raylastic.TrainingFailedError`` (and its ``failures``, ``reason``) keeps
working, and so does ``except ray.train.WorkerGroupError`` (with ``worker_failures``).

- a failure with per-rank causes (the train function raised, a worker process died, a
  node was lost) -> :class:`WorkerGroupFailed`, a ``ray.train.WorkerGroupError``: the
  message is Ray's ("Training failed due to worker errors:") with each rank's error and
  the first traceback, then raylastic's reason (which budget ran out, and the fix);
- any other (the run's storage failed) -> :class:`ControllerFailed`, a
  ``ray.train.ControllerError``.

Ray's ``worker_failures`` holds the worker's exception object; here the exception
crossed a process boundary as text, so each value is a :class:`RankError` carrying the
original type name, message and traceback.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from raylastic.errors import RankFailure, TrainingFailedError, group_failures


class RankError(RuntimeError):
    """One rank's failure as ``WorkerGroupError.worker_failures`` holds it: ``str()`` is
    ``"<ExceptionType>: <message>"``; ``kind`` is "error" (the train function raised),
    "crash" (the process died) or "node_lost"; ``traceback`` the worker's traceback."""

    def __init__(self, rank: int, kind: str, message: str, traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.traceback = traceback

    def __reduce__(self):
        return (RankError, (self.rank, self.kind, str(self), self.traceback))


def _worker_message(reason: str, failures: Sequence[RankFailure]) -> str:
    lines = []
    for ranks, msg in group_failures(failures):
        label = "Rank" if len(ranks) == 1 else "Ranks"
        lines.append(f"[{label} {','.join(map(str, ranks))}]: {msg}")
    tb = next((f.traceback for f in failures if f.traceback), "")
    if tb:
        lines.append(tb.rstrip())
    lines.append(f"(raylastic: {reason})")
    return "\n".join(lines)


def _init_ours(err: TrainingFailedError, reason: str, failures: Sequence[RankFailure]) -> None:
    """raylastic's attributes, without ``TrainingFailedError.__init__``: its ``super()``
    call would reach Ray's ``__init__`` (next in these classes' MRO) with the wrong
    arguments. The message is set by the caller, in Ray's shape."""
    err.reason = reason
    err.failures = list(failures)


class WorkerGroupFailed(TrainingFailedError, WorkerGroupError):
    """raylastic's ``TrainingFailedError`` that is also Ray Train's ``WorkerGroupError``."""

    def __init__(self, reason: str, failures: Sequence[RankFailure] = ()):
        _init_ours(self, reason, failures)
        self._error_message = _worker_message(reason, self.failures)
        last: Dict[int, RankError] = {}
        for f in self.failures:  # the last failure of each rank, as Ray's poll reports it
            last[f.rank] = RankError(f.rank, f.kind, f.message, f.traceback)
        self.worker_failures: Dict[int, Exception] = dict(sorted(last.items()))
        Exception.__init__(self, "Training failed due to worker errors:\n" + self._error_message)

    def __reduce__(self):
        return (WorkerGroupFailed, (self.reason, self.failures))


class ControllerFailed(TrainingFailedError, ControllerError):
    """raylastic's ``TrainingFailedError`` that is also Ray Train's ``ControllerError``:
    ``controller_failure`` is what failed (the storage error), or the error itself."""

    def __init__(self, reason: str, failures: Sequence[RankFailure] = (), cause: Optional[BaseException] = None):
        _init_ours(self, reason, failures)
        self.controller_failure = cause if isinstance(cause, Exception) else RuntimeError(reason)
        Exception.__init__(
            self, "Training failed due to controller error:\n" + str(TrainingFailedError(reason, self.failures))
        )

    def __reduce__(self):
        return (ControllerFailed, (self.reason, self.failures, self.controller_failure))


def as_ray_error(err: TrainingFailedError) -> TrainingFailedError:
    """The same failure as an instance of Ray Train's types (see the module docstring)."""
    if isinstance(err, (WorkerGroupFailed, ControllerFailed)):
        return err
    if err.failures:
        out: TrainingFailedError = WorkerGroupFailed(err.reason, err.failures)
    else:
        out = ControllerFailed(err.reason, err.failures, err.__cause__)
    out.__cause__ = err.__cause__
    return out
