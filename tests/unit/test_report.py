"""`raylastic report`: synthetic event logs with known answers for every number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raylastic.reporting import JSON_KEYS, Prices, build_report
from raylastic.reporting.cli import main

SPOT, OD = 0.5, 3.0
FROZEN_KEYS = [
    "schema_version", "run_path", "status", "error", "start_ts", "end_ts", "wall_s",
    "productive_step_s", "goodput", "steps", "world_size_timeline", "recoveries", "resizes",
    "checkpoints", "node_hours", "prices", "cost_usd", "on_demand_type", "on_demand_cost_usd",
    "savings_usd", "savings_pct", "productive_worker_s", "notes", "bill",
]
T0 = 1_700_000_000.0


def ev(t, kind, **fields):
    return {"ts": T0 + t, "kind": kind, "message": "", **fields}


def met(t, index, epoch, ws, loss=None):
    return {"ts": T0 + t, "index": index, "epoch": epoch, "world_size": ws,
            "metrics": {"loss": loss if loss is not None else 1.0 / index}}


def ready(t, node, ntype, market, wid=None):
    return ev(t, "worker_ready", wid=wid or node, node_id=node, node_type=ntype, market=market)


def spot_run(price_event=True):
    """3 workers (2 spot, 1 on-demand); spot n2 preempted at t=45 (5 s detection... 1 s),
    restore from checkpoint 20 with 4 steps lost; a spot node comes back and the group grows
    gracefully to 3 at t=81; finished at index 50. One report per second."""
    e = [ev(0, "run_started", resume_from=None)]
    if price_event:
        e.append(ev(0, "price_table", usd_per_hour={"spot": SPOT, "on_demand": OD},
                    markets={"spot": "spot", "on_demand": "on_demand"},
                    on_demand_type="on_demand", source="test"))
    e += [ready(1, "n1", "spot", "spot"), ready(1, "n2", "spot", "spot"),
          ready(2, "n3", "on_demand", "on_demand"),
          ev(10, "group_formed", epoch=1, world_size=3, previous_world_size=0,
             nodes=["n1", "n2", "n3"], restore_index=0, restore_path=None),
          ev(10.5, "training_started", epoch=1, world_size=3),
          ev(21.2, "first_step", epoch=1, index=1, world_size=3, report_ts=T0 + 21),
          ev(31, "checkpoint_committed", index=10, epoch=1, bytes=1000, upload_s=0.5,
             stage_s=0.1, wait_s=0.0),
          ev(41, "checkpoint_committed", index=20, epoch=1, bytes=1000, upload_s=0.7,
             stage_s=0.1, wait_s=0.2),
          ev(45, "worker_lost", wid="n2", rank=1, node_id="n2", cause="node_lost", epoch=1,
             last_index=24),
          ev(46, "failure", epoch=1, failure_kind="node_lost", decision="Retry",
             reason="node loss 1 of unlimited", reached_index=24),
          ev(47, "resize", epoch=1, reason="node_lost", graceful=False, survivors=2,
             reached_index=24, restore_index=20, lost_steps=4, resize_s=1.0),
          ev(50, "group_formed", epoch=2, world_size=2, previous_world_size=3,
             nodes=["n1", "n3"], restore_index=20, restore_path="x"),
          ev(50.1, "checkpoint_restored", epoch=2, index=20, path="x"),
          ev(55.2, "first_step", epoch=2, index=21, world_size=2, report_ts=T0 + 55),
          ev(75, "checkpoint_committed", index=40, epoch=2, bytes=1000, upload_s=0.3,
             stage_s=0.3, wait_s=0.0),
          ready(80, "n4", "spot", "spot"),
          ev(81, "resize", epoch=2, reason="scale up 2 -> 3", graceful=True, survivors=2,
             reached_index=40, restore_index=40, lost_steps=0, resize_s=0.5),
          ev(82, "group_formed", epoch=3, world_size=3, previous_world_size=2,
             nodes=["n1", "n3", "n4"], restore_index=40, restore_path="y"),
          ev(85.1, "first_step", epoch=3, index=41, world_size=3, report_ts=T0 + 85),
          ev(95, "run_finished", epoch=3, index=50)]
    e += [ev(96, "worker_released", wid=n, node_id=n) for n in ("n1", "n3", "n4")]
    m = [met(20 + i, i, 1, 3) for i in range(1, 25)]  # 1..24 at t=21..44
    m += [met(55 + i - 21, i, 2, 2) for i in range(21, 41)]  # 21..40 at t=55..74
    m += [met(85 + i - 41, i, 3, 3) for i in range(41, 51)]  # 41..50 at t=85..94
    e.sort(key=lambda x: x["ts"])
    return e, m


def write_run(path, events, metrics, tail=""):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as fh:
        fh.write("".join(json.dumps(e) + "\n" for e in events) + tail)
    with open(os.path.join(path, "metrics.jsonl"), "w") as fh:
        fh.write("".join(json.dumps(m) + "\n" for m in metrics))
    return str(path)


def cli(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- numbers

def test_world_size_timeline():
    r = build_report(*spot_run())
    got = [(s.epoch, s.world_size, s.start_s, s.end_s, s.restore_index, s.ended_by)
           for s in r.world_size_timeline]
    assert got == [(1, 3, 10, 45, 0, "node_lost"), (2, 2, 50, 81, 20, "resize"),
                   (3, 3, 82, 95, 40, "finished")]
    assert r.status == "finished" and r.wall_s == pytest.approx(96)


def test_recoveries_and_graceful_resizes_are_separate():
    r = build_report(*spot_run())
    assert len(r.recoveries) == 1
    x = r.recoveries[0]
    assert (x.cause, x.nodes, x.steps_lost) == ("node_lost", ("n2",), 4)
    assert x.at_s == pytest.approx(45)
    assert x.detection_s == pytest.approx(1.0)  # failure.ts - worker_lost.ts
    assert x.recovery_s == pytest.approx(10.0)  # first_step.report_ts - worker_lost.ts
    assert (x.world_size_before, x.world_size_after, x.restore_index) == (3, 2, 20)
    graceful = [z for z in r.resizes if z.graceful]
    assert len(graceful) == 1 and len(r.resizes) == 2
    g = graceful[0]
    assert (g.from_world_size, g.to_world_size, g.lost_steps) == (2, 3, 0)
    assert g.pause_s == pytest.approx(85 - 74)  # next first report - report 40


def test_checkpoint_sync_and_async_times():
    c = build_report(*spot_run()).checkpoints
    assert (c["count"], c["restored"], c["bytes_total"], c["bytes_last"]) == (3, 1, 3000, 1000)
    # sync = stage_s + wait_s (the training loop was blocked); async = upload_s
    assert [i["sync_s"] for i in c["items"]] == pytest.approx([0.1, 0.3, 0.3])
    assert c["sync_s_total"] == pytest.approx(0.7) and c["sync_s_max"] == pytest.approx(0.3)
    assert c["async_s_mean"] == pytest.approx(0.5) and c["async_s_max"] == pytest.approx(0.7)


def test_error_failure_without_worker_lost_is_a_recovery_with_zero_detection():
    e = [ev(0, "run_started"), ev(1, "group_formed", epoch=1, world_size=2, restore_index=0),
         ev(5, "failure", epoch=1, failure_kind="error", reason="ValueError", reached_index=3),
         ev(6, "resize", epoch=1, graceful=False, reached_index=3, restore_index=0, lost_steps=3),
         ev(7, "group_formed", epoch=2, world_size=2, restore_index=0),
         ev(9, "first_step", epoch=2, index=1, report_ts=T0 + 8.5), ev(12, "run_finished", index=3)]
    m = [met(2 + i, i, 1, 2) for i in (1, 2, 3)] + [met(7.5 + i, i, 2, 2) for i in (1, 2, 3)]
    r = build_report(e, m)
    (x,) = r.recoveries
    assert (x.cause, x.detection_s, x.steps_lost) == ("error", 0.0, 3)
    assert x.recovery_s == pytest.approx(3.5)
    assert r.steps["kept"] == 3 and r.steps["retrained"] == 3


def test_node_hours_cost_and_on_demand_baseline():
    r = build_report(*spot_run())
    spot, od = r.node_hours["spot"], r.node_hours["on_demand"]
    # n1 1->96, n2 1->45 (lost), n4 80->96; n3 (on-demand) 2->96
    assert spot.hours == pytest.approx((95 + 44 + 16) / 3600)
    assert (spot.nodes, spot.market, od.nodes, od.market) == (3, "spot", 1, "on_demand")
    assert od.hours == pytest.approx(94 / 3600)
    cost = (155 * SPOT + 94 * OD) / 3600
    assert r.cost_usd == pytest.approx(cost)
    # productive worker-seconds: 20 steps x 3 + 20 x 2 + 10 x 3 (1 s each)
    assert r.productive_worker_s == pytest.approx(130)
    assert r.on_demand_type == "on_demand"
    assert r.on_demand_cost_usd == pytest.approx(130 * OD / 3600)
    assert r.savings_usd == pytest.approx(130 * OD / 3600 - cost)
    assert r.savings_pct == pytest.approx(100 * (1 - cost / (130 * OD / 3600)))


def test_a_spare_released_by_the_capacity_policy_ends_its_node_interval():
    """The demo's pattern: an on-demand spare becomes ready, the capacity policy releases
    it half a second later (worker_released), and much later a new worker lands on the
    same node. The node is held twice briefly, not for the whole gap, and one node of
    the type still hosts one worker at a time (the baseline's per-worker price)."""
    e, m = spot_run()
    # a second on-demand node: a spare ready at 3 s, released at 4 s; a worker again from 60 s
    extra = [ready(3, "n5", "on_demand", "on_demand", wid="s5"),
              ev(4, "worker_released", wid="s5", node_id="n5", node_type="on_demand",
                 reason="capacity target lowered"),
              ready(60, "n5", "on_demand", "on_demand", wid="w5"),
              ev(96, "worker_released", wid="w5", node_id="n5")]
    e = sorted(e + extra, key=lambda x: x["ts"])
    r = build_report(e, m)
    od = r.node_hours["on_demand"]
    # n3 2->96; n5 3->4 and 60->96 (not 3->96)
    assert od.hours == pytest.approx((94 + 1 + 36) / 3600)
    assert r.on_demand_cost_usd == pytest.approx(130 * OD / 3600)  # one worker per node


def test_goodput_counts_only_kept_step_time():
    r = build_report(*spot_run())
    assert r.steps == {"final_index": 50, "kept": 50, "reported": 54, "retrained": 4, "lost": 4}
    assert r.productive_step_s == pytest.approx(50)  # 4 re-trained seconds excluded
    assert r.goodput == pytest.approx(50 / 96)


def test_resumed_run_restarts_epoch_numbers_and_excludes_the_gap():
    e1, m1 = spot_run()
    e1 = [x for x in e1 if x["kind"] not in ("run_finished", "worker_released")
          and x["ts"] < T0 + 60]  # controller died at t=60 (after report 25)
    m1 = [x for x in m1 if x["ts"] < T0 + 60]
    later = 1000.0
    e2 = [ev(later, "run_started", resume_from=20), ready(later + 1, "n9", "spot", "spot"),
          ev(later + 2, "group_formed", epoch=1, world_size=1, restore_index=20),
          ev(later + 3.2, "first_step", epoch=1, index=21, report_ts=T0 + later + 3),
          ev(later + 10, "run_finished", epoch=1, index=27),
          ev(later + 10, "worker_released", wid="n9", node_id="n9")]
    m2 = [met(later + 3 + i - 21, i, 1, 1) for i in range(21, 28)]
    r = build_report(e1 + e2, m1 + m2)
    assert r.wall_s == pytest.approx(59 + 10)  # the idle gap is not wall time
    assert r.steps["final_index"] == 27
    assert r.steps["kept"] == 27  # 1..20 from session 1, 21..27 from session 2
    assert [s.epoch for s in r.world_size_timeline] == [1, 2, 1]
    assert r.world_size_timeline[1].ended_by == "controller stopped"


def test_incomplete_run_holds_nodes_until_its_last_event():
    e, m = spot_run()
    e = [x for x in e if x["ts"] <= T0 + 70]
    r = build_report(e, [x for x in m if x["ts"] <= T0 + 70])
    assert r.status == "incomplete"
    assert any("still running or crashed" in n for n in r.notes)
    assert r.node_hours["on_demand"].hours == pytest.approx((70 - 2) / 3600)


def test_run_without_node_types_uses_default_and_cli_prices():
    e, m = spot_run(price_event=False)
    for x in e:
        if x["kind"] == "worker_ready":
            x["node_type"] = x["market"] = None
    r = build_report(e, m)
    assert set(r.node_hours) == {"default"} and r.cost_usd is None
    assert any("no price table" in n for n in r.notes)
    r = build_report(e, m, Prices({"default": 2.0}, source="--prices"))
    assert r.cost_usd == pytest.approx((95 + 44 + 94 + 16) * 2.0 / 3600)
    assert r.on_demand_type == "default"  # the only type is the baseline
    assert r.on_demand_cost_usd == pytest.approx(130 * 2.0 / 3600)


def test_cli_prices_override_the_recorded_table():
    r = build_report(*spot_run(), Prices({"spot": 1.0}, source="--prices"))
    assert r.node_hours["spot"].usd_per_hour == 1.0
    assert r.node_hours["on_demand"].usd_per_hour == OD


# ----------------------------------------------------------------------------- CLI

def test_text_output(tmp_path, capsys):
    run = write_run(tmp_path / "run", *spot_run())
    rc, out, err = cli([run], capsys)
    assert rc == 0, err
    for needle in ("World size timeline", "Recoveries (failures / preemptions): 1",
                   "Graceful resizes: 1", "Checkpoints: 3 committed", "on-demand baseline",
                   "goodput 52.1 %", "node_lost", "savings"):
        assert needle in out, needle


def test_json_keys_are_stable(tmp_path, capsys):
    assert list(JSON_KEYS) == FROZEN_KEYS
    run = write_run(tmp_path / "run", *spot_run())
    rc, out, _ = cli([run, "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert list(data) == FROZEN_KEYS
    assert data["node_hours"]["spot"]["market"] == "spot"
    assert set(data["recoveries"][0]) >= {"at_s", "cause", "detection_s", "recovery_s",
                                          "steps_lost"}
    assert set(data["steps"]) == {"final_index", "kept", "reported", "retrained", "lost"}
    assert data["goodput"] == pytest.approx(50 / 96)


def test_truncated_last_line_is_a_warning_not_a_traceback(tmp_path, capsys):
    e, m = spot_run()
    run = write_run(tmp_path / "run", e[:-3], m, tail='{"ts": 1700000096.0, "kind": "work')
    rc, out, err = cli([run], capsys)
    assert rc == 0
    assert "warning" in err and "truncated last line" in err
    assert "Traceback" not in err + out
    assert "World size timeline" in out


def test_corrupt_line_inside_the_log_is_a_clear_error(tmp_path, capsys):
    run = write_run(tmp_path / "run", *spot_run())
    with open(os.path.join(run, "events.jsonl"), "a") as fh:
        fh.write("garbage\n" + json.dumps(ev(200, "state")) + "\n")
    rc, _, err = cli([run], capsys)
    assert rc == 2 and "is not valid JSON" in err and "Traceback" not in err


def test_not_a_run_exits_2_with_a_clear_message(tmp_path, capsys):
    rc, _, err = cli([tmp_path / "missing"], capsys)
    assert rc == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = cli([tmp_path / "empty"], capsys)
    assert rc == 2 and "is not a raylastic run directory" in err and "events.jsonl" in err
    write_run(tmp_path / "storage" / "myrun", *spot_run())
    rc, _, err = cli([tmp_path / "storage"], capsys)
    assert rc == 2 and "myrun" in err and "Try: raylastic report" in err
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "events.jsonl").write_text("")
    rc, _, err = cli([tmp_path / "blank"], capsys)
    assert rc == 2 and "holds no events" in err


def test_unknown_price_names_the_node_type(tmp_path, capsys):
    e, m = spot_run()
    for x in e:
        if x.get("node_id") == "n4" and x["kind"] == "worker_ready":
            x["node_type"] = "gpu-spot"
    run = write_run(tmp_path / "run", e, m)
    rc, out, err = cli([run, "--json"], capsys)
    assert rc == 0
    assert "gpu-spot" in err and "no hourly price" in err
    data = json.loads(out)
    assert data["cost_usd"] is None and data["savings_usd"] is None
    assert data["node_hours"]["gpu-spot"]["cost_usd"] is None
    assert data["on_demand_cost_usd"] == pytest.approx(130 * OD / 3600)  # still known
    rc, out, err = cli([run, "--prices", '{"gpu-spot": 1.5}'], capsys)
    assert rc == 0 and "gpu-spot" not in err and "unknown" not in out.split("cost")[-1][:30]


def test_bad_prices_argument_exits_2(tmp_path, capsys):
    run = write_run(tmp_path / "run", *spot_run())
    rc, _, err = cli([run, "--prices", "{not json"], capsys)
    assert rc == 2 and "--prices" in err and "not valid JSON" in err
    rc, _, err = cli([run, "--prices", '{"spot": -1}'], capsys)
    assert rc == 2 and "'spot'" in err
    rc, _, err = cli([run, "--prices", str(tmp_path / "nope.json")], capsys)
    assert rc == 2 and "not a readable file" in err
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"spot": 0.1, "on_demand": 1.0}))
    rc, out, err = cli([run, "--prices", prices, "--json"], capsys)
    assert rc == 0 and json.loads(out)["prices"]["usd_per_hour"]["spot"] == 0.1


