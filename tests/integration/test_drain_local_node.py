"""A worker drains its own Ray node; the driver sees it in ``draining_nodes()``.

One worker node (the head has no CPUs), one actor on it. The tests run in file order:
the node stays draining, and a drained node accepts no new actors.
"""

from __future__ import annotations

import time

import pytest
import ray

from raylastic._internal.cluster.drain import draining_nodes
from raylastic.testing.cluster import LocalCluster
from raylastic.testing.metadata_servers import FakeGCPMetadata


@ray.remote(num_cpus=1)
class NodeAgent:
    def __init__(self):
        self.watcher = None

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def drain(self, reason, deadline_ts):
        from raylastic._internal.cluster.drain import drain_local_node

        return drain_local_node(reason, deadline_ts)

    def watch(self, environ):
        from raylastic._internal.cluster.drain import start_preemption_watcher

        self.watcher = start_preemption_watcher(environ)
        return self.watcher is not None

    def wait_notice(self, timeout_s):
        return self.watcher.wait(timeout_s)


@pytest.fixture(scope="module")
def agent():
    with LocalCluster(num_nodes=1) as cluster:
        a = NodeAgent.remote()
        node = ray.get(a.node_id.remote())
        assert node == cluster.worker_nodes[0].node_id
        yield a, node


def test_drain_local_node_reaches_the_gcs(agent):
    a, node = agent
    assert node not in draining_nodes()
    deadline = time.time() + 120
    result = ray.get(a.drain.remote("test: spot notice", deadline))
    assert result.accepted and result.node_id == node and result.message == ""
    assert draining_nodes()[node] == int(deadline * 1000)
    # another worker on the node reporting a later deadline does not move it
    later = ray.get(a.drain.remote("test: later", deadline + 60))
    assert later.accepted and "already draining" in later.message
    assert draining_nodes()[node] == int(deadline * 1000)
    # an earlier one does
    ray.get(a.drain.remote("test: sooner", deadline - 30))
    assert draining_nodes()[node] == int((deadline - 30) * 1000)


def test_cloud_notice_drains_the_node(agent):
    a, node = agent
    with FakeGCPMetadata() as gcp:
        env = {"RAYLASTIC_PREEMPTION_SOURCES": "gcp", "RAYLASTIC_GCP_METADATA_URL": gcp.base_url,
               "RAYLASTIC_GCP_POLL_S": "0.05"}
        assert ray.get(a.watch.remote(env))
        gcp.announce(in_s=30)
        notice = ray.get(a.wait_notice.remote(10))
    assert notice is not None and notice.source == "gcp"
    assert draining_nodes()[node] == int(notice.deadline_ts * 1000)
