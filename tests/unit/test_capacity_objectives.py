"""Objectives of the capacity policy: cost-first, time-first and deadline rules (pure)."""

from __future__ import annotations

import pickle

import pytest

from raylastic.errors import InsufficientCapacityError
from raylastic.policies.base import Noop
from raylastic.policies.capacity import (
    CapacityPolicy,
    CapacitySnapshot,
    CapacityState,
    DeadlineUnreachable,
    DeadlineUnreachableError,
    MigrateToSpot,
    ReleaseOnDemand,
    RequestCapacity,
)
from raylastic.policies.node_types import PriceTable
from raylastic.policies.objective import WorkProgress, cost_fill, deadline_need

PRICES = PriceTable.from_mapping({"spot": 0.3, "on_demand": 1.0})


def snap(now, ready, in_group=None, requested=None, lo=2, hi=3, boundary=False, progress=None):
    return CapacitySnapshot(now_s=now, min_workers=lo, max_workers=hi, ready=ready,
                            in_group=in_group or {}, requested=requested or {},
                            at_checkpoint_boundary=boundary, progress=progress)


def run(policy, snaps, state=None):
    """Decide on each snapshot in turn, carrying the state; returns the steps."""
    steps = []
    for s in snaps:
        step = policy.decide(s, state)
        state = step.state
        steps.append(step)
    return steps


# -- cost objective ------------------------------------------------------------------------

def test_cost_is_the_default_and_never_fills_when_waiting_is_cheaper():
    policy = CapacityPolicy(fallback_after_s=5, max_wait_s=600, prices=PRICES)
    assert policy.objective.value == "cost"
    req = {"spot": 3}
    steps = run(policy, [snap(t, {"spot": 1}, {"spot": 1}, req) for t in (0, 10, 100, 250)])
    # 1 on-demand worker ($1.0/h) to train at min=2 costs more than 2 spot workers' worth
    # of the same samples later ($0.6/h): wait, whatever the time.
    assert all(isinstance(s.decision, Noop) for s in steps)
    plan = cost_fill(spot=1, min_workers=2, max_workers=3, p_spot=0.3, p_od=1.0, fixed_usd_h=0.0,
                     progress=None, max_fill=3)
    assert plan.workers == 0
    assert plan.numbers["fill_usd_per_h"] == pytest.approx(1.3)
    assert plan.numbers["wait_usd_per_h"] == pytest.approx(0.3 + 2 / 3 * 0.9)


def test_cost_fills_one_worker_to_min_when_cheaper_and_never_past_min():
    policy = CapacityPolicy(fallback_after_s=5, max_wait_s=600, prices=PRICES)
    req = {"spot": 6}
    steps = run(policy, [snap(0, {"spot": 3}, {"spot": 3}, req, lo=4, hi=6),
                         snap(5, {"spot": 3}, {"spot": 3}, req, lo=4, hi=6)])
    assert isinstance(steps[0].decision, Noop)  # fallback_after_s debounces a short dip
    d = steps[1].decision
    # 1 x $1.0 < 4 x $0.3: one on-demand worker lets three idle spot workers train
    assert isinstance(d, RequestCapacity) and d.counts == {"spot": 6, "on_demand": 1}
    assert d.numbers["fill_usd_per_h"] < d.numbers["wait_usd_per_h"]
    assert "cheaper per sample" in d.reason


def test_cost_uses_measured_throughput_and_logs_cost_per_step():
    # Poor scaling: 4 workers train barely faster than 2, so samples done later on spot
    # at max_workers are expensive and filling now pays.
    progress = WorkProgress(elapsed_s=100, steps_done=10, total_steps=100,
                            steps_per_s={2: 1.0, 4: 1.1})
    plan = cost_fill(spot=1, min_workers=2, max_workers=4, p_spot=0.3, p_od=1.0, fixed_usd_h=0.0,
                     progress=progress, max_fill=4)
    assert plan.workers == 1
    assert plan.numbers["fill_usd_per_step"] == pytest.approx(1.3 / 3600)
    assert plan.numbers["fill_usd_per_step"] < plan.numbers["wait_usd_per_step"]


