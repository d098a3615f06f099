"""Node types (spot / on-demand) and their hourly prices.

The convention that ties a Ray cluster to raylastic's node types
----------------------------------------------------------------
A raylastic *node type* is a name (``"spot"``, ``"on-demand-gpu"``...) and a market
(:class:`Market.SPOT` or :class:`Market.ON_DEMAND`). Every worker node of type ``<name>``
carries, in the cluster config (cluster-launcher ``available_node_types.<x>`` or a KubeRay
worker group):

- the **custom resource** ``{"node_type:<name>": <slots>}``: one unit per training-worker
  slot on the node (1 for a one-worker node, 8 for an 8-GPU node running one worker per
  GPU). A worker actor asks for ``{"node_type:<name>": 1, **worker_resources}``, so it can
  only land on that type, and ``ray.autoscaler.sdk.request_resources(bundles=...)`` with
  that bundle makes the autoscaler launch exactly that type. The head node carries no
  ``node_type:*`` resource, so no worker is ever placed on it.
- the **Ray labels** ``raylastic.io/market=spot|on_demand`` and
  ``raylastic.io/node-type=<name>``, used as ``bundle_label_selectors`` (autoscaler v2) and
  for humans reading ``ray status``. (``ray.io/market-type`` is Ray's own label, set from
  ``RAY_NODE_MARKET_TYPE``; custom labels may not use the ``ray.io/`` prefix.)

Names must be valid label values: 1-63 characters, letters, digits, ``-``, ``_``, ``.``,
starting and ending with a letter or digit.

Prices
------
:class:`PriceTable` maps node type name -> USD per hour. Build it from a mapping, or from a
cluster-launcher YAML's ``metadata.raylastic.prices_usd_per_hour`` block (Ray does not
interpret ``metadata``; node-type ``resources`` must be integers, so prices cannot live
there), or from a KubeRay RayCluster/RayJob annotation ``raylastic.io/prices-usd-per-hour``
(a JSON object). Record :meth:`PriceTable.to_record` in the event log so cost can be
computed later.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Tuple, Union

RESOURCE_PREFIX = "node_type:"
MARKET_LABEL = "raylastic.io/market"
NODE_TYPE_LABEL = "raylastic.io/node-type"
PRICES_ANNOTATION = "raylastic.io/prices-usd-per-hour"
_KUBERAY_KINDS = ("RayCluster", "RayJob")

_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


class Market(str, Enum):
    SPOT = "spot"
    ON_DEMAND = "on_demand"

    @classmethod
    def parse(cls, value: Union["Market", str], what: str = "market") -> "Market":
        if isinstance(value, Market):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what}={value!r} is not a market; use 'spot' or 'on_demand'") from None


class UnknownNodeTypeError(ValueError):
    """A node type name that the configuration does not define."""


class MissingPriceError(ValueError):
    """A node type that gets used has no hourly price."""


def validate_node_type_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{what}={name!r} is not a valid node type name: use 1-63 letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit (it becomes the "
            f"'{NODE_TYPE_LABEL}' label value and the '{RESOURCE_PREFIX}<name>' resource)"
        )
    return name


@dataclass(frozen=True, kw_only=True)
class NodeType:
    """One kind of worker node. See the module docstring for the resource/label convention.

    ``worker_resources`` is what one training worker needs on such a node besides the
    ``node_type:<name>`` slot, e.g. ``{"GPU": 1}`` (so Ray sets CUDA_VISIBLE_DEVICES) or
    ``{"CPU": 1}``.
    """

    name: str
    market: Market
    worker_resources: Dict[str, float] = field(default_factory=lambda: {"CPU": 1})

    def __post_init__(self) -> None:
        validate_node_type_name(self.name, "NodeType.name")
        object.__setattr__(self, "market", Market.parse(self.market, "NodeType.market"))
        res = dict(self.worker_resources)
        for key, value in res.items():
            if key.startswith(RESOURCE_PREFIX):
                raise ValueError(
                    f"NodeType {self.name!r}: worker_resources must not contain {key!r}; "
                    f"the '{self.resource_key}' slot is added by bundle()"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"NodeType {self.name!r}: worker_resources[{key!r}]={value!r} must be a number >= 0")
        object.__setattr__(self, "worker_resources", res)

    def __hash__(self) -> int:  # the dict field is never mutated after construction
        return hash((self.name, self.market, tuple(sorted(self.worker_resources.items()))))

    @property
    def resource_key(self) -> str:
        """The custom resource every node of this type carries, one unit per worker slot."""
        return f"{RESOURCE_PREFIX}{self.name}"

    @property
    def labels(self) -> Dict[str, str]:
        """The Ray node labels every node of this type carries."""
        return {MARKET_LABEL: self.market.value, NODE_TYPE_LABEL: self.name}

    def bundle(self) -> Dict[str, float]:
        """Resources of one worker: the type's slot plus ``worker_resources``."""
        return {self.resource_key: 1, **self.worker_resources}

    def label_selector(self) -> Dict[str, str]:
        """Equality label selector matching this type (for ``bundle_label_selectors``)."""
        return dict(self.labels)