def test_plots_writes_three_non_empty_pngs(tmp_path, capsys):
    run = write_run(tmp_path / "run", *spot_run())
    rc, _, err = cli([run, "--plots", tmp_path / "plots"], capsys)
    assert rc == 0, err
    for name in ("world_size.png", "loss.png", "cost.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_plots_without_prices_or_loss_still_write(tmp_path, capsys):
    e, m = spot_run(price_event=False)
    for x in m:
        x["metrics"] = {"acc": 0.5}
    run = write_run(tmp_path / "run", e, m)
    rc, _, err = cli([run, "--plots", tmp_path / "plots"], capsys)
    assert rc == 0, err
    assert all((tmp_path / "plots" / n).stat().st_size > 0
               for n in ("world_size.png", "loss.png", "cost.png"))


def test_python_dash_m_and_usage(tmp_path):
    run = write_run(tmp_path / "run", *spot_run())
    p = subprocess.run([sys.executable, "-m", "raylastic", "report", run, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["status"] == "finished"
    p = subprocess.run([sys.executable, "-m", "raylastic", "frobnicate"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown command" in p.stderr
    assert "ray" not in json.loads(subprocess.run(
        [sys.executable, "-c", "import sys, json, raylastic.reporting.cli, raylastic.reporting.render;"
         "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"],
        capture_output=True, text=True, timeout=120).stdout)


def test_public_report_function_is_not_shadowed_by_the_reporting_package():
    import raylastic
    import raylastic.reporting
    import raylastic.session

    assert raylastic.report is raylastic.session.report


# ----------------------------------------------------------------------------- planned moves

DEMO_RUN = os.path.join(os.path.dirname(__file__), "fixtures", "demo_spot_return")


def test_planned_moves_in_a_real_demo_run_are_graceful_resizes_not_recoveries():
    """tests/unit/fixtures/demo_spot_return: the event log of a real `make demo` run
    (metrics trimmed to every 25th report plus the reports the resizes refer to). Two spot
    preemptions with notice drain workers, then spot returns and two on-demand workers are
    released (worker_lost cause "released"). None of it is a loss: every move is a
    graceful resize, there is no recovery, and world_size.png draws no cross."""
    from raylastic.reporting import load_run
    from raylastic.reporting.plots import failure_crosses

    data = load_run(DEMO_RUN)
    moved = [e for e in data.events if e["kind"] == "worker_lost"]
    assert sorted({e["cause"] for e in moved}) == ["preempted", "released"]  # the log is what it claims
    r = build_report(data.events, data.metrics)
    assert r.recoveries == ()
    assert failure_crosses(r) == []
    graceful = [(z.reason.split(" (")[0].split(":")[0], z.from_world_size, z.to_world_size)
                for z in r.resizes if z.graceful]
    assert graceful == [("scale up 1 -> 3", 1, 3), ("preemption notice", 3, 2),
                        ("scale up 2 -> 3", 2, 3), ("preemption notice", 3, 2),
                        ("spot capacity back", 2, 3), ("spot capacity back", 3, 3)]
    assert len(r.resizes) == 6
    released = [e["ts"] - r.start_ts for e in moved if e["cause"] == "released"]
    back = [z for z in r.resizes if z.reason.startswith("spot capacity back")]
    assert [z.at_s for z in back] == pytest.approx(released, abs=0.5)
    assert all(z.pause_s is not None and 0 < z.pause_s < 10 for z in back)
    assert [s.ended_by for s in r.world_size_timeline].count("released") == 2


def test_a_planned_release_next_to_a_real_loss_leaves_one_recovery():
    """spot_run's node loss stays the only recovery (and the only cross) when spot later
    returns and the on-demand worker is released: the release is a graceful resize."""
    from raylastic.reporting.plots import failure_crosses

    e, m = spot_run()
    e += [ready(86, "n5", "spot", "spot"),
          ev(88, "worker_lost", wid="n3", rank=1, node_id="n3", cause="released"),
          ev(88.2, "resize", epoch=3, reason="spot capacity back", graceful=True, survivors=3,
             reached_index=44, restore_index=44, lost_steps=0, resize_s=0.3),
          ev(88.5, "group_formed", epoch=4, world_size=3, previous_world_size=3,
             nodes=["n1", "n4", "n5"], restore_index=44),
          ev(89.1, "first_step", epoch=4, index=45, world_size=3, report_ts=T0 + 89)]
    e.sort(key=lambda x: x["ts"])
    for x in m:
        if x["index"] >= 45:
            x["epoch"] = 4
    r = build_report(e, m)
    (x,) = r.recoveries
    assert (x.cause, x.nodes, x.at_s, x.steps_lost) == ("node_lost", ("n2",), pytest.approx(45), 4)
    assert failure_crosses(r) == [(pytest.approx(45), 3)]
    moves = [(z.at_s, z.from_world_size, z.to_world_size, z.lost_steps) for z in r.resizes if z.graceful]
    assert moves == [(pytest.approx(81), 2, 3, 0), (pytest.approx(88.2), 3, 3, 0)]
    assert r.resizes[-1].pause_s == pytest.approx(89 - 88)  # report 44 at t=88
    assert r.world_size_timeline[2].ended_by == "released"
    assert r.node_hours["on_demand"].hours == pytest.approx((88 - 2) / 3600)  # n3 given back


def test_a_resize_after_a_loss_names_the_world_size_it_came_from():
    r = build_report(*spot_run())
    assert [(z.graceful, z.from_world_size, z.to_world_size) for z in r.resizes] == [
        (False, 3, 2), (True, 2, 3)]
