"""Trace format: parser, errors naming file and line, shipped traces."""

from __future__ import annotations

import math
import pickle

import pytest

from raylastic.sim import (
    SHIPPED_TRACES,
    TraceEventKind,
    TraceFormatError,
    load_trace,
    parse_trace,
    shipped_trace,
    shipped_trace_path,
)
from raylastic.sim.trace import HEADER

H = ",".join(HEADER)


def test_parse_events_comments_and_blank_lines():
    text = f"# a comment\n\n{H}\n0,capacity,spot,4,\n  # indented comment\n" \
           "10.5,preempt,spot,2,15\n20,add,spot,-1,\n20,add,on_demand,3,\n"
    trace = parse_trace(text, source="t.csv")
    assert [e.kind for e in trace.events] == [TraceEventKind.CAPACITY, TraceEventKind.PREEMPT,
                                              TraceEventKind.ADD, TraceEventKind.ADD]
    pre = trace.events[1]
    assert (pre.time_s, pre.node_type, pre.count, pre.notice_s, pre.line) == (10.5, "spot", 2, 15.0, 6)
    assert trace.events[0].notice_s is None
    assert trace.node_types == ("on_demand", "spot")
    assert trace.duration_s == 20
    assert trace.capacity_at("spot", 0) == 4
    assert trace.capacity_at("spot", 25) == 3
    assert trace.capacity_at("on_demand", 25) == 3   # add to unset capacity starts from 0
    assert trace.capacity_at("other", 25) is None    # never set: unlimited
    assert [e.line for e in trace.due(-math.inf, 0)] == [4]
    assert [e.line for e in trace.due(0, 20)] == [6, 7, 8]


@pytest.mark.parametrize("row, match", [
    ("0,capacity,spot,4", r"expected 5 fields.*got 4"),
    ("x,capacity,spot,4,", r"time_s 'x' is not a number"),
    ("-1,capacity,spot,4,", r"time_s '-1' must be a finite number >= 0"),
    ("0,explode,spot,4,", r"unknown event 'explode'"),
    ("0,capacity,bad type,4,", r"not a valid node type name"),
    ("0,capacity,spot,four,", r"count 'four' is not an integer"),
    ("0,capacity,spot,-1,", r"capacity count -1 must be >= 0"),
    ("0,preempt,spot,0,5", r"preempt count 0 must be >= 1"),
    ("0,preempt,spot,1,", r"preempt needs notice_s"),
    ("0,preempt,spot,1,-3", r"notice_s '-3' must be"),
    ("0,capacity,spot,1,5", r"notice_s applies to preempt only"),
    ("0,add,spot,0,", r"add count must be a non-zero integer"),
])
def test_bad_row_error_names_file_and_line(row, match):
    text = f"# header next\n{H}\n0,capacity,spot,4,\n{row}\n"
    with pytest.raises(TraceFormatError, match=match) as info:
        parse_trace(text, source="traces/mine.csv")
    assert str(info.value).startswith("traces/mine.csv:4: ")
    assert info.value.line == 4
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value)


def test_out_of_order_rows_and_bad_header():
    with pytest.raises(TraceFormatError, match=r"t.csv:3: time_s 5 is before.*10"):
        parse_trace(f"{H}\n10,capacity,spot,1,\n5,capacity,spot,2,\n", source="t.csv")
    with pytest.raises(TraceFormatError, match=r"t.csv:2: expected the header"):
        parse_trace("# c\ntime,event,node_type,count,notice\n", source="t.csv")
    with pytest.raises(TraceFormatError, match=r"empty trace"):
        parse_trace("# only a comment\n", source="t.csv")


def test_unknown_node_type_names_the_line():
    trace = parse_trace(f"{H}\n0,capacity,spot,4,\n1,preempt,gpu,1,5\n", source="t.csv")
    trace.check_node_types(["spot", "gpu"])
    with pytest.raises(TraceFormatError, match=r"t.csv:3: unknown node type 'gpu'"):
        trace.check_node_types(["spot", "on_demand"])


def test_load_trace_from_file(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text(f"{H}\n0,capacity,spot,2,\n3,oops,spot,1,\n")
    with pytest.raises(TraceFormatError, match=rf"{p}:3: unknown event 'oops'"):
        load_trace(p)


def test_shipped_traces_parse_and_have_the_described_shape():
    assert SHIPPED_TRACES == ("calm", "busy", "drought", "demo", "long")
    for name in SHIPPED_TRACES:
        trace = shipped_trace(name)
        assert load_trace(shipped_trace_path(name)).events == trace.events
        trace.check_node_types(["spot", "on_demand"])
        assert trace.capacity_at("spot", 0) == (3 if name == "demo" else 4) and trace.duration_s <= 150

    demo = shipped_trace("demo")  # make demo: two preemptions, a drought, spot returns
    assert len([e for e in demo.events if e.kind is TraceEventKind.PREEMPT]) == 2
    assert demo.capacity_at("spot", 60) == 0 and demo.capacity_at("spot", 90) == 3

    calm = shipped_trace("calm")
    assert not [e for e in calm.events if e.kind is TraceEventKind.PREEMPT]

    busy = shipped_trace("busy")
    preempts = [e for e in busy.events if e.kind is TraceEventKind.PREEMPT]
    assert len(preempts) == 2 and all(e.notice_s > 0 for e in preempts)

    drought = shipped_trace("drought")
    zero = [t for t in range(0, 181) if drought.capacity_at("spot", t) == 0]
    assert zero and 35 <= len(zero) <= 45          # ~40 s without spot capacity
    assert drought.capacity_at("spot", zero[-1] + 1) > 0   # then it returns

    long = shipped_trace("long")  # spot_economics.py: >= 8 preemptions, 0 s notices among them
    preempts = [e for e in long.events if e.kind is TraceEventKind.PREEMPT]
    assert sum(e.count for e in preempts) >= 8
    assert {0, 5, 10, 20} <= {e.notice_s for e in preempts}
    assert long.capacity_at("spot", 90) == 1 and long.capacity_at("spot", 115) == 4
    with pytest.raises(ValueError, match=r"no shipped trace 'storm'"):
        shipped_trace("storm")


def test_a_file_that_is_not_utf8_is_a_format_error_naming_the_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(f"{H}\n0,capacity,spot,4,\n".encode() + b"1,add,sp\xffot,1,\n")
    with pytest.raises(TraceFormatError, match=r"t.csv:3: not UTF-8 text \(byte \d+ is b'\\xff'\)"):
        load_trace(path)
