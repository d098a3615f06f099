"""Capacity policy: pure unit tests (no Ray cluster, no clock)."""

from __future__ import annotations

import json
import pickle

import pytest

from raylastic.policies.base import Noop, Raise
from raylastic.policies.capacity import (
    CapacityPhase,
    CapacityPolicy,
    CapacitySnapshot,
    CapacityState,
    CapacityTimeoutError,
    GiveUp,
    MigrateToSpot,
    ReleaseOnDemand,
    RequestCapacity,
)
from raylastic.policies.node_types import (
    Market,
    MissingPriceError,
    NodeType,
    PriceTable,
    UnknownNodeTypeError,
)

PRICES = PriceTable.from_mapping({"spot": 0.9, "on_demand": 3.0})


def snap(now, ready=None, in_group=None, requested=None, boundary=False, lo=1, hi=4):
    return CapacitySnapshot(now_s=now, min_workers=lo, max_workers=hi, ready=ready or {},
                            in_group=in_group or {}, requested=requested or {},
                            at_checkpoint_boundary=boundary)


class FakeCluster:
    """A tiny stand-in for cloud + autoscaler + controller, stepped every 0.5 s.

    Nodes boot instantly up to min(requested, capacity); the group keeps its workers while
    their nodes exist, grows onto spare ready slots (spot first), and changes composition
    otherwise only through MigrateToSpot. A checkpoint is committed every ``ckpt_every_s``.
    """

    def __init__(self, policy, capacity, lo=1, hi=4, ckpt_every_s=5.0):
        self.policy, self.capacity, self.lo, self.hi = policy, capacity, lo, hi
        self.ckpt_every_s = ckpt_every_s
        self.requested = {}
        self.ready = {"spot": 0, "on_demand": 0}
        self.group = {"spot": 0, "on_demand": 0}
        self.state = CapacityState()
        self.log = []  # (t, decision, phase)

    def tick(self, t):
        for name in self.ready:
            self.ready[name] = min(self.requested.get(name, 0), self.capacity(name, t))
            self.group[name] = min(self.group[name], self.ready[name])
        for name in ("spot", "on_demand"):  # elastic growth (the scaling policy's job)
            spare = self.ready[name] - self.group[name]
            self.group[name] += max(0, min(spare, self.hi - sum(self.group.values())))
        boundary = t > 0 and t % self.ckpt_every_s == 0
        step = self.policy.decide(snap(t, self.ready, self.group, self.requested, boundary,
                                       self.lo, self.hi), self.state)
        self.state, d = step.state, step.decision
        if isinstance(d, (RequestCapacity, ReleaseOnDemand)):
            self.policy.request_args(d.counts)  # what the controller passes to Ray
            self.requested = dict(d.counts)
        elif isinstance(d, MigrateToSpot):
            self.group = dict(d.target)
        self.log.append((t, d, step.phase))

    def run(self, until_s):
        t = 0.0
        while t <= until_s:
            self.tick(t)
            t += 0.5
        return [(t, d) for t, d, _ in self.log if not isinstance(d, Noop)]


def drought(start, end):
    def capacity(name, t):
        if name == "spot" and start <= t < end:
            return 1
        return 4
    return capacity


def test_drought_falls_back_after_configured_time_then_returns_to_spot():
    policy = CapacityPolicy(prefer="spot", objective="time", fallback_after_s=20, max_on_demand_workers=2,
                            max_wait_s=300, prices=PRICES)
    cluster = FakeCluster(policy, drought(start=30, end=90))
    acts = cluster.run(until_s=120)

    kinds = [(t, type(d).__name__) for t, d in acts]
    assert kinds == [
        (0.0, "RequestCapacity"),     # 4 spot
        (50.0, "RequestCapacity"),    # spot short since 30 s + fallback_after_s=20
        (90.0, "MigrateToSpot"),      # spot back at 90, a checkpoint boundary
        (90.5, "ReleaseOnDemand"),    # on-demand no longer in the group
    ]
    assert acts[0][1].counts == {"spot": 4, "on_demand": 0}
    fallback = acts[1][1]
    assert fallback.counts == {"spot": 4, "on_demand": 2}  # 3 short, capped at 2
    assert "fallback_after_s=20" in fallback.reason and "max_on_demand_workers=2" in fallback.reason
    migrate = acts[2][1]
    assert migrate.workers == 2 and migrate.target == {"spot": 4, "on_demand": 0}
    release = acts[3][1]
    assert release.workers == 2 and release.counts == {"spot": 4, "on_demand": 0}
    assert cluster.group == {"spot": 4, "on_demand": 0}
    assert cluster.log[-1][2] is CapacityPhase.SPOT
    phases = {t: p for t, _, p in cluster.log}
    assert phases[10.0] is CapacityPhase.SPOT
    assert phases[40.0] is CapacityPhase.SPOT_SHORT
    assert phases[60.0] is CapacityPhase.FALLBACK
    for d in (a[1] for a in acts):
        json.dumps(d.to_event())  # event-log ready


