"""`raylastic report`'s bill by phase and the released-but-billed time up to `node_gone`:
synthetic event logs with known answers (no Ray)."""

from __future__ import annotations

import json
import os

import pytest

from raylastic.reporting import Prices, build_report
from raylastic.reporting.bill import BUCKETS, phases, split
from raylastic.reporting.cli import main

T0 = 1_700_000_000.0
SPOT, OD = 0.36, 3.6  # USD/h: 0.0001 and 0.001 USD per node-second
DEMO_RUN = os.path.join(os.path.dirname(__file__), "fixtures", "demo_spot_return")


def ev(t, kind, **fields):
    return {"ts": T0 + t, "kind": kind, "message": "", **fields}


def state(t, new, old):
    return ev(t, "state", state=new, previous=old)


def ready(t, node, ntype, wid=None):
    return ev(t, "worker_ready", wid=wid or node, node_id=node, node_type=ntype,
              market="spot" if ntype == "spot" else "on_demand")


def released(t, node, wid=None):
    return ev(t, "worker_released", wid=wid or node, node_id=node)


def gone(t, node, ntype, released_ts=None):
    return ev(t, "node_gone", node_id=node, node_type=ntype,
              released_ts=T0 + released_ts if released_ts is not None else None,
              billed_after_release_s=t - released_ts if released_ts is not None else None)


def prices():
    return ev(0, "price_table", usd_per_hour={"spot": SPOT, "on_demand": OD},
              markets={"spot": "spot", "on_demand": "on_demand"}, on_demand_type="on_demand",
              source="test")


def run(with_prices=True, with_gone=True):
    """Spot n1 and on-demand n2 ready at 1 and 2; group at 4, Running at 5, first step at 8;
    n1 lost at 21 (Resizing from 20), Scheduling from 22; spot n3 ready at 30, group and
    Running at 31, first step at 33; finished at 40, n2 and n3 released. n1's node_gone
    (after a loss) adds nothing; n3 is billed until 100 and n2 until 130."""
    e = [ev(0, "run_started", resume_from=None)] + ([prices()] if with_prices else [])
    e += [ready(1, "n1", "spot"), ready(2, "n2", "on_demand"),
          ev(4, "group_formed", epoch=1, world_size=2, nodes=["n1", "n2"], restore_index=0),
          state(5, "Running", "Scheduling"), ev(5, "training_started", epoch=1, world_size=2),
          ev(8, "first_step", epoch=1, index=1, world_size=2, report_ts=T0 + 8),
          state(20, "Resizing", "Running"),
          ev(21, "worker_lost", wid="n1", rank=0, node_id="n1", cause="node_lost", epoch=1),
          ev(22, "resize", epoch=1, graceful=False, reached_index=12, restore_index=10,
             lost_steps=2),
          state(22, "Scheduling", "Resizing"), ready(30, "n3", "spot"),
          ev(31, "group_formed", epoch=2, world_size=2, nodes=["n2", "n3"], restore_index=10),
          state(31, "Running", "Scheduling"),
          ev(33, "first_step", epoch=2, index=11, world_size=2, report_ts=T0 + 33),
          ev(40, "run_finished", epoch=2, index=17), state(40, "Finished", "Running"),
          released(40, "n2"), released(40, "n3")]
    if with_gone:
        e += [gone(50, "n1", "spot"), gone(100, "n3", "spot", 40), gone(130, "n2", "on_demand", 40)]
    return e


def secs(report, ntype=None):
    phases_ = report.bill.total if ntype is None else report.bill.by_node_type[ntype]
    return {b: pytest.approx(phases_[b].node_s) for b in BUCKETS}


def usd(report, ntype=None):
    phases_ = report.bill.total if ntype is None else report.bill.by_node_type[ntype]
    return {b: phases_[b].usd for b in BUCKETS}