def test_cost_counts_fixed_costs():
    # a $3/h head node makes finishing sooner worth more than the on-demand premium
    plan = cost_fill(spot=1, min_workers=2, max_workers=3, p_spot=0.3, p_od=1.0, fixed_usd_h=3.0,
                     progress=None, max_fill=3)
    assert plan.workers == 1


def test_cost_fills_after_spot_wait_s_and_returns_to_spot():
    policy = CapacityPolicy(fallback_after_s=5, spot_wait_s=60, max_wait_s=600, prices=PRICES)
    req = {"spot": 3}
    steps = run(policy, [snap(0, {"spot": 1}, {"spot": 1}, req), snap(30, {"spot": 1}, {"spot": 1}, req),
                         snap(60, {"spot": 1}, {"spot": 1}, req)])
    assert isinstance(steps[1].decision, Noop)
    d = steps[2].decision
    assert isinstance(d, RequestCapacity) and d.counts == {"spot": 3, "on_demand": 1}
    assert "spot_wait_s=60" in d.reason
    # spot is back: the on-demand worker leaves at the next checkpoint boundary ...
    back = dict(ready={"spot": 3, "on_demand": 1}, in_group={"spot": 1, "on_demand": 1},
                requested={"spot": 3, "on_demand": 1})
    step = policy.decide(snap(70, **back), steps[2].state)
    assert isinstance(step.decision, Noop) and "checkpoint boundary" in step.decision.reason
    step = policy.decide(snap(71, boundary=True, **back), step.state)
    assert step.decision == MigrateToSpot(workers=1, target={"spot": 3, "on_demand": 0},
                                          reason=step.decision.reason, numbers=step.decision.numbers)
    # ... and, once out of the group, its slot is released
    step = policy.decide(snap(75, {"spot": 3, "on_demand": 1}, {"spot": 3}, back["requested"]), step.state)
    assert isinstance(step.decision, ReleaseOnDemand) and step.decision.counts == {"spot": 3, "on_demand": 0}


def test_cost_without_prices_waits_for_spot():
    policy = CapacityPolicy(fallback_after_s=0, max_wait_s=600)
    step = policy.decide(snap(0, {"spot": 1}, {"spot": 1}, {"spot": 3}))
    assert isinstance(step.decision, Noop) and "no price table" in step.decision.reason


def test_time_objective_fills_to_max_workers():
    policy = CapacityPolicy(objective="time", fallback_after_s=0, max_wait_s=600, prices=PRICES)
    step = policy.decide(snap(0, {"spot": 1}, {"spot": 1}, {"spot": 3}))
    assert step.decision == RequestCapacity(counts={"spot": 3, "on_demand": 2}, reason=step.decision.reason,
                                            numbers={})


# -- deadline ---------------------------------------------------------------------------------

def prog(elapsed, done, total=100, rate_per_worker=0.1):
    return WorkProgress(elapsed_s=elapsed, steps_done=done, total_steps=total,
                        steps_per_s={3: 3 * rate_per_worker})


def test_deadline_waits_on_spot_while_slack_covers_a_boot_then_adds_on_demand():
    # 100 steps at 0.1 step/s/worker: 333 s at 3 workers. Deadline 600 s, margin 60 s, boot 30 s.
    policy = CapacityPolicy(deadline_s=600, on_demand_boot_s=30, max_wait_s=900, prices=PRICES)
    # spot gone at t=100 with 40 steps done: 60 steps need 200 s at 3 on-demand workers;
    # the latest safe start is 600 - 60 - 30 - 200 = 310 s
    s = policy.decide(snap(100, {}, {}, {"spot": 3}, progress=prog(100, 40)))
    assert isinstance(s.decision, Noop), s.decision
    s = policy.decide(snap(300, {}, {}, {"spot": 3}, progress=prog(300, 40)), s.state)
    assert isinstance(s.decision, Noop)
    s = policy.decide(snap(311, {}, {}, {"spot": 3}, progress=prog(311, 40)), s.state)
    d = s.decision
    assert isinstance(d, RequestCapacity) and d.counts == {"spot": 3, "on_demand": 3}
    n = d.numbers
    assert n["deadline_s"] == 600 and n["remaining_steps"] == 60
    assert n["projected_finish_full_s"] == pytest.approx(311 + 200)
    assert n["projected_finish_s"] is None  # no worker can train now
    assert "deadline_s=600" in d.reason