def test_no_fallback_before_fallback_after_s():
    policy = CapacityPolicy(objective="time", fallback_after_s=20, max_wait_s=300)
    state = CapacityState()
    for t in (0.0, 5.0, 19.5):
        step = policy.decide(snap(t, ready={"spot": 2}, in_group={"spot": 2},
                                  requested={"spot": 4}), state)
        state = step.state
        assert isinstance(step.decision, Noop) and step.phase is CapacityPhase.SPOT_SHORT
        assert "fallback_after_s=20" in step.decision.reason
    step = policy.decide(snap(20.0, ready={"spot": 2}, in_group={"spot": 2},
                              requested={"spot": 4}), state)
    assert step.decision == RequestCapacity(counts={"spot": 4, "on_demand": 2},
                                            reason=step.decision.reason)


def test_short_blip_resets_the_fallback_timer():
    policy = CapacityPolicy(objective="time", fallback_after_s=20, max_wait_s=300)
    short = dict(ready={"spot": 3}, in_group={"spot": 3}, requested={"spot": 4})
    full = dict(ready={"spot": 4}, in_group={"spot": 4}, requested={"spot": 4})
    state = policy.decide(snap(0, **short), CapacityState()).state
    state = policy.decide(snap(15, **full), state).state
    assert state.spot_short_since_s is None
    state = policy.decide(snap(16, **short), state).state
    step = policy.decide(snap(30, **short), state)  # 14 s short this time, not 30
    assert isinstance(step.decision, Noop)


def test_fallback_with_zero_delay_and_fallback_fill():
    policy = CapacityPolicy(objective="time", fallback_after_s=0, max_wait_s=60)
    step = policy.decide(snap(0, ready={"spot": 1}, in_group={"spot": 1},
                              requested={"spot": 4}))
    assert step.decision.counts == {"spot": 4, "on_demand": 3}  # no cap: the shortfall


def test_preemption_during_fallback_raises_on_demand_up_to_cap():
    policy = CapacityPolicy(objective="time", fallback_after_s=0, max_on_demand_workers=3, max_wait_s=60)
    req = {"spot": 4, "on_demand": 1}
    step = policy.decide(snap(0, ready={"spot": 0, "on_demand": 1},
                              in_group={"on_demand": 1}, requested=req))
    assert isinstance(step.decision, RequestCapacity)
    assert step.decision.counts == {"spot": 4, "on_demand": 3}


def test_max_on_demand_zero_never_requests_on_demand():
    policy = CapacityPolicy(objective="time", fallback_after_s=0, max_on_demand_workers=0, max_wait_s=60)
    state = CapacityState()
    for t in range(0, 30, 5):
        step = policy.decide(snap(t, ready={"spot": 1}, in_group={"spot": 1},
                                  requested={"spot": 4, "on_demand": 0}), state)
        state = step.state
        assert isinstance(step.decision, Noop)
    assert policy.used_node_types() == (policy.spot,)


def test_spot_returns_waits_for_checkpoint_boundary():
    policy = CapacityPolicy(objective="time", fallback_after_s=10, max_wait_s=60)
    common = dict(ready={"spot": 4, "on_demand": 2}, in_group={"spot": 2, "on_demand": 2},
                  requested={"spot": 4, "on_demand": 2})
    step = policy.decide(snap(100, **common))
    assert isinstance(step.decision, Noop) and step.phase is CapacityPhase.RETURNING
    assert "checkpoint boundary" in step.decision.reason
    step = policy.decide(snap(100.5, boundary=True, **common), step.state)
    assert step.decision == MigrateToSpot(workers=2, target={"spot": 4, "on_demand": 0},
                                          reason=step.decision.reason)
    assert "return_to_spot=True" in step.decision.reason


