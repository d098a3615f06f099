"""The node provider of the local spot cloud: runs inside Ray's autoscaler (monitor) process.

:class:`SpotSimProvider` extends Ray's fake multi-node provider (every "instance" is a real
raylet on this machine) with what a spot market does to a cluster:

- a per-node-type **capacity cap**: a launch above the cap is refused with
  ``NodeLaunchException("InsufficientCapacity")``, the way a cloud refuses a spot request.
  The v1 autoscaler logs the failure and asks again at its next update (every second
  here), so a refused launch succeeds as soon as the cap allows it. Nodes that got a
  preemption notice do not count against the cap (their capacity is already gone);
- a per-node-type **launch delay** before the raylet starts (the node is "pending" in
  the provider's list meanwhile, so the autoscaler does not launch it twice);
- **preemption**: :class:`raylastic.sim.cloud.SpotCloud` drains the node through Ray and
  at the deadline asks the provider to kill it; the provider stops the node's raylet
  (SIGTERM after a notice, SIGKILL without one) and drops the node from its own list,
  which lets the autoscaler replace it.

The provider lives in another process than :class:`SpotCloud`, so they talk through two
files in the cloud's state directory: ``control.json`` (caps, noticed/kill node ids,
shutdown; written atomically by the cloud, re-read by the provider every
:data:`POLL_S`) and ``events.jsonl`` (every launch, refusal, start, kill and
termination, appended by the provider with wall-clock times).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Set

import ray
import ray._private.ray_constants as ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import (
    FAKE_HEAD_NODE_ID,
    FakeMultiNodeProvider,
)
from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UNINITIALIZED,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from raylastic.testing.cluster import QUIET_DAEMON_ENV

logger = logging.getLogger(__name__)

CONTROL_FILE = "control.json"
EVENTS_FILE = "events.jsonl"
POLL_S = 0.05
PROVIDER_MODULE = "raylastic.sim.provider.SpotSimProvider"
HEAD_NODE_ID = FAKE_HEAD_NODE_ID  # the head is started under this id so the provider knows it


def write_control(state_dir: Path, control: Mapping[str, Any]) -> None:
    """Atomically replace ``control.json`` (the provider never reads a half-written file)."""
    tmp = state_dir / f".{CONTROL_FILE}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(json.dumps(control), encoding="utf-8")
    os.replace(tmp, state_dir / CONTROL_FILE)


def read_control(state_dir: Path) -> Dict[str, Any]:
    try:
        return json.loads((state_dir / CONTROL_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def read_events(state_dir: Path) -> list:
    """Every complete record of ``events.jsonl`` (a line still being written is skipped)."""
    try:
        text = (state_dir / EVENTS_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class SpotSimProvider(FakeMultiNodeProvider):
    """Fake multi-node provider with capacity caps, launch delays and preemption kills.

    Extra ``provider`` config keys: ``sim_dir`` (the cloud's state directory) and
    ``launch_delay_s`` (node type -> seconds).
    """

    def __init__(self, provider_config: Dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._dir = Path(provider_config["sim_dir"])
        self._delays = {k: float(v) for k, v in provider_config.get("launch_delay_s", {}).items()}
        self._control: Dict[str, Any] = {}
        self._killed: Set[str] = set()
        self._events_lock = threading.Lock()
        self._events = open(self._dir / EVENTS_FILE, "a", encoding="utf-8")
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._refresh_control()
        self._poller = threading.Thread(target=self._poll_loop, name="spot-sim-control", daemon=True)
        self._poller.start()

    # -- the autoscaler's calls -------------------------------------------------------

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        node_type = tags[TAG_RAY_USER_NODE_TYPE]
        with self.lock:
            self._refresh_control()
            cap = self._caps().get(node_type)
            active = sum(
                1
                for nid, n in self._nodes.items()
                if n["tags"].get(TAG_RAY_USER_NODE_TYPE) == node_type
                and n["tags"].get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER
                and nid not in self._noticed()
            )
            allowed = count if cap is None else max(0, min(count, cap - active))
            for _ in range(allowed):
                self._launch(node_type, tags, resources, labels)
        refused = count - allowed
        if refused:
            self._record(
                "launch_refused",
                node_type,
                None,
                detail={"refused": refused, "capacity": cap, "up_or_pending": active + allowed},
            )
            raise NodeLaunchException(
                "InsufficientCapacity",
                f"simulated spot market: {node_type} capacity is {cap} and "
                f"{active + allowed} node(s) are up or pending",
                src_exc_info=None,
            )

    def terminate_node(self, node_id):
        """The autoscaler scales a node down (idle, max_workers...)."""
        with self.lock:
            node = self._nodes.pop(node_id, None)
        if node is not None:
            self._record("terminated", node["tags"].get(TAG_RAY_USER_NODE_TYPE), node_id, detail={"by": "autoscaler"})
            self._stop_node(node, graceful=True)

    # -- launching ---------------------------------------------------------------------

    def _launch(self, node_type: str, tags, resources, labels) -> None:
        node_id = self._next_hex_node_id()
        all_tags = {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type, TAG_RAY_NODE_NAME: node_id}
        all_tags.update(tags)
        all_tags[TAG_RAY_NODE_STATUS] = STATUS_UNINITIALIZED
        # Ray's FakeMultiNodeProvider._nodes is inferred from its head entry (tags only)
        self._nodes[node_id] = {"tags": all_tags, "node": None}  # type: ignore[dict-item]
        delay = self._delays.get(node_type, 0.0)
        self._record("launch", node_type, node_id, detail={"launch_delay_s": delay})
        threading.Thread(
            target=self._start_after,
            name=f"spot-sim-launch-{node_id[-5:]}",
            args=(node_id, node_type, delay, copy.deepcopy(resources), dict(labels or {})),
            daemon=True,
        ).start()

    def _start_after(self, node_id, node_type, delay, resources, labels) -> None:
        if self._stop.wait(delay):
            return
        # One raylet at a time: Ray names a node's socket files by probing the shared
        # session directory, so two raylets started at once can collide. Holding the lock
        # until the node is registered also lets _shutdown_all see every started node.
        with self._start_lock:
            with self.lock:
                if node_id not in self._nodes or self._stop.is_set():
                    return  # terminated while pending, or shutting down
            try:
                node = self._start_raylet(node_id, node_type, resources, labels)
            except Exception as e:  # noqa: BLE001  (reported; the autoscaler retries)
                logger.exception("spot sim: starting node %s failed", node_id)
                with self.lock:
                    self._nodes.pop(node_id, None)
                self._record("launch_failed", node_type, node_id, detail=repr(e))
                return
            with self.lock:
                entry = self._nodes.get(node_id)
                if entry is not None:
                    entry["node"] = node
                    entry["tags"][TAG_RAY_NODE_STATUS] = STATUS_UP_TO_DATE
        if entry is None:  # terminated while its raylet was starting
            self._stop_node({"node": node}, graceful=False)
            return
        pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
        self._record("node_up", node_type, node_id, detail={"pids": pids})

    def _start_raylet(self, node_id, node_type, resources, labels):
        """One worker raylet, as the parent class starts it, under our node id."""
        gcs = self._gcs_address
        ray_params = ray._private.parameter.RayParams(
            min_worker_port=0,
            max_worker_port=0,
            dashboard_port=None,
            dashboard_agent_listen_port=0,
            include_log_monitor=False,
            num_cpus=resources.pop("CPU", 0),
            num_gpus=resources.pop("GPU", 0),
            object_store_memory=resources.pop("object_store_memory", None),
            resources=resources,
            labels=labels,
            redis_address=gcs,
            gcs_address=gcs,
            env_vars={
                **QUIET_DAEMON_ENV,
                "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id,
                "RAY_CLOUD_INSTANCE_ID": node_id,
                "RAY_NODE_TYPE_NAME": node_type,
                ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
            },
        )
        return ray._private.node.Node(ray_params, head=False, shutdown_at_exit=False, spawn_reaper=False)

    @staticmethod
    def _stop_node(entry, graceful: bool) -> None:
        if entry.get("node") is not None:
            entry["node"].kill_all_processes(check_alive=False, allow_graceful=graceful)

    # -- control channel ----------------------------------------------------------------

    def _caps(self) -> Dict[str, Optional[int]]:
        return self._control.get("caps", {})

    def _noticed(self) -> Set[str]:
        return set(self._control.get("noticed", ()))

    def _refresh_control(self) -> None:
        try:
            self._control = read_control(self._dir)
        except ValueError:  # never half-written (atomic replace); keep the last good one
            pass

    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                with self.lock:
                    self._refresh_control()
                    to_kill = [(n, g) for n, g in self._control.get("kill", ()) if n not in self._killed]
                    shutdown = bool(self._control.get("shutdown"))
                for node_id, graceful in to_kill:
                    self._kill(node_id, graceful)
                if shutdown:
                    self._shutdown_all()
                    return
            except Exception:  # noqa: BLE001  (keep polling; the cloud sees no kill record)
                logger.exception("spot sim: control poll failed")

    def _kill(self, node_id: str, graceful: bool) -> None:
        """Preemption: stop the node (SIGTERM to its raylet when ``graceful``, the way a
        VM shuts down at the end of a notice; SIGKILL otherwise) and forget it, so the
        autoscaler may launch a replacement."""
        self._killed.add(node_id)
        with self.lock:
            entry = self._nodes.pop(node_id, None)
        if entry is None:  # already terminated by the autoscaler: record the order anyway
            self._record("preempted", None, node_id, detail={"signal": None})
            return
        self._record(
            "preempted",
            entry["tags"].get(TAG_RAY_USER_NODE_TYPE),
            node_id,
            detail={"signal": "SIGTERM" if graceful else "SIGKILL"},
        )
        self._stop_node(entry, graceful=graceful)

    def _shutdown_all(self) -> None:
        self._stop.set()
        # Let a raylet start in progress finish and register (Ray's Node() can block for
        # up to 30 s if its node dies while starting; do not wait that long).
        started = self._start_lock.acquire(timeout=5)
        try:
            with self.lock:
                entries = [
                    (nid, e) for nid, e in self._nodes.items() if e["tags"].get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER
                ]
                for nid, _ in entries:
                    self._nodes.pop(nid)
        finally:
            if started:
                self._start_lock.release()
        for _, entry in entries:
            self._stop_node(entry, graceful=False)
        self._record("provider_shutdown", None, None, detail=f"killed {len(entries)} worker node(s)")

    def _record(self, event: str, node_type: Optional[str], node_id: Optional[str], detail: Any = None) -> None:
        rec = {
            "ts": time.time(),
            "event": event,
            "node_type": node_type,
            "node_id": node_id,
            "notice_s": None,
            "detail": detail,
        }
        with self._events_lock:
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
