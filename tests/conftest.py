"""Shared fixtures. Ray clusters are module-scoped (one start per test module) and
always shut down, so no Ray process outlives the test session."""

from __future__ import annotations

import os

import pytest

from integration.storage_fixtures import *  # noqa: F401,F403  (SeaweedFS/Azurite storage fixtures)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker: gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def local_cluster():
    """Head (0 CPUs) + 3 one-CPU worker nodes with fast failure detection."""
    from raylastic.testing.cluster import LocalCluster

    cluster = LocalCluster(num_nodes=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def run_dir(tmp_path):
    """A fresh storage path for one run."""
    path = tmp_path / "results"
    path.mkdir()
    return str(path)


@pytest.fixture
def restore_nodes(local_cluster):
    """Put the cluster back to 3 worker nodes after a test that removed some."""
    yield local_cluster
    while len(local_cluster.worker_nodes) < 3:
        local_cluster.add_node()


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
