"""The local spot cloud follows its trace: capacity caps hold against the autoscaler,
raised caps launch after the launch delay, preemptions drain then kill at the deadline,
on-demand launches while spot is capped at 0, and nothing is left running afterwards.

Each test starts its own SpotCloud (head ~3.5 s, shutdown ~2 s); every wait is bounded
and waits on a condition.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.autoscaler.sdk import request_resources

from raylastic.policies.node_types import MARKET_LABEL, NODE_TYPE_LABEL, PriceTable
from raylastic.sim import DEFAULT_SIM_NODE_TYPES, SimNodeType, SpotCloud, parse_trace
from raylastic.sim.provider import HEAD_NODE_ID
from raylastic.testing.cluster import wait_until

pytestmark = pytest.mark.timeout(120)

SPOT = {"CPU": 1, "node_type:spot": 1}
ON_DEMAND = {"CPU": 1, "node_type:on_demand": 1}


def _types(spot_delay_s: float = 0.0):
    return (SimNodeType(name="spot", market="spot", price_usd_per_hour=0.30,
                        launch_delay_s=spot_delay_s),
            SimNodeType(name="on_demand", market="on_demand", price_usd_per_hour=1.00))


def _trace(*rows: str):
    return parse_trace("time_s,event,node_type,count,notice_s\n" + "\n".join(rows) + "\n",
                       source="<test>")


def _events(cloud, kind, node_type=None):
    return [e for e in cloud.history
            if e["event"] == kind and (node_type is None or e["node_type"] == node_type)]


def _refused(cloud, node_type, after_ts=0.0):
    return sum(e["detail"]["refused"] for e in _events(cloud, "launch_refused", node_type)
               if e["ts"] > after_ts)


@ray.remote(num_cpus=0)
class _Probe:
    def node(self):
        return ray.get_runtime_context().get_node_id()


def test_node_type_config_and_prices_without_ray():
    spot, on_demand = DEFAULT_SIM_NODE_TYPES
    assert (spot.market.value, spot.price_usd_per_hour) == ("spot", 0.30)
    assert (on_demand.market.value, on_demand.price_usd_per_hour) == ("on_demand", 1.00)
    entry = spot.autoscaler_entry()
    assert entry["resources"]["node_type:spot"] == 1 and entry["resources"]["CPU"] == 1
    assert entry["labels"] == {MARKET_LABEL: "spot", NODE_TYPE_LABEL: "spot"}
    prices = SpotCloud().prices()
    assert isinstance(prices, PriceTable)
    assert prices.usd_per_hour == {"spot": 0.30, "on_demand": 1.00}
    with pytest.raises(ValueError, match="launch_delay_s"):
        SimNodeType(name="spot", market="spot", price_usd_per_hour=1, launch_delay_s=-1)
    with pytest.raises(ValueError, match="unknown node type 'gpu'"):
        SpotCloud(capacity={"gpu": 1})


def test_capacity_cap_holds_and_raising_it_launches_after_the_delay():
    delay = 2.0
    with SpotCloud(_types(spot_delay_s=delay), capacity={"spot": 1}) as cloud:
        assert ray.get_runtime_context().get_node_id() == HEAD_NODE_ID  # driver on the head
        request_resources(bundles=[SPOT] * 3)
        first = cloud.wait_for_nodes("spot", 1, timeout_s=30)
        (up,) = _events(cloud, "node_up", "spot")  # wait_for_nodes waits for node_up
        up_ts = up["ts"]
        # The autoscaler keeps asking for the two missing nodes and is refused each time.
        wait_until(lambda: _refused(cloud, "spot", after_ts=up_ts) >= 4, 20,
                   what="refused spot launches")
        assert cloud.node_counts() == {"spot": 1, "on_demand": 0}
        assert len(_events(cloud, "launch", "spot")) == 1

        cloud.start_trace(_trace("0,capacity,spot,3,"))
        nodes = cloud.wait_for_nodes("spot", 3, timeout_s=30)
        assert first.keys() < nodes.keys()
        cap_ts = _events(cloud, "capacity", "spot")[-1]["ts"]
        launches = [e for e in _events(cloud, "launch", "spot") if e["ts"] > cap_ts]
        ups = [e for e in _events(cloud, "node_up", "spot") if e["ts"] > cap_ts]
        assert len(launches) == 2 and len(ups) == 2
        for e in launches:  # the autoscaler's next 1 s update asks again
            assert e["ts"] - cap_ts < 3.5
        for e in ups:  # ... and the raylet starts launch_delay_s after the launch
            launch = next(x for x in launches if x["node_id"] == e["node_id"])
            assert e["ts"] - launch["ts"] >= delay
        assert cloud.capacity("spot") == 3


def test_preempt_event_drains_the_node_then_kills_it_at_the_deadline():
    from ray._private.state import state

    notice_s = 4.0
    with SpotCloud(_types(), capacity={"spot": 1}) as cloud:
        request_resources(bundles=[SPOT])
        (node_id,) = cloud.wait_for_nodes("spot", 1, timeout_s=30)
        probe = _Probe.options(resources={"node_type:spot": 0.01}).remote()
        assert ray.get(probe.node.remote(), timeout=30) == node_id

        # stretch 0.5: the preemption comes at 1 s with 4 s of notice.
        cloud.start_trace(_trace(f"2,preempt,spot,1,{2 * notice_s:g}"), stretch=0.5)
        draining = wait_until(lambda: state.get_draining_nodes(), 10, what="a draining node")
        t_drain = time.time()
        assert list(draining) == [node_id]
        assert abs(draining[node_id] / 1000 - (t_drain + notice_s)) < 1.5
        # A drained node keeps running its actors until the deadline.
        assert ray.get(probe.node.remote(), timeout=5) == node_id
        assert cloud.node_counts()["spot"] == 1

        with pytest.raises(ray.exceptions.ActorDiedError) as died:
            wait_until(lambda: ray.get(probe.node.remote(), timeout=15) and False,
                       notice_s + 10, what="the probe to die")
        assert died.value.preempted
        (notice,) = _events(cloud, "notice", "spot")
        (killed,) = _events(cloud, "preempted", "spot")
        assert notice["node_id"] == killed["node_id"] == node_id
        assert notice["notice_s"] == killed["notice_s"] == notice_s
        assert notice["detail"]["drained"] and killed["detail"]["signal"] == "SIGTERM"
        assert notice_s - 0.1 <= killed["ts"] - notice["ts"] <= notice_s + 1.0

        # Gone from the provider's list, so the autoscaler replaces it (capacity allows 1).
        (replacement,) = cloud.wait_for_nodes("spot", 1, timeout_s=30)
        assert replacement != node_id
        cloud.wait_for_trace(timeout_s=10)

        # notice_s 0: no drain, SIGKILL at once.
        cloud.start_trace(_trace("0,preempt,spot,1,0"))
        cloud.wait_for_trace(timeout_s=10)
        assert not state.get_draining_nodes().get(replacement)
        notice, killed = [e for e in cloud.history if e["node_id"] == replacement
                          and e["event"] in ("notice", "preempted")]
        assert not notice["detail"]["drained"] and killed["detail"]["signal"] == "SIGKILL"
        assert killed["ts"] - notice["ts"] < 0.5


def test_on_demand_launches_while_spot_is_capped_at_zero():
    with SpotCloud(_types(), capacity={"spot": 0}) as cloud:
        request_resources(bundles=[SPOT])
        # An actor that needs an on-demand slot steers the autoscaler to that type.
        probe = _Probe.options(num_cpus=1, resources={"node_type:on_demand": 0.01}).remote()
        node_id = ray.get(probe.node.remote(), timeout=40)
        labels = next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)
        assert labels[MARKET_LABEL] == "on_demand" and labels[NODE_TYPE_LABEL] == "on_demand"
        assert list(cloud.wait_for_nodes("on_demand", 1, timeout_s=10)) == [node_id]
        wait_until(lambda: _refused(cloud, "spot") >= 2, 20, what="refused spot launches")
        assert cloud.node_counts() == {"spot": 0, "on_demand": 1}
        assert not _events(cloud, "launch", "spot")


def test_lowered_cap_preempts_excess_and_shutdown_leaves_no_ray_process():
    cloud = SpotCloud(_types())
    cloud.start()
    try:
        session = cloud.session_name
        request_resources(bundles=[SPOT, ON_DEMAND])
        cloud.wait_for_nodes("spot", 1, timeout_s=30)
        cloud.wait_for_nodes("on_demand", 1, timeout_s=30)
        assert len(_processes_of(session)) >= 3  # head's gcs/raylet/monitor + 2 raylets
        # Lowering a cap directly can also preempt the nodes above it.
        (gone,) = cloud.set_capacity("spot", 0, preempt_excess_notice_s=1.0)
        cloud.wait_for_trace(timeout_s=10)
        assert cloud.node_counts() == {"spot": 0, "on_demand": 1}
        assert [e["node_id"] for e in _events(cloud, "preempted")] == [gone]
    finally:
        cloud.shutdown()
    assert not ray.is_initialized()
    wait_until(lambda: not _processes_of(session), 15,
               what=f"every process of {session} to exit")


def _processes_of(session: str):
    """Live processes (not this one) whose command line or open files name the session:
    GCS, raylets, monitor, agents; workers retitle themselves (``ray::IDLE``) but keep
    their log files in the session directory open."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace").replace("\0", " ")
            files = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if session in cmd or any(session in f for f in files):
            out.append((int(pid), cmd[:100]))
    return out
