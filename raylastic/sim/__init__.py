"""A local spot cloud: the capacity/preemption trace format (:mod:`raylastic.sim.trace`),
the simulator that replays traces against Ray's real autoscaler
(:class:`~raylastic.sim.SpotCloud`), and the time scale that maps its seconds to a real
cloud's (:mod:`raylastic.sim.timescale`)."""

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
from raylastic.sim.timescale import RealWorld, TimeScale  # noqa: E402

__all__ += ["DEFAULT_SIM_NODE_TYPES", "RealWorld", "SimNodeType", "SpotCloud", "TimeScale"]
