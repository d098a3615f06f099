"""Node types of the local spot cloud and the autoscaler config built from them.

A :class:`SimNodeType` named ``<name>`` becomes an autoscaler node type of the same name
whose nodes carry (the convention of :mod:`raylastic.policies.node_types`):

- resources ``{"CPU": cpus, "node_type:<name>": 1}``,
- labels ``raylastic.io/market=<market>`` and ``raylastic.io/node-type=<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Sequence

from raylastic.policies.node_types import (
    MARKET_LABEL,
    NODE_TYPE_LABEL,
    RESOURCE_PREFIX,
    Market,
    validate_node_type_name,
)
from raylastic.sim import provider as _prov

HEAD_NODE_TYPE = "ray.head.default"
NODE_OBJECT_STORE_BYTES = 80 * 1024**2  # per node; keeps /dev/shm use small


@dataclass(frozen=True, kw_only=True)
class SimNodeType:
    """One node type of the simulated cloud: ``max_nodes`` is the autoscaler's bound,
    ``launch_delay_s`` is added before the node's raylet starts (which itself takes
    ~1.1-2.3 s here; see docs/simulator.md)."""

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
                raise ValueError(f"SimNodeType {self.name!r}: {field_name}={value!r} must be an integer >= {minimum}")
        for field_name in ("price_usd_per_hour", "launch_delay_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SimNodeType {self.name!r}: {field_name}={value!r} must be a number >= 0")

    @property
    def resource_key(self) -> str:
        return f"{RESOURCE_PREFIX}{self.name}"

    def autoscaler_entry(self) -> Dict[str, Any]:
        """This type's ``available_node_types`` entry."""
        return {
            "resources": {"CPU": self.cpus, self.resource_key: 1, "object_store_memory": NODE_OBJECT_STORE_BYTES},
            "labels": {MARKET_LABEL: self.market.value, NODE_TYPE_LABEL: self.name},
            "node_config": {},
            "min_workers": 0,
            "max_workers": self.max_nodes,
        }


DEFAULT_SIM_NODE_TYPES = (
    SimNodeType(name="spot", market=Market.SPOT, price_usd_per_hour=0.30),
    SimNodeType(name="on_demand", market=Market.ON_DEMAND, price_usd_per_hour=1.00),
)

_EMPTY_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
    "cluster_synced_files",
    "rsync_exclude",
    "rsync_filter",
)


def autoscaler_config(
    node_types: Sequence[SimNodeType], *, gcs_address: str, state_dir: Path, idle_timeout_s: float
) -> Dict[str, Any]:
    """A v1 autoscaler config (what ``ray up`` would read) using
    :class:`~raylastic.sim.provider.SpotSimProvider`. Node ids double as "IPs" and no
    updater runs, as in Ray's fake multi-node example config."""
    types: Dict[str, Any] = {HEAD_NODE_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0}}
    types.update({t.name: t.autoscaler_entry() for t in node_types})
    return {
        "cluster_name": "raylastic-spotcloud",
        "max_workers": sum(t.max_nodes for t in node_types),
        "upscaling_speed": 100.0,  # launch every requested node at once
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        "provider": {
            "type": "external",
            "module": _prov.PROVIDER_MODULE,
            "gcs_address": gcs_address,
            "head_node_id": _prov.HEAD_NODE_ID,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "sim_dir": str(state_dir),
            "launch_delay_s": {t.name: t.launch_delay_s for t in node_types},
        },
        "available_node_types": types,
        "head_node_type": HEAD_NODE_TYPE,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
        **{k: [] for k in _EMPTY_LISTS},
    }
