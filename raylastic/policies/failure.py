"""Whether to recover from a failure, with separate budgets for the two kinds.

A node loss (preemption, hardware) is not the training code's fault: it has its own
budget, unlimited by default. A real failure (the train function raised, a worker
process crashed on a healthy node) counts against ``max_failures`` so that a bug
cannot restart forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from raylastic.errors import failure_reason
from raylastic.policies.base import Raise, Retry


class FailureKind(str, enum.Enum):
    NODE_LOST = "node_lost"
    ERROR = "error"


@dataclass(frozen=True)
class FailureCounts:
    errors: int = 0  # real failures recovered from so far
    node_losses: int = 0


FailureDecision = Union[Retry, Raise]


# Real failures beyond the first FREE_RETRIES wait 1, 2, 4, ... s (at most MAX_BACKOFF_S)
# before the group re-forms: a flaky step recovers at once, while a bug that raises at
# every start under max_failures=-1 settles to one attempt a minute instead of spinning
# (each attempt re-forms the group and reloads a checkpoint).
FREE_RETRIES = 3
MAX_BACKOFF_S = 60.0


def backoff_s(failure_number: int) -> float:
    """Seconds to wait before recovering from the ``failure_number``-th real failure (1-based)."""
    if failure_number <= FREE_RETRIES:
        return 0.0
    return min(MAX_BACKOFF_S, 2.0 ** min(failure_number - FREE_RETRIES - 1, 16))


@dataclass(frozen=True)
class FailurePolicy:
    max_failures: int = 0  # -1: unlimited
    max_node_failures: Optional[int] = None  # None: unlimited

    def decide(self, kind: FailureKind, counts: FailureCounts) -> FailureDecision:
        if kind is FailureKind.NODE_LOST:
            budget = self.max_node_failures
            if budget is not None and counts.node_losses >= budget:
                return Raise(failure_reason("node-loss", "max_node_failures", budget))
            return Retry(
                f"node loss {counts.node_losses + 1} of {'unlimited' if budget is None else budget} (max_node_failures)"
            )
        if self.max_failures != -1 and counts.errors >= self.max_failures:
            return Raise(failure_reason("failure", "max_failures", self.max_failures))
        delay = backoff_s(counts.errors + 1)
        return Retry(
            f"failure {counts.errors + 1} of "
            f"{'unlimited' if self.max_failures == -1 else self.max_failures} (max_failures)"
            + (f"; retrying in {delay:.0f} s" if delay else ""),
            delay_s=delay,
        )
