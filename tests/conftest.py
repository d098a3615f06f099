"""Shared fixtures. The ``local_cluster`` Ray cluster is started once and kept for the
modules that follow each other using it (each module gets it back at 3 worker nodes); it is
shut down before any other test runs (a test that may start a Ray cluster of its own) and at
the end of the session, so no Ray process outlives the session and one pytest process never
runs two clusters at once. ``make test RAY_LANES=2`` runs two such processes side by side, one per lane
(``--ray-lane``): two clusters, each of its own session and ports. So a test connects to its
cluster by address (``LocalCluster`` does), never by a bare ``ray.init()``: that reads
Ray's "latest cluster" file, which names whichever cluster started last."""

from __future__ import annotations

import importlib
import json
import os
import time

import pytest

from integration.storage_fixtures import *  # noqa: F401,F403  (SeaweedFS/Azurite storage fixtures)


def pytest_addoption(parser):
    parser.addoption(
        "--ray-lane", choices=("shared", "own"), default=None,
        help="run only the tests of one lane: 'shared', the modules using the shared "
             "local_cluster; 'own', every other test (each starts its cluster, if any). "
             "`make test RAY_LANES=2` runs the two lanes at once, in two pytest processes.")


def pytest_collection_modifyitems(config, items):
    lane = config.getoption("--ray-lane")
    if lane is not None:
        keep, other = [], []
        for item in items:
            (keep if _lane(item) == lane else other).append(item)
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = keep
    # The modules sharing ``local_cluster`` run one after another, after the others (each
    # keeps its order): a module that starts no cluster or its own in between made the
    # next one start a fresh cluster (~7 s each). Last, not first: their node-loss tests
    # race a node added back against the run's end, and the suite's first minutes are its
    # busiest (the tests without Ray start their storage servers then).
    shared = {item.path for item in items if _uses_local_cluster(item)}
    items.sort(key=lambda item: item.path in shared)
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


def _uses_local_cluster(item) -> bool:
    return "local_cluster" in getattr(item, "fixturenames", ())


# Modules with clusters of their own that run in the 'shared' lane anyway, to even the two
# lanes out: in clean clones' `make test` the 'own' lane took 1,180 s against 1,055 s
# (f007794), then, with the first of these moved, 1,133 s against 992 s (578802d; these
# three 42 + 46 + 14 s of it). They run before the modules sharing local_cluster (see the
# sort above), so that cluster is not started twice.
_SHARED_LANE_TOO = {"test_control_plane_bench.py", "test_join_loss.py", "test_drain_local_node.py"}


def _lane(item) -> str:
    """The --ray-lane a test runs in."""
    return "shared" if _uses_local_cluster(item) or item.path.name in _SHARED_LANE_TOO else "own"


class _SharedCluster:
    """The ``local_cluster`` of consecutive modules: started on first use, shut down by
    ``close()`` (before a test that does not use it, and at the end of the session)."""

    def __init__(self) -> None:
        self.cluster = None
        self.in_use = False  # a module's local_cluster fixture holds it
        self.failed = False  # a test using it failed: the next module gets a fresh one

    def get(self):
        from raylastic.testing.cluster import LocalCluster

        if self.cluster is None:
            cluster = LocalCluster(num_nodes=3)
            try:
                cluster.start()
            except BaseException:
                cluster.shutdown()
                raise
            self.cluster = cluster
        while len(self.cluster.worker_nodes) < 3:
            self.cluster.add_node()
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown()


_SHARED = _SharedCluster()


# The modules whose tests keep no workers (and start with none kept): see below.
_KEEP_NONE = {"test_sharded.py", "test_ray_data_input.py"}
# How long the local_cluster modules' runs keep their workers for the next fit() by default.
_KEEP_LOCAL_CLUSTER_S = "30"


