"""Refuse a local ``storage_path`` that the cluster's other hosts do not see.

A local path is fine on one machine or on a mount every node shares (NFS, a Lustre or
EFS mount at the same path). On several hosts without such a mount, each node would write
its own disk: rank 0's checkpoint lands on one node, the restore looks on another, and the
run "loses" its checkpoints. Ray Train finds out at the first checkpoint; we ask before the
first worker starts.

How: the run's lease record (``checkpoint/lease.py``) has just been written through the
driver's view of the path, with a random token in it. One zero-CPU task per distinct host
reads that file through its own view; a host that cannot find it, or finds another token
(a stale copy on its own disk), does not share the path. Hosts that join later are not
checked here (docs/security.md says so).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

from raylastic.errors import ConfigError

CHECK_TIMEOUT_S = 60.0


def _read_token(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return str(json.loads(fh.read().decode("utf-8")).get("token", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def hosts_by_ip() -> Dict[str, str]:
    """``{host ip: one alive node id on it}`` for the nodes Ray reports alive."""
    import ray

    hosts: Dict[str, str] = {}
    for n in ray.nodes():
        if n.get("Alive"):
            hosts.setdefault(n.get("NodeManagerAddress", ""), n["NodeID"])
    return hosts


def check_shared(lease_path: str, token: str, storage_path: str) -> None:
    """Raise ConfigError naming ``RunConfig.storage_path`` if a host does not share it."""
    hosts = hosts_by_ip()
    if len(hosts) < 2:
        return  # one host (a laptop, ray.cluster_utils.Cluster): nothing to share
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_read_token)
    refs = {
        ip: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(lease_path)
        for ip, node in hosts.items()
    }
    missing: List[str] = []
    for ip, ref in refs.items():
        try:
            seen = ray.get(ref, timeout=CHECK_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a node that dies now is not a config problem
            continue
        if seen != token:
            missing.append(ip)
    if missing:
        raise ConfigError(
            f"RunConfig.storage_path={storage_path!r} is a local path that host(s) "
            f"{', '.join(sorted(missing))} do not share with this driver ({os.uname().nodename}): "
            "each node would write checkpoints to its own disk and a restore would not find them. "
            "Fix: mount the same shared filesystem (NFS, EFS, Lustre) at that path on every node, "
            "or use object storage (s3://, gs://, abfs://)."
        )