def assert_adds_up(r):
    billed = sum(u.hours for u in r.node_hours.values()) * 3600
    assert sum(p.node_s for p in r.bill.total.values()) == pytest.approx(billed)
    for t, u in r.node_hours.items():
        assert sum(p.node_s for p in r.bill.by_node_type[t].values()) == pytest.approx(u.hours * 3600)
        if u.cost_usd is not None:
            assert sum(p.usd for p in r.bill.by_node_type[t].values()) == pytest.approx(u.cost_usd)
    if r.cost_usd is None:
        assert all(p.usd is None for p in r.bill.total.values())
    else:
        assert sum(p.usd for p in r.bill.total.values()) == pytest.approx(r.cost_usd)


# ----------------------------------------------------------------------------- buckets

def test_each_bucket_per_node_type():
    r = build_report(run(), [])
    # n1 1->21: waiting 1-5, recovering 5-8, training 8-20, recovering (Resizing) 20-21
    # n3 30->40: waiting 30-31, recovering 31-33, training 33-40; released 40->100
    assert secs(r, "spot") == {"training": 12 + 7, "waiting": 4 + 1, "recovering": 4 + 2,
                               "released": 60}
    # n2 2->40: waiting 2-5 and 22-31, recovering 5-8, 20-22, 31-33, training 8-20, 33-40
    assert secs(r, "on_demand") == {"training": 19, "waiting": 12, "recovering": 7, "released": 90}
    assert secs(r) == {"training": 38, "waiting": 17, "recovering": 13, "released": 150}
    assert usd(r, "on_demand") == pytest.approx({"training": 0.019, "waiting": 0.012,
                                                 "recovering": 0.007, "released": 0.090})
    assert usd(r)["released"] == pytest.approx(60 * SPOT / 3600 + 90 * OD / 3600)
    assert_adds_up(r)


def test_node_gone_extends_a_released_node_until_it_leaves_the_cluster():
    r = build_report(run(), [])
    assert r.node_hours["spot"].hours == pytest.approx((20 + 10 + 60) / 3600)  # n1 lost: no tail
    assert r.node_hours["on_demand"].hours == pytest.approx((38 + 90) / 3600)
    assert r.cost_usd == pytest.approx(90 * SPOT / 3600 + 128 * OD / 3600)
    # the wait for the nodes to go is billed, but it is not the run's wall time
    assert r.wall_s == pytest.approx(40) and r.end_ts == pytest.approx(T0 + 40)
    assert r.series.cost[-1][0] == pytest.approx(130)
    assert r.series.cost[-1][2] == pytest.approx(r.cost_usd)  # the cost curve ends at the bill
    assert r.status == "finished"


def test_without_node_gone_the_released_bucket_is_empty_and_hours_are_the_held_time():
    r = build_report(run(with_gone=False), [])
    assert r.node_hours["spot"].hours == pytest.approx(30 / 3600)
    assert r.node_hours["on_demand"].hours == pytest.approx(38 / 3600)
    assert secs(r)["released"] == 0 and usd(r)["released"] == 0.0
    assert_adds_up(r)


def test_node_gone_after_a_loss_extends_nothing():
    e = run(with_gone=False) + [
        gone(21.5, "n1", "spot"),  # right after n1's worker_lost (node_lost)
        gone(200, "n1", "spot")]  # a duplicate, much later
    r = build_report(sorted(e, key=lambda x: x["ts"]), [])
    base = build_report(run(with_gone=False), [])
    assert r.node_hours == base.node_hours and r.cost_usd == pytest.approx(base.cost_usd)
    assert secs(r)["released"] == 0


def test_a_worker_moved_off_by_the_capacity_policy_releases_its_node_a_preempted_one_not():
    """worker_lost cause "released" (spot came back; the on-demand worker moved off) is
    the run giving the node back: billed until node_gone. A preempted node is not."""
    e = run(with_gone=False) + [
        ready(2, "n6", "on_demand"), ready(2, "n7", "spot"),
        ev(25, "worker_lost", wid="n6", rank=2, node_id="n6", cause="released", epoch=1),
        ev(26, "worker_lost", wid="n7", rank=3, node_id="n7", cause="preempted", epoch=1),
        gone(45, "n6", "on_demand", 25), gone(46, "n7", "spot", 26)]
    r = build_report(sorted(e, key=lambda x: x["ts"]), [])
    assert secs(r, "on_demand")["released"] == 20  # n6: 25 -> 45
    assert secs(r, "spot")["released"] == 0
    assert r.node_hours["on_demand"].hours == pytest.approx((38 + 23 + 20) / 3600)
    assert r.node_hours["spot"].hours == pytest.approx((20 + 10 + 24) / 3600)
    assert_adds_up(r)


