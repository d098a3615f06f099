"""Local spot-cloud simulation helpers. For now: the capacity/preemption trace format
(:mod:`raylastic.sim.trace`); the autoscaler-backed simulator that replays traces is
being built separately."""

from raylastic.sim.trace import (
    SHIPPED_TRACES,
    Trace,
    TraceEvent,
    TraceEventKind,
    TraceFormatError,
    load_trace,
    parse_trace,
    shipped_trace,
    shipped_trace_path,
)

__all__ = [
    "SHIPPED_TRACES",
    "Trace",
    "TraceEvent",
    "TraceEventKind",
    "TraceFormatError",
    "load_trace",
    "parse_trace",
    "shipped_trace",
    "shipped_trace_path",
]
