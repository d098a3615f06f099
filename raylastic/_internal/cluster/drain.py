"""Drain this process's Ray node: how a cloud preemption notice reaches Ray.

A drain (``DRAIN_NODE_REASON_PREEMPTION`` with a deadline) is the one signal raylastic's
controller acts on, whoever sends it: this module (cloud metadata, ``notices.py``), the
autoscaler, KubeRay, ``ray drain-node``, or ``raylastic.sim``. A drained node keeps running
its actors and gets no new work; Ray does nothing at the deadline (the cloud kills the
VM). Measured facts: ``../shared/RAY_NOTES.md`` ("Draining").

Ray 2.60 lets a later drain replace an earlier one's deadline (even with 0, "no
deadline"), so :func:`drain_local_node` never moves a known deadline later: every worker
on a node may report the same notice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, Optional, Set

from raylastic._internal.cluster.notices import NoticeWatcher, PreemptionNotice, watcher_from_env

logger = logging.getLogger("raylastic")

DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


@dataclass(frozen=True)
class DrainResult:
    node_id: str  # hex
    accepted: bool
    deadline_ms: int  # the node's drain deadline now (Unix ms; 0 = none)
    message: str  # Ray's rejection reason, or why no request was sent; "" otherwise


def alive_nodes() -> Set[str]:
    """Hex ids of the nodes the GCS reports alive (draining ones included). Needs a
    connected Ray worker or driver; raises whatever Ray raises without one."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def draining_nodes() -> Dict[str, int]:
    """``{node_id_hex: deadline_ms}`` of every node Ray is draining (0 = no deadline).
    Needs a connected Ray worker or driver."""
    from ray._private.state import state

    return dict(state.get_draining_nodes())


def drain_local_node(reason: str, deadline_ts: Optional[float]) -> DrainResult:
    """Ask the GCS to drain the Ray node this process runs on, as a preemption.

    ``deadline_ts``: Unix seconds when the node goes away (None or 0: no deadline). Call
    it from inside a Ray task or actor (or a driver on the node to drain). If the node is
    already draining with a deadline no later than this one, nothing is sent."""
    import ray
    from ray.core.generated import autoscaler_pb2

    if not ray.is_initialized():
        raise RuntimeError(
            "drain_local_node needs a connected Ray worker: call it inside a "
            "Ray actor or task, or after ray.init() on the node to drain"
        )
    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    deadline_ms = int(deadline_ts * 1000) if deadline_ts else 0
    try:
        current = draining_nodes().get(node_id)
    except Exception as e:  # noqa: BLE001 - then just send the drain
        logger.debug("could not read draining nodes: %s", e)
        current = None
    if current and (deadline_ms == 0 or current <= deadline_ms):
        return DrainResult(node_id, True, current, "already draining with an earlier deadline")
    # GcsClient: not in Ray's partial _raylet.pyi
    gcs = ray._raylet.GcsClient(address=ctx.gcs_address)  # type: ignore[attr-defined]
    accepted, rejection = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON), reason, deadline_ms
    )
    if not accepted:
        logger.warning("Ray refused to drain node %s: %s", node_id[:8], rejection)
    return DrainResult(node_id, bool(accepted), deadline_ms if accepted else (current or 0), rejection or "")


def drain_on_notice(notice: PreemptionNotice) -> DrainResult:
    """The :class:`NoticeWatcher` callback: drain this node until the notice's deadline."""
    result = drain_local_node(f"raylastic: {notice.source} preemption notice: {notice.reason}", notice.deadline_ts)
    logger.warning(
        "drained node %s on a %s preemption notice (deadline in %.1f s): %s",
        result.node_id[:8],
        notice.source,
        notice.deadline_ts - time.time(),
        "accepted" if result.accepted else f"refused: {result.message}",
    )
    return result


def start_preemption_watcher(environ=None) -> Optional[NoticeWatcher]:
    """Start a watcher that drains this node on the first cloud notice, for the sources
    ``RAYLASTIC_PREEMPTION_SOURCES`` enables; None (and no thread) when none are."""
    watcher = watcher_from_env(drain_on_notice, environ)
    return watcher.start() if watcher is not None else None
