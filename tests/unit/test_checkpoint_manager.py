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


def test_damaged_committed_checkpoint_falls_back_to_the_previous(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 1)
    for i in (1, 2):
        mgr.on_records([_record(storage, tmp, i, 0, 1, True)])
    assert mgr.latest_valid().index == 2
    (tmp / checkpoint_rel("run", 2, 1) / "shard-0.bin").write_bytes(b"")  # truncated behind our back
    assert mgr.latest_valid().index == 1


def test_async_staging_checksums_and_back_pressure(tmp_path):
    import threading
    import zlib

    from raylastic.checkpoint.uploader import AsyncUploader

    storage = Storage(str(tmp_path / "store"))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"hello")
    (src / "sub" / "b.bin").write_bytes(b"x" * 1000)
    up = AsyncUploader(storage, staging_root=str(tmp_path / "staging"))
    staged = up.stage(str(src), "k1")
    gate, results = threading.Event(), []
    real_upload = storage.upload_dir

    def slow_upload(local, rel):
        gate.wait(10)
        return real_upload(local, rel)

    storage.upload_dir = slow_upload  # hold the first upload open
    up.submit(staged, "run/ck1", results.append)
    assert up.pending
    staged2 = up.stage(str(src), "k2")
    t = threading.Thread(target=lambda: up.submit(staged2, "run/ck2", results.append))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # the second submit waits: at most one upload pending
    gate.set()
    t.join(10)
    up.wait(10)
    assert [r.rel for r in results] == ["run/ck1", "run/ck2"] and all(r.error is None for r in results)
    assert sorted(results[0].files) == sorted([("a.bin", 5, f"crc32:{zlib.crc32(b'hello'):08x}"),
                                               ("sub/b.bin", 1000, f"crc32:{zlib.crc32(b'x' * 1000):08x}")])
    assert (tmp_path / "store" / "run" / "ck2" / "sub" / "b.bin").read_bytes() == b"x" * 1000
    assert not os.path.exists(staged) and not os.path.exists(staged2)  # staging freed


def test_commit_after_loss_only_when_the_lost_rank_never_wrote_files(env):
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 3)
    for r in range(3):  # index 1: rank 0 writes, 1 and 2 pass None
        mgr.on_records([_record(storage, tmp, 1, r, 1, r == 0)])
    assert mgr.latest().index == 1
    mgr.on_records([_record(storage, tmp, 2, 0, 1, True), _record(storage, tmp, 2, 1, 1, False)])
    assert mgr.latest().index == 1  # rank 2's report never arrived
    assert [c.index for c in mgr.commit_after_loss([2])] == [2]
    manifest = json.loads((tmp / checkpoint_rel("run", 2, 1) / MANIFEST).read_text())
    assert manifest["ranks_lost_before_reporting"] == [2]

    # Sharded: every rank writes, so a lost rank's shard may be missing: no commit.
    mgr.begin_epoch(2, 2)
    for r in range(2):
        mgr.on_records([_record(storage, tmp, 3, r, 2, True)])
    mgr.on_records([_record(storage, tmp, 4, 0, 2, True)])
    assert mgr.commit_after_loss([1]) == []
    assert mgr.latest().index == 3


@pytest.mark.parametrize("content", [b"{not json", b"", b"[]", b'{"schema_version": 1}',
                                     b'{"schema_version": 99, "index": 2}'])
def test_a_corrupt_manifest_is_skipped_logged_and_kept(env, content, caplog):
    """A manifest is written whole and last, so one that is present but unusable was not
    written by a commit: not committed (never restored), logged, left for a human."""
    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 1)
    mgr.on_records([_record(storage, tmp, 1, 0, 1, True)])
    rel = _record(storage, tmp, 2, 0, 1, True).checkpoint_rel
    (tmp / rel / MANIFEST).write_bytes(content)
    fresh = CheckpointManager(storage, "run", None, events)
    assert [c.index for c in fresh.committed] == [1]
    assert "corrupt manifest" in caplog.text
    fresh.begin_epoch(2, 1)
    assert (tmp / rel / MANIFEST).read_bytes() == content