def test_deadline_adds_only_what_is_needed_and_releases_when_spot_returns():
    policy = CapacityPolicy(deadline_s=600, on_demand_boot_s=30, max_wait_s=900, prices=PRICES,
                            fallback_after_s=0)
    # 2 spot workers train; 100 steps left at t=300: 2 workers need 500 s (too slow), 3 need 333 s
    s = policy.decide(snap(300, {"spot": 2}, {"spot": 2}, {"spot": 3}, progress=prog(300, 0, 100, 0.4)))
    # 0.4 step/s/worker: 2 workers 125 s, fine; nothing to add
    assert isinstance(s.decision, Noop)
    s = policy.decide(snap(300, {"spot": 2}, {"spot": 2}, {"spot": 3}, progress=prog(300, 0, 100, 0.2)))
    # 0.2: 2 workers 250 s > 600-300-60-30 = 210; 3 workers 167 s fits: one on-demand (spot
    # trains, so the planner does not wait for the latest safe switch)
    assert isinstance(s.decision, RequestCapacity) and s.decision.counts == {"spot": 3, "on_demand": 1}
    # spot is back: re-form without the on-demand worker at a boundary, then release it
    back = dict(ready={"spot": 3, "on_demand": 1}, in_group={"spot": 2, "on_demand": 1},
                requested={"spot": 3, "on_demand": 1})
    s = policy.decide(snap(330, boundary=True, progress=prog(330, 20, 100, 0.2), **back), s.state)
    assert isinstance(s.decision, MigrateToSpot) and s.decision.target == {"spot": 3, "on_demand": 0}


def test_deadline_shrinks_on_demand_when_slack_is_regained():
    policy = CapacityPolicy(deadline_s=600, on_demand_boot_s=30, max_wait_s=900, prices=PRICES)
    # one spot + one on-demand in the group; the run pulled ahead: 1 spot alone can't train
    # (min 2), so the on-demand worker stays ...
    cur = dict(ready={"spot": 1, "on_demand": 1}, in_group={"spot": 1, "on_demand": 1},
               requested={"spot": 3, "on_demand": 1})
    s = policy.decide(snap(400, boundary=True, progress=prog(400, 95), **cur))
    assert not isinstance(s.decision, MigrateToSpot)
    # ... but with 2 spot ready and plenty of time, the on-demand worker goes
    cur = dict(ready={"spot": 2, "on_demand": 1}, in_group={"spot": 2, "on_demand": 1},
               requested={"spot": 3, "on_demand": 1})
    s = policy.decide(snap(400, boundary=True, progress=prog(400, 95), **cur))
    assert isinstance(s.decision, MigrateToSpot) and s.decision.target == {"spot": 2, "on_demand": 0}


def test_deadline_unreachable_ends_the_run_early_with_the_numbers():
    policy = CapacityPolicy(deadline_s=300, on_demand_boot_s=30, max_wait_s=900, prices=PRICES)
    far = prog(200, 0)  # 100 steps need 333 s at 3 workers; 100 s left
    s = policy.decide(snap(200, {"spot": 3}, {"spot": 3}, {"spot": 3}, progress=far))
    assert not isinstance(s.decision, DeadlineUnreachable)  # debounced: 5% of the deadline (15 s)
    s = policy.decide(snap(216, {"spot": 3}, {"spot": 3}, {"spot": 3}, progress=prog(216, 0)), s.state)
    assert isinstance(s.decision, DeadlineUnreachable)
    err = s.decision.error()
    assert isinstance(err, InsufficientCapacityError) and isinstance(err, DeadlineUnreachableError)
    assert "deadline_s=300" in str(err) and "remaining_steps" in str(err)
    assert err.numbers["best_finish_s"] == pytest.approx(216 + 333.33, abs=0.01)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_deadline_needs_total_steps_and_waits_for_a_measured_rate():
    policy = CapacityPolicy(deadline_s=600, max_wait_s=900, prices=PRICES)
    with pytest.raises(ValueError, match="RunConfig.total_steps"):
        policy.decide(snap(0, {"spot": 3}, progress=WorkProgress(elapsed_s=0, steps_done=0)))
    assert deadline_need(spot=0, on_demand_now=0, min_workers=2, max_workers=3, max_on_demand=3,
                         deadline_s=600, margin_s=60, boot_s=30,
                         progress=WorkProgress(elapsed_s=0, total_steps=10)) is None


