"""Node types and price tables: pure unit tests."""

from __future__ import annotations

import json
import pickle

import pytest

from raylastic.policies.node_types import (
    DEFAULT_NODE_TYPES,
    MARKET_LABEL,
    NODE_TYPE_LABEL,
    Market,
    MissingPriceError,
    NodeType,
    PriceTable,
    node_types_from_cluster_config,
)


def launcher_config(**node_types):
    return {"cluster_name": "x", "provider": {"type": "aws"}, "available_node_types": node_types}


def test_node_type_convention():
    t = NodeType(name="spot-gpu", market="spot", worker_resources={"GPU": 1})
    assert t.market is Market.SPOT
    assert t.resource_key == "node_type:spot-gpu"
    assert t.labels == {MARKET_LABEL: "spot", NODE_TYPE_LABEL: "spot-gpu"}
    assert t.bundle() == {"node_type:spot-gpu": 1, "GPU": 1}
    assert t.label_selector() == t.labels
    assert pickle.loads(pickle.dumps(t)) == t
    assert [d.name for d in DEFAULT_NODE_TYPES] == ["spot", "on_demand"]
    assert NodeType(name="x", market="on_demand").bundle() == {"node_type:x": 1, "CPU": 1}


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="bad name", market="spot"), r"'bad name' is not a valid node type name"),
    (dict(name="-x", market="spot"), r"not a valid node type name"),
    (dict(name="x" * 64, market="spot"), r"not a valid node type name"),
    (dict(name="x", market="preemptible"), r"market='preemptible' is not a market"),
    (dict(name="x", market="spot", worker_resources={"GPU": -1}), r"worker_resources\['GPU'\]"),
    (dict(name="x", market="spot", worker_resources={"node_type:x": 1}), r"must not contain"),
])
def test_bad_node_type(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NodeType(**kwargs)


def test_node_type_labels_are_valid_ray_labels():
    from ray._private.label_utils import validate_node_label_syntax

    for t in (NodeType(name="on_demand", market="on_demand"),
              NodeType(name="spot-a100.x8", market="spot")):
        validate_node_label_syntax(t.labels)


def test_price_table_from_mapping():
    prices = PriceTable.from_mapping({"spot": 0.9, "on_demand": 3})
    assert prices.price_for("on_demand") == 3.0
    assert prices.price_for(NodeType(name="spot", market="spot")) == 0.9
    assert prices.cost_usd("spot", 7200) == pytest.approx(1.8)
    rec = prices.to_record()
    assert json.loads(json.dumps(rec)) == {"kind": "prices", "source": "user mapping",
                                           "usd_per_hour": {"spot": 0.9, "on_demand": 3.0}}
    assert pickle.loads(pickle.dumps(prices)) == prices


def test_missing_price_is_a_clear_error():
    prices = PriceTable.from_mapping({"spot": 0.9})
    with pytest.raises(MissingPriceError, match=r"no hourly price for node type 'on_demand'.*"
                                                r"cover \['spot'\]\); add 'on_demand'"):
        prices.price_for("on_demand")
    with pytest.raises(MissingPriceError, match=r"\['a', 'b'\]"):
        prices.require(["spot", "b", "a"])
    prices.require(["spot"])


@pytest.mark.parametrize("price", [-1, float("nan"), float("inf"), "1.0", True])
def test_bad_price(price):
    with pytest.raises(ValueError, match=r"price for 'spot'"):
        PriceTable.from_mapping({"spot": price})


def test_from_launcher_config_dict():
    cfg = launcher_config(
        head={"resources": {"CPU": 4}, "node_config": {}},
        cpu_spot={"resources": {"CPU": 4, "node_type:cpu-spot": 4}, "node_config": {},
                  "labels": {MARKET_LABEL: "spot"}},
        gpu_od={"resources": {"CPU": 32, "GPU": 8, "node_type:gpu-od": 4}, "node_config": {},
                "labels": {MARKET_LABEL: "on_demand", NODE_TYPE_LABEL: "gpu-od"}},
    )
    cfg["metadata"] = {"raylastic": {"prices_usd_per_hour": {"cpu-spot": 0.1, "gpu-od": 30}}}
    types = {t.name: t for t in node_types_from_cluster_config(cfg)}
    assert set(types) == {"cpu-spot", "gpu-od"}  # head skipped: no node_type:* resource
    assert types["cpu-spot"].worker_resources == {"CPU": 1}
    assert types["gpu-od"].worker_resources == {"GPU": 2.0}  # 8 GPUs / 4 slots
    assert types["gpu-od"].market is Market.ON_DEMAND
    assert PriceTable.from_cluster_config(cfg).price_for("gpu-od") == 30.0
    cfg["metadata"]["raylastic"]["worker_resources"] = {"cpu-spot": {"CPU": 4}}
    types = {t.name: t for t in node_types_from_cluster_config(cfg)}
    assert types["cpu-spot"].worker_resources == {"CPU": 4}


def test_from_launcher_config_errors():
    no_label = launcher_config(w={"resources": {"node_type:w": 1}, "node_config": {}})
    with pytest.raises(ValueError, match=r"node type 'w'.*no 'raylastic.io/market' label"):
        node_types_from_cluster_config(no_label)
    mismatch = launcher_config(w={"resources": {"node_type:w": 1}, "node_config": {},
                                  "labels": {MARKET_LABEL: "spot", NODE_TYPE_LABEL: "v"}})
    with pytest.raises(ValueError, match=r"disagrees with resource 'node_type:w'"):
        node_types_from_cluster_config(mismatch)
    with pytest.raises(ValueError, match=r"no node type carries a 'node_type:<name>'"):
        node_types_from_cluster_config(launcher_config(h={"resources": {}, "node_config": {}}))
    with pytest.raises(MissingPriceError, match=r"metadata.raylastic.prices_usd_per_hour"):
        PriceTable.from_cluster_config(no_label)


def test_from_kuberay_manifest_with_rayStartParams_labels():
    manifest = {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": "x", "annotations": {
            "raylastic.io/prices-usd-per-hour": json.dumps({"s": 1.5})}},
        "spec": {"workerGroupSpecs": [{
            "groupName": "s",
            "rayStartParams": {"resources": '"{\\"node_type:s\\": 1}"',
                               "labels": "raylastic.io/market=spot,raylastic.io/node-type=s"},
            "template": {"spec": {"containers": [{"resources": {"limits": {}}}]}},
        }]},
    }
    (t,) = node_types_from_cluster_config(manifest)
    assert t == NodeType(name="s", market="spot", worker_resources={"CPU": 1})
    assert PriceTable.from_cluster_config(manifest).usd_per_hour == {"s": 1.5}
    manifest["metadata"]["annotations"]["raylastic.io/prices-usd-per-hour"] = "{oops"
    with pytest.raises(ValueError, match=r"prices-usd-per-hour.*is not JSON"):
        PriceTable.from_cluster_config(manifest)
