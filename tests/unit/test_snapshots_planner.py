"""The restore plan (``raylastic/_internal/snapshots/planner.py``): pure decisions from what
each member holds, without Ray or torch."""

from dataclasses import dataclass, field
from typing import Dict, List

from raylastic._internal.snapshots.placement import WHOLE, union
from raylastic._internal.snapshots.planner import adds_shards, evacuation, plan_restore, rescue_target, why_storage


@dataclass(eq=False)
class M:
    wid: int
    snapshots: List[int] = field(default_factory=list)
    stripes: Dict[int, tuple] = field(default_factory=dict)

    def holding(self, index):
        return self.stripes.get(index, WHOLE)


@dataclass
class Ckpt:
    index: int
    rel: str = "run/checkpoints/c"


def test_memory_when_the_members_cover_the_newest_shared_snapshot():
    a = M(0, [4, 5], {5: (3, (0, 1))})
    b = M(1, [4, 5], {5: (3, (1, 2))})
    plan = plan_restore([a, b], 2, Ckpt(3), skip_memory=False)
    assert (plan.memory_index, plan.index, plan.broadcast, plan.restart_count) == (5, 5, True, 2)
    assert plan.checkpoint_rel == "run/checkpoints/c"


def test_storage_when_memory_is_skipped_older_or_uncovered():
    a, b = M(0, [5], {5: (3, (0,))}), M(1, [5], {5: (3, (1,))})
    assert plan_restore([a, b], 0, Ckpt(3), skip_memory=False).memory_index is None  # shard 2 lost
    assert why_storage([a, b], Ckpt(3))[1] == 5
    whole = M(0, [5])
    assert plan_restore([whole], 0, Ckpt(3), skip_memory=True).index == 3
    assert plan_restore([whole], 0, Ckpt(6), skip_memory=False).index == 6  # storage is newer
    assert why_storage([whole], Ckpt(6)) is None
    assert why_storage([M(0, [1]), M(1, [2])], None) == ("the surviving workers share no in-memory snapshot", None)


def test_evacuation_moves_shards_only_leaving_members_hold():
    a, b, c = M(0, [5], {5: (3, (0, 1))}), M(1, [5], {5: (3, (1, 2))}), M(2, [5], {5: (3, (2, 0))})
    assert evacuation([a, b, c], [c], 5) is None  # a and b cover it
    target, holders = evacuation([a, b, c], [b, c], 5)
    assert target is a and holders == [a, b, c]
    target, _ = evacuation([a, b], [a, b], 5)  # nobody stays: gathered on a leaving one
    assert target is a


def test_adds_shards_and_rescue_target():
    assert adds_shards((3, (2,)), (3, (0, 1)))
    assert not adds_shards((3, (1,)), (3, (0, 1)))
    assert not adds_shards(WHOLE, WHOLE)
    assert adds_shards(WHOLE, (3, (0,)))
    hung = M(0, [4, 5])
    assert rescue_target(hung, [M(1, [3])]) is None  # no snapshot in common
    assert rescue_target(hung, [M(1, [4, 5])]) is None  # whole copies: nothing to add
    # 3 ranks, 2 of 3 shards each; rank 2's node is lost, rank 0 hangs, rank 1 stopped
    striped_hung = M(0, [4, 5], {4: (3, (0, 2)), 5: (3, (0, 2))})
    r1 = M(1, [4, 5], {4: (3, (0, 1)), 5: (3, (0, 1))})
    assert rescue_target(striped_hung, [r1]) == (5, r1)  # the newest: the shards of 2 are on 0


def test_rescue_moves_the_snapshot_the_restore_can_use_not_just_the_newest():
    """Rank 2's node was lost while snapshot 7's peer copies travelled: 7 holds each
    survivor's own shard only, nobody has rank 2's. Moving 7 helps nothing; 6, complete
    on both, is split between the hung rank 0 (shards 0, 2) and rank 1 (0, 1)."""
    hung = M(0, [6, 7], {6: (3, (0, 2)), 7: (3, (0,))})
    r1 = M(1, [6, 7], {6: (3, (0, 1)), 7: (3, (1,))})
    assert rescue_target(hung, [r1]) == (6, r1)
    assert plan_restore([r1], 0, None, skip_memory=False).memory_index is None  # without the move
    r1.stripes[6] = union(r1.holding(6), hung.holding(6))
    assert plan_restore([r1], 0, None, skip_memory=False).memory_index == 6
    assert rescue_target(hung, [r1]) is None  # done: the stopped rank covers 6 already
    assert union((3, (0,)), WHOLE) == WHOLE and union((3, (2,)), (3, (0,))) == (3, (0, 2))
