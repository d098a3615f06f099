"""Spot capacity / preemption traces for the local spot-cloud simulator.

Format (CSV, UTF-8; also described in docs/traces.md)::

    # comment lines start with '#'; blank lines are ignored
    time_s,event,node_type,count,notice_s
    0,capacity,spot,4,
    0,capacity,on_demand,2,
    45,preempt,spot,1,15
    90,add,spot,2,

- The first non-comment line is the header, exactly ``time_s,event,node_type,count,notice_s``.
- Every row has 5 fields. ``time_s``: seconds since the run started (a number >= 0), rows
  in non-decreasing time order. ``node_type``: a raylastic node type name (see
  :mod:`raylastic.policies.node_types`).
- ``event``:

  ``capacity``  set the number of nodes of ``node_type`` the cloud will run to ``count``
                (>= 0). Only limits *new* launches; nodes already up keep running (combine
                with ``preempt`` to take them away). A node type never given a capacity is
                unlimited.
  ``add``       change that capacity by ``count`` (a non-zero integer, may be negative;
                the result is floored at 0).
  ``preempt``   preempt ``count`` (>= 1) running nodes of ``node_type`` after
                ``notice_s`` seconds of notice (>= 0; 0 = killed without notice). The
                notice is a Ray drain with a deadline, like a cloud's preemption notice.

- ``notice_s`` is required for ``preempt`` and must be empty for the other events.

Bad rows raise :class:`TraceFormatError` naming the file and line. Shipped traces (for a
~2-3 minute local run with 3-4 one-CPU worker nodes, node types ``spot`` and
``on_demand``): ``calm``, ``busy``, ``drought``, ``long`` (nine preemptions with 0-20 s
notices); see :func:`shipped_trace`.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple, Union

from raylastic.policies.node_types import validate_node_type_name

HEADER = ("time_s", "event", "node_type", "count", "notice_s")
SHIPPED_TRACES = ("calm", "busy", "drought", "demo", "long")


class TraceFormatError(ValueError):
    """A trace file row that does not follow the format; names the file and line."""

    def __init__(self, source: str, line: int, message: str) -> None:
        self.source, self.line, self.detail = source, line, message
        super().__init__(f"{source}:{line}: {message}")

    def __reduce__(self):
        return (TraceFormatError, (self.source, self.line, self.detail))


class TraceEventKind(str, Enum):
    CAPACITY = "capacity"
    ADD = "add"
    PREEMPT = "preempt"


@dataclass(frozen=True)
class TraceEvent:
    time_s: float
    kind: TraceEventKind
    node_type: str
    count: int
    notice_s: Optional[float]  # set for PREEMPT only
    line: int  # line in the source file, for messages


@dataclass(frozen=True)
class Trace:
    events: Tuple[TraceEvent, ...]
    source: str

    @property
    def node_types(self) -> Tuple[str, ...]:
        return tuple(sorted({e.node_type for e in self.events}))

    @property
    def duration_s(self) -> float:
        """Time of the last event (0 for an empty trace)."""
        return self.events[-1].time_s if self.events else 0.0

    def check_node_types(self, known: Iterable[str]) -> None:
        """Raise :class:`TraceFormatError` at the first row naming an unknown node type."""
        known = set(known)
        for e in self.events:
            if e.node_type not in known:
                raise TraceFormatError(
                    self.source, e.line, f"unknown node type {e.node_type!r}; the run defines {sorted(known)}"
                )

    def due(self, after_s: float, upto_s: float) -> Tuple[TraceEvent, ...]:
        """Events with ``after_s < time_s <= upto_s`` (use ``after_s=-inf`` for the first
        call so events at time 0 are included)."""
        return tuple(e for e in self.events if after_s < e.time_s <= upto_s)

    def capacity_at(self, node_type: str, t_s: float) -> Optional[int]:
        """Capacity of ``node_type`` after every event at or before ``t_s``; ``None`` means
        unlimited (never set)."""
        cap: Optional[int] = None
        for e in self.events:
            if e.time_s > t_s:
                break
            if e.node_type != node_type:
                continue
            if e.kind is TraceEventKind.CAPACITY:
                cap = e.count
            elif e.kind is TraceEventKind.ADD:
                cap = max(0, (cap or 0) + e.count)
        return cap


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    """Parse trace text; ``source`` names the file in error messages."""
    events = []
    header_seen = False
    last_time = -math.inf
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in next(csv.reader([line]))]
        if not header_seen:
            if tuple(fields) != HEADER:
                raise TraceFormatError(source, lineno, f"expected the header {','.join(HEADER)!r}, got {line!r}")
            header_seen = True
            continue
        event = _parse_row(fields, source, lineno)
        if event.time_s < last_time:
            raise TraceFormatError(
                source,
                lineno,
                f"time_s {event.time_s:g} is before the previous row's {last_time:g}; keep rows in time order",
            )
        last_time = event.time_s
        events.append(event)
    if not header_seen:
        raise TraceFormatError(source, 1, f"empty trace: no header {','.join(HEADER)!r}")
    return Trace(events=tuple(events), source=source)


def _parse_row(fields, source: str, lineno: int) -> TraceEvent:
    def bad(msg: str) -> TraceFormatError:
        return TraceFormatError(source, lineno, msg)

    if len(fields) != len(HEADER):
        raise bad(
            f"expected {len(HEADER)} fields ({','.join(HEADER)}), got {len(fields)}; "
            "leave notice_s empty but keep its comma"
        )
    time_f, kind_f, node_type, count_f, notice_f = fields
    try:
        time_s = float(time_f)
    except ValueError:
        raise bad(f"time_s {time_f!r} is not a number") from None
    if not math.isfinite(time_s) or time_s < 0:
        raise bad(f"time_s {time_f!r} must be a finite number >= 0")
    try:
        kind = TraceEventKind(kind_f)
    except ValueError:
        raise bad(f"unknown event {kind_f!r}; use one of {[k.value for k in TraceEventKind]}") from None
    try:
        validate_node_type_name(node_type, "node_type")
    except ValueError as e:
        raise bad(str(e)) from None
    try:
        count = int(count_f)
    except ValueError:
        raise bad(f"count {count_f!r} is not an integer") from None
    if kind is TraceEventKind.CAPACITY and count < 0:
        raise bad(f"capacity count {count} must be >= 0")
    if kind is TraceEventKind.PREEMPT and count < 1:
        raise bad(f"preempt count {count} must be >= 1")
    if kind is TraceEventKind.ADD and count == 0:
        raise bad("add count must be a non-zero integer")
    notice_s: Optional[float] = None
    if kind is TraceEventKind.PREEMPT:
        try:
            notice_s = float(notice_f)
        except ValueError:
            raise bad(f"preempt needs notice_s (seconds >= 0, 0 = no notice), got {notice_f!r}") from None
        if not math.isfinite(notice_s) or notice_s < 0:
            raise bad(f"notice_s {notice_f!r} must be a finite number >= 0")
    elif notice_f:
        raise bad(f"notice_s applies to preempt only; leave it empty for {kind.value}")
    return TraceEvent(time_s=time_s, kind=kind, node_type=node_type, count=count, notice_s=notice_s, line=lineno)


def load_trace(path: Union[str, Path]) -> Trace:
    """Parse the trace file at ``path``; bytes that are not UTF-8 are a TraceFormatError
    naming the line (the file is data: any content is a named error, never a crash)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TraceFormatError(
            str(path), line, f"not UTF-8 text (byte {e.start} is {data[e.start : e.start + 1]!r})"
        ) from None
    return parse_trace(text, source=str(path))


def shipped_trace(name: str) -> Trace:
    """One of :data:`SHIPPED_TRACES` (``calm``, ``busy``, ``drought``)."""
    if name not in SHIPPED_TRACES:
        raise ValueError(
            f"no shipped trace {name!r}; choose one of {list(SHIPPED_TRACES)} "
            "or load your own file with load_trace(path)"
        )
    ref = resources.files("raylastic.sim").joinpath("traces", f"{name}.csv")
    return parse_trace(ref.read_text(encoding="utf-8"), source=f"raylastic/sim/traces/{name}.csv")


def shipped_trace_path(name: str) -> Path:
    if name not in SHIPPED_TRACES:
        raise ValueError(f"no shipped trace {name!r}; choose one of {list(SHIPPED_TRACES)}")
    return Path(__file__).parent / "traces" / f"{name}.csv"


def counts_by_kind(trace: Trace) -> Dict[str, int]:
    """Number of events of each kind (for summaries and tests)."""
    out: Dict[str, int] = {k.value: 0 for k in TraceEventKind}
    for e in trace.events:
        out[e.kind.value] += 1
    return out
