"""A real multi-node Ray cluster on one machine, for tests, examples and benchmarks.

Every node is its own raylet (``ray.cluster_utils.Cluster``), so removing one is a real
node loss: its processes are killed and the GCS declares it dead. Failure detection is
tuned fast by default (Ray's defaults take ~14 s to notice a dead node; see README).
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Dict, Iterator, List, Optional

import ray
from ray.cluster_utils import Cluster

# GCS health-check settings measured here: a SIGKILLed node is seen dead in ~0.45 s,
# with no false node deaths under training load (../shared/RAY_NOTES.md).
FAST_FAILURE_DETECTION: Dict[str, Any] = {
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 200,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
}

# Ray's periodic work that nothing here reads, turned down: an idle head + 3 nodes took
# 7.4 and 8.5 CPU-s per 30 s in Ray's processes, 6.1 and 6.4 with these (2026-12-07), CPU
# the tests and benchmarks on a 2-core machine then have. Each node's dashboard agent samples every
# process with psutil every 5 s for the dashboard's metrics (not started here), the
# raylets export metrics, and the memory monitor reads /proc 4 times a second to kill
# workers when the machine runs out of memory (a test machine's OOM then fails the test
# itself, not a worker Ray picked).
QUIET_DAEMONS: Dict[str, Any] = {"memory_monitor_refresh_ms": 0, "enable_metrics_collection": False}
QUIET_DAEMON_ENV: Dict[str, str] = {"REPORTER_UPDATE_INTERVAL_MS": "60000"}


class LocalCluster:
    """``with LocalCluster(num_nodes=3) as c:`` gives a head (no CPUs) + 3 worker nodes.

    ``add_node`` must be called from the main thread (Ray installs a signal handler),
    so tests run ``fit()`` in a background thread (see ``FitThread``).
    """

    def __init__(
        self,
        num_nodes: int = 3,
        cpus_per_node: int = 1,
        node_resources: Optional[Dict[str, float]] = None,
        head_cpus: int = 0,
        fast_failure_detection: bool = True,
        object_store_memory: int = 80 * 1024**2,
    ):
        self._num_nodes = num_nodes
        self._cpus = cpus_per_node
        self._resources = dict(node_resources or {})
        self._head_cpus = head_cpus
        self._system_config = {**(FAST_FAILURE_DETECTION if fast_failure_detection else {}), **QUIET_DAEMONS}
        self._osm = object_store_memory
        self.cluster: Optional[Cluster] = None
        self.worker_nodes: List[Any] = []

    def start(self) -> "LocalCluster":
        with _caller_keeps_sigterm():  # (the head's, and ray.init's)
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": self._head_cpus,
                    "_system_config": self._system_config,
                    "object_store_memory": self._osm,
                    "include_dashboard": False,
                    "env_vars": dict(QUIET_DAEMON_ENV),
                },
            )
            for _ in range(self._num_nodes):
                self.add_node(wait=False)
            ray.init(address=self.cluster.address, log_to_driver=True)
        self.cluster.wait_for_nodes()
        return self

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return self.cluster.address

    def add_node(self, wait: bool = True, **kwargs: Any):
        assert self.cluster is not None, "start() the cluster first"
        args: Dict[str, Any] = {
            "num_cpus": self._cpus,
            "resources": dict(self._resources),
            "object_store_memory": self._osm,
        }
        args.update(kwargs)
        args["env_vars"] = {**QUIET_DAEMON_ENV, **(args.get("env_vars") or {})}
        with _caller_keeps_sigterm():
            node = self.cluster.add_node(**args)
        self.worker_nodes.append(node)
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node=None, graceful: bool = False):
        """Kill a worker node (default: the most recently added). A real node loss."""
        assert self.cluster is not None
        node = node if node is not None else self.worker_nodes[-1]
        self.worker_nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=graceful)
        return node

    def node_by_id(self, node_id: str):
        for n in self.worker_nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no live worker node {node_id}")

    def alive_node_ids(self) -> List[str]:
        return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
            self.worker_nodes = []

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def _caller_keeps_sigterm() -> Iterator[None]:
    """Each Ray node made in this process (the head, every ``add_node``) installs Ray's
    SIGTERM handler: drain the node for up to 30 s, kill its processes, ``sys.exit(1)``
    (and ``ray.init`` one of its own, ``sys.exit``).
    A caller that installed a SIGTERM handler of its own keeps it: a benchmark's handler
    writes the results so far, and under ``timeout -k 10`` Ray's 30 s drain meant a
    SIGKILL and no results (2026-11-28). Its cluster is then shut down by the caller's
    ``with`` / ``shutdown()``. Without a handler of the caller's, Ray's stays (the
    newest node's, as without this). Main thread only, as ``add_node`` is."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(before) and not getattr(before, "__module__", "").startswith("ray."):
            signal.signal(signal.SIGTERM, before)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what="condition"):
    """Poll ``predicate`` until it returns a truthy value and return it; TimeoutError after
    timeout_s naming ``what`` (a callable is called for an up-to-date message)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {text}")
        time.sleep(interval_s)
