"""Commit rules of the checkpoint manager, on local storage (no Ray)."""

import json
import os

import pytest

from raylastic.checkpoint.manager import MANIFEST, CheckpointManager
from raylastic.checkpoint.storage import Storage
from raylastic.events import EventLog
from raylastic.session import ReportRecord, checkpoint_rel


@pytest.fixture
def env(tmp_path):
    storage = Storage(str(tmp_path))
    events = EventLog(storage, "run", verbose=False)
    return storage, events, tmp_path


def _record(storage, tmp_path, index, rank, epoch, with_files):
    rec = ReportRecord(index=index, rank=rank, epoch=epoch, ts=0.0, metrics={"step": index})
    if with_files:
        src = tmp_path / f"src-{index}-{rank}"
        src.mkdir()
        (src / f"shard-{rank}.bin").write_bytes(b"x" * (rank + 1))
        rel = checkpoint_rel("run", index, epoch)
        rec.files = storage.upload_dir(str(src), rel)
        rec.checkpoint_rel = rel
    return rec


def test_commits_only_when_every_rank_reported(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 2)
    assert mgr.on_records([_record(storage, tmp, 1, 0, 1, True)]) == []
    assert mgr.latest() is None
    rel = checkpoint_rel("run", 1, 1)
    assert not os.path.exists(os.path.join(tmp, rel, MANIFEST))
    [c] = mgr.on_records([_record(storage, tmp, 1, 1, 1, True)])
    assert c.index == 1 and c.world_size == 2
    manifest = json.loads((tmp / rel / MANIFEST).read_text())
    assert manifest["ranks_with_files"] == [0, 1]
    assert sorted(f[0] for f in manifest["files"]) == ["shard-0.bin", "shard-1.bin"]
    # A fresh manager (a new driver) finds it.
    assert CheckpointManager(storage, "run", None, events).latest().index == 1


def test_reports_without_checkpoint_commit_nothing_and_old_epochs_are_ignored(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(2, 1)
    assert mgr.on_records([_record(storage, tmp, 1, 0, 2, False)]) == []
    assert mgr.on_records([_record(storage, tmp, 2, 0, 1, True)]) == []  # stale epoch
    assert mgr.latest() is None


def test_retention_keeps_newest_and_deletes_oldest_first(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", 2, events)
    mgr.begin_epoch(1, 1)
    for i in range(1, 5):
        mgr.on_records([_record(storage, tmp, i, 0, 1, True)])
    assert [c.index for c in mgr.committed] == [3, 4]
    assert sorted(os.listdir(tmp / "run" / "checkpoints")) == [
        "checkpoint_00000003-e1", "checkpoint_00000004-e1"]


def test_uncommitted_and_corrupt_checkpoints_are_never_restored(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 1)
    mgr.on_records([_record(storage, tmp, 1, 0, 1, True)])
    # epoch 2 starts writing index 2 but never commits (a node died mid-upload)
    mgr.begin_epoch(2, 2)
    _record(storage, tmp, 2, 0, 2, True)
    # and index 3 has a corrupt manifest
    bad = tmp / checkpoint_rel("run", 3, 2)
    bad.mkdir(parents=True)
    (bad / MANIFEST).write_text("{not json")
    fresh = CheckpointManager(storage, "run", None, events)
    assert fresh.latest().index == 1
    fresh.delete_uncommitted()
    names = sorted(os.listdir(tmp / "run" / "checkpoints"))
    assert "checkpoint_00000002-e2" not in names  # partial: removed
    assert "checkpoint_00000003-e2" in names  # corrupt: kept for a human, never restored
