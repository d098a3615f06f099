"""The roll call before ``init_process_group`` (raylastic/_internal/distributed/process_group.py):
ranks wait for each other in slices, so a join the controller gave up on (a chosen member
died before it arrived) leaves at once instead of sitting out the group timeout in C++."""

import threading
import time

import pytest
import torch.distributed as dist

from raylastic._internal.distributed.process_group import JoinCancelled, roll_call


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    return dist.PrefixStore(f"test-{time.monotonic_ns()}", master)


def test_returns_when_every_rank_arrived(store):
    arrived = threading.Event()
    t = threading.Thread(target=lambda: (roll_call(store, 1, 2, 10.0), arrived.set()))
    t.start()
    roll_call(store, 0, 2, 10.0)
    t.join(10)
    assert arrived.is_set()


def test_a_given_up_join_leaves_while_a_rank_is_missing(store):
    given_up = threading.Event()
    threading.Timer(0.3, given_up.set).start()
    t0 = time.monotonic()
    with pytest.raises(JoinCancelled, match="rank 0: join given up"):
        roll_call(store, 0, 3, 30.0, cancelled=given_up.is_set)
    assert time.monotonic() - t0 < 10  # not the 30 s timeout


def test_a_missing_rank_times_out_naming_it(store):
    store.set("rollcall/2", b"1")
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not arrive within 0.3 s"):
        roll_call(store, 0, 3, 0.3)
