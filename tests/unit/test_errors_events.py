"""Errors group per-rank causes and pickle; the event log survives a torn last line, and
`raylastic report` turns a damaged log into one line on stderr, never a traceback."""

import json
import pickle

import pytest

from raylastic._internal.controller import states
from raylastic.errors import InsufficientCapacityError, RankFailure, TrainingFailedError
from raylastic.events import CorruptLogError, read_jsonl
from raylastic.reporting import build_report
from test_report import cli, ev, spot_run, write_run  # the report tests' synthetic run


def test_training_failed_error_groups_ranks_and_pickles():
    fails = [
        RankFailure(0, 1, "error", "ValueError: bad batch", "Traceback ...\nValueError: bad batch"),
        RankFailure(3, 1, "error", "ValueError: bad batch"),
        RankFailure(2, 1, "node_lost", "node died"),
    ]
    e = TrainingFailedError("failure budget exhausted", fails)
    text = str(e)
    assert "[ranks 0,3]: error: ValueError: bad batch" in text
    assert "[rank 2]: node_lost: node died" in text
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == text and e2.failures == fails


def test_capacity_error_names_the_knobs_and_pickles():
    e = InsufficientCapacityError(4, 1, 30.0, {"CPU": 1})
    assert "max_wait_s" in str(e) and "min_workers=4" in str(e)
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_truncated_last_line_is_skipped_but_corruption_inside_is_not():
    good = json.dumps({"kind": "a"})
    assert list(read_jsonl(f"{good}\n{good}\n{{\"kind\": \"b")) == [{"kind": "a"}] * 2
    with pytest.raises(ValueError, match="line 2"):
        list(read_jsonl(f"{good}\nnot json\n{good}\n"))


@pytest.mark.parametrize("bad", ["[" * 100_000, "1" * 5000, '{"a": ' + "9" * 5000 + "}", "\udc80"],
                         ids=["too-deep", "too-many-digits", "huge-int-field", "lone-surrogate"])
def test_lines_json_cannot_parse_are_the_named_error_or_a_torn_last_line(bad):
    """RecursionError and the int-digits ValueError of json.loads are corrupt lines too."""
    good = json.dumps({"kind": "a"})
    with pytest.raises(CorruptLogError, match="line 2 is not valid JSON"):
        list(read_jsonl(f"{good}\n{bad}\n{good}\n"))
    assert list(read_jsonl(f"{good}\n{bad}")) == [{"kind": "a"}]  # torn last line: skipped


def test_lines_end_at_newlines_only():
    """A JSON string may hold U+2028 or \\x85 unescaped (other writers than ours do)."""
    text = '{"m": "a\u2028b\x85c"}\n{"m": 1}\r\n'
    assert list(read_jsonl(text)) == [{"m": "a\u2028b\x85c"}, {"m": 1}]


def test_state_machine_transitions_are_checked():
    sched = states.Scheduling(since=0.0)
    running = states.Running(epoch=1, members=[], started_at=0.0, restored_index=0)
    states.check_transition(sched, running)
    states.check_transition(running, states.Resizing(epoch=1, members=[], reason="x", graceful=True))
    with pytest.raises(AssertionError, match="Scheduling -> Finished"):
        states.check_transition(sched, states.Finished())
    with pytest.raises(AssertionError):
        states.check_transition(states.Finished(), sched)
    assert states.is_terminal(states.Errored(RuntimeError()))


# ----------------------------------------------------------------------------- damaged logs
# Security issue 22 (low): a field of the wrong type was a traceback, and --json could print
# NaN/Infinity. Now: exit 2 with one line naming the file, line and field; strict JSON.

def assert_one_line_error(rc, out, err, *needles):
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("raylastic report: error: ") and "internal error" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def _set(which, **fields):
    """Set ``fields`` on the first event of kind ``which`` (or metrics record)."""
    def apply(e, m):
        target = m[0] if which == "metrics" else next(x for x in e if x["kind"] == which)
        target.update(fields)
    return apply