DEFAULT_NODE_TYPES: Tuple[NodeType, ...] = (
    NodeType(name="spot", market=Market.SPOT),
    NodeType(name="on_demand", market=Market.ON_DEMAND),
)


def _load_config(config: Union[Mapping[str, Any], str, Path]) -> Tuple[Mapping[str, Any], str]:
    if isinstance(config, Mapping):
        return config, "cluster config"
    import yaml  # only needed when reading a file

    path = Path(config)
    with path.open() as f:
        data = yaml.safe_load(f)
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: not a YAML mapping (expected a Ray cluster config)")
    return data, str(path)


def node_types_from_cluster_config(
    config: Union[Mapping[str, Any], str, Path],
) -> Tuple[NodeType, ...]:
    """Node types declared in a cluster config: a Ray cluster-launcher config or a KubeRay
    RayCluster / RayJob manifest (a dict or a YAML path).

    Every node type (launcher ``available_node_types`` entry, KubeRay worker group) whose
    resources hold a ``node_type:<name>`` key is a raylastic node type; its market comes
    from its ``raylastic.io/market`` label. ``worker_resources`` come from
    ``metadata.raylastic.worker_resources.<name>`` (launcher configs) if given, else
    ``{"GPU": GPUs per slot}`` on GPU nodes and ``{"CPU": 1}`` otherwise.
    """
    data, source = _load_config(config)
    explicit: Mapping[str, Any]
    if data.get("kind") in _KUBERAY_KINDS:
        entries, explicit = _kuberay_entries(data, source), {}
    else:
        entries = {k: v or {} for k, v in (data.get("available_node_types") or {}).items()}
        explicit = _raylastic_metadata(data, source).get("worker_resources") or {}
    found = []
    for entry, spec in entries.items():
        resources = spec.get("resources") or {}
        keys = [k for k in resources if k.startswith(RESOURCE_PREFIX)]
        if not keys:
            continue
        where = f"{source}: node type {entry!r}"
        if len(keys) > 1:
            raise ValueError(f"{where}: more than one node_type:* resource ({keys}); keep one")
        name = validate_node_type_name(keys[0][len(RESOURCE_PREFIX) :], f"{where} resource name")
        labels = spec.get("labels") or {}
        if MARKET_LABEL not in labels:
            raise ValueError(
                f"{where}: has resource {keys[0]!r} but no '{MARKET_LABEL}' label; add "
                f"labels: {{'{MARKET_LABEL}': spot}} (or on_demand)"
            )
        if labels.get(NODE_TYPE_LABEL, name) != name:
            raise ValueError(
                f"{where}: label {NODE_TYPE_LABEL}={labels[NODE_TYPE_LABEL]!r} disagrees with "
                f"resource {keys[0]!r}; make them name the same node type"
            )
        slots = float(resources[keys[0]])
        if name in explicit:
            worker = dict(explicit[name])
        elif float(resources.get("GPU") or 0) > 0:
            worker = {"GPU": float(resources["GPU"]) / slots}
        else:
            worker = {"CPU": 1}
        market = Market.parse(labels[MARKET_LABEL], f"{where} label {MARKET_LABEL}")
        found.append(NodeType(name=name, market=market, worker_resources=worker))
    if not found:
        raise ValueError(
            f"{source}: no node type carries a '{RESOURCE_PREFIX}<name>' resource; see "
            "cluster-configs/README.md for the convention"
        )
    return tuple(found)


