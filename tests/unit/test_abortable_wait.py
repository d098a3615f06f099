"""The train thread's collective waits that an abort ends (``abortable_wait``), against a
fake work and a fake torch wait: which waits are sliced, when one is given up, and that an
abort of an earlier run's epoch (a kept worker) never ends a wait of the next run. The
real gloo case is ``tests/integration/test_gloo_abort.py``."""

import datetime
import threading

import pytest

from raylastic._internal.distributed import abortable_wait as aw

FOREVER = datetime.timedelta(0)


class FakeWork:
    def __init__(self, op_type=4, slices_before_done=3, error=None):
        self.op_type, self.left, self.error = op_type, slices_before_done, error
        self.timeouts = []

    def _get_op_type(self):
        return self.op_type


def torch_wait(work, timeout):
    """c10d::Work::wait: with a timeout, "Operation timed out!" while not done."""
    work.timeouts.append(timeout)
    if timeout == FOREVER or work.left <= 0:
        if work.error:
            raise RuntimeError(work.error)
        return True
    work.left -= 1
    raise RuntimeError("Operation timed out!")


@pytest.fixture(autouse=True)
def formed(monkeypatch):
    monkeypatch.setattr(aw, "_install", lambda: None)  # no torch patch: the fake wait is passed in
    monkeypatch.setattr(aw, "_hold", lambda current: None)
    monkeypatch.setattr(aw, "ABANDON_AFTER_S", 0.0)
    aw.group_formed(1, "gloo", 30.0)
    yield
    aw.group_left()


def test_a_collective_waits_in_slices_and_returns_when_done():
    w = FakeWork(slices_before_done=3)
    with aw.abandon_waits_on_abort():
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True
    assert w.timeouts == [aw._SLICE] * 4


def test_it_is_given_up_once_its_epoch_is_aborted():
    w = FakeWork(slices_before_done=10**9)
    aw.aborted(1)
    with aw.abandon_waits_on_abort(), pytest.raises(aw.WaitAbandoned, match="epoch 1"):
        aw.sliced_wait(w, FOREVER, torch_wait)
    assert len(w.timeouts) == 1


def test_an_abort_before_this_formation_never_ends_its_waits():
    """A kept worker: aborted in epoch 1 of one run, serving epoch 1 of the next."""
    aw.aborted(1)
    aw.group_formed(1, "gloo", 30.0)  # the next fit()'s first group
    w = FakeWork(slices_before_done=3)
    with aw.abandon_waits_on_abort():
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True


def test_another_epochs_abort_does_not_end_it():
    aw.aborted(2)
    w = FakeWork(slices_before_done=2)
    with aw.abandon_waits_on_abort():
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True


@pytest.mark.parametrize("op_type", [12, 13, 14, 17, 100])
def test_point_to_point_and_unknown_works_are_waited_as_torch_waits(op_type):
    """gloo fails a point-to-point wait's group when its timeout passes: never sliced."""
    w = FakeWork(op_type=op_type, slices_before_done=10**9)
    aw.aborted(1)
    with aw.abandon_waits_on_abort():
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True
    assert w.timeouts == [FOREVER]


def test_unmarked_threads_nccl_epochs_and_explicit_timeouts_are_left_alone():
    aw.aborted(1)
    w = FakeWork(slices_before_done=10**9)
    assert aw.sliced_wait(w, FOREVER, torch_wait) is True  # this thread did not ask
    with aw.abandon_waits_on_abort():
        assert aw.sliced_wait(w, datetime.timedelta(seconds=5), lambda wk, t: ("torch", t)) == (
            "torch", datetime.timedelta(seconds=5))
        aw.group_added("nccl")  # an NCCL subgroup in a gloo epoch: slicing off
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True
        aw.group_formed(2, "nccl", 30.0)
        assert aw.sliced_wait(w, FOREVER, torch_wait) is True
    assert w.timeouts == [FOREVER] * 3


def test_the_operations_own_error_is_raised_as_it_is():
    w = FakeWork(slices_before_done=1, error="Connection closed by peer")
    with aw.abandon_waits_on_abort(), pytest.raises(RuntimeError, match="closed by peer"):
        aw.sliced_wait(w, FOREVER, torch_wait)


def test_the_mark_is_per_thread_and_nests():
    seen = []
    with aw.abandon_waits_on_abort():
        with aw.abandon_waits_on_abort():
            pass
        seen.append(getattr(aw._local, "on", False))
        t = threading.Thread(target=lambda: seen.append(getattr(aw._local, "on", False)))
        t.start()
        t.join()
    seen.append(getattr(aw._local, "on", False))
    assert seen == [True, False, False]


def test_an_aborted_epoch_holds_the_live_groups_when_it_is_left(monkeypatch):
    held = []
    monkeypatch.setattr(aw, "_hold", held.append)
    aw.group_left()
    aw.group_formed(3, "gloo", 30.0)
    aw.group_left()  # not aborted: nothing held
    aw.group_formed(4, "gloo", 30.0)
    aw.aborted(4)
    aw.group_left()
    assert held == [(4, 30.0)]
