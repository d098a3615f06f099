"""Where a graceful stop ends (pure policy, no Ray), and how a rank takes the proposals."""

import pytest
from trainer_session import session_for

from raylastic.policies.stop_index import MAX_WAIT_FOR_BOUNDARY_S, choose_stop_index


def test_with_snapshots_every_index_is_a_restore_point_so_stop_soon():
    # 0.3 s of 0.05 s steps ahead, never fewer than 2 while two steps fit the deadline
    assert choose_stop_index(100, step_time_s=0.05, snapshots=True, committed=[80, 90]) == 106
    assert choose_stop_index(100, step_time_s=5.0, snapshots=True) == 102
    assert choose_stop_index(100, step_time_s=2.5, snapshots=True, budget_s=10.0) == 102


def test_a_drain_deadline_two_steps_do_not_fit_stops_after_the_step_in_flight():
    # 10 s notice, 5 s steps (measured: the 51.6M FSDP2 benchmark on a slow VM): stopping
    # two reports ahead came after the node was gone, so the stop turned into a node loss
    assert choose_stop_index(100, step_time_s=5.0, snapshots=True, budget_s=10.0) == 101
    assert choose_stop_index(101, step_time_s=5.0, committed=[90, 100], budget_s=10.0) == 102


def test_a_later_proposal_moves_an_accepted_stop_index_so_all_ranks_stop_together():
    """Rank 0 accepted stop-after-101 while rank 1 had already reported 101; the controller
    then proposes 102 to both. Rank 0 must stop after 102 too, not after 101 (then rank 1
    would wait for it in step 102's collective until a timeout)."""
    from raylastic.session import StopTraining, _set_session

    sess = session_for("stop-index")
    for _ in range(100):
        sess.report({})
    assert sess.request_stop_at(101)
    assert sess.request_stop_at(102)
    sess.report({})  # 101: goes on
    with pytest.raises(StopTraining):
        sess.report({})  # 102
    # a rank that reached its stop index refuses another; one past an index refuses it
    assert not sess.request_stop_at(103)
    assert not sess.request_stop_at(102)
    _set_session(None)


def test_without_snapshots_the_next_checkpoint_boundary_when_it_comes_soon_enough():
    assert choose_stop_index(101, step_time_s=0.1, committed=[90, 100]) == 110
    # one committed checkpoint gives no period: stop soon
    assert choose_stop_index(101, step_time_s=0.1, committed=[100]) == 104


def test_a_boundary_too_far_away_or_past_the_drain_deadline_is_not_waited_for():
    far = int(MAX_WAIT_FOR_BOUNDARY_S / 0.1) * 2
    assert choose_stop_index(101, step_time_s=0.1, committed=[100 - far, 100]) == 104
    # 9 steps of 1 s to the boundary, but the node goes away in 10 s (70% less 1 s = 6 s)
    assert choose_stop_index(101, step_time_s=1.0, committed=[90, 100], budget_s=10.0) == 103
    assert choose_stop_index(101, step_time_s=1.0, committed=[90, 100], budget_s=20.0) == 110