def _keep_workers_between_runs(item) -> None:
    """The tests of the modules sharing ``local_cluster`` keep a run's workers 30 s for the
    next ``fit()`` to take (``ScalingConfig.keep_workers_s``); the other integration tests
    keep none. ``RAYLASTIC_TEST_KEEP_WORKERS_S`` sets it for every integration test (0:
    none). Why keep: a worker's start is ~5 CPU-s here (Ray's actor, torch, and torch's
    dynamo through DDP's constructor), and the worker processes were 1,023 of the ~2,200
    CPU-s of a clean-clone ``make test`` on these 2 cores (192 of them, 2026-11-27); with
    every integration test keeping them, 129-139 were started, and many local_cluster tests
    ran in a third to a half of their time. Set here, before the test's fixtures (a
    module-scoped one may run fits), and for integration tests only; a test that passes
    ``keep_workers_s`` itself is not changed.

    Why only the local_cluster modules: in two of the five clean clones with every
    integration test keeping workers, a test failed that keeping them may explain
    (docs/status.md), and neither was in a local_cluster module still keeping them:
    ``test_storage_stopped_while_a_group_re_forms``, whose replacement worker must start on
    the one node the run did not use within 90 s and did not (likely: a kept worker held
    that node's CPU; not verified), and the FSDP2 3-2-3 test's restore from peer memory on
    a shard shape. The latter is explained since (2026-11-28): a kept worker that had been
    rank 2 became rank 1 and got its old DTensor mesh back from torch's per-thread caches,
    which the worker's train thread now clears before each attempt. The ``_KEEP_NONE``
    modules keep none and end the kept ones first:
    - ``test_sharded.py``: keeping gained nothing measurable (4 passed in 172 s keeping,
      174 s not, 2026-11-28): each test's elastic run asks for more workers than its
      reference run leaves, so it starts all of them anyway (kept workers are all or none);
    - ``test_ray_data_input.py``: its datasets' tasks need the CPUs the workers kept from
      the test before hold, and waited for them to expire (two of its tests 62 -> 89 s and
      58 -> 94 s in a clean clone, 2026-11-27)."""
    from raylastic.config import KEEP_ENV

    if "integration" not in item.path.parts:
        os.environ.pop(KEEP_ENV, None)
        return
    if item.path.name in _KEEP_NONE:
        os.environ[KEEP_ENV] = "0"
        from raylastic._internal.worker_group.keeper import end_kept_workers

        end_kept_workers()  # they hold CPUs these tests' runs need
        return
    default = _KEEP_LOCAL_CLUSTER_S if _uses_local_cluster(item) else "0"
    os.environ[KEEP_ENV] = os.environ.get("RAYLASTIC_TEST_KEEP_WORKERS_S", default)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "no_ray: starts no Ray cluster of its own (a local_cluster kept for the next "
                   "module using it may stay up meanwhile)")


def pytest_runtest_setup(item):
    _keep_workers_between_runs(item)
    # A test outside the modules using local_cluster may start Ray itself: the shared
    # cluster goes first (a module holding it keeps it for all of its tests).
    if not _SHARED.in_use and not _uses_local_cluster(item) \
            and item.get_closest_marker("no_ray") is None:
        _SHARED.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``RAYLASTIC_TEST_PROFILE=FILE``: one JSON line per test (setup, call and teardown
    together) with its wall seconds and the CPU-seconds the whole machine was busy
    meanwhile, to find where the suite's time goes (the machine's, as a test's Ray
    processes are not children of pytest)."""
    path = os.environ.get("RAYLASTIC_TEST_PROFILE")
    if not path:
        return (yield)
    from raylastic.testing.machine import cpu_seconds

    t0, (busy0, total0) = time.monotonic(), cpu_seconds()
    try:
        return (yield)
    finally:
        busy1, total1 = cpu_seconds()
        with open(path, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 2),
                                "busy_cpu_s": round(busy1 - busy0, 1),
                                "idle_cpu_s": round((total1 - total0) - (busy1 - busy0), 1)}) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _uses_local_cluster(item):
        _SHARED.failed = True
    return report


def pytest_sessionfinish(session, exitstatus):
    _SHARED.close()


@pytest.fixture(scope="module")
def local_cluster():
    """Head (0 CPUs) + 3 one-CPU worker nodes with fast failure detection; the same cluster
    serves the next module too when it also uses this fixture."""
    cluster = _SHARED.get()
    _SHARED.in_use = True
    try:
        yield cluster
    finally:
        _SHARED.in_use = False
        if _SHARED.failed:
            _SHARED.failed = False
            _SHARED.close()
        elif _SHARED.cluster is cluster:
            try:
                while len(cluster.worker_nodes) < 3:  # the next module gets the same shape
                    cluster.add_node()
            except BaseException:
                _SHARED.close()
                raise


@pytest.fixture
def run_dir(tmp_path):
    """A fresh storage path for one run."""
    path = tmp_path / "results"
    path.mkdir()
    return str(path)


@pytest.fixture
def deepspeed():
    """DeepSpeed, imported; skips where it is not installed. Under ``make test`` DeepSpeed's
    build and install run beside the integration tests (the Makefile's ``deepspeed`` job),
    which name in ``RAYLASTIC_TEST_DEEPSPEED_RC`` the file that job writes its install's
    exit status to: wait for it (bounded), and fail, not skip, if the install failed."""
    rc_file = os.environ.get("RAYLASTIC_TEST_DEEPSPEED_RC")
    if rc_file:
        deadline = time.monotonic() + 1200
        while not os.path.exists(rc_file) and time.monotonic() < deadline:
            time.sleep(1)
        if not os.path.exists(rc_file):
            pytest.fail(f"DeepSpeed's install beside the tests did not finish in 20 min ({rc_file} never appeared)")
        with open(rc_file) as f:
            status = f.read().strip()
        if status != "0":
            pytest.fail(f"DeepSpeed's install beside the tests failed (exit status {status}): see .cache/deepspeed.log")
        importlib.invalidate_caches()  # installed after this interpreter listed site-packages
    return pytest.importorskip("deepspeed")


@pytest.fixture
def restore_nodes(local_cluster):
    """Put the cluster back to 3 worker nodes after a test that removed some."""
    yield local_cluster
    while len(local_cluster.worker_nodes) < 3:
        local_cluster.add_node()


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
