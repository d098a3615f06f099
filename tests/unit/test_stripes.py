"""Striped snapshot replication (no Ray): who copies which shard, the split of tensors
into shards, coverage, and copying only a stripe."""

import torch

from raylastic._internal.snapshots.capture import StateCopier, keep_mask, leaves, nbytes
from raylastic._internal.snapshots.placement import WHOLE, covered, plan_stripes, shard_of_leaves
from raylastic.state import SnapshotStore, Snapshot, restore_from_memory_possible


def _holders(stripes, shard):
    return [r for r, s in enumerate(stripes) if shard in s]


def test_every_shard_has_two_copies_on_different_nodes_and_each_rank_copies_two():
    nodes = ["a", "b", "c", "d"]
    stripes = plan_stripes(nodes)
    assert [len(s) for s in stripes] == [2, 2, 2, 2]
    for shard in range(4):
        hs = _holders(stripes, shard)
        assert len(hs) == 2 and len({nodes[r] for r in hs}) == 2
    # losing any one node leaves every shard covered
    for lost in range(4):
        assert covered([(4, s) for r, s in enumerate(stripes) if r != lost])


def test_ranks_sharing_a_node_put_second_copies_on_other_nodes():
    nodes = ["a", "a", "a", "b"]  # three ranks on one node, one on another
    stripes = plan_stripes(nodes)
    for shard in range(4):
        assert len({nodes[r] for r in _holders(stripes, shard)}) == 2, stripes
    survivors_of_a = [(4, s) for r, s in enumerate(stripes) if nodes[r] == "a"]
    assert covered(survivors_of_a)  # node b lost: a still has everything
    assert covered([(4, stripes[3])])  # node a lost: b holds a copy of every shard


def test_no_striping_below_three_ranks_and_one_node_still_survives_a_crashed_rank():
    assert plan_stripes(["a"]) is None and plan_stripes(["a", "b"]) is None
    stripes = plan_stripes(["a", "a", "a"])
    for crashed in range(3):
        assert covered([(3, s) for r, s in enumerate(stripes) if r != crashed])


def test_losing_a_node_and_its_snapshot_peer_is_not_covered():
    stripes = plan_stripes(["a", "b", "c"])
    for survivor in range(3):
        assert not covered([(3, stripes[survivor])])
    assert covered([None, (0, ())])  # a full copy covers everything
    assert not covered([None, None])


def test_shards_are_balanced_by_bytes_and_the_same_on_every_rank():
    sizes = [1000, 10, 1000, 990, 5, 5, 20]
    a, b = shard_of_leaves(sizes, 3), shard_of_leaves(list(sizes), 3)
    assert a == b
    load = [sum(sz for sz, s in zip(sizes, a) if s == k) for k in range(3)]
    assert max(load) - min(load) <= 20, load


def test_restore_choice_needs_coverage_and_falls_back_to_an_older_full_copy():
    # index 5 is striped 3 ways; members 1 and 2 hold shards (0, 1) and (1, 2)
    stripes = {1: {5: (3, (0, 1))}, 2: {5: (3, (1, 2))}}
    assert restore_from_memory_possible({1: [4, 5], 2: [4, 5]}, stripes) == 5
    # only shards 0 and 1 left: not covered; snapshot 4 was a full copy on both
    stripes = {1: {5: (3, (0, 1))}, 2: {5: (3, (0, 1))}}
    assert restore_from_memory_possible({1: [4, 5], 2: [4, 5]}, stripes) == 4
    stripes[1][4] = (3, (0,))
    stripes[2][4] = (3, (0,))
    assert restore_from_memory_possible({1: [4, 5], 2: [4, 5]}, stripes) is None


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_a_stripe_copies_only_its_shards_and_the_stripes_add_up_to_the_whole():
    model, opt = _model_opt()
    full, start = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None)
    start()
    stripes = plan_stripes(["a", "b", "c"])
    parts = []
    for s in stripes:
        part, start = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None, (3, s))
        start()
        parts.append(part)
        assert nbytes(part) < 0.8 * nbytes(full)  # 2 of 3 shards, balanced
    for j, t in enumerate(leaves(full)):
        copies = [leaves(p)[j] for p in parts if not leaves(p)[j].is_meta]
        assert len(copies) == 2  # each tensor is in exactly two stripes
        for c in copies:
            assert torch.equal(c, t)
    # what a stripe does not hold stays in its structure as a placeholder of the same shape
    for t, f in zip(leaves(parts[0]), leaves(full)):
        assert t.shape == f.shape and t.dtype == f.dtype
    assert any(t.is_meta for t in leaves(parts[0]))


def test_keep_mask_is_none_for_a_full_copy():
    model, _ = _model_opt()
    assert keep_mask(model.state_dict(), WHOLE) is None
    assert keep_mask(model.state_dict(), (0, ())) is None


def test_merging_another_copys_shards_makes_a_stripe_whole():
    model, opt = _model_opt()
    stripes = plan_stripes(["a", "b", "c"])
    store = SnapshotStore()
    copies = []
    for s in stripes[:2]:
        tensors, start = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None, (3, s))
        start()
        copies.append(tensors)
    snap = Snapshot(index=7, plain={}, tensors=copies[0], holding=(3, stripes[0]))
    snap.complete.set()
    store.add("r", snap)
    assert store.stripes("r") == {7: (3, stripes[0])}
    other = {j: t for j, t in enumerate(leaves(copies[1])) if not t.is_meta}
    assert store.merge("r", 7, (3, stripes[1]), other) == WHOLE  # shards {0,1} + {1,2}: all
    assert store.stripes("r") == {}
    got = store.get("r", 7).tensors
    model.load_state_dict(got["model"])  # no placeholders left: loads
    assert not any(t.is_meta for t in leaves(got))


def test_bad_elastic_state_arguments_name_the_parameter():
    import pytest

    from raylastic import ElasticState

    for kwargs, name in (({"striped": "yes"}, "striped"), ({"async_snapshot": 1}, "async_snapshot"),
                         ({"snapshot_every": 0}, "snapshot_every")):
        with pytest.raises(ValueError, match=rf"ElasticState\({name}="):
            ElasticState(**kwargs)
