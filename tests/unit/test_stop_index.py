"""Where a graceful stop ends (pure policy, no Ray)."""

from raylastic.policies.stop_index import MAX_WAIT_FOR_BOUNDARY_S, choose_stop_index


def test_with_snapshots_every_index_is_a_restore_point_so_stop_soon():
    # 0.3 s of 0.05 s steps ahead, never fewer than 2
    assert choose_stop_index(100, step_time_s=0.05, snapshots=True, committed=[80, 90]) == 106
    assert choose_stop_index(100, step_time_s=5.0, snapshots=True) == 102


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
