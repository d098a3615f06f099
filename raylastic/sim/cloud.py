"""A local spot cloud: a real Ray autoscaler (v1) launching local raylets, with spot
capacity caps, launch delays, hourly prices and preemptions replayed from a trace.

::

    from raylastic.sim import SpotCloud, shipped_trace

    with SpotCloud() as cloud:               # head (0 CPUs); this process's driver on it
        ray.autoscaler.sdk.request_resources(bundles=[{"CPU": 1, "node_type:spot": 1}] * 2)
        cloud.wait_for_nodes("spot", 2, timeout_s=30)
        cloud.start_trace(shipped_trace("busy"))
        ...                                   # train; cloud.history records what happened

How it fits together (docs/simulator.md has the measured timings):

- the head starts in this process (``ray.cluster_utils.Cluster``) with an
  ``autoscaling_config``, so Ray's own monitor process runs the v1 autoscaler with
  :class:`raylastic.sim.provider.SpotSimProvider` (Ray's fake multi-node provider plus
  caps, launch delays and kills). Worker nodes are real raylets on this machine, typed
  as :mod:`raylastic.sim.config` describes;
- this process decides *when* (trace times, notice deadlines) on one scheduler thread;
  the provider, in the monitor process, launches and kills. They share a state
  directory (see :mod:`raylastic.sim.provider`);
- a preemption with notice is a Ray drain (``DRAIN_NODE_REASON_PREEMPTION``, deadline =
  now + notice) and, at the deadline, a SIGTERM to the node's raylet (a VM shutting
  down); a preemption without notice is a SIGKILL and no drain.
"""

from __future__ import annotations

import atexit
import functools
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from raylastic.policies.node_types import PriceTable
from raylastic.sim import _head
from raylastic.sim import provider as _prov
from raylastic.sim._scheduler import Scheduler, wait_for
from raylastic.sim.config import DEFAULT_SIM_NODE_TYPES, SimNodeType
from raylastic.sim.timescale import TimeScale
from raylastic.sim.trace import Trace, TraceEvent, TraceEventKind

logger = logging.getLogger(__name__)