WRONG_TYPES = [
    (_set("group_formed", epoch="one"), "events.jsonl", "'epoch'"),
    (_set("worker_ready", node_id=["n1"]), "events.jsonl", "'node_id'"),
    (_set("first_step", report_ts="soon"), "events.jsonl", "'report_ts'"),
    (_set("checkpoint_committed", bytes="1000"), "events.jsonl", "'bytes'"),
    (_set("resize", resize_s={"s": 1}), "events.jsonl", "'resize_s'"),
    (_set("group_formed", nodes=[["n1"]]), "events.jsonl", "'nodes'"),
    (_set("failure", reason={"why": [[[1]]]}), "events.jsonl", "'reason'"),
    (_set("run_started", kind=["run_started"]), "events.jsonl", "'kind'"),
    (_set("failure", ts=1e300), "events.jsonl", "'ts'"),
    (_set("metrics", index="7"), "metrics.jsonl", "'index'"),
    (_set("metrics", metrics=[1.0]), "metrics.jsonl", "'metrics'"),
    (_set("metrics", epoch=[1]), "metrics.jsonl", "'epoch'"),
]


@pytest.mark.parametrize("damage, file, field", WRONG_TYPES,
                         ids=[f"{f.split('.')[0]}-{n.strip(chr(39))}" for _, f, n in WRONG_TYPES])
def test_a_field_of_the_wrong_type_is_a_one_line_error(tmp_path, capsys, damage, file, field):
    e, m = spot_run()
    damage(e, m)
    run = write_run(tmp_path / "run", e, m)
    for extra in ([], ["--json"]):
        rc, out, err = cli([run, *extra], capsys)
        assert_one_line_error(rc, out, err, f"{file} line ", field)


def test_a_broken_price_table_is_skipped_not_a_crash(tmp_path, capsys):
    e, m = spot_run()
    table = next(x for x in e if x["kind"] == "price_table")
    bad = [dict(table, markets=[1, 2]), dict(table, markets={"spot": ["spot"]}),
           dict(table, on_demand_type=["on_demand"]), dict(table, usd_per_hour={"spot": 10**400})]
    run = write_run(tmp_path / "run", e[:1] + bad + e[2:], m)  # no valid table left
    rc, out, err = cli([run, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["cost_usd"] is None and "no price table" in err


def test_huge_or_non_finite_metric_values_are_not_plotted(tmp_path, capsys):
    e, m = spot_run()
    m[0]["metrics"]["loss"] = 10**400  # an int no float holds
    m[1]["metrics"]["loss"] = float("nan")
    m[2]["metrics"]["loss"] = float("inf")
    run = write_run(tmp_path / "run", e, m)
    rc, out, err = cli([run, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["steps"]["reported"] == len(m)
    r = build_report(e, m)
    assert len(r.series.loss) == len(m) - 3


def _no_constants(name):
    raise AssertionError(f"--json printed {name}: not JSON")


def test_json_is_strict_when_a_number_overflows(tmp_path, capsys):
    """Absurd but valid prices over a long run: the cost overflows to infinity, which
    JSON cannot say. It is null in --json (and "inf" in the text)."""
    e, m = spot_run()
    e = [x for x in e if x["kind"] != "worker_released"]  # nodes held to the session's end,
    e.append(ev(400_000, "state", state="Finished"))  # 111 h later
    run = write_run(tmp_path / "run", e, m)
    prices = json.dumps({"spot": 1e308, "on_demand": 1e308})
    rc, out, err = cli([run, "--json", "--prices", prices], capsys)
    assert rc == 0, err
    data = json.loads(out, parse_constant=_no_constants)
    assert data["cost_usd"] is None and data["node_hours"]["spot"]["cost_usd"] is None
    rc, out, err = cli([run, "--prices", prices], capsys)
    assert rc == 0 and "$inf" in out, err


def test_control_characters_from_a_log_are_escaped(tmp_path, capsys):
    """A log is data from a store: its strings cannot drive the terminal."""
    e, m = spot_run()
    e = [x for x in e if x["kind"] != "run_finished"]
    e.append(ev(95, "run_failed", message="boom\x1b[2J\x07 \udc80"))
    run = write_run(tmp_path / "run", e, m)
    rc, out, err = cli([run], capsys)
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out and "boom\\x1b[2J\\x07 \\udc80" in out


def test_an_unexpected_error_is_one_line_too(tmp_path, capsys, monkeypatch):
    """A bug in a pass is still no traceback for the user (and names itself a bug)."""
    import raylastic.reporting.cli as cli_mod

    run = write_run(tmp_path / "run", *spot_run())

    def broken(*a, **k):
        raise ZeroDivisionError("a bug\nin two lines")

    monkeypatch.setattr(cli_mod, "build_report", broken)
    rc, out, err = cli([run], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "internal error (please report it): ZeroDivisionError: a bug\\nin two lines" in err