def test_a_node_used_again_after_its_release_is_billed_twice_not_for_the_gap():
    """A spare on n5 released at 3 (capacity target lowered), a new worker there at 10,
    released at 40 with the others. The node_gone after the last release ends n5's bill
    at 70 (the first release's gap is not billed: the node was used again)."""
    e = run(with_gone=False) + [
        ready(2.5, "n5", "on_demand", wid="s5"),
        ev(3, "worker_released", wid="s5", node_id="n5", node_type="on_demand",
           reason="capacity target lowered"),
        ready(10, "n5", "on_demand", wid="w5"),
        released(40, "n5", wid="w5"), gone(70, "n5", "on_demand", 40)]
    r = build_report(sorted(e, key=lambda x: x["ts"]), [])
    assert r.node_hours["on_demand"].hours == pytest.approx((38 + 0.5 + 30 + 30) / 3600)
    assert r.node_hours["on_demand"].nodes == 2
    # n5 held 2.5-3 (waiting), then 10-40: training 10-20 and 33-40 like n2
    assert secs(r, "on_demand")["released"] == 30
    assert secs(r, "on_demand")["training"] == 19 + (20 - 10) + 7
    assert_adds_up(r)


# ----------------------------------------------------------------------------- prices

def test_missing_prices_leave_dollars_null_not_seconds():
    r = build_report(run(with_prices=False), [])
    assert r.cost_usd is None
    assert all(p.usd is None for ph in r.bill.by_node_type.values() for p in ph.values())
    assert all(p.usd is None for p in r.bill.total.values())
    assert secs(r)["released"] == 150
    assert_adds_up(r)


def test_one_unpriced_node_type_nulls_its_dollars_and_the_totals():
    r = build_report(run(with_prices=False), [], Prices({"spot": SPOT}, source="--prices"))
    assert r.cost_usd is None
    assert usd(r, "spot")["training"] == pytest.approx(19 * SPOT / 3600)
    assert set(usd(r, "on_demand").values()) == {None}
    assert set(usd(r).values()) == {None}
    r = build_report(run(with_prices=False), [], Prices({"spot": SPOT, "on_demand": OD}))
    assert usd(r) == pytest.approx(usd(build_report(run(), [])))
    assert_adds_up(r)


# ----------------------------------------------------------------------------- old logs

def test_a_log_without_state_events_infers_the_phases_and_says_so():
    e = [x for x in run() if x["kind"] != "state"]
    r = build_report(e, [])
    assert any("no state events" in n for n in r.notes)
    # group_formed -> Running (4), worker_lost while Running -> Resizing (21), resize ->
    # Scheduling (22), group_formed (31), run_finished -> Finished (40)
    assert secs(r, "on_demand") == {"training": 12 + 1 + 7, "waiting": 2 + 9, "recovering": 4 + 1 + 2,
                                    "released": 90}
    assert_adds_up(r)


def test_the_demo_fixture_gives_the_numbers_it_gave_before():
    """tests/unit/fixtures/demo_spot_return (no node_gone): node-hours, cost, wall time and
    goodput exactly as the report computed them before the bill existed."""
    from raylastic.reporting import load_run

    data = load_run(DEMO_RUN)
    r = build_report(data.events, data.metrics)
    hours = {t: (u.nodes, u.hours) for t, u in r.node_hours.items()}
    assert hours == {"on_demand": (2, pytest.approx(0.02287374026245541, rel=1e-12)),
                     "spot": (7, pytest.approx(0.049219597776730864, rel=1e-12))}
    assert r.cost_usd == pytest.approx(0.03763961959547467, rel=1e-12)
    assert r.wall_s == pytest.approx(121.63097286224365, rel=1e-12)
    assert r.goodput == pytest.approx(0.7105329053466249, rel=1e-12)
    assert secs(r)["released"] == 0 and not any("no state events" in n for n in r.notes)
    assert_adds_up(r)
    # The on-demand fallback's nodes wait in Scheduling until the group runs (74.80 and
    # 75.52 -> 76.57), and again while epoch 6 is scheduled (113.76 -> 113.90).
    assert r.bill.by_node_type["on_demand"]["waiting"].node_s == pytest.approx(
        (76.57 - 74.80) + (76.57 - 75.52) + (113.90 - 113.76), abs=0.02)