def _raylastic_metadata(data: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    meta = (data.get("metadata") or {}).get("raylastic") or {}
    if not isinstance(meta, Mapping):
        raise ValueError(f"{source}: metadata.raylastic must be a mapping")
    return meta


def _kuberay_entries(data: Mapping[str, Any], source: str) -> Dict[str, Dict[str, Any]]:
    """KubeRay worker groups as {groupName: {"resources": {...}, "labels": {...}}}, read
    the way Ray's KubeRay autoscaler reads them (top-level ``resources``/``labels``, else
    ``rayStartParams``; GPUs from the container's ``nvidia.com/gpu`` limit)."""
    spec = data.get("spec") or {}
    if data.get("kind") == "RayJob":
        spec = spec.get("rayClusterSpec") or {}
    entries = {}
    for group in spec.get("workerGroupSpecs") or []:
        name = group.get("groupName", "?")
        params = group.get("rayStartParams") or {}
        resources: Dict[str, Any] = dict(group.get("resources") or {})
        if not resources and params.get("resources"):
            text = str(params["resources"]).strip()
            if len(text) > 1 and text[0] == text[-1] == '"':
                text = text[1:-1]
            try:
                resources = json.loads(text.replace('\\"', '"'))
            except ValueError:
                raise ValueError(
                    f"{source}: worker group {name!r}: rayStartParams.resources {params['resources']!r} "
                    "is not a JSON object"
                ) from None
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        gpus = ((containers[0].get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
        if gpus is not None and "GPU" not in resources:
            resources["GPU"] = gpus
        labels = group.get("labels")
        if labels is None and params.get("labels"):
            labels = dict(pair.split("=", 1) for pair in str(params["labels"]).split(","))
        entries[name] = {"resources": resources, "labels": labels or {}}
    return entries


@dataclass(frozen=True, kw_only=True)
class PriceTable:
    """Hourly USD price per node type name. ``source`` says where the prices came from."""

    usd_per_hour: Dict[str, float]
    source: str = "user mapping"

    def __post_init__(self) -> None:
        prices = {}
        for name, price in dict(self.usd_per_hour).items():
            validate_node_type_name(name, f"PriceTable ({self.source}) node type")
            if (
                isinstance(price, bool)
                or not isinstance(price, (int, float))
                or not (math.isfinite(price) and price >= 0)
            ):
                raise ValueError(
                    f"PriceTable ({self.source}): price for {name!r} is {price!r}; use a "
                    "finite number of USD per hour >= 0"
                )
            prices[name] = float(price)
        object.__setattr__(self, "usd_per_hour", prices)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.usd_per_hour.items())), self.source))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, float], source: str = "user mapping") -> "PriceTable":
        return cls(usd_per_hour=dict(mapping), source=source)

    @classmethod
    def from_cluster_config(cls, config: Union[Mapping[str, Any], str, Path]) -> "PriceTable":
        """Read ``metadata.raylastic.prices_usd_per_hour`` from a cluster-launcher config,
        or the ``raylastic.io/prices-usd-per-hour`` annotation (JSON) of a KubeRay
        RayCluster / RayJob."""
        data, source = _load_config(config)
        if data.get("kind") in _KUBERAY_KINDS:
            where = f"metadata.annotations['{PRICES_ANNOTATION}']"
            text = ((data.get("metadata") or {}).get("annotations") or {}).get(PRICES_ANNOTATION)
            try:
                prices = json.loads(text) if text else None
            except ValueError:
                raise ValueError(f"{source}: {where} is not JSON: {text!r}") from None
        else:
            where = "metadata.raylastic.prices_usd_per_hour"
            prices = _raylastic_metadata(data, source).get("prices_usd_per_hour")
        if not isinstance(prices, Mapping) or not prices:
            raise MissingPriceError(
                f"{source}: no {where} mapping; add one (node type name -> USD per hour) "
                "or pass PriceTable.from_mapping({...})"
            )
        return cls(usd_per_hour=dict(prices), source=source)

    def price_for(self, node_type: Union[NodeType, str]) -> float:
        """USD per hour for ``node_type``; :class:`MissingPriceError` names the fix."""
        name = node_type.name if isinstance(node_type, NodeType) else node_type
        try:
            return self.usd_per_hour[name]
        except KeyError:
            raise MissingPriceError(
                f"no hourly price for node type {name!r} (prices from {self.source} cover "
                f"{sorted(self.usd_per_hour)}); add {name!r} to the price mapping or to "
                "metadata.raylastic.prices_usd_per_hour"
            ) from None

    def require(self, names: Iterable[str]) -> None:
        """Raise one :class:`MissingPriceError` listing every name without a price."""
        missing = sorted(set(n for n in names if n not in self.usd_per_hour))
        if missing:
            raise MissingPriceError(
                f"no hourly price for node type(s) {missing} that this run can use (prices "
                f"from {self.source} cover {sorted(self.usd_per_hour)}); add them to the "
                "price mapping or to metadata.raylastic.prices_usd_per_hour"
            )

    def cost_usd(self, node_type: Union[NodeType, str], seconds: float) -> float:
        return self.price_for(node_type) * seconds / 3600.0

    def to_record(self) -> Dict[str, Any]:
        """A plain, JSON-ready record for the event log."""
        return {"kind": "prices", "usd_per_hour": dict(self.usd_per_hour), "source": self.source}
