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

# The local spot cloud (a real Ray autoscaler replaying traces): docs/simulator.md.
from raylastic.sim.cloud import SpotCloud  # noqa: E402
from raylastic.sim.config import DEFAULT_SIM_NODE_TYPES, SimNodeType  # noqa: E402

__all__ += ["DEFAULT_SIM_NODE_TYPES", "SimNodeType", "SpotCloud"]
