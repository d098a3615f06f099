"""The Ray processes of a :class:`~raylastic.sim.cloud.SpotCloud` and what it asks of Ray
itself rather than of its provider: start the head (whose monitor process runs the
autoscaler, and so the provider) and connect to it, read the GCS's node table, drain a node
at a preemption notice, and make sure no worker raylet outlives the cloud.

Kept apart from ``cloud.py`` so that the cloud reads as its bookkeeping (caps, notices, kill
orders, the trace, the history) while Ray's details (the fake-cluster environment, the
head's arguments, protobuf enums, raylet pids) sit in one place. Everything here runs in
the driver's process; :mod:`raylastic.sim.provider` runs in Ray's monitor process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from raylastic.policies.node_types import RESOURCE_PREFIX
from raylastic.sim import provider as _prov
from raylastic.sim._scheduler import environ, free_port, wait_for
from raylastic.sim.config import NODE_OBJECT_STORE_BYTES, SimNodeType, autoscaler_config
from raylastic.testing.cluster import FAST_FAILURE_DETECTION, QUIET_DAEMON_ENV, QUIET_DAEMONS

logger = logging.getLogger("raylastic.sim.cloud")  # SpotCloud's warnings keep their logger

_PROVIDER_SHUTDOWN_WAIT_S = 10.0

# Environment of the head's processes (the monitor inherits it): fake-cluster mode, a
# 1 s autoscaler loop (Ray's default is 5 s), autoscaler v1.
_HEAD_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_enable_autoscaler_v2": "0"}


def start_head(node_types: Sequence[SimNodeType], *, idle_timeout_s: float, state_dir: Path) -> Any:
    """Write the v1 autoscaler config for ``node_types`` into ``state_dir`` and start the
    head in this process with it (0 CPUs, on a free GCS port, under the provider's head node
    id), so that Ray's monitor runs the autoscaler with the simulator's provider. Returns the
    ``ray.cluster_utils.Cluster``."""
    import ray
    from ray.cluster_utils import Cluster

    port = free_port()
    config = autoscaler_config(
        tuple(node_types),
        idle_timeout_s=idle_timeout_s,
        gcs_address=f"{ray.util.get_node_ip_address()}:{port}",
        state_dir=state_dir,
    )
    config_path = state_dir / "autoscaler.json"
    config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    with environ(_HEAD_ENV):
        return Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "gcs_server_port": port,
                "include_dashboard": False,
                "autoscaling_config": str(config_path),
                "_system_config": {**FAST_FAILURE_DETECTION, **QUIET_DAEMONS},
                "object_store_memory": NODE_OBJECT_STORE_BYTES,
                "env_vars": {**QUIET_DAEMON_ENV, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": _prov.HEAD_NODE_ID},
            },
        )


def gcs_client(address: str) -> Any:
    """A ``ray._raylet.GcsClient`` of the head at ``address``: node table and drains."""
    import ray

    # GcsClient: not in Ray's partial _raylet.pyi
    return ray._raylet.GcsClient(address=address)  # type: ignore[attr-defined]


def connect_driver(address: str) -> None:
    """``ray.init`` this process to the head at ``address``, so that its
    ``request_resources`` calls reach this cloud's autoscaler."""
    import ray
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    ray.init(address=address)
    # request_resources() reads a per-process cache of "is this cluster on
    # autoscaler v2?"; refresh it from this head.
    is_autoscaler_v2(fetch_from_server=True)


def alive_worker_nodes(infos: Mapping[Any, Any], node_type: Optional[str] = None) -> Dict[str, str]:
    """``{node_id_hex: node_type}`` of the alive nodes (draining ones included) in
    ``GcsClient.get_all_node_info()``'s answer ``infos``. A node's type is its
    ``node_type:<name>`` resource; the head has none, so it is never listed."""
    from ray.core.generated import gcs_pb2

    out = {}
    for node_id, info in infos.items():
        if info.state != gcs_pb2.GcsNodeInfo.ALIVE:
            continue
        names = [k[len(RESOURCE_PREFIX) :] for k in info.resources_total if k.startswith(RESOURCE_PREFIX)]
        if names and (node_type is None or names[0] == node_type):
            out[node_id.hex()] = names[0]
    return out


def drain_for_preemption(gcs: Any, node_type: str, node_id: str, notice_s: float) -> Tuple[bool, Any]:
    """Drain ``node_id`` through ``gcs`` (a ``GcsClient``) as a preemption with a deadline
    ``notice_s`` from now, as a cloud's notice reaches Ray: the node keeps its actors, gets
    no new work, and is listed as draining. Returns Ray's ``(accepted, rejection reason)``."""
    from ray.core.generated import autoscaler_pb2

    return gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"raylastic.sim: {node_type} preempted, {notice_s:g} s notice",
        int((time.time() + notice_s) * 1000),
    )


def ensure_nodes_stopped(state_dir: Path, session: str) -> None:
    """After the control file asked the provider to shut down: wait for its
    ``provider_shutdown`` record, and if it does not come, kill the raylets it started
    (:func:`kill_leftover_raylets`), so that no node outlives its cloud."""
    try:
        wait_for(
            lambda: any(e["event"] == "provider_shutdown" for e in _prov.read_events(state_dir)),
            _PROVIDER_SHUTDOWN_WAIT_S,
            "the provider to stop its nodes",
        )
    except TimeoutError:
        logger.warning("spot cloud: the provider did not confirm its shutdown; killing its raylets by pid")
        kill_leftover_raylets(state_dir, session)


def kill_leftover_raylets(state_dir: Path, session: str) -> None:
    """Last resort if the provider could not stop its nodes: SIGKILL the raylets this
    cloud started (their workers exit when their raylet is gone). A pid is killed only
    while its command line still names this session (pids get reused)."""
    for e in _prov.read_events(state_dir):
        if e["event"] != "node_up":
            continue
        for pid in (e.get("detail") or {}).get("pids", []):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if session.encode() in f.read():
                        os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
