"""Policies decide; the controller acts (``base.py``). ``from_configs`` builds the policies a
run's ``ScalingConfig`` asks for, so that the controller and tests build them one way."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from raylastic.policies.scaling import ElasticScalingPolicy


def from_configs(scaling: Any) -> Tuple[ElasticScalingPolicy, Optional[Any]]:
    """The scaling policy and the capacity policy (or None) of ``scaling`` (a
    ``raylastic.ScalingConfig``; typed loosely because ``config`` imports this package),
    on one clock.

    Both can give up when fewer than ``min_workers`` are placeable. With a capacity policy
    its ``max_wait_s`` is the only wait bound (it knows which market it is waiting for and
    raises ``CapacityTimeoutError``); the scaling policy then never gives up on its own, so
    two clocks can never disagree about when a run ends. ``ScalingConfig`` refuses a
    ``max_wait_s`` set in both places.
    """
    cap = scaling.capacity
    policy = ElasticScalingPolicy(
        min_workers=scaling.min_workers,
        max_workers=scaling.max_workers,
        max_wait_s=scaling.max_wait_s if cap is None else None,
    )
    return policy, cap