def test_an_unreadable_manifest_is_an_error_not_a_missing_checkpoint(env):
    """The store answering with an error (here: the manifest's name is a directory) is not
    "no manifest": the scan raises instead of silently restoring an older checkpoint."""
    from raylastic.checkpoint.storage import StorageError

    storage, events, tmp = env
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 1)
    for i in (1, 2):
        mgr.on_records([_record(storage, tmp, i, 0, 1, True)])
    manifest = tmp / checkpoint_rel("run", 2, 1) / MANIFEST
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(StorageError, match="read 'run/checkpoints/checkpoint_00000002-e1/"):
        CheckpointManager(storage, "run", None, events)


def test_an_empty_checkpoint_directory_stages_and_uploads(tmp_path):
    """Staging creates the destination even when there is nothing to copy (a rank that
    wrote no files), so its upload does not fail with 'not a directory'."""
    from raylastic.checkpoint.uploader import AsyncUploader

    storage = Storage(str(tmp_path / "store"))
    (tmp_path / "empty").mkdir()
    up = AsyncUploader(storage, staging_root=str(tmp_path / "staging"))
    results = []
    up.submit(up.stage(str(tmp_path / "empty"), "k"), "run/ck", results.append)
    up.wait(10)
    assert [(r.rel, r.error, list(r.files)) for r in results] == [("run/ck", None, [])]


def test_a_rank_reporting_an_empty_directory_contributes_no_checkpoint(tmp_path):
    """The README's DDP pattern: every rank reports Checkpoint.from_directory(d), only
    rank 0 writes into d. Rank 1's record carries no checkpoint; rank 0's does."""
    from ray.train import Checkpoint

    from raylastic.checkpoint.uploader import AsyncUploader
    from raylastic.session import GroupSpec, RestoreInfo, Session

    storage = Storage(str(tmp_path / "store"))
    records = {}
    for rank in (0, 1):
        spec = GroupSpec(epoch=1, rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0,
                         master_addr="127.0.0.1", master_port=0, backend="gloo")
        sess = Session(spec=spec, storage=storage, run_rel="run", run_name="run", restore=RestoreInfo(),
                       uploader=AsyncUploader(storage, staging_root=str(tmp_path / f"staging{rank}")),
                       async_upload=False)
        d = tmp_path / f"ckpt{rank}"
        d.mkdir()
        if rank == 0:
            (d / "state.pt").write_bytes(b"weights")
        sess.report({"step": 1}, checkpoint=Checkpoint.from_directory(str(d)))
        records[rank] = sess.drain()
    assert [r.checkpoint_rel for r in records[1]] == [None]
    (rec0,) = records[0]
    assert rec0.checkpoint_rel and [f[0] for f in rec0.files] == ["state.pt"]


def test_a_checkpoint_staged_by_the_uploader_is_read_back_as_committed(env, tmp_path):
    """The uploader's file entries carry a checksum ([path, size, "crc32:..."]): a manifest
    that holds them is a committed checkpoint for the next fit(), not a corrupt one."""
    from raylastic.checkpoint.manager import committed_checkpoints
    from raylastic.checkpoint.uploader import checksum_tree

    storage, events, tmp = env
    src = tmp_path / "staged"
    src.mkdir()
    (src / "model.pt").write_bytes(b"weights")
    entries = checksum_tree(str(src))
    assert entries and len(entries[0]) == 3 and entries[0][2].startswith("crc32:")
    rel = checkpoint_rel("run", 4, 2)
    storage.upload_dir(str(src), rel)
    rec = ReportRecord(index=4, rank=0, epoch=2, ts=0.0, metrics={"step": 4}, checkpoint_rel=rel,
                       files=[list(e) for e in entries])
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(2, 1)
    assert [c.index for c in mgr.on_records([rec])] == [4]
    assert [c.index for c in committed_checkpoints(storage, "run")] == [4]
