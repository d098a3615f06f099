"""Why a :class:`~raylastic.policies.capacity.CapacityPolicy` is refused: the checks it
runs when it is built (``__post_init__``) and against the run's worker range
(``validate_scaling``, also on every tick).

A module of its own so that ``capacity.py`` reads as the decision rule. The field rules are
:mod:`raylastic._internal.validate`'s, shared with the run configs; every error names
``CapacityPolicy.<field>`` (or the pair of fields that conflict) and the fix, and is a
:class:`~raylastic.errors.ConfigError` (a ``ValueError``) at construction, a plain
``ValueError`` against the worker range.
"""

from __future__ import annotations

from typing import Any, Optional

from raylastic._internal.validate import check_bool, check_instance, check_int, check_number, error
from raylastic.errors import ConfigError
from raylastic.policies.node_types import Market, NodeType, PriceTable
from raylastic.policies.objective import Objective


def check_policy(policy: Any) -> None:
    """Check every field of ``policy`` (a ``CapacityPolicy`` being built) and the rules
    between them; normalise ``prefer`` and ``objective`` to their enums and ``node_types``
    to a tuple. Typed loosely: the fields may hold anything until these checks pass, and
    ``capacity.py`` imports this module (raylastic has no import cycles)."""
    for name, enum in (("prefer", Market), ("objective", Objective)):
        try:
            object.__setattr__(policy, name, enum.parse(getattr(policy, name), f"CapacityPolicy.{name}"))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{e}. Fix: pass {name}=" + " or ".join(repr(m.value) for m in enum)) from None
    seconds = {
        "fallback_after_s": "0 requests on-demand as soon as spot is short",
        "max_wait_s": "30 minutes: max_wait_s=1800",
        "on_demand_boot_s": "180 s is typical",
        "spot_wait_s": "None: half of max_wait_s",
    }
    for name, hint in seconds.items():  # ranges of the first two below, with their own messages
        check_number(
            getattr(policy, name),
            f"CapacityPolicy.{name}",
            unit="seconds",
            minimum=None if name in ("fallback_after_s", "max_wait_s") else 0,
            none_means="half of max_wait_s" if name == "spot_wait_s" else None,
            fix=f"pass {name} as seconds ({hint})",
        )
    check_number(
        policy.fixed_usd_per_hour,
        "CapacityPolicy.fixed_usd_per_hour",
        minimum=0,
        fix="pass the run's fixed cost in USD per hour (head node, licences), or 0",
    )
    check_number(
        policy.deadline_margin,
        "CapacityPolicy.deadline_margin",
        minimum=0,
        fix="pass a fraction of deadline_s such as 0.1 (finish 10% early)",
    )
    check_number(
        policy.deadline_s,
        "CapacityPolicy.deadline_s",
        above=0,
        unit="seconds",
        none_means="no deadline",
        fix="pass the seconds from fit() the run must finish in, or None",
    )
    check_int(
        policy.max_on_demand_workers,
        "CapacityPolicy.max_on_demand_workers",
        minimum=None,
        none_means="up to max_workers",
        fix="pass a number of workers >= 0, or None",
    )
    check_bool(policy.return_to_spot, "CapacityPolicy.return_to_spot")
    check_instance(
        policy.prices,
        PriceTable,
        "CapacityPolicy.prices",
        "prices=PriceTable.from_mapping({'spot': 0.9, 'on_demand': 3.0}), or None",
        optional=True,
    )
    if policy.deadline_margin >= 1:
        raise ConfigError(
            f"CapacityPolicy.deadline_margin={policy.deadline_margin!r} is a fraction of "
            "deadline_s and must be < 1. Fix: e.g. 0.1 (finish 10% early)"
        )
    if policy.fallback_after_s < 0:
        raise ConfigError(
            f"CapacityPolicy.fallback_after_s ({policy.fallback_after_s}) must be >= 0. "
            "Fix: use 0 to request on-demand as soon as spot is short"
        )
    if policy.max_wait_s <= 0:
        raise ConfigError(
            f"CapacityPolicy.max_wait_s ({policy.max_wait_s}) must be > 0. Fix: it is finite "
            "by design; pass the seconds to wait below min_workers, e.g. 1800"
        )
    cap = policy.max_on_demand_workers
    if cap is not None and cap < 0:
        raise ConfigError(
            f"CapacityPolicy.max_on_demand_workers ({cap!r}) must be an int >= 0. Fix: pass 0 (spot "
            "only), a cap, or None for up to max_workers"
        )
    wait_first = policy.spot_wait_after_s if policy.objective is Objective.COST else policy.fallback_after_s
    if policy.prefer is Market.SPOT and cap != 0 and policy.deadline_s is None and policy.max_wait_s <= wait_first:
        raise ConfigError(
            f"CapacityPolicy.max_wait_s ({policy.max_wait_s}) <= "
            f"{'spot_wait_s' if policy.objective is Objective.COST else 'fallback_after_s'} "
            f"({wait_first}): the run would give up before trying on-demand. Fix: "
            "raise max_wait_s or lower it"
        )
    if policy.prefer is Market.ON_DEMAND and cap == 0:
        raise ConfigError(
            "CapacityPolicy: prefer='on_demand' with max_on_demand_workers=0 can never get "
            "a worker. Fix: raise max_on_demand_workers or use prefer='spot'"
        )
    _check_node_types(policy)
    if policy.prices is not None:
        policy.prices.require(t.name for t in policy.used_node_types())


def _check_node_types(policy: Any) -> None:
    """``node_types`` as a tuple of :class:`NodeType`, exactly one per market and each
    named once: the policy finds its spot and on-demand types by market, and a request's
    counts by name."""
    if not isinstance(policy.node_types, (tuple, list)):
        raise error(
            "CapacityPolicy.node_types",
            policy.node_types,
            "a tuple of NodeType",
            "pass node_types=(NodeType(name=..., market='spot'), NodeType(name=..., market='on_demand'))",
            wrong_type=True,
        )
    types = tuple(policy.node_types)
    object.__setattr__(policy, "node_types", types)
    for t in types:
        if not isinstance(t, NodeType):
            raise ConfigError(
                f"CapacityPolicy.node_types: {t!r} is not a NodeType. Fix: pass NodeType(name=..., market=...) objects"
            )
    names = [t.name for t in types]
    if len(set(names)) != len(names):
        raise ConfigError(f"CapacityPolicy.node_types: duplicate names in {names}. Fix: name each node type once")
    for market in Market:
        of_market = [t.name for t in types if t.market is market]
        if len(of_market) != 1:
            raise ConfigError(
                f"CapacityPolicy.node_types needs exactly one {market.value} node type, "
                f"got {of_market or 'none'}. Fix: pass node_types=(NodeType(name=..., "
                "market='spot'), NodeType(name=..., market='on_demand'))"
            )


def check_scaling(prefer: Market, cap: Optional[int], *, min_workers: int, max_workers: int) -> None:
    """``CapacityPolicy.validate_scaling``: ``prefer`` and ``max_on_demand_workers``
    (``cap``) against the run's worker range, before any resources are taken."""
    if cap is not None and cap > max_workers:
        raise ValueError(
            f"CapacityPolicy.max_on_demand_workers ({cap}) > max_workers ({max_workers}). "
            f"Fix: lower max_on_demand_workers to at most {max_workers}"
        )
    if prefer is Market.ON_DEMAND and cap is not None and cap < min_workers:
        raise ValueError(
            f"CapacityPolicy: prefer='on_demand' with max_on_demand_workers ({cap}) < min_workers "
            f"({min_workers}) can never start. Fix: raise max_on_demand_workers"
        )
