"""The worker <-> controller protocol: one module, versioned (no Ray)."""

import pytest

from raylastic._internal import protocol
from raylastic._internal.worker_group.pool import check_protocol
from raylastic.errors import ConfigError


def _info(**over):
    info = {"node_id": "n1", "node_type": None, "market": None, "ip": "10.0.0.2", "hostname": "worker-1",
            "pid": 7, "actor_id": "a", "gpu_ids": [], "protocol": protocol.PROTOCOL_VERSION,
            "raylastic_version": "0.1.0"}
    info.update(over)
    return info


def test_a_worker_of_the_same_protocol_is_accepted():
    check_protocol(_info())


@pytest.mark.parametrize("over", [{"protocol": protocol.PROTOCOL_VERSION + 1}, {"protocol": None}])
def test_a_worker_of_another_raylastic_is_refused_naming_the_node_and_the_fix(over):
    info = _info(**over)
    if over["protocol"] is None:
        del info["protocol"], info["raylastic_version"]  # what a worker from before the protocol answers
    with pytest.raises(ConfigError, match=r"node n1 \(worker-1\).*install the same raylastic on every node"):
        check_protocol(info)


def test_the_old_import_paths_still_give_the_protocol_types():
    from raylastic._internal.worker_group import results
    from raylastic import session

    assert session.ReportRecord is protocol.ReportRecord and session.GroupSpec is protocol.GroupSpec
    assert results.PollResult is protocol.PollResult and results.Holdings is protocol.Holdings
