"""When to form, grow or wait: the elastic sizing rule.

Rules, in order:
- No group yet: form one as soon as ``min_workers`` are ready, with every ready worker
  up to ``max_workers``, after a short settle window so that workers coming up together
  join the first group instead of forcing an immediate resize. Workers already placed on
  a node and starting (their process importing torch; seconds apart on a loaded or fresh
  node) are waited for too, as long as some worker became ready within
  ``starting_wait_s``: a first group formed without them would resize moments later.
- Running: grow when spare ready workers exist and the group is below ``max_workers``,
  once no new worker has become ready for ``settle_s`` (several nodes joining in a burst
  cause one resize, not several).
- Fewer than ``min_workers`` ready: wait; give up after ``max_wait_s``; ask for a log
  line every ``log_every_s`` so a waiting run is never silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from raylastic.policies.base import Noop, Raise, Resize, Wait


@dataclass(frozen=True)
class ScalingSnapshot:
    """What the sizing rule looks at. Times are seconds on one monotonic clock."""

    now: float
    group_size: int  # workers in the running group (0 when no group is running)
    ready_spares: int  # ready workers not in the group
    last_ready_at: Optional[float]  # when a worker last became ready
    waiting_since: Optional[float]  # since when fewer than min_workers were ready
    last_wait_log_at: Optional[float] = None
    starting: int = 0  # workers placed on a node (holding its resources), not ready yet


ScalingDecision = Union[Noop, Resize, Wait, Raise]


@dataclass(frozen=True)
class ElasticScalingPolicy:
    min_workers: int
    max_workers: int
    max_wait_s: Optional[float] = None
    settle_s: float = 1.0
    log_every_s: float = 30.0
    starting_wait_s: float = 30.0

    def decide(self, s: ScalingSnapshot) -> ScalingDecision:
        available = s.group_size + s.ready_spares
        if s.group_size == 0:
            return self._decide_formation(s, available)
        if s.ready_spares > 0 and s.group_size < self.max_workers:
            if s.last_ready_at is not None and s.now - s.last_ready_at < self.settle_s:
                return Noop("waiting for more workers to come up before growing")
            target = min(self.max_workers, available)
            return Resize(
                target,
                f"scale up {s.group_size} -> {target}: {s.ready_spares} new worker(s) ready; "
                f"max_workers={self.max_workers}",
            )
        return Noop()

    def _decide_formation(self, s: ScalingSnapshot, available: int) -> ScalingDecision:
        if available < self.min_workers:
            waited = 0.0 if s.waiting_since is None else s.now - s.waiting_since
            if self.max_wait_s is not None and waited > self.max_wait_s:
                return Raise(
                    f"only {available} of min_workers={self.min_workers} workers placeable "
                    f"after {waited:.0f} s (max_wait_s={self.max_wait_s})"
                )
            due = s.last_wait_log_at is None or s.now - s.last_wait_log_at >= self.log_every_s
            return Wait(
                f"waiting for capacity: {available} of min_workers={self.min_workers} ready for {waited:.0f} s",
                log=due,
            )
        target = min(self.max_workers, available)
        recently = s.last_ready_at is not None and s.now - s.last_ready_at < self.settle_s
        if target < self.max_workers and recently:
            return Noop("min_workers ready; letting workers that are starting join")
        if (
            target < self.max_workers
            and s.starting > 0
            and (s.last_ready_at is None or s.now - s.last_ready_at < self.starting_wait_s)
        ):
            return Noop(f"min_workers ready; {s.starting} worker(s) placed and starting: letting them join")
        return Resize(
            target,
            f"form group of {target}: {available} worker(s) ready; "
            f"min_workers={self.min_workers}, max_workers={self.max_workers}",
        )
