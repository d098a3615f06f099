"""The capacity driver's own bookkeeping, without Ray: the training rate it hands the
policy, and the ``node_gone`` record that ends a released node's billed time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pytest

from raylastic._internal.cluster import capacity_driver as cd
from raylastic.events import EventKind
from raylastic.policies.capacity import CapacityPolicy


@dataclass
class Handle:
    node_id: str
    node_type: str
    ready: bool = True


class Pool:
    def __init__(self) -> None:
        self.workers: Dict[int, Handle] = {}

    def set_targets(self, targets, protect):
        return []


class Events:
    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []

    def emit(self, kind: EventKind, message: str = "", **fields: Any) -> Dict[str, Any]:
        rec = {"kind": kind.value, "message": message, **fields}
        self.records.append(rec)
        return rec


class Clock:
    """Stands in for ``time`` inside the driver (monotonic and wall clock alike)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


@pytest.fixture
def driver(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cd, "time", clock)
    pool, events = Pool(), Events()
    d = cd.CapacityDriver(CapacityPolicy(max_wait_s=600), min_workers=2, max_workers=3, pool=pool,
                          events=events, total_steps=100, fit_ts=clock.t)
    return d, pool, events, clock


def test_rate_skips_the_warm_up_window_and_needs_two_windows(driver):
    d, _pool, _events, clock = driver
    index = 0
    # 3 workers: a slow first window (a restore), then 2 steps/s
    d._measure(clock.t, 3, index)
    clock.t += 2.0
    index += 1
    d._measure(clock.t, 3, index)  # warm-up window: not counted
    assert d._rates == {}
    for _ in range(2):
        clock.t += 2.0
        index += 4
        d._measure(clock.t, 3, index)
    assert d._rates == {3: pytest.approx(2.0)}
    # a resize starts over: the new size has no rate until its own windows are in
    d._measure(clock.t, 2, index)
    clock.t += 2.0
    d._measure(clock.t, 2, index + 3)
    assert 2 not in d._rates and d._rates[3] == pytest.approx(2.0)


def test_a_rollback_restarts_the_window(driver):
    d, _pool, _events, clock = driver
    d._measure(clock.t, 3, 50)
    clock.t += 3.0
    d._measure(clock.t, 3, 40)  # restored from an older checkpoint
    assert d._mark[2] == 40 and d._mark[3] is True


def test_node_gone_records_how_long_a_released_node_stayed_billed(driver, monkeypatch):
    d, pool, events, clock = driver
    alive = {"n1", "n2"}
    monkeypatch.setattr("ray.nodes", lambda: [{"NodeID": n, "Alive": n in alive} for n in ("n1", "n2")])
    pool.workers = {1: Handle("n1", "on_demand"), 2: Handle("n2", "spot")}
    d._watch_nodes(clock.t)
    released_at = clock.t = clock.t + 1.0
    del pool.workers[1]  # the policy released n1's worker; the node idles, still billed
    d._watch_nodes(clock.t)
    clock.t += 1.5
    d._watch_nodes(clock.t)
    assert not [e for e in events.records if e["kind"] == "node_gone"]
    alive.discard("n1")  # the autoscaler terminated it
    clock.t += 4.0
    d._watch_nodes(clock.t)
    gone = [e for e in events.records if e["kind"] == "node_gone"]
    assert gone == [{"kind": "node_gone", "message": "", "node_id": "n1", "node_type": "on_demand",
                     "released_ts": released_at, "billed_after_release_s": 5.5}]
    clock.t += 2.0
    d._watch_nodes(clock.t)  # recorded once
    assert len([e for e in events.records if e["kind"] == "node_gone"]) == 1


def test_node_gone_waits_out_a_cluster_view_error(driver, monkeypatch):
    d, pool, events, clock = driver

    def broken():
        raise ConnectionError("GCS unavailable")

    monkeypatch.setattr("ray.nodes", broken)
    pool.workers = {1: Handle("n1", "spot")}
    d._watch_nodes(clock.t)
    pool.workers = {}
    clock.t += 2.0
    d._watch_nodes(clock.t)
    assert not events.records
    monkeypatch.setattr("ray.nodes", lambda: [])
    clock.t += 2.0
    d._watch_nodes(clock.t)
    assert [e["node_id"] for e in events.records] == ["n1"]


def test_decisions_carry_their_numbers(driver, monkeypatch):
    d, pool, events, clock = driver
    monkeypatch.setattr(cd, "request_resources", lambda **kw: None)
    d.policy = CapacityPolicy(max_wait_s=600, deadline_s=300, on_demand_boot_s=10)
    d._rates = {3: 0.3}
    clock.t += 1.0
    out: Optional[Any] = d.tick([], {}, False, index=0, training=False)
    assert out is None
    req = [e for e in events.records if e.get("decision") == "capacity.request"]
    assert req and req[-1]["numbers"]["deadline_s"] == 300 and req[-1]["numbers"]["remaining_steps"] == 100


@dataclass(eq=False)
class Worker:
    wid: int
    snapshots: List[int]
    node_id: str = ""
    node_type: str = "on_demand"
    ready: bool = True


def test_a_spare_holding_only_superseded_snapshots_is_not_protected():
    from raylastic._internal.worker_group.pool import spares_holding_needed_state

    members = [Worker(1, [10, 12]), Worker(2, [12])]
    old, newer = Worker(3, [8, 10]), Worker(4, [14])
    ready = members + [old, newer]
    assert spares_holding_needed_state(ready, members, running=True) == [newer]
    # while the group is not running (forming, restoring), every holder is kept
    assert spares_holding_needed_state(ready, members, running=False) == [old, newer]
    # a member without snapshots yet: the group may still need the spare's
    assert spares_holding_needed_state([old, newer], [Worker(1, [])], running=True) == [old, newer]


def test_trim_releases_workers_above_the_request_once_unprotected(driver):
    d, pool, events, _clock = driver
    released = []

    def set_targets(targets, protect):
        out = [h for h in pool.workers.values() if h not in protect and h.node_type == "on_demand"
               and targets.get("on_demand", 0) == 0]
        released.extend(out)
        return out

    pool.set_targets = set_targets
    w = Worker(7, [3], node_id="n7")
    pool.workers = {7: w}
    d.requested = {"spot": 3, "on_demand": 0}
    d._trim([w])
    assert not events.records  # protected: holds state the group needs
    d._trim([])
    assert [e["kind"] for e in events.records] == ["worker_released"] and events.records[0]["node_id"] == "n7"


def test_efficiency_counts_time_lost_since_training_started(driver):
    d, _pool, _events, clock = driver
    for training in (False, False, True, True, True, False, True):  # start-up is not counted
        d._account(clock.t, training)
        clock.t += 1.0
    d._account(clock.t, False)
    assert d.efficiency == pytest.approx(4 / 5)
    for _ in range(20):  # a long wait: floored at 0.5
        clock.t += 1.0
        d._account(clock.t, False)
    assert d.efficiency == 0.5