def test_work_progress_rate_scales_from_the_nearest_measurement():
    p = WorkProgress(elapsed_s=0, steps_per_s={2: 1.0, 4: 1.6})
    assert p.rate(2) == 1.0 and p.rate(4) == 1.6
    assert p.rate(3) == pytest.approx(1.2)  # tie: from the larger size, 0.4/worker
    assert p.rate(8) == pytest.approx(3.2) and p.rate(0) == 0.0
    assert WorkProgress(elapsed_s=0).rate(3) is None
    with pytest.raises(ValueError, match="steps_per_s"):
        WorkProgress(elapsed_s=0, steps_per_s={2: float("nan")})


def test_to_record_carries_the_objective():
    rec = CapacityPolicy(deadline_s=600, max_wait_s=900).to_record()
    assert rec["objective"] == "cost" and rec["deadline_s"] == 600 and rec["spot_wait_s"] == 450
    assert isinstance(CapacityState(), CapacityState)


def test_deadline_a_little_late_keeps_going_with_every_worker():
    # 100 steps at 0.3 step/s (3 workers): 333 s; 320 s left: late by 13 s < the 30 s margin
    need = deadline_need(spot=1, on_demand_now=0, min_workers=2, max_workers=3, max_on_demand=3,
                         deadline_s=300, margin_s=30, boot_s=10, progress=prog(-20, 0))
    assert need.workers == 2 and not need.unreachable and "at risk" in need.reason


def test_deadline_keeps_what_it_has_without_counting_a_boot():
    # 2 spot workers at 0.25 step/s/worker, 100 steps: 200 s. 600 - 340 - 60 = 200 s left
    # before the margin: on track as is, although a new node's boot would not fit.
    policy = CapacityPolicy(deadline_s=600, on_demand_boot_s=30, max_wait_s=900, prices=PRICES)
    s = policy.decide(snap(340, {"spot": 2}, {"spot": 2}, {"spot": 3}, progress=prog(340, 0, 100, 0.25)))
    assert isinstance(s.decision, Noop), s.decision
    # with one on-demand worker in the group, dropping it must leave room for a boot should that prove wrong
    need = deadline_need(spot=2, on_demand_now=1, min_workers=2, max_workers=3, max_on_demand=3,
                         deadline_s=600, margin_s=60, boot_s=30, progress=prog(330, 0, 100, 0.25))
    assert need.workers == 1  # 2 workers: 200 s > 600 - 330 - 60 - 30 = 180 s
    need = deadline_need(spot=2, on_demand_now=1, min_workers=2, max_workers=3, max_on_demand=3,
                         deadline_s=600, margin_s=60, boot_s=30, progress=prog(300, 0, 100, 0.25))
    assert need.workers == 0 and "releasing" in need.reason


def test_deadline_projection_counts_the_interruptions_seen_so_far():
    p = WorkProgress(elapsed_s=300, steps_done=0, total_steps=100, steps_per_s={2: 0.5}, efficiency=0.8)
    need = deadline_need(spot=2, on_demand_now=0, min_workers=2, max_workers=3, max_on_demand=3,
                         deadline_s=600, margin_s=60, boot_s=10, progress=p)
    # 100 steps at 0.5 step/s = 200 s, / 0.8 = 250 s > 240 s: one on-demand worker
    assert need.workers == 1 and need.numbers["efficiency"] == 0.8
    with pytest.raises(ValueError, match="efficiency"):
        WorkProgress(elapsed_s=0, efficiency=0)
