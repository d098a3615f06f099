"""A train function that fails on its own (a peer's connection closed) before the
controller's abort arrives must unwind at once: its last snapshot's peer copy, stuck on
the gone peer until the side group's timeout, is not waited for. No Ray: the actor body
is driven directly."""

from __future__ import annotations

import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

from raylastic._internal.snapshots.store import STORE, Snapshot
from raylastic._internal.worker_group.results import WorkerStatus
from raylastic._internal.worker_group.worker import TrainWorker
from raylastic.checkpoint.storage import Storage
from raylastic.session import StopTraining


@pytest.fixture(autouse=True)
def _no_snapshot_left_in_flight():
    """STORE is process-wide: a snapshot left in flight would hold up the next test's
    ``STORE.wait_pending()``."""
    yield
    for snap in list(STORE._snaps):
        snap.done.set()
    STORE.drop_after(STORE.run or "", -1)


def _worker_with_a_snapshot_in_flight(run: str):
    worker = TrainWorker(Storage(tempfile.mkdtemp()), run, run)
    snap = Snapshot(index=5, plain={})
    snap.complete.set()  # the own shard is copied; the peer copy (snap.done) never ends
    STORE.add(run, snap)
    return worker, snap


@pytest.mark.parametrize("aborted", [False, True])
def test_an_attempt_that_failed_does_not_wait_for_a_peer_copy(aborted):
    worker, snap = _worker_with_a_snapshot_in_flight(f"unwind-error-{aborted}")
    sess = SimpleNamespace(aborted=aborted)

    def train():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:23688")

    t0 = time.monotonic()
    worker._session = sess
    worker._run(lambda _cfg: train(), None, sess)
    assert time.monotonic() - t0 < 5  # the wait for snap.done would take its 30 s
    assert worker._status == (WorkerStatus.STOPPED if aborted else WorkerStatus.ERROR)
    assert not snap.done.is_set()


def test_a_graceful_stop_still_waits_for_the_stop_snapshots_peer_copy():
    worker, snap = _worker_with_a_snapshot_in_flight("unwind-graceful")
    sess = SimpleNamespace(aborted=False, raise_upload_error=lambda: None)
    worker._finish_uploads = lambda _s: None  # nothing uploads here

    def train():
        raise StopTraining()

    threading.Timer(0.5, snap.done.set).start()  # the peer copy ends a moment later
    t0 = time.monotonic()
    worker._session = sess
    worker._run(lambda _cfg: train(), None, sess)
    assert 0.4 < time.monotonic() - t0 < 10
    assert worker._status == WorkerStatus.STOPPED
