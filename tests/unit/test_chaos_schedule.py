"""The chaos schedule (reproducible, valid for the cluster) and the chaos checks, without Ray."""

import json
import os

import pytest

from raylastic.testing.chaos import ChaosSchedule, FaultKind
from raylastic.testing.chaos_checks import exactly_once_problems, goodput_from_steps, partial_checkpoint_loads


def _nodes_over_time(schedule):
    up, seen = schedule.nodes, []
    for f in schedule.faults:
        up += 1 if f.kind is FaultKind.ADD_NODE else -f.kind.nodes_removed
        seen.append(up)
    return seen


@pytest.mark.parametrize("seed", range(12))
def test_a_seed_gives_the_same_valid_schedule(seed):
    a = ChaosSchedule.from_seed(seed, 20, interval_s=(20, 30))
    assert a == ChaosSchedule.from_seed(seed, 20, interval_s=(20, 30))
    assert len(a.faults) == 20
    counts = _nodes_over_time(a)
    assert min(counts) >= a.min_nodes and max(counts) <= a.nodes and counts[-1] == a.nodes
    gaps = [b.at_s - f.at_s for f, b in zip(a.faults, a.faults[1:])]
    assert all(19.99 <= g <= 30.01 for g in gaps), gaps
    for f in a.faults:
        assert (f.deadline_s is not None) == (f.kind is FaultKind.DRAIN_NODE)
        if f.deadline_s is not None:
            assert 2 <= f.deadline_s <= 10
        assert (f.outage_s == 10.0) == (f.kind is FaultKind.STOP_STORAGE)
    json.dumps(a.to_json())


def test_twenty_faults_mix_every_kind():
    kinds = {f.kind for f in ChaosSchedule.from_seed(7, 20).faults}
    assert kinds == set(FaultKind)


def test_from_kinds_keeps_the_order_and_rejects_an_impossible_one():
    kinds = [FaultKind.KILL_DURING_UPLOAD, FaultKind.ADD_NODE, FaultKind.KILL_TWO_NODES]
    s = ChaosSchedule.from_kinds(1, kinds, interval_s=(5, 6))
    assert [f.kind for f in s.faults] == kinds
    with pytest.raises(ValueError, match="fault 1 .kill_two_nodes. leaves 0 node"):
        ChaosSchedule.from_kinds(1, [FaultKind.KILL_NODE, FaultKind.KILL_TWO_NODES])
    with pytest.raises(ValueError, match="interval_s"):
        ChaosSchedule.from_seed(1, 5, interval_s=(3, 1))


def test_goodput_counts_kept_steps_over_wall():
    # group a: steps 1-4 at 1 s; group b restores step 2 and trains 3-6; wall 0..10
    rows = [{"t": t, "step": s, "group": "a", "world": 2} for t, s in ((1, 1), (2, 2), (3, 3), (4, 4))]
    rows += [{"t": t, "step": s, "group": "b", "world": 2} for t, s in ((7, 3), (8, 4), (9, 5), (10, 6))]
    g = goodput_from_steps(rows, 0.0, 10.0, {"a": 0.5, "b": 6.5})
    # kept: a1 (a group's first step: its median, 1 s, capped at 0.5 s since it started),
    # a2 (1 s), b3 (likewise capped at 0.5 s), b4..b6 (3 x 1 s); a3, a4 were trained again
    assert g["kept"] == 6 and g["retrained"] == 2
    assert g["productive_s"] == pytest.approx(0.5 + 1 + 0.5 + 3)
    assert g["goodput"] == pytest.approx(5.0 / 10)


def test_partial_checkpoint_loads_flags_an_uncommitted_restore():
    ok = [{"kind": "checkpoint_committed", "index": 25, "path": "r/checkpoints/checkpoint_00000025-e1"},
          {"kind": "checkpoint_restored", "index": 25, "source": "storage", "path": "r/checkpoints/checkpoint_00000025-e1"},
          {"kind": "checkpoint_restored", "index": 40, "source": "memory"}]
    assert partial_checkpoint_loads(ok) == []
    bad = ok + [{"kind": "checkpoint_restored", "index": 50, "source": "storage",
                 "path": "r/checkpoints/checkpoint_00000050-e2"}]
    assert len(partial_checkpoint_loads(bad)) == 1


def test_exactly_once_sees_a_rolled_back_step_and_a_skipped_one(tmp_path):
    from raylastic.data import global_batch_indices, shard_for_rank

    n, gbs, seed = 96, 48, 0  # 2 steps per epoch

    def write(group, t, world, steps):
        with open(tmp_path / "members.jsonl", "a") as fh:
            for r in range(world):
                fh.write(json.dumps({"t": t, "group": group, "rank": r, "world": world}) + "\n")
        for r in range(world):
            with open(tmp_path / f"idx-{group}-{r}.jsonl", "a") as fh:
                for index, (epoch, step) in steps:
                    idx = shard_for_rank(global_batch_indices(n, seed, epoch, step, gbs, True), r, world)
                    fh.write(json.dumps({"group": group, "rank": r, "world": world, "index": index,
                                         "epoch": epoch, "step": step, "indices": idx}) + "\n")

    # group a trains epoch 0 and the first step of epoch 1; b restores index 2 and redoes it
    write("a", 1.0, 2, [(1, (0, 0)), (2, (0, 1)), (3, (1, 0))])
    write("b", 2.0, 3, [(3, (1, 0)), (4, (1, 1))])
    assert exactly_once_problems(str(tmp_path), n=n, seed=seed, global_batch=gbs, epochs=2) == []
    assert exactly_once_problems(str(tmp_path), n=n, seed=seed, global_batch=gbs, epochs=3) == [
        "epoch 2 step 0: never trained", "epoch 2 step 1: never trained"]
    os.remove(tmp_path / "idx-b-1.jsonl")  # rank 1's rows of b are missing except at its last step
    problems = exactly_once_problems(str(tmp_path), n=n, seed=seed, global_batch=gbs, epochs=2)
    assert problems and problems[0].startswith("epoch 1 step 0: ranks [0, 2]"), problems
