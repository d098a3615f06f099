"""Global batch policies and the learning-rate rule that goes with a changing global batch.

Why two policies: under ``FIXED`` the global batch (and so the optimisation trajectory) is the
same at every world size; fewer workers just accumulate more micro-batches per step. Under
``DYNAMIC`` every worker does one micro-batch per step, so steps stay fast after a shrink but
the global batch follows the world size, and the learning rate has to follow it too.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TypeVar

import torch

__all__ = ["BatchPolicy", "LRScaling", "apply_lr_scaling", "lr_scale_factor"]

E = TypeVar("E", bound=enum.Enum)


class BatchPolicy(str, enum.Enum):
    """How the global batch relates to the world size."""

    FIXED = "fixed"
    """Constant ``global_batch_size``; each rank accumulates ``~G / W`` samples per step."""

    DYNAMIC = "dynamic"
    """``global batch = micro_batch_size * world_size``: one micro-batch per rank per step."""


class LRScaling(str, enum.Enum):
    """Learning-rate rule for the dynamic policy, relative to ``base_world_size``."""

    NONE = "none"
    LINEAR = "linear"  # lr ~ global batch (Goyal et al. 2017, for SGD)
    SQRT = "sqrt"  # lr ~ sqrt(global batch) (common for Adam-type optimizers)


def coerce_enum(enum_type: type[E], name: str, value: object) -> E:
    """Accept an enum member or its string value; anything else is an error naming ``name``."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"{name} ({value!r}) must be one of {choices}") from None


def lr_scale_factor(world_size: int, base_world_size: int, rule: LRScaling | str = LRScaling.LINEAR) -> float:
    """Factor to multiply the base learning rate by at ``world_size`` under ``rule``.

    The base learning rate is the one tuned for ``base_world_size`` workers, i.e. for a global
    batch of ``micro_batch_size * base_world_size``.
    """
    rule = coerce_enum(LRScaling, "lr_scaling", rule)
    for name, value in (("world_size", world_size), ("base_world_size", base_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    ratio = world_size / base_world_size
    if rule is LRScaling.LINEAR:
        return ratio
    if rule is LRScaling.SQRT:
        return math.sqrt(ratio)
    return 1.0


def apply_lr_scaling(optimizer: torch.optim.Optimizer, factor: float, base_lrs: Sequence[float]) -> None:
    """Set each param group's ``lr`` to ``base_lr * factor``.

    ``base_lrs`` is one float per param group, captured once before training, e.g.
    ``[g["lr"] for g in optimizer.param_groups]``; passing the base explicitly (instead of
    scaling the current lr in place) keeps repeated resizes from compounding the factor.
    """
    groups = optimizer.param_groups
    if len(base_lrs) != len(groups):
        raise ValueError(
            f"base_lrs has {len(base_lrs)} entries but the optimizer has {len(groups)} param "
            "groups; capture them with [g['lr'] for g in optimizer.param_groups]"
        )
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor ({factor!r}) must be a finite positive number")
    for group, base in zip(groups, base_lrs):
        group["lr"] = float(base) * factor
