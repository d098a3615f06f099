"""Decision values returned by policies. Policies decide; the controller acts.

Policies never call Ray or torch: they take plain snapshots and return one of these
frozen values, so every rule is unit-tested in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Noop:
    """Nothing to do now."""

    reason: str = ""


@dataclass(frozen=True)
class Resize:
    """Form a new worker group of ``world_size`` workers (a new membership epoch)."""

    world_size: int
    reason: str


@dataclass(frozen=True)
class Wait:
    """Too few workers can be placed; keep waiting for capacity."""

    reason: str
    log: bool = False  # True when the periodic "still waiting" line is due


@dataclass(frozen=True)
class Retry:
    """Recover from a failure: re-form the group and restore the last checkpoint, after
    ``delay_s`` (a backoff, so that a bug that fails at once cannot spin)."""

    reason: str
    delay_s: float = 0.0


@dataclass(frozen=True)
class Raise:
    """Give up: the controller stops training with this reason."""

    reason: str
