"""A local spot cloud, for tests, ``make demo`` and the benchmarks (no cloud account).

- :class:`~raylastic.sim.SpotCloud`: a Ray head plus Ray's real autoscaler (v1) launching
  local raylets of the node types ``spot`` and ``on_demand`` (the ``CapacityPolicy``
  defaults), with capacity caps, launch delays, hourly prices, and preemptions with a
  notice (a Ray drain with a deadline, then a kill).
- Traces (:mod:`raylastic.sim.trace`): the CSV format of what the cloud does over time, and
  the shipped traces ``calm``, ``busy``, ``drought``, ``long`` and ``demo``
  (:func:`shipped_trace`).
- The time scale (:mod:`raylastic.sim.timescale`): what one simulated second stands for on a
  real cloud; ``SpotCloud(time_scale=10)`` derives boots and idle timeouts from real-world
  values.

Guides: docs/simulator.md and docs/traces.md.
"""

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
