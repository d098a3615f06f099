"""cluster-configs/: every Ray cluster-launcher YAML passes Ray's own config preparation
and schema validation; the KubeRay manifests have the structure raylastic needs.

No cloud SDK and no network: ``prepare_config`` only merges the provider's defaults.yaml
shipped with Ray (bootstrapping, which calls the cloud, is what ``ray up`` does next and is
not run here). KubeRay manifests also go through Ray's own RayCluster -> autoscaler-config
translation (the function the KubeRay autoscaler runs), then the same schema validation.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from raylastic.policies.capacity import CapacityPolicy
from raylastic.policies.node_types import (
    MARKET_LABEL,
    NODE_TYPE_LABEL,
    RESOURCE_PREFIX,
    Market,
    PriceTable,
    node_types_from_cluster_config,
)

ROOT = Path(__file__).resolve().parents[2] / "cluster-configs"
LAUNCHER = ["aws-spot.yaml", "azure-spot.yaml", "gcp-spot.yaml"]
KUBERAY = ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"]
CLOUD_SDKS = ("boto3", "botocore", "azure.mgmt", "azure.identity", "googleapiclient",
              "google.cloud", "kubernetes")
SPOT_NODE_KEYS = ("cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType",
                  "karpenter.sh/capacity-type", "kubernetes.azure.com/scalesetpriority")


def load(name):
    with open(ROOT / name) as f:
        return yaml.safe_load(f)


def is_spot_node_config(provider, node_config):
    if provider == "aws":
        return (node_config.get("InstanceMarketOptions") or {}).get("MarketType") == "spot"
    if provider == "azure":
        return node_config["azure_arm_parameters"].get("priority") in ("Spot", "Low")
    if provider == "gcp":
        sched = node_config.get("scheduling") or {}
        return sched.get("provisioningModel") == "SPOT" or bool(sched.get("preemptible"))
    raise AssertionError(provider)


def test_all_expected_files_exist():
    names = {p.name for p in ROOT.iterdir()}
    assert set(LAUNCHER + KUBERAY + ["README.md"]) <= names


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_config_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load(name)
    before = set(sys.modules)
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)  # ray-schema.json + Ray's cross-field checks
    loaded = {m for m in set(sys.modules) - before if m.startswith(CLOUD_SDKS)}
    assert not loaded, f"validation pulled in cloud SDKs: {sorted(loaded)}"

    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    provider = raw["provider"]["type"]
    assert not is_spot_node_config(provider, head["node_config"]), "head must be on-demand"
    assert not any(k.startswith(RESOURCE_PREFIX) for k in head["resources"])
    assert head["max_workers"] == 0
    assert sum(t["max_workers"] for n, t in types.items()
               if n != prepared["head_node_type"]) <= prepared["max_workers"]

    for entry, spec in types.items():
        for key in spec["resources"]:
            if key.startswith(RESOURCE_PREFIX):
                assert key == RESOURCE_PREFIX + entry  # node type name == entry name
                market = spec["labels"][MARKET_LABEL]
                assert spec["labels"][NODE_TYPE_LABEL] == entry
                assert is_spot_node_config(provider, spec["node_config"]) == (market == "spot")


@pytest.mark.parametrize("name", LAUNCHER + KUBERAY)
def test_config_defines_spot_and_on_demand_types_with_prices(name):
    from ray._private.label_utils import validate_node_label_syntax

    types = node_types_from_cluster_config(ROOT / name)
    assert sorted(t.market.value for t in types) == ["on_demand", "spot"]
    for t in types:
        validate_node_label_syntax(t.labels)
        assert t.worker_resources.get("GPU") == 1
    prices = PriceTable.from_cluster_config(ROOT / name)
    prices.require(t.name for t in types)
    spot = next(t for t in types if t.market is Market.SPOT)
    od = next(t for t in types if t.market is Market.ON_DEMAND)
    assert prices.price_for(spot) < prices.price_for(od)
    policy = CapacityPolicy(node_types=types, prices=prices, max_on_demand_workers=2,
                            max_wait_s=900)
    assert len(policy.request_args({spot.name: 2, od.name: 1})["bundles"]) == 3


def test_schema_validation_is_real():
    """A price put into node-type resources (floats are not allowed there) is rejected."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load("aws-spot.yaml")
    raw["available_node_types"]["spot-gpu"]["resources"]["price"] = 0.48
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(raw))


def cluster_spec(manifest):
    return manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]


def selects_spot(pod_spec):
    tolerations = [t.get("key") for t in pod_spec.get("tolerations") or []]
    selector = pod_spec.get("nodeSelector") or {}
    return any(k in SPOT_NODE_KEYS for k in tolerations) or any(
        k in SPOT_NODE_KEYS and str(v).lower() in ("true", "spot") for k, v in selector.items())


def avoids_spot(pod_spec):
    terms = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    exprs = {e["key"]: e["operator"] for term in terms or [] for e in term["matchExpressions"]}
    return all(exprs.get(k) in ("DoesNotExist", "NotIn") for k in SPOT_NODE_KEYS)


@pytest.mark.parametrize("name, kind", [("kuberay-raycluster.yaml", "RayCluster"),
                                        ("kuberay-rayjob.yaml", "RayJob")])
def test_kuberay_manifest_structure(name, kind):
    m = load(name)
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == kind
    if kind == "RayJob":
        assert m["spec"]["entrypoint"] and m["spec"]["shutdownAfterJobFinishes"] is True
        assert avoids_spot(m["spec"]["submitterPodTemplate"]["spec"])
    spec = cluster_spec(m)
    assert spec["enableInTreeAutoscaling"] is True

    head = spec["headGroupSpec"]["template"]["spec"]
    assert not selects_spot(head), "head must not tolerate or select spot nodes (kuberay#2153)"
    assert avoids_spot(head)
    assert "resources" not in (spec["headGroupSpec"].get("rayStartParams") or {})

    markets = {}
    for group in spec["workerGroupSpecs"]:
        name_ = group["groupName"]
        labels = group["labels"]
        assert labels[NODE_TYPE_LABEL] == name_
        market = labels[MARKET_LABEL]
        markets[market] = name_
        resources = json.loads(group["rayStartParams"]["resources"].strip('"').replace('\\"', '"'))
        assert resources == {f"{RESOURCE_PREFIX}{name_}": 1}
        assert 0 <= group["minReplicas"] <= group["maxReplicas"]
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        for part in ("requests", "limits"):
            assert {"cpu", "memory", "nvidia.com/gpu"} <= set(container["resources"][part])
        assert selects_spot(pod) == (market == "spot")
        if market == "on_demand":
            assert avoids_spot(pod)
    assert set(markets) == {"spot", "on_demand"}


@pytest.mark.parametrize("name", KUBERAY)
def test_kuberay_manifest_through_rays_own_translation(name):
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )
    from ray.autoscaler._private.util import prepare_config, validate_config

    m = load(name)
    ray_cr = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
              "metadata": {"name": m["metadata"]["name"], "namespace": "default"},
              "spec": cluster_spec(m)}
    derived = _derive_autoscaling_config_from_ray_cr(ray_cr)
    validate_config(prepare_config(derived))
    # What the Ray autoscaler sees matches what raylastic reads from the manifest.
    assert node_types_from_cluster_config(derived) == node_types_from_cluster_config(m)
    for t in node_types_from_cluster_config(m):
        node_type = derived["available_node_types"][t.name]
        assert node_type["labels"] == t.labels
        assert node_type["resources"][t.resource_key] == 1
