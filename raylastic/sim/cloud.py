"""A local spot cloud: a real Ray autoscaler (v1) launching local raylets, with spot
capacity caps, launch delays, hourly prices and preemptions replayed from a trace.

::

    from raylastic.sim import SpotCloud, shipped_trace

    with SpotCloud() as cloud:              # head (0 CPUs) + driver attached to it
        ray.autoscaler.sdk.request_resources(bundles=[{"CPU": 1, "node_type:spot": 1}] * 2)
        cloud.wait_for_nodes("spot", 2, timeout_s=30)
        cloud.start_trace(shipped_trace("busy"))
        ...                                  # train; cloud.history records what happened

How it fits together (docs/simulator.md has the measured timings):

- the head is started in this process (``ray.cluster_utils.Cluster``) with an
  ``autoscaling_config``, so Ray's own monitor process runs the v1 autoscaler; its node
  provider is :class:`raylastic.sim.provider.SpotSimProvider` (Ray's fake multi-node
  provider + caps, delays, kills). Every worker node is a real raylet on this machine
  with ``{"CPU": cpus, "node_type:<name>": 1}`` and the labels
  ``raylastic.io/market`` / ``raylastic.io/node-type`` (see
  :mod:`raylastic.policies.node_types`);
- this process decides *when* (trace times, notice deadlines) in one scheduler thread;
  the provider, in the monitor process, does the launching and killing. They share a
  state directory (see :mod:`raylastic.sim.provider`);
- a preemption is a Ray drain (``DRAIN_NODE_REASON_PREEMPTION``, deadline = now +
  notice) followed, at the deadline, by a SIGKILL of the node's raylet.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from raylastic.policies.node_types import (
    MARKET_LABEL,
    NODE_TYPE_LABEL,
    RESOURCE_PREFIX,
    Market,
    PriceTable,
    validate_node_type_name,
)
from raylastic.sim import provider as _prov
from raylastic.sim.trace import Trace, TraceEvent, TraceEventKind
from raylastic.testing.cluster import FAST_FAILURE_DETECTION

logger = logging.getLogger(__name__)

HEAD_NODE_TYPE = "ray.head.default"
_NODE_OBJECT_STORE_BYTES = 80 * 1024**2
# Environment of the head's processes (the monitor inherits it): fake-cluster mode, a
# 1 s autoscaler loop (default 5 s), autoscaler v1.
_HEAD_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
             "RAY_enable_autoscaler_v2": "0"}


@dataclass(frozen=True, kw_only=True)
class SimNodeType:
    """One node type of the simulated cloud. Every node has ``cpus`` CPUs and one unit of
    the ``node_type:<name>`` resource."""

    name: str
    market: Market
    price_usd_per_hour: float
    cpus: int = 1
    launch_delay_s: float = 0.0
    max_nodes: int = 4

    def __post_init__(self) -> None:
        validate_node_type_name(self.name, "SimNodeType.name")
        object.__setattr__(self, "market", Market.parse(self.market, "SimNodeType.market"))
        for field_name, minimum in (("cpus", 1), ("max_nodes", 0)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"SimNodeType {self.name!r}: {field_name}={value!r} must be "
                                 f"an integer >= {minimum}")
        for field_name in ("price_usd_per_hour", "launch_delay_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SimNodeType {self.name!r}: {field_name}={value!r} must be "
                                 "a number >= 0")

    @property
    def resource_key(self) -> str:
        return f"{RESOURCE_PREFIX}{self.name}"

    def autoscaler_entry(self) -> Dict[str, Any]:
        return {
            "resources": {"CPU": self.cpus, self.resource_key: 1,
                          "object_store_memory": _NODE_OBJECT_STORE_BYTES},
            "labels": {MARKET_LABEL: self.market.value, NODE_TYPE_LABEL: self.name},
            "node_config": {},
            "min_workers": 0,
            "max_workers": self.max_nodes,
        }


DEFAULT_SIM_NODE_TYPES = (
    SimNodeType(name="spot", market=Market.SPOT, price_usd_per_hour=0.30),
    SimNodeType(name="on_demand", market=Market.ON_DEMAND, price_usd_per_hour=1.00),
)


class _Scheduler(threading.Thread):
    """Runs callables at monotonic times, in order, on one thread."""

    def __init__(self) -> None:
        super().__init__(name="spot-cloud-scheduler", daemon=True)
        self._heap: List[Any] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._running = 0

    def call_at(self, due: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._heap and not self._running

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self.is_alive():
            self.join(timeout=5)

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (
                        not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._heap)
                self._running += 1
            try:
                fn()
            except Exception:  # noqa: BLE001  (one bad action must not stop the trace)
                logger.exception("spot cloud: scheduled action failed")
            finally:
                with self._cond:
                    self._running -= 1


class SpotCloud:
    """``with SpotCloud() as cloud:`` a local autoscaling Ray cluster that behaves like a
    spot cloud. See the module docstring and docs/simulator.md.

    ``capacity`` sets initial caps (node type -> max nodes; a type not named is limited
    only by its ``max_nodes``). ``idle_timeout_s`` is the autoscaler's scale-down delay
    for idle nodes not held by ``request_resources``.
    """

    def __init__(self, node_types: Sequence[SimNodeType] = DEFAULT_SIM_NODE_TYPES, *,
                 capacity: Optional[Mapping[str, int]] = None, idle_timeout_s: float = 60.0,
                 connect_driver: bool = True) -> None:
        self.node_types: Dict[str, SimNodeType] = {t.name: t for t in node_types}
        if len(self.node_types) != len(node_types):
            raise ValueError("SpotCloud: node type names must be unique")
        self._caps: Dict[str, Optional[int]] = {n: None for n in self.node_types}
        for name, cap in (capacity or {}).items():
            self._check_type(name)
            self._caps[name] = self._check_count(cap, f"capacity[{name!r}]")
        self._idle_timeout_s = float(idle_timeout_s)
        self._connect_driver = connect_driver
        self._lock = threading.RLock()
        self._gcs_lock = threading.Lock()
        self._noticed: Dict[str, float] = {}  # node id -> kill deadline (monotonic)
        self._kill: List[Any] = []  # (node id, graceful)
        self._events: List[Dict[str, Any]] = []
        self._dir: Optional[Path] = None
        self._cluster = None
        self._gcs = None
        self._scheduler: Optional[_Scheduler] = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "SpotCloud":
        import ray
        from ray.autoscaler.v2.utils import is_autoscaler_v2
        from ray.cluster_utils import Cluster

        self._dir = Path(tempfile.mkdtemp(prefix="raylastic-spotcloud-"))
        self._write_control()
        port = _free_port()
        ip = ray.util.get_node_ip_address()
        config_path = self._dir / "autoscaler.json"
        config_path.write_text(json.dumps(self._autoscaler_config(f"{ip}:{port}")))
        try:
            with _environ(_HEAD_ENV):
                self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                                        head_node_args={
                    "num_cpus": 0, "gcs_server_port": port, "include_dashboard": False,
                    "autoscaling_config": str(config_path),
                    "_system_config": dict(FAST_FAILURE_DETECTION),
                    "object_store_memory": _NODE_OBJECT_STORE_BYTES,
                    "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": _prov.HEAD_NODE_ID},
                })
            self._gcs = ray._raylet.GcsClient(address=self.address)
            if self._connect_driver:
                ray.init(address=self.address)
                is_autoscaler_v2(fetch_from_server=True)  # refresh a cache left by another cluster
            self._scheduler = _Scheduler()
            self._scheduler.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Stop the trace, kill every worker node, the head and the driver connection."""
        import ray

        if self._scheduler is not None:
            self._scheduler.stop()
            self._scheduler = None
        if self._connect_driver and ray.is_initialized():
            ray.shutdown()  # first, so the driver does not report the raylets' deaths
        if self._dir is not None and self._cluster is not None:
            self._write_control(shutdown=True)
            try:
                _wait(lambda: any(e["event"] == "provider_shutdown"
                                  for e in _prov.read_events(self._dir)), 15.0)
            except TimeoutError:
                logger.warning("spot cloud: the provider did not confirm shutdown; killing "
                               "its raylets by pid")
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        if self._dir is not None:
            self._kill_leftover_pids()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "SpotCloud":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- what consumers read ------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("SpotCloud is not started; use `with SpotCloud() as cloud:`")
        return self._cluster.address

    @property
    def session_name(self) -> str:
        """Ray's session name; every process of this cloud has it on its command line."""
        if self._cluster is None:
            raise RuntimeError("SpotCloud is not started")
        return self._cluster.head_node.session_name

    def prices(self) -> PriceTable:
        return PriceTable.from_mapping(
            {n: t.price_usd_per_hour for n, t in self.node_types.items()},
            source="raylastic.sim.SpotCloud")

    def alive_nodes(self, node_type: Optional[str] = None) -> Dict[str, str]:
        """Alive worker nodes as ``{node_id_hex: node_type}`` (from the GCS)."""
        from ray.core.generated import gcs_pb2

        out = {}
        with self._gcs_lock:
            infos = self._gcs.get_all_node_info(timeout=10)
        for node_id, info in infos.items():
            if info.state != gcs_pb2.GcsNodeInfo.ALIVE:
                continue
            for key in info.resources_total:
                if key.startswith(RESOURCE_PREFIX):
                    name = key[len(RESOURCE_PREFIX):]
                    if node_type is None or name == node_type:
                        out[node_id.hex()] = name
        return out

    def node_counts(self) -> Dict[str, int]:
        """Alive nodes per node type (every configured type is a key)."""
        counts = {n: 0 for n in self.node_types}
        for name in self.alive_nodes().values():
            counts[name] = counts.get(name, 0) + 1
        return counts

    def capacity(self, node_type: str) -> Optional[int]:
        """The current cap of ``node_type`` (None = only ``max_nodes`` limits it)."""
        self._check_type(node_type)
        with self._lock:
            return self._caps[node_type]

    @property
    def history(self) -> List[Dict[str, Any]]:
        """Everything that happened, oldest first: dicts with ``ts`` (wall clock),
        ``event``, ``node_type``, ``node_id``, ``notice_s``, ``detail``. Events: ``capacity``,
        ``launch`` (accepted, pending), ``launch_refused``, ``node_up``, ``notice`` (drain
        sent), ``preempted`` (killed at the deadline), ``terminated`` (autoscaler
        scale-down), ``launch_failed``, ``trace_start``, ``trace_event``, ``provider_shutdown``."""
        with self._lock:
            own = list(self._events)
        theirs = _prov.read_events(self._dir) if self._dir is not None else []
        notice = {e["node_id"]: e["notice_s"] for e in own if e["event"] == "notice"}
        for e in theirs:
            if e["event"] == "preempted":
                e["notice_s"] = notice.get(e["node_id"])
        return sorted(own + theirs, key=lambda e: e["ts"])

    def wait_for_nodes(self, node_type: str, n: int, timeout_s: float) -> Dict[str, str]:
        """Wait until at least ``n`` nodes of ``node_type`` are alive; returns them."""
        self._check_type(node_type)
        return _wait(lambda: (lambda a: a if len(a) >= n else None)(self.alive_nodes(node_type)),
                     timeout_s, f"{n} alive {node_type!r} node(s) (have "
                     f"{{}}; cap {self._caps[node_type]}, see cloud.history)",
                     lambda: len(self.alive_nodes(node_type)))

    def wait_for_trace(self, timeout_s: float) -> None:
        """Wait until every trace event has run and every preempted node is dead."""
        def done() -> bool:
            with self._lock:
                killed = {n for n, _ in self._kill}
            return self._scheduler.idle() and not killed & set(self.alive_nodes())

        _wait(done, timeout_s, "the trace and its preemptions to finish")

    # -- what the trace (or a test) does ------------------------------------------------

    def start_trace(self, trace: Trace, time_scale: float = 1.0) -> None:
        """Replay ``trace`` from now. ``time_scale`` multiplies every event time and notice
        (0.5 = twice as fast)."""
        if not time_scale > 0:
            raise ValueError(f"time_scale={time_scale!r} must be > 0")
        trace.check_node_types(self.node_types)
        t0 = time.monotonic()
        self._record("trace_start", None, None, detail={"source": trace.source,
                                                        "time_scale": time_scale})
        for e in trace.events:
            self._scheduler.call_at(t0 + e.time_s * time_scale,
                                    lambda e=e: self._apply(e, time_scale))

    def set_capacity(self, node_type: str, count: Optional[int], *,
                     preempt_excess_notice_s: Optional[float] = None) -> List[str]:
        """Set the cap (None = unlimited). Like the trace's ``capacity`` event it only limits
        new launches, unless ``preempt_excess_notice_s`` is given: then nodes above the new
        cap get a preemption notice of that many seconds. Returns the preempted node ids."""
        self._check_type(node_type)
        if count is not None:
            count = self._check_count(count, "count")
        self._record("capacity", node_type, None, detail={"capacity": count})
        with self._lock:
            self._caps[node_type] = count
            self._write_control()
        if preempt_excess_notice_s is None or count is None:
            return []
        excess = len(self._preemptible(node_type)) - count
        return self.preempt(node_type, excess, preempt_excess_notice_s) if excess > 0 else []

    def preempt(self, node_type: str, count: int = 1, notice_s: float = 0.0, *,
                node_ids: Optional[Sequence[str]] = None) -> List[str]:
        """Give ``count`` alive nodes of ``node_type`` (newest first, or ``node_ids``) a
        preemption notice: a Ray drain with deadline now + ``notice_s``; each is killed at
        its deadline (at once for 0). Returns the node ids (fewer if fewer are up)."""
        self._check_type(node_type)
        victims = list(node_ids) if node_ids is not None else \
            sorted(self._preemptible(node_type), reverse=True)[:max(0, int(count))]
        if len(victims) < count and node_ids is None:
            self._record("preempt_short", node_type, None,
                         detail=f"asked to preempt {count}, {len(victims)} up")
        for node_id in victims:
            self._notice(node_type, node_id, float(notice_s))
        return victims

    # -- internals ----------------------------------------------------------------------

    def _apply(self, e: TraceEvent, time_scale: float) -> None:
        self._record("trace_event", e.node_type, None, notice_s=e.notice_s,
                     detail={"kind": e.kind.value, "time_s": e.time_s, "count": e.count,
                             "line": e.line})
        if e.kind is TraceEventKind.CAPACITY:
            self.set_capacity(e.node_type, e.count)
        elif e.kind is TraceEventKind.ADD:
            with self._lock:
                self.set_capacity(e.node_type, max(0, (self._caps[e.node_type] or 0) + e.count))
        else:
            self.preempt(e.node_type, e.count, e.notice_s * time_scale)

    def _preemptible(self, node_type: str) -> List[str]:
        with self._lock:
            return [n for n in self.alive_nodes(node_type) if n not in self._noticed]

    def _notice(self, node_type: str, node_id: str, notice_s: float) -> None:
        from ray.core.generated import autoscaler_pb2

        deadline = time.monotonic() + notice_s
        with self._lock:
            self._noticed[node_id] = deadline
            self._write_control()
        accepted, why = True, ""
        if notice_s > 0:
            deadline_ms = int((time.time() + notice_s) * 1000)
            with self._gcs_lock:
                accepted, why = self._gcs.drain_node(
                node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                    f"raylastic.sim: {node_type} preempted, {notice_s:g} s notice", deadline_ms)
        self._record("notice", node_type, node_id, notice_s=notice_s,
                     detail={"drained": notice_s > 0 and accepted, "rejected": why or None})
        self._scheduler.call_at(deadline, lambda: self._order_kill(node_id, notice_s > 0))

    def _order_kill(self, node_id: str, graceful: bool) -> None:
        with self._lock:
            self._kill.append((node_id, graceful))
            self._write_control()

    def _write_control(self, shutdown: bool = False) -> None:
        with self._lock:
            _prov.write_control(self._dir, {"caps": self._caps, "noticed": list(self._noticed),
                                            "kill": self._kill, "shutdown": shutdown})

    def _record(self, event: str, node_type: Optional[str], node_id: Optional[str],
                notice_s: Optional[float] = None, detail: Any = None) -> None:
        rec = {"ts": time.time(), "event": event, "node_type": node_type, "node_id": node_id,
               "notice_s": notice_s, "detail": detail}
        with self._lock:
            self._events.append(rec)
        logger.info("spot cloud: %s", rec)

    def _autoscaler_config(self, gcs_address: str) -> Dict[str, Any]:
        types = {HEAD_NODE_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0}}
        types.update({n: t.autoscaler_entry() for n, t in self.node_types.items()})
        empty_lists = ("initialization_commands", "setup_commands", "head_setup_commands",
                       "worker_setup_commands", "head_start_ray_commands",
                       "worker_start_ray_commands", "cluster_synced_files", "rsync_exclude",
                       "rsync_filter")
        return {
            "cluster_name": "raylastic-spotcloud",
            "max_workers": sum(t.max_nodes for t in self.node_types.values()),
            "upscaling_speed": 100.0,
            "idle_timeout_minutes": self._idle_timeout_s / 60.0,
            "provider": {
                "type": "external", "module": _prov.PROVIDER_MODULE,
                "gcs_address": gcs_address, "head_node_id": _prov.HEAD_NODE_ID,
                "use_node_id_as_ip": True, "disable_node_updaters": True,
                "disable_launch_config_check": True, "sim_dir": str(self._dir),
                "launch_delay_s": {n: t.launch_delay_s for n, t in self.node_types.items()},
            },
            "available_node_types": types,
            "head_node_type": HEAD_NODE_TYPE,
            "auth": {}, "docker": {}, "file_mounts": {},
            "file_mounts_sync_continuously": False,
            **{k: [] for k in empty_lists},
        }

    def _kill_leftover_pids(self) -> None:
        """Last resort after shutdown: SIGKILL processes of nodes this cloud started."""
        for e in _prov.read_events(self._dir):
            if e["event"] != "node_up":
                continue
            for pid in (e.get("detail") or {}).get("pids", []):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _check_type(self, name: str) -> None:
        if name not in self.node_types:
            raise ValueError(f"unknown node type {name!r}; this SpotCloud defines "
                             f"{sorted(self.node_types)}")

    @staticmethod
    def _check_count(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{what}={value!r} must be an integer >= 0")
        return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _environ:
    """Set environment variables for a block (the head's processes inherit them)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env, self._saved = dict(env), {}

    def __enter__(self) -> None:
        self._saved = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str = "condition",
          progress: Optional[Callable[[], Any]] = None, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            now = progress() if progress is not None else None
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for "
                               f"{what.format(now)}")
        time.sleep(interval_s)