def test_partial_return_moves_what_spot_can_hold():
    policy = CapacityPolicy(objective="time", fallback_after_s=10, max_wait_s=60)
    state = CapacityState(spot_short_since_s=0.0)
    s = snap(50, ready={"spot": 3, "on_demand": 2}, in_group={"spot": 2, "on_demand": 2},
             requested={"spot": 4, "on_demand": 2}, boundary=True)
    step = policy.decide(s, state)
    assert step.decision.workers == 1
    assert step.decision.target == {"spot": 3, "on_demand": 1}
    s = snap(51, ready={"spot": 3, "on_demand": 2}, in_group={"spot": 3, "on_demand": 1},
             requested={"spot": 4, "on_demand": 2})
    step = policy.decide(s, step.state)
    assert isinstance(step.decision, ReleaseOnDemand)
    assert step.decision.workers == 1 and step.decision.counts == {"spot": 4, "on_demand": 1}


def test_return_to_spot_false_keeps_on_demand_and_stops_extra_spot():
    policy = CapacityPolicy(objective="time", fallback_after_s=10, return_to_spot=False, max_wait_s=60)
    s = snap(100, ready={"spot": 4, "on_demand": 2}, in_group={"spot": 2, "on_demand": 2},
             requested={"spot": 4, "on_demand": 2}, boundary=True)
    step = policy.decide(s)
    assert isinstance(step.decision, RequestCapacity)
    assert step.decision.counts == {"spot": 2, "on_demand": 2}
    assert step.phase is CapacityPhase.FALLBACK


def test_max_wait_exceeded_gives_up_with_a_typed_picklable_error():
    policy = CapacityPolicy(objective="time", fallback_after_s=10, max_on_demand_workers=1, max_wait_s=30)
    state = CapacityState()
    for t in (0.0, 10.0, 29.5):
        step = policy.decide(snap(t, ready={"spot": 0, "on_demand": 1},
                                  in_group={"on_demand": 1}, lo=2), state)
        assert not isinstance(step.decision, GiveUp)
        state = step.state
    d = policy.decide(snap(30.0, ready={"spot": 0, "on_demand": 1},
                           in_group={"on_demand": 1}, lo=2), state).decision
    # a decision like the other policies' (a Raise with a reason), not an exception
    assert isinstance(d, GiveUp) and isinstance(d, Raise)
    assert "max_wait_s=30" in d.reason and d.waited_s == 30.0
    err = d.error()
    assert "max_wait_s=30" in str(err) and "min_workers=2" in str(err)
    assert err.waited_s == 30.0 and err.available == 1
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CapacityTimeoutError and str(again) == str(err)
    assert again.max_wait_s == 30


def test_wait_timer_resets_when_min_workers_are_back():
    policy = CapacityPolicy(objective="time", fallback_after_s=10, max_wait_s=30)
    state = policy.decide(snap(0, ready={}, lo=2)).state
    state = policy.decide(snap(20, ready={"spot": 2}, lo=2), state).state
    assert state.below_min_since_s is None
    state = policy.decide(snap(25, ready={"spot": 1}, lo=2), state).state
    policy.decide(snap(50, ready={"spot": 1}, lo=2), state)  # 25 s below min: fine


def test_prefer_on_demand_requests_on_demand_only():
    policy = CapacityPolicy(prefer="on_demand", max_on_demand_workers=3, max_wait_s=60)
    step = policy.decide(snap(0))
    assert step.decision.counts == {"spot": 0, "on_demand": 3}
    assert step.phase is CapacityPhase.ON_DEMAND_ONLY
    assert policy.used_node_types() == (policy.on_demand,)


def test_request_args_are_valid_for_ray_request_resources():
    from ray._private.label_utils import validate_label_selector

    types = (NodeType(name="spot-gpu", market="spot", worker_resources={"GPU": 1}),
             NodeType(name="od-gpu", market="on_demand", worker_resources={"GPU": 1}))
    policy = CapacityPolicy(node_types=types, max_wait_s=600)
    args = policy.request_args({"spot-gpu": 2, "od-gpu": 1})
    assert args["bundles"] == [{"node_type:spot-gpu": 1, "GPU": 1}] * 2 + [
        {"node_type:od-gpu": 1, "GPU": 1}]
    assert args["bundle_label_selectors"][0] == {"raylastic.io/market": "spot",
                                                 "raylastic.io/node-type": "spot-gpu"}
    assert args["bundle_label_selectors"][2]["raylastic.io/market"] == "on_demand"
    for sel in args["bundle_label_selectors"]:
        assert validate_label_selector(sel) is None
    assert policy.request_args({}) == {"bundles": [], "bundle_label_selectors": []}


