"""Snapshot store rules (no Ray): double buffering, pinning, and the restore choice."""

import torch

from raylastic.state import Snapshot, SnapshotStore, _copy_into, restore_from_memory_possible


def _snap(i, complete=True):
    s = Snapshot(index=i, plain={})
    if complete:
        s.complete.set()
    return s


def test_keeps_the_two_newest_and_recycles_only_the_oldest_complete_unpinned():
    st = SnapshotStore(keep=2)
    st.add("r", _snap(1))
    assert st.recycle("r") is None  # not full yet
    st.add("r", _snap(2))
    st.add("r", _snap(3))
    assert st.complete_indices("r") == [2, 3]
    st._snaps[0].pins = 1
    assert st.recycle("r") is None  # a writer still reads snapshot 2
    st._snaps[0].pins = 0
    old = st.recycle("r")
    assert old.index == 2 and not old.complete.is_set()
    assert st.complete_indices("r") == [3]  # the newest complete one always stays
    assert st.complete_indices("other-run") == []


def test_copy_into_reuses_buffers_and_copies_values():
    src = {"w": torch.ones(3), "state": {0: {"m": torch.zeros(2)}}, "lr": 0.1}
    first = _copy_into(None, src)
    buf = first["w"]
    src["w"] += 1
    second = _copy_into(first, src)
    assert second["w"] is buf and torch.equal(second["w"], torch.full((3,), 2.0))
    assert second["lr"] == 0.1
    assert not torch.equal(second["w"], torch.ones(3)) and src["w"] is not second["w"]
    # a shape change gets a fresh buffer
    src["w"] = torch.ones(4)
    assert _copy_into(second, src)["w"].shape == (4,)


def test_restore_choice_is_the_newest_snapshot_all_holders_share():
    assert restore_from_memory_possible({1: [4, 5], 2: [5, 6], 3: []}) == 5
    assert restore_from_memory_possible({1: [4], 2: [6]}) is None
    assert restore_from_memory_possible({1: [], 2: []}) is None
