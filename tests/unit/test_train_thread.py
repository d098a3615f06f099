"""The worker's train thread: every attempt in the same thread (see the module's docstring
for the torch crash that a new thread per attempt met), one attempt at a time, bounded
joins, and grad mode back on for each attempt."""

import threading

import pytest
import torch

from raylastic._internal.worker_group.train_thread import TrainThread


def test_attempts_run_one_at_a_time_in_one_thread_that_is_not_the_callers():
    t = TrainThread("train")
    seen, release, started = [], threading.Event(), threading.Event()

    def blocked():
        seen.append(threading.get_ident())
        started.set()
        release.wait(10)

    assert not t.busy() and t.ident is None and t.join(0)
    t.submit(blocked)
    assert started.wait(10) and t.busy() and t.ident == seen[0]
    with pytest.raises(RuntimeError, match="still running"):
        t.submit(lambda: None)
    assert not t.join(0.05)
    release.set()
    assert t.join(10) and not t.busy() and t.ident is None
    t.submit(lambda: seen.append(threading.get_ident()))
    assert t.join(10)
    assert seen[0] == seen[1] != threading.get_ident()


def test_a_job_that_raises_leaves_the_thread_serving_the_next():
    t = TrainThread("train")
    t.submit(lambda: 1 / 0)
    assert t.join(10)
    done = []
    t.submit(lambda: done.append(True))
    assert t.join(10) and done == [True]


def test_each_attempt_starts_with_grad_mode_on_like_a_new_thread():
    t = TrainThread("train")
    modes = []

    def attempt():
        modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)  # left off, as a train function might

    for _ in range(2):
        t.submit(attempt)
        assert t.join(10)
    assert modes == [True, True]