def test_policy_and_decisions_pickle_and_record():
    policy = CapacityPolicy(prefer="spot", objective="time", fallback_after_s=120, max_on_demand_workers=2,
                            return_to_spot=True, max_wait_s=900, prices=PRICES)
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert hash(policy) == hash(pickle.loads(pickle.dumps(policy)))  # usable in frozen configs
    rec = policy.to_record()
    json.dumps(rec)
    assert rec["prices"]["usd_per_hour"] == {"spot": 0.9, "on_demand": 3.0}
    assert rec["node_types"]["spot"]["resource"] == "node_type:spot"
    d = RequestCapacity(counts={"spot": 4}, reason="r")
    assert pickle.loads(pickle.dumps(d)) == d


# -- bad input: clear errors before any resources are taken ---------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(fallback_after_s=-1), r"fallback_after_s \(-1\) must be >= 0"),
    (dict(max_wait_s=0), r"max_wait_s \(0\) must be > 0"),
    (dict(objective="time", fallback_after_s=120, max_wait_s=60), r"max_wait_s \(60\) <= fallback_after_s"),
    (dict(spot_wait_s=700, max_wait_s=600), r"max_wait_s \(600\) <= spot_wait_s"),
    (dict(objective="cheap"), r"objective=.cheap.: use .cost."),
    (dict(deadline_s=-5), r"deadline_s=-5 must be"),
    (dict(deadline_s=100, deadline_margin=1.5), r"deadline_margin=1.5"),
    (dict(on_demand_boot_s=float("nan")), r"on_demand_boot_s=nan"),
    (dict(max_on_demand_workers=-2), r"max_on_demand_workers \(-2\)"),
    (dict(prefer="cheap"), r"prefer='cheap' is not a market"),
    (dict(prefer="on_demand", max_on_demand_workers=0), r"max_on_demand_workers=0"),
    (dict(node_types=(NodeType(name="a", market="spot"),)),
     r"exactly one on_demand node type"),
    (dict(node_types=(NodeType(name="a", market="spot"), NodeType(name="b", market="spot"),
                      NodeType(name="c", market="on_demand"))),
     r"exactly one spot node type, got \['a', 'b'\]"),
])
def test_bad_config_names_the_parameter(kwargs, match):
    kwargs.setdefault("max_wait_s", 600)
    with pytest.raises(ValueError, match=match):
        CapacityPolicy(**kwargs)


def test_max_on_demand_above_max_workers_is_an_error():
    policy = CapacityPolicy(max_on_demand_workers=5, max_wait_s=600)
    with pytest.raises(ValueError, match=r"max_on_demand_workers \(5\) > max_workers \(4\)"):
        policy.validate_scaling(min_workers=1, max_workers=4)
    with pytest.raises(ValueError, match=r"max_on_demand_workers \(5\) > max_workers \(4\)"):
        policy.decide(snap(0, hi=4))


def test_missing_price_for_a_used_node_type_is_an_error():
    with pytest.raises(MissingPriceError, match=r"\['on_demand'\]"):
        CapacityPolicy(max_wait_s=600, prices=PriceTable.from_mapping({"spot": 1.0}))
    # Not used -> not needed.
    CapacityPolicy(max_wait_s=600, max_on_demand_workers=0,
                   prices=PriceTable.from_mapping({"spot": 1.0}))


def test_unknown_node_type_in_snapshot_is_an_error():
    policy = CapacityPolicy(max_wait_s=600)
    with pytest.raises(UnknownNodeTypeError, match=r"'gpu-spot'.*\['spot', 'on_demand'\]"):
        policy.decide(snap(0, ready={"gpu-spot": 1}))
    with pytest.raises(UnknownNodeTypeError):
        policy.request_args({"nope": 1})


def test_bad_snapshot_values():
    with pytest.raises(ValueError, match=r"min_workers \(5\) <= max_workers \(4\)"):
        snap(0, lo=5, hi=4)
    with pytest.raises(ValueError, match=r"ready\['spot'\]=-1"):
        snap(0, ready={"spot": -1})


def test_market_enum_accepts_strings():
    assert CapacityPolicy(prefer="spot", max_wait_s=600).prefer is Market.SPOT