def test_a_resumed_controller_starts_waiting_again():
    e = run(with_gone=False)[:8] + [  # the controller died at 20, training (n1, n2 held)
        ev(20, "checkpoint_committed", index=10, epoch=1)]
    later = 100.0
    e += [ev(later, "run_started", resume_from=10), ready(later + 1, "n9", "spot"),
          ev(later + 2, "group_formed", epoch=1, world_size=1, nodes=["n9"], restore_index=10),
          state(later + 3, "Running", "Scheduling"),
          ev(later + 4, "first_step", epoch=1, index=11, report_ts=T0 + later + 4),
          ev(later + 10, "run_finished", epoch=1, index=15), state(later + 10, "Finished", "Running"),
          released(later + 10, "n9")]
    r = build_report(e, [])
    assert [p[1] for p in phases(e)] == ["recovering", "training", "waiting", "recovering",
                                         "training", "waiting"]
    assert secs(r, "spot") == {"training": 12 + 6, "waiting": 4 + 2, "recovering": 3 + 1,
                               "released": 0}
    assert_adds_up(r)


def test_split_covers_an_interval_exactly_once():
    pts = [(1.0, "recovering"), (2.0, "training"), (2.0, "waiting"), (5.0, "training")]
    got = split(0.0, 6.0, pts)  # waiting before the first point; the last of equal times wins
    assert got == {"waiting": pytest.approx(1 + 3), "recovering": pytest.approx(1),
                   "training": pytest.approx(1)}
    assert split(1.5, 2.5, pts) == {"recovering": pytest.approx(0.5), "training": 0.0,
                                    "waiting": pytest.approx(0.5)}
    assert split(3.0, 3.0, pts) == {} and split(7.0, 8.0, pts) == {"training": 1.0}


# ----------------------------------------------------------------------------- output

def test_json_and_text(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in run()))
    assert main([str(d), "--json"]) == 0
    bill = json.loads(capsys.readouterr().out)["bill"]
    assert list(bill) == ["by_node_type", "total"]
    assert list(bill["by_node_type"]) == ["on_demand", "spot"]
    assert list(bill["total"]) == list(BUCKETS)
    assert bill["by_node_type"]["spot"]["released"] == {"node_s": pytest.approx(60),
                                                        "usd": pytest.approx(0.006)}
    assert main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "Bill by phase" in out and "released-but-billed" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("total")
               and "released" not in line and " s " in line)
    assert "150.0 s" in row and "$0.0960" in row


def test_node_gone_ends_a_node_the_log_still_shows_held():
    """A spare worker on a drained node leaves no worker_lost; the node's node_gone ends its
    billed time (not the session's end)."""
    from raylastic.reporting import _nodes

    events = [
        {"ts": 0.0, "kind": "run_started"},
        {"ts": 1.0, "kind": "worker_ready", "wid": 1, "node_id": "a", "node_type": "spot", "market": "spot"},
        {"ts": 2.0, "kind": "worker_ready", "wid": 2, "node_id": "b", "node_type": "spot", "market": "spot"},
        {"ts": 10.0, "kind": "node_gone", "node_id": "b", "node_type": "spot"},
        {"ts": 30.0, "kind": "run_finished"},
    ]
    nodes = _nodes.node_intervals(events, [(0.0, 30.0)])
    assert sorted(nodes.intervals) == [("spot", 1.0, 30.0), ("spot", 2.0, 10.0)]