class SpotCloud:
    """``with SpotCloud() as cloud:`` a local autoscaling Ray cluster that behaves like a
    spot cloud. See the module docstring and docs/simulator.md.

    ``capacity``: initial caps (node type -> nodes; a type not named is limited only by
    its ``max_nodes``). ``idle_timeout_s``: the autoscaler removes a node idle that long
    unless ``request_resources`` holds it (default 60 s). ``time_scale``: real seconds
    per benchmark second (:mod:`raylastic.sim.timescale`); when given, every node type's
    launch delay and the idle timeout derive from real-world values at that scale (so
    ``idle_timeout_s`` and node types' ``launch_delay_s`` must be left at their defaults).
    ``connect_driver``: ``ray.init`` this process to the head on start (and
    ``ray.shutdown`` on shutdown).
    """

    def __init__(
        self,
        node_types: Sequence[SimNodeType] = DEFAULT_SIM_NODE_TYPES,
        *,
        capacity: Optional[Mapping[str, int]] = None,
        idle_timeout_s: Optional[float] = None,
        time_scale: Optional[Union[float, TimeScale]] = None,
        connect_driver: bool = True,
    ) -> None:
        self.time_scale: Optional[TimeScale] = None
        if time_scale is not None:
            self.time_scale = time_scale if isinstance(time_scale, TimeScale) else TimeScale(time_scale)
            if idle_timeout_s is not None or any(t.launch_delay_s for t in node_types):
                raise ValueError(
                    "SpotCloud: with time_scale, idle_timeout_s and launch_delay_s derive "
                    "from real-world values (raylastic.sim.timescale); leave them unset"
                )
            node_types = [replace(t, launch_delay_s=self.time_scale.launch_delay_s) for t in node_types]
            idle_timeout_s = self.time_scale.idle_timeout_s
        self.node_types: Dict[str, SimNodeType] = {t.name: t for t in node_types}
        if len(self.node_types) != len(node_types):
            raise ValueError("SpotCloud: node type names must be unique")
        self._caps: Dict[str, Optional[int]] = {n: None for n in self.node_types}
        for name, cap in (capacity or {}).items():
            self._check_type(name)
            self._caps[name] = _check_count(cap, f"capacity[{name!r}]")
        idle_timeout_s = 60.0 if idle_timeout_s is None else idle_timeout_s
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s={idle_timeout_s!r} must be > 0")
        self._idle_timeout_s = float(idle_timeout_s)
        self._connect_driver = connect_driver
        self._lock = threading.RLock()
        self._gcs_lock = threading.Lock()
        self._noticed: List[str] = []
        self._kill: List[Tuple[str, bool]] = []  # (node id, graceful), in order
        self._events: List[Dict[str, Any]] = []
        self._dir: Optional[Path] = None
        self._cluster: Any = None  # ray.cluster_utils.Cluster once started
        self._gcs: Any = None  # ray._raylet.GcsClient once started
        self._scheduler: Optional[Scheduler] = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "SpotCloud":
        import ray

        if self._dir is not None:
            raise RuntimeError("SpotCloud is already started; create a new one per cluster")
        if self._connect_driver and ray.is_initialized():
            raise RuntimeError(
                "SpotCloud connects this process's driver to its head, but "
                "Ray is already initialized here: call ray.shutdown() first, "
                "or pass connect_driver=False"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="raylastic-spotcloud-"))
        atexit.register(self.shutdown)
        try:
            self._write_control()
            self._cluster = _head.start_head(
                tuple(self.node_types.values()), idle_timeout_s=self._idle_timeout_s, state_dir=self._dir
            )
            self._gcs = _head.gcs_client(self.address)
            if self._connect_driver:
                _head.connect_driver(self.address)
            self._scheduler = Scheduler()
            self._scheduler.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Stop the trace, disconnect the driver, kill every worker node and the head.
        Idempotent."""
        import ray

        atexit.unregister(self.shutdown)
        if self._scheduler is not None:
            self._scheduler.stop()
            self._scheduler = None
        if self._connect_driver and ray.is_initialized():
            ray.shutdown()  # first, so the driver does not report the raylets' deaths
        if self._cluster is not None:
            self._write_control(shutdown=True)
            _head.ensure_nodes_stopped(self._state_dir(), self.session_name)
            self._cluster.shutdown()
            self._cluster = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "SpotCloud":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- what consumers read ------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address (``ray.init(address=...)``)."""
        return self._started().address

    @property
    def session_name(self) -> str:
        """Ray's session name; every process of this cloud's nodes runs under it."""
        return self._started().head_node.session_name

    def prices(self) -> PriceTable:
        return PriceTable.from_mapping(
            {n: t.price_usd_per_hour for n, t in self.node_types.items()}, source="raylastic.sim.SpotCloud"
        )

    def alive_nodes(self, node_type: Optional[str] = None) -> Dict[str, str]:
        """Alive worker nodes (draining ones included) as ``{node_id_hex: node_type}``, as
        the GCS sees them."""
        self._started()
        with self._gcs_lock:
            infos = self._gcs.get_all_node_info(timeout=10)
        return _head.alive_worker_nodes(infos, node_type)

    def node_counts(self) -> Dict[str, int]:
        """Alive nodes per node type (every configured type is a key)."""
        counts = {n: 0 for n in self.node_types}
        for name in self.alive_nodes().values():
            counts[name] = counts.get(name, 0) + 1
        return counts

    def capacity(self, node_type: str) -> Optional[int]:
        """The current cap of ``node_type`` (None: only ``max_nodes`` limits it)."""
        self._check_type(node_type)
        with self._lock:
            return self._caps[node_type]

    @property
    def history(self) -> List[Dict[str, Any]]:
        """What happened, oldest first: dicts with ``ts`` (``time.time()``), ``event``,
        ``node_type``, ``node_id``, ``notice_s`` and ``detail``. See docs/simulator.md for
        the events."""
        with self._lock:
            own = [dict(e) for e in self._events]
        theirs = _prov.read_events(self._state_dir()) if self._dir is not None else []
        notice = {e["node_id"]: e["notice_s"] for e in own if e["event"] == "notice"}
        for e in theirs:
            if e["event"] == "preempted":
                e["notice_s"] = notice.get(e["node_id"])
        return sorted(own + theirs, key=lambda e: e["ts"])

    def wait_for_nodes(self, node_type: str, n: int, timeout_s: float) -> Dict[str, str]:
        """Wait until at least ``n`` nodes of ``node_type`` are alive and fully started
        (``node_up`` recorded, so they can be preempted); returns them."""
        self._check_type(node_type)

        def enough():
            up = self._started_ids()
            alive = {k: v for k, v in self.alive_nodes(node_type).items() if k in up}
            return alive if len(alive) >= n else None

        return wait_for(
            enough,
            timeout_s,
            lambda: (
                f"{n} alive {node_type!r} node(s): {len(self.alive_nodes(node_type))} alive, "
                f"capacity {self.capacity(node_type)} (cloud.history has the launches)"
            ),
        )

    def wait_for_trace(self, timeout_s: float) -> None:
        """Wait until every scheduled trace event and kill has run: each preempted node
        has its ``preempted`` record and is dead."""

        def done() -> bool:
            if not self._sched().idle():
                return False
            with self._lock:
                killed = {n for n, _ in self._kill}
            recorded = {e["node_id"] for e in _prov.read_events(self._state_dir()) if e["event"] == "preempted"}
            return killed <= recorded and not killed & set(self.alive_nodes())

        wait_for(done, timeout_s, "the trace and its preemptions to finish")

    # -- what the trace (or a test) does ------------------------------------------------

    def start_trace(self, trace: Trace, stretch: float = 1.0) -> None:
        """Replay ``trace`` from now (its times are benchmark seconds). ``stretch``
        multiplies every event time and notice (0.5 = twice as fast), for tests; it is not
        the cloud's ``time_scale``."""
        if not stretch > 0:
            raise ValueError(f"stretch={stretch!r} must be > 0")
        trace.check_node_types(self.node_types)
        scheduler = self._scheduler
        if scheduler is None:
            raise RuntimeError("SpotCloud is not started")
        t0 = time.monotonic()
        self._record(
            "trace_start",
            None,
            None,
            detail={
                "source": trace.source,
                "stretch": stretch,
                "time_scale": self.time_scale.to_record() if self.time_scale else None,
            },
        )
        for e in trace.events:
            scheduler.call_at(t0 + e.time_s * stretch, functools.partial(self._apply, e, stretch))
        scheduler.call_at(
            t0 + trace.duration_s * stretch,
            lambda: self._record("trace_end", None, None, detail={"source": trace.source}),
        )

    def set_capacity(
        self, node_type: str, count: Optional[int], *, preempt_excess_notice_s: Optional[float] = None
    ) -> List[str]:
        """Set the cap (None: unlimited). Like the trace's ``capacity`` event this limits
        new launches only, unless ``preempt_excess_notice_s`` is given: then the nodes
        above the new cap are preempted with that notice. Returns the preempted ids."""
        self._check_type(node_type)
        if count is not None:
            count = _check_count(count, "count")
        self._record("capacity", node_type, None, detail={"capacity": count})
        with self._lock:
            self._caps[node_type] = count
            self._write_control()
        if preempt_excess_notice_s is None or count is None:
            return []
        excess = len(self._preemptible(node_type)) - count
        return self.preempt(node_type, excess, preempt_excess_notice_s) if excess > 0 else []

    def preempt(
        self, node_type: str, count: int = 1, notice_s: float = 0.0, *, node_ids: Optional[Sequence[str]] = None
    ) -> List[str]:
        """Preempt ``count`` alive nodes of ``node_type`` not already noticed (newest
        first), or exactly ``node_ids``: a drain with deadline now + ``notice_s`` and a
        SIGTERM at the deadline; ``notice_s=0``: SIGKILL now, no drain. Returns the ids
        (fewer than ``count`` if fewer are up; a ``preempt_short`` event records it)."""
        self._check_type(node_type)
        if not notice_s >= 0:
            raise ValueError(f"notice_s={notice_s!r} must be >= 0")
        if node_ids is None:
            victims = sorted(self._preemptible(node_type), reverse=True)[: max(0, count)]
            if len(victims) < count:
                self._record("preempt_short", node_type, None, detail={"asked": count, "preemptible": len(victims)})
        else:
            victims = list(node_ids)
        for node_id in victims:
            self._notice(node_type, node_id, float(notice_s))
        return victims

    # -- internals ----------------------------------------------------------------------

    def _apply(self, e: TraceEvent, stretch: float) -> None:
        self._record(
            "trace_event",
            e.node_type,
            None,
            notice_s=e.notice_s,
            detail={"kind": e.kind.value, "time_s": e.time_s, "count": e.count, "line": e.line},
        )
        if e.kind is TraceEventKind.CAPACITY:
            self.set_capacity(e.node_type, e.count)
        elif e.kind is TraceEventKind.ADD:
            with self._lock:
                self.set_capacity(e.node_type, max(0, (self._caps[e.node_type] or 0) + e.count))
        else:
            assert e.notice_s is not None  # the trace parser requires it for preempt
            self.preempt(e.node_type, e.count, e.notice_s * stretch)

    def _preemptible(self, node_type: str) -> List[str]:
        """Alive, fully started (``node_up`` recorded) and not yet noticed. The GCS lists
        a node a moment before Ray's ``Node()`` returns in the provider; a node that dies
        in between (a drain makes an idle raylet exit at once) left ``Node()`` blocked for
        more than 10 s."""
        alive = self.alive_nodes(node_type)
        up = self._started_ids()
        with self._lock:
            return [n for n in alive if n in up and n not in self._noticed]

    def _started_ids(self) -> set:
        return {e["node_id"] for e in _prov.read_events(self._state_dir()) if e["event"] == "node_up"}

    def _notice(self, node_type: str, node_id: str, notice_s: float) -> None:
        deadline = time.monotonic() + notice_s
        with self._lock:
            self._noticed.append(node_id)
            self._write_control()  # a noticed node no longer counts against the cap
        accepted, rejection = False, None
        if notice_s > 0:
            with self._gcs_lock:
                accepted, rejection = _head.drain_for_preemption(self._gcs, node_type, node_id, notice_s)
        self._record(
            "notice",
            node_type,
            node_id,
            notice_s=notice_s,
            detail={"drained": accepted, "rejection": rejection or None},
        )
        graceful = notice_s > 0
        self._sched().call_at(deadline, lambda: self._order_kill(node_id, graceful))

    def _order_kill(self, node_id: str, graceful: bool) -> None:
        with self._lock:
            self._kill.append((node_id, graceful))
            self._write_control()

    def _write_control(self, shutdown: bool = False) -> None:
        with self._lock:
            _prov.write_control(
                self._state_dir(),
                {"caps": self._caps, "noticed": self._noticed, "kill": self._kill, "shutdown": shutdown},
            )

    def _record(
        self,
        event: str,
        node_type: Optional[str],
        node_id: Optional[str],
        notice_s: Optional[float] = None,
        detail: Any = None,
    ) -> None:
        rec = {
            "ts": time.time(),
            "event": event,
            "node_type": node_type,
            "node_id": node_id,
            "notice_s": notice_s,
            "detail": detail,
        }
        with self._lock:
            self._events.append(rec)
        logger.info("spot cloud: %s", rec)

    def _state_dir(self) -> Path:
        if self._dir is None:
            raise RuntimeError("SpotCloud is not started; use `with SpotCloud() as cloud:`")
        return self._dir

    def _sched(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("SpotCloud is not started; use `with SpotCloud() as cloud:`")
        return self._scheduler

    def _started(self) -> Any:
        if self._cluster is None:
            raise RuntimeError("SpotCloud is not started; use `with SpotCloud() as cloud:`")
        return self._cluster

    def _check_type(self, name: str) -> None:
        if name not in self.node_types:
            raise ValueError(f"unknown node type {name!r}; this SpotCloud defines {sorted(self.node_types)}")


def _check_count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}={value!r} must be an integer >= 0")
    return value
