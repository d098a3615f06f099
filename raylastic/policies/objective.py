"""What a spot run optimizes: the rules that say how many on-demand workers are worth it.

Pure arithmetic over prices, measured throughput and progress, used by
:class:`raylastic.policies.capacity.CapacityPolicy`. Kept apart so each rule reads (and is
tested) on its own, and so every number a decision used can be logged with it.

Two rules, each returning an :class:`OnDemandPlan` (how many on-demand workers, why, and
the numbers):

- :func:`cost_fill` (``objective="cost"``): spot alone is below ``min_workers``, so the
  group cannot train while its ready spot nodes are billed. Filling the gap with
  ``min_workers - spot`` on-demand workers is worth it only when it lowers the run's cost
  per trained sample. Per hour of shortfall:

  - fill:  ``spot * p_spot + fill * p_od + fixed`` trains ``rate(min)`` steps per second;
  - wait:  ``spot * p_spot + fixed`` trains nothing, and the same steps are trained later
    on spot at ``max_workers``, costing ``rate(min) / rate(max) * (max * p_spot + fixed)``
    per hour of shortfall.

  Fill iff fill < wait. With linear scaling and no fixed cost this is
  ``fill * p_od < min * p_spot``: at spot = 0.3x on-demand, a group at ``min=2`` never
  fills one worker, a group at ``min=4`` with 3 spot workers does. It never fills past
  ``min_workers``: above it the group trains, and each on-demand step costs
  ``p_od / p_spot`` times a spot step.
- :func:`deadline_need` (``deadline_s=``): while spot trains (>= ``min_workers``), the
  projected finish at the current rate (slowed by the share of time the run has lost to
  resizes, recoveries and waits so far) must land ``margin_s`` before the deadline,
  counting ``boot_s`` for any new node; when it does not, the fewest on-demand workers
  that bring it back on track are asked for (all it may, when none suffice). While spot
  cannot train at all, waiting costs nothing, so it waits for spot as long as the run
  could still make it by adding every on-demand worker it may after a boot (the latest
  safe switch). On-demand workers are kept only while needed: spot returning, or the run
  pulling ahead, lowers the count. The deadline is reported unreachable when even
  ``max_workers`` from now would miss it by more than the margin (a run that would be
  a little late keeps going with every worker it may have). Under the pessimistic assumption that spot
  never returns, the on-demand worker-seconds needed are the same now or later (linear
  scaling), so waiting only wins when spot does return; the margin covers the risk
  ("Can't Be Late", NSDI '24, makes the same trade with its uniform-progress rule).

Work is counted in steps (reports); with a constant global batch a step is a fixed number
of samples, so cost per step orders options exactly as cost per sample does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Mapping, Optional


class Objective(str, Enum):
    """``cost``: minimize dollars per trained sample; ``time``: finish soonest (fill any
    spot shortfall with on-demand up to ``max_workers``)."""

    COST = "cost"
    TIME = "time"

    @classmethod
    def parse(cls, value: Any, what: str = "objective") -> "Objective":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{what}={value!r}: use 'cost' (cheapest per sample) or 'time' "
                "(soonest); set deadline_s for 'cheapest that finishes by then'"
            ) from None


@dataclass(frozen=True, kw_only=True)
class WorkProgress:
    """How far the run is. ``elapsed_s``: since ``fit()``; ``steps_done`` of
    ``total_steps`` (None: unknown); ``steps_per_s``: measured training rate by world size;
    ``efficiency``: the share of the time since training first started that the group
    spent training (resizes, recoveries and waits take the rest), so projections of the
    remaining time count the interruptions a run has been seeing.
    """

    elapsed_s: float
    steps_done: int = 0
    total_steps: Optional[int] = None
    steps_per_s: Mapping[int, float] = field(default_factory=dict)
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        e = self.efficiency
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"WorkProgress.efficiency={e!r} must be in (0, 1]")
        if not (isinstance(self.elapsed_s, (int, float)) and math.isfinite(self.elapsed_s)):
            raise ValueError(f"WorkProgress.elapsed_s={self.elapsed_s!r} must be a finite number")
        rates = {}
        for n, r in dict(self.steps_per_s).items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"WorkProgress.steps_per_s: world size {n!r} must be an int >= 1")
            if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
                raise ValueError(f"WorkProgress.steps_per_s[{n}]={r!r} must be a number > 0")
            rates[n] = float(r)
        object.__setattr__(self, "steps_per_s", rates)

    @property
    def remaining_steps(self) -> Optional[int]:
        if self.total_steps is None:
            return None
        return max(0, self.total_steps - self.steps_done)

    def rate(self, world: int) -> Optional[float]:
        """Steps per second at ``world`` workers: measured, else scaled linearly from the
        measured world size nearest to it (None before any measurement)."""
        if world <= 0:
            return 0.0
        if world in self.steps_per_s:
            return self.steps_per_s[world]
        if not self.steps_per_s:
            return None
        near = min(self.steps_per_s, key=lambda n: (abs(n - world), -n))
        return self.steps_per_s[near] / near * world


@dataclass(frozen=True)
class OnDemandPlan:
    """``workers`` on-demand workers wanted by one rule; ``numbers`` are what it used."""

    workers: int
    reason: str
    numbers: Dict[str, Any] = field(default_factory=dict)
    unreachable: bool = False  # the deadline cannot be met by any plan


def cost_fill(
    *,
    spot: int,
    min_workers: int,
    max_workers: int,
    p_spot: Optional[float],
    p_od: Optional[float],
    fixed_usd_h: float,
    progress: Optional[WorkProgress],
    max_fill: int,
) -> OnDemandPlan:
    """On-demand workers that lower cost per sample while spot is below ``min_workers``
    (see the module docstring). ``max_fill``: the on-demand cap left."""
    fill = min(max(0, min_workers - spot), max_fill)
    if spot >= min_workers or fill == 0:
        return OnDemandPlan(
            0,
            f"spot covers min_workers ({spot} >= {min_workers})"
            if spot >= min_workers
            else f"no on-demand worker allowed (cap {max_fill})",
        )
    if spot + fill < min_workers:
        return OnDemandPlan(
            0,
            f"{fill} on-demand worker(s) allowed cannot bring {spot} spot up to "
            f"min_workers={min_workers}: waiting for spot",
        )
    if p_spot is None or p_od is None:
        return OnDemandPlan(0, "no price table: assuming spot is the cheaper way to train; waiting for spot")
    rate = progress.rate if progress is not None else (lambda n: None)
    r_min, r_max = rate(min_workers), rate(max_workers)
    ratio = (r_min / r_max) if r_min and r_max else min_workers / max_workers
    fill_h = spot * p_spot + fill * p_od + fixed_usd_h
    wait_h = spot * p_spot + fixed_usd_h + ratio * (max_workers * p_spot + fixed_usd_h)
    numbers: Dict[str, Any] = {
        "fill_usd_per_h": round(fill_h, 6),
        "wait_usd_per_h": round(wait_h, 6),
        "spot_workers": spot,
        "fill_workers": fill,
    }
    if r_min:
        per_step = 3600.0 * r_min
        numbers["fill_usd_per_step"] = round(fill_h / per_step, 9)
        numbers["wait_usd_per_step"] = round(wait_h / per_step, 9)
    if fill_h < wait_h:
        return OnDemandPlan(
            fill,
            f"{fill} on-demand worker(s) let {spot} idle spot worker(s) train: "
            f"${fill_h:.4f}/h now < ${wait_h:.4f}/h waiting for spot (cheaper per "
            "sample)",
            numbers,
        )
    return OnDemandPlan(
        0,
        f"waiting for spot: filling to min_workers with {fill} on-demand worker(s) "
        f"costs ${fill_h:.4f}/h >= ${wait_h:.4f}/h of idle spot plus the same "
        "samples on spot later",
        numbers,
    )


def deadline_need(
    *,
    spot: int,
    on_demand_now: int,
    min_workers: int,
    max_workers: int,
    max_on_demand: int,
    deadline_s: float,
    margin_s: float,
    boot_s: float,
    progress: Optional[WorkProgress],
) -> Optional[OnDemandPlan]:
    """On-demand workers the deadline needs now (module docstring), or None when it cannot
    be judged yet (no total_steps or no measured rate)."""
    if progress is None or progress.remaining_steps is None:
        return None
    left_steps = progress.remaining_steps
    if left_steps == 0:
        return OnDemandPlan(0, "every step is trained", {"remaining_steps": 0})
    if progress.rate(min_workers) is None:
        return None
    d_max = max(0, min(max_on_demand, max_workers - spot))
    left_s = deadline_s - progress.elapsed_s
    budget = left_s - margin_s - boot_s  # time to finish with nodes booted now

    def finish_s(n_od: int) -> float:
        n = min(max_workers, spot + n_od)
        r = progress.rate(n) if n >= min_workers else 0.0
        return left_steps / r / progress.efficiency if r else math.inf

    full = finish_s(d_max)
    r_all = progress.rate(max_workers) or 0.0
    best_s = left_steps / r_all if r_all else math.inf
    numbers: Dict[str, Any] = {
        "deadline_s": deadline_s,
        "elapsed_s": round(progress.elapsed_s, 2),
        "remaining_steps": left_steps,
        "margin_s": margin_s,
        "boot_s": boot_s,
        "efficiency": round(progress.efficiency, 3),
        "projected_finish_s": _round(progress.elapsed_s + finish_s(on_demand_now)),
        "projected_finish_full_s": _round(progress.elapsed_s + full),
        "slack_s": _round(left_s - margin_s - full),
        "best_finish_s": _round(progress.elapsed_s + best_s),
        "spot_workers": spot,
        "on_demand_workers": on_demand_now,
    }
    if best_s > left_s + margin_s:
        return OnDemandPlan(
            d_max,
            f"deadline unreachable: {left_steps} steps at {max_workers} workers "
            f"take {best_s:.1f} s, {left_s:.1f} s left",
            numbers,
            unreachable=True,
        )
    if best_s > left_s:  # late by less than the margin: finish as soon as possible, don't end the run
        return OnDemandPlan(
            d_max,
            f"deadline at risk: even {max_workers} workers finish "
            f"{best_s - left_s:.1f} s late (within the margin); every on-demand "
            "worker allowed",
            numbers,
        )
    # Keeping today's on-demand workers needs no boot; adding one does, and so does
    # dropping one (hysteresis: if that proves wrong, a new node must boot in time).
    fits = [d for d in range(d_max + 1) if finish_s(d) <= (left_s - margin_s if d == on_demand_now else budget)]
    need = fits[0] if fits else d_max
    if spot < min_workers and (left_s - margin_s - full) > boot_s and need > on_demand_now:
        return OnDemandPlan(
            min(need, on_demand_now),
            f"on spot: {left_s - margin_s - full:.1f} s of slack with every on-demand "
            f"worker allowed > {boot_s:g} s to boot one; waiting for spot",
            numbers,
        )
    if need < on_demand_now:
        why = (
            f"releasing {on_demand_now - need} on-demand worker(s): {spot} spot + {need} on-demand "
            f"finish at {progress.elapsed_s + finish_s(need):.1f} s, by the deadline less margin and boot"
        )
    elif need > on_demand_now:
        now_at = numbers["projected_finish_s"]
        why = (
            f"behind the deadline: {spot} spot + {on_demand_now} on-demand "
            + (f"finish at {now_at} s" if now_at is not None else "cannot train")
            + f" (deadline less margin: {deadline_s - margin_s:.1f} s); {need} on-demand worker(s) "
            "get back on track"
        )
    else:
        why = f"on track with {spot} spot + {need} on-demand worker(s)"
    return OnDemandPlan(need, why, numbers)


def _round(x: float) -> Optional[float]:
    return round(x, 2) if math.isfinite(x) else None
