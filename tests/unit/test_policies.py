"""Sizing and failure rules, as pure functions of snapshots (no Ray)."""

from raylastic.policies.base import Noop, Raise, Resize, Retry, Wait
from raylastic.policies.failure import FailureCounts, FailureKind, FailurePolicy
from raylastic.policies.scaling import ElasticScalingPolicy, ScalingSnapshot


def snap(**kw):
    base = dict(now=100.0, group_size=0, ready_spares=0, last_ready_at=None, waiting_since=90.0)
    base.update(kw)
    return ScalingSnapshot(**base)


P = ElasticScalingPolicy(min_workers=2, max_workers=4, max_wait_s=60, settle_s=1.0)


def test_waits_below_min_and_logs_periodically():
    d = P.decide(snap(ready_spares=1))
    assert isinstance(d, Wait) and d.log
    d = P.decide(snap(ready_spares=1, last_wait_log_at=95.0))
    assert isinstance(d, Wait) and not d.log
    d = P.decide(snap(ready_spares=1, last_wait_log_at=60.0))
    assert d.log


def test_gives_up_after_max_wait():
    d = P.decide(snap(ready_spares=1, waiting_since=30.0))
    assert isinstance(d, Raise)
    assert "max_wait_s=60" in d.reason
    forever = ElasticScalingPolicy(min_workers=2, max_workers=4, max_wait_s=None)
    assert isinstance(forever.decide(snap(ready_spares=1, waiting_since=-1e9)), Wait)


def test_forms_at_min_when_nothing_else_is_coming():
    d = P.decide(snap(ready_spares=2, last_ready_at=50.0))
    assert d == Resize(2, d.reason)
    assert "min_workers=2" in d.reason


def test_formation_settles_for_workers_coming_up_together():
    assert isinstance(P.decide(snap(ready_spares=2, last_ready_at=99.5)), Noop)
    # At max there is nothing to wait for.
    assert isinstance(P.decide(snap(ready_spares=4, last_ready_at=99.9)), Resize)


def test_formation_waits_for_placed_workers_that_are_starting_but_not_forever():
    # 2 ready 5 s ago, 2 more placed and importing torch: wait for them rather than form
    # at 2 and resize moments later.
    d = P.decide(snap(ready_spares=2, last_ready_at=95.0, starting=2))
    assert isinstance(d, Noop) and "2 worker(s) placed and starting" in d.reason
    # Once one of them is ready, still wait for the other.
    assert isinstance(P.decide(snap(ready_spares=3, last_ready_at=98.0, starting=1)), Noop)
    # No worker ready for starting_wait_s (30 s): a stuck start does not hold the run back.
    assert P.decide(snap(ready_spares=3, last_ready_at=69.0, starting=1)) == Resize(3, P.decide(
        snap(ready_spares=3, last_ready_at=69.0, starting=1)).reason)
    # Pending actors that hold no node (no capacity) are not "starting": form at once.
    assert isinstance(P.decide(snap(ready_spares=2, last_ready_at=95.0, starting=0)), Resize)
    # Neither is there anything to wait for at max, nor below min (that is a Wait).
    assert isinstance(P.decide(snap(ready_spares=4, last_ready_at=99.9, starting=1)), Resize)
    assert isinstance(P.decide(snap(ready_spares=1, last_ready_at=99.9, starting=3)), Wait)


def test_formation_caps_at_max():
    assert P.decide(snap(ready_spares=6, last_ready_at=10.0)).world_size == 4


def test_grows_when_spares_appear_after_settling():
    assert isinstance(P.decide(snap(group_size=2, ready_spares=1, last_ready_at=99.8)), Noop)
    d = P.decide(snap(group_size=2, ready_spares=1, last_ready_at=98.0))
    assert isinstance(d, Resize) and d.world_size == 3
    assert "scale up 2 -> 3" in d.reason
    d = P.decide(snap(group_size=2, ready_spares=5, last_ready_at=98.0))
    assert d.world_size == 4


def test_no_growth_at_max_or_without_spares():
    assert isinstance(P.decide(snap(group_size=4, ready_spares=2, last_ready_at=0.0)), Noop)
    assert isinstance(P.decide(snap(group_size=3, ready_spares=0)), Noop)


def test_node_losses_have_their_own_unlimited_budget():
    p = FailurePolicy(max_failures=0)
    assert isinstance(p.decide(FailureKind.NODE_LOST, FailureCounts(node_losses=1000)), Retry)
    assert isinstance(p.decide(FailureKind.ERROR, FailureCounts()), Raise)


def test_failure_budgets_count():
    p = FailurePolicy(max_failures=2, max_node_failures=1)
    assert isinstance(p.decide(FailureKind.ERROR, FailureCounts(errors=1)), Retry)
    d = p.decide(FailureKind.ERROR, FailureCounts(errors=2))
    assert isinstance(d, Raise) and "max_failures=2" in d.reason
    assert isinstance(p.decide(FailureKind.NODE_LOST, FailureCounts(node_losses=0)), Retry)
    assert isinstance(p.decide(FailureKind.NODE_LOST, FailureCounts(node_losses=1)), Raise)
    unlimited = FailurePolicy(max_failures=-1)
    assert isinstance(unlimited.decide(FailureKind.ERROR, FailureCounts(errors=10**6)), Retry)


def test_unlimited_failures_back_off_instead_of_spinning():
    """max_failures=-1 used to retry a bug that fails at once with no pause, forever."""
    unlimited = FailurePolicy(max_failures=-1)
    delays = [unlimited.decide(FailureKind.ERROR, FailureCounts(errors=n)).delay_s for n in range(12)]
    assert delays[:3] == [0.0, 0.0, 0.0]  # a flaky step recovers at once
    assert delays[3:9] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert delays[9:] == [60.0, 60.0, 60.0]  # at most a minute
    assert unlimited.decide(FailureKind.ERROR, FailureCounts(errors=10**6)).delay_s == 60.0
    assert "retrying in 60 s" in unlimited.decide(FailureKind.ERROR, FailureCounts(errors=50)).reason
    # node losses are not the code's fault: never delayed
    assert unlimited.decide(FailureKind.NODE_LOST, FailureCounts(node_losses=50)).delay_s == 0.0


def test_from_configs_runs_one_wait_clock():
    """With a CapacityPolicy its max_wait_s alone bounds the wait; a second bound in
    ScalingConfig is refused instead of racing it."""
    import pytest

    from raylastic import ConfigError, ScalingConfig
    from raylastic.policies import from_configs
    from raylastic.policies.capacity import CapacityPolicy

    plain, cap = from_configs(ScalingConfig(min_workers=2, max_workers=3, max_wait_s=45))
    assert cap is None and plain.max_wait_s == 45
    policy = CapacityPolicy(max_wait_s=600)
    scaling, cap = from_configs(ScalingConfig(min_workers=2, max_workers=3, capacity=policy))
    assert cap is policy and scaling.max_wait_s is None  # never gives up on its own clock
    with pytest.raises(ConfigError, match="ScalingConfig.max_wait_s=45 and a CapacityPolicy"):
        ScalingConfig(min_workers=2, max_workers=3, max_wait_s=45, capacity=policy)
