"""Ray Train's storage options and run layout under ``raylastic.TorchTrainer`` (no Ray
cluster): ``RunConfig(storage_filesystem=...)``, ``report(checkpoint_dir_name=...)``
directories directly under the run directory, and ``RAY_CHDIR_TO_TRIAL_DIR``."""

import os
import pickle

import pyarrow.fs as pafs
import pytest
import ray.train
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

import raylastic
from raylastic import ConfigError
from raylastic._internal import ray_train_checkpoints as rtc
from raylastic.checkpoint import backends
from raylastic.checkpoint.manager import CheckpointManager, committed_checkpoints, named_dir_problem
from raylastic.checkpoint.storage import Storage
from raylastic.events import EventLog
from raylastic.ray_train import ResumeFrom, chdir_to_run_dir, chdir_to_run_dir_enabled
from raylastic.session import ReportRecord


def train_func(config):
    return config


def _dir_fs(root) -> pafs.FileSystem:
    """What Ray's test_persistence passes: a local directory behind an fsspec DirFileSystem."""
    os.makedirs(root, exist_ok=True)
    return pafs.PyFileSystem(pafs.FSSpecHandler(DirFileSystem(path=str(root), fs=LocalFileSystem())))


def _trainer(run_config, **kw):
    return raylastic.TorchTrainer(train_func, scaling_config=ray.train.ScalingConfig(num_workers=2),
                                  run_config=run_config, **kw)


# -- RunConfig(storage_filesystem=...) -----------------------------------------------------

def test_storage_filesystem_is_the_runs_storage(tmp_path):
    fs = _dir_fs(tmp_path / "root")
    t = _trainer(ray.train.RunConfig(name="r", storage_path="bucket/runs", storage_filesystem=fs))
    uri = t.translation.run.storage_path
    assert uri.startswith("pyfs://") and uri.endswith("/bucket/runs")
    storage = Storage(uri)
    storage.write_bytes("r/x/y.json", b"{}")  # parent directories made (fsspec's local fs needs them)
    assert (tmp_path / "root" / "bucket" / "runs" / "r" / "x" / "y.json").read_bytes() == b"{}"
    assert storage.path("r") == "bucket/runs/r"  # the path on that filesystem, as Ray's Result.path


def test_storage_filesystem_travels_with_a_pickled_storage(tmp_path):
    """The controller and the workers unpickle the Storage: the filesystem object comes
    with it and is registered there, so a Storage made later from the URI opens it too."""
    fs = _dir_fs(tmp_path / "root")
    uri = backends.filesystem_uri(fs, "b")
    assert backends.filesystem_uri(fs, "b") == uri  # registered once
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_bytes(b"abc")
    Storage(uri).upload_dir(str(src), "run/c1")
    blob = pickle.dumps(Storage(uri))
    key = uri.split("/")[2]
    saved = backends._FILESYSTEMS.pop(key)
    try:
        with pytest.raises(Exception, match="not known in this process"):
            Storage(uri)
        again = pickle.loads(blob)
        assert again.read_bytes("run/c1/w") == b"abc" and Storage(uri).list_dirs("run") == ["c1"]
        again.delete_dir("run/c1")
        assert again.list_dir("run") == []
    finally:
        backends._FILESYSTEMS[key] = saved


def test_storage_filesystem_must_be_a_pyarrow_filesystem(tmp_path):
    rc = ray.train.RunConfig(name="r", storage_path="bucket")
    rc.storage_filesystem = object()  # (Ray's RunConfig does not check it)
    with pytest.raises(ConfigError, match="RunConfig.storage_filesystem"):
        _trainer(rc)


def test_pyfs_uris_are_checked():
    for bad in ("pyfs://key", "pyfs://key/", "pyfs:///path", "pyfs://key/a/../b"):
        with pytest.raises(ValueError):
            backends.parse_uri(bad)
    assert backends.parse_uri("pyfs://k//abs/path").prefix == "/abs/path"


# -- report(checkpoint_dir_name=...) --------------------------------------------------------

def test_named_dir_problem():
    assert named_dir_problem("checkpoint_epoch=3") is None
    for bad in ("", "a/b", "..", ".hidden", "checkpoints", "a\nb", None, 3):
        assert named_dir_problem(bad) is not None, bad


def _commit(mgr, storage, tmp_path, index, rel, metrics, ranks=(0,)):
    records = []
    for rank in ranks:
        src = tmp_path / f"src{index}-{rank}"
        src.mkdir()
        (src / f"shard-{rank}").write_bytes(b"x" * (rank + 1))
        records.append(ReportRecord(index=index, rank=rank, epoch=0, ts=0.0, metrics=metrics, checkpoint_rel=rel,
                                    files=storage.upload_dir(str(src), rel)))
    return mgr.on_records(records)


def test_named_directories_commit_list_and_retire_under_the_run(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    mgr = CheckpointManager(storage, "run", 1, EventLog(storage, "run", verbose=False),
                            score_attribute="score", score_order="max")
    mgr.begin_epoch(0, 2)
    for i, score in enumerate([1, 5, 3]):
        assert len(_commit(mgr, storage, tmp_path, i + 1, f"run/checkpoint_epoch={i}", {"score": score},
                           ranks=(0, 1))) == 1
    mgr.begin_epoch(1, 2)  # (cleans checkpoints/ only: named directories are never swept)
    # best by score (epoch 1) and the newest (epoch 2) are kept, each with both ranks' files
    assert sorted(os.listdir(tmp_path / "store" / "run" / "checkpoint_epoch=1")) == [
        ".raylastic_manifest.json", "shard-0", "shard-1"]
    listed = committed_checkpoints(storage, "run")
    assert [c.rel for c in listed] == ["run/checkpoint_epoch=1", "run/checkpoint_epoch=2"]
    assert not (tmp_path / "store" / "run" / "checkpoint_epoch=0").exists()
    assert [c.rel for c in CheckpointManager(storage, "run", None, EventLog(storage, "run", verbose=False)).committed
            ] == [c.rel for c in listed]


def test_a_name_reported_again_replaces_the_checkpoint(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    mgr = CheckpointManager(storage, "run", None, EventLog(storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    _commit(mgr, storage, tmp_path, 1, "run/final", {"step": 1})
    _commit(mgr, storage, tmp_path, 2, "run/final", {"step": 2})
    assert [(c.rel, c.index) for c in mgr.committed] == [("run/final", 2)]
    assert [c.metrics for c in committed_checkpoints(storage, "run")] == [{"step": 2}]


def _adapter_session(tmp_path, monkeypatch, upload=True):
    """A rank's session with Ray Train's API routed to it (as ``ray_train_compat.install``)."""
    from ray.train.v2._internal.execution import train_fn_utils

    from raylastic._internal import ray_train_compat
    from raylastic.checkpoint.uploader import AsyncUploader
    from tests.unit.test_ray_train_trainer import _session

    sess = _session(tmp_path)
    sess.uploader, sess.async_upload = (AsyncUploader(sess.storage), False) if upload else (None, True)
    adapter = ray_train_compat.RayTrainAdapter(sess)
    monkeypatch.setattr(train_fn_utils, "_train_fn_utils", adapter)
    return sess, adapter


def _dir_checkpoint(tmp_path, name="src"):
    src = tmp_path / name
    src.mkdir()
    (src / "w").write_bytes(b"x")
    return ray.train.Checkpoint.from_directory(str(src))


@pytest.mark.parametrize("name, with_checkpoint, honoured, rel", [
    ("checkpoint_epoch=3", True, True, "run/checkpoint_epoch=3"),
    (None, True, True, "run/checkpoints/checkpoint_00000001-e0"),
    ("checkpoint_epoch=3", False, True, None),  # no checkpoint: nothing named
    ("a/b", True, True, "run/checkpoints/checkpoint_00000001-e0"),  # not one plain segment: ignored
    ("checkpoints", True, True, "run/checkpoints/checkpoint_00000001-e0"),  # raylastic's own directory
    ("checkpoint_epoch=3", True, False, "run/checkpoints/checkpoint_00000001-e0"),  # ElasticTrainer: its layout
])
def test_report_uploads_into_the_named_directory(tmp_path, monkeypatch, name, with_checkpoint, honoured, rel):
    """The name reaches the session's report as an argument (no process-wide swap of how
    checkpoint directories are named): the record, the upload and the rank's published
    directory (``_files_rel``) all say the named directory."""
    from raylastic import session as _session_mod

    sess, adapter = _adapter_session(tmp_path, monkeypatch)
    if honoured:
        rtc.honour_dir_names()
        rtc.honour_dir_names()  # idempotent
    ray.train.report({"m": 1}, checkpoint=_dir_checkpoint(tmp_path) if with_checkpoint else None,
                     checkpoint_dir_name=name)
    [record] = sess.drain()
    assert record.checkpoint_rel == rel
    if rel is not None:
        assert (tmp_path / rel / "w").read_bytes() == b"x"
        assert rtc._files_rel(sess, sess.last_files_index) == rel
    # a later report without a name goes to checkpoints/ again; how directories are named
    # outside report() never changed
    ray.train.report({"m": 2}, checkpoint=_dir_checkpoint(tmp_path, "src2"))
    [record] = sess.drain()
    assert record.checkpoint_rel == "run/checkpoints/checkpoint_00000002-e0"
    assert _session_mod.checkpoint_rel("run", 7, 2) == "run/checkpoints/checkpoint_00000007-e2"


def test_ray_snapshot_names_the_named_directory(tmp_path):
    import json

    storage = Storage(str(tmp_path / "store"))
    mgr = CheckpointManager(storage, "run", None, EventLog(storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    _commit(mgr, storage, tmp_path, 1, "run/checkpoint_epoch=0", {"score": 1})
    rtc.write_ray_snapshot(storage, "run", raylastic.CheckpointConfig())
    snap = json.loads((tmp_path / "store" / "run" / "checkpoint_manager_snapshot.json").read_text())
    assert snap["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_epoch=0"


# -- RAY_CHDIR_TO_TRIAL_DIR -------------------------------------------------------------------

@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("true", True), ("0", False),
                                            ("False", False)])
def test_chdir_setting_is_read_as_ray_reads_it(monkeypatch, tmp_path, value, enabled):
    if value is None:
        monkeypatch.delenv("RAY_CHDIR_TO_TRIAL_DIR", raising=False)
    else:
        monkeypatch.setenv("RAY_CHDIR_TO_TRIAL_DIR", value)
    assert chdir_to_run_dir_enabled() is enabled
    t = _trainer(ray.train.RunConfig(name="myrun", storage_path=str(tmp_path)))
    assert t._trainer._train_func.working_dir == ("myrun" if enabled else None)


def test_workers_change_into_the_runs_artifacts_directory(monkeypatch, tmp_path):
    import ray.train.constants

    monkeypatch.setattr(ray.train.constants, "_get_ray_train_session_dir", lambda: str(tmp_path / "artifacts"))
    monkeypatch.chdir(tmp_path)
    seen = ResumeFrom(lambda: os.getcwd(), working_dir="myrun")({})
    assert seen == str(tmp_path / "artifacts" / "myrun") and os.path.isdir(seen)
    assert chdir_to_run_dir("other") == str(tmp_path / "artifacts" / "other") == os.getcwd()


def test_the_directory_a_named_report_went_to_is_what_a_rank_waits_on(tmp_path, monkeypatch):
    """get_all_reported_checkpoints() waits for the manifest of the newest checkpoint with
    files in the directory its report named (here committed by a thread 0.3 s later)."""
    import threading
    import time

    from raylastic import session as _session_mod

    sess, adapter = _adapter_session(tmp_path, monkeypatch)
    rtc.honour_dir_names()
    adapter.report({"loss": 1.0}, _dir_checkpoint(tmp_path), checkpoint_dir_name="final")
    [record] = sess.drain()
    assert record.checkpoint_rel == "run/final" and rtc._files_rel(sess, record.index) == "run/final"
    assert rtc._files_rel(sess, record.index + 1) == "run/checkpoints/checkpoint_%08d-e0" % (record.index + 1)
    mgr = CheckpointManager(sess.storage, "run", None, EventLog(sess.storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    threading.Timer(0.3, mgr.on_records, args=([record],)).start()
    _session_mod._set_session(sess)
    try:
        start = time.monotonic()
        got = adapter.get_all_reported_checkpoints(timeout_s=30)
    finally:
        _session_mod._set_session(None)
    assert 0.2 < time.monotonic() - start < 10
    assert [c.checkpoint.path for c in got] == [sess.storage.path("run/final")]


def test_a_failing_train_function_lets_its_uploads_finish_first(tmp_path):
    """Checkpoints a rank reported before raising are uploaded (so they can commit) before
    the error leaves the worker, as Ray Train's report() persists before returning."""
    from types import SimpleNamespace

    from raylastic import session as _session_mod
    from tests.unit.test_ray_train_trainer import _session

    waits = []
    sess = _session(tmp_path)
    sess.uploader = SimpleNamespace(wait=lambda timeout_s=None: waits.append(timeout_s))

    def fails(config):
        raise ValueError("boom")

    _session_mod._set_session(sess)
    try:
        with pytest.raises(ValueError, match="boom"):
            ResumeFrom(fails)({})
        assert waits == [60.0]
        ResumeFrom(lambda: None)({})
        assert waits == [60.0]  # no wait on success (the worker waits for the last upload itself)
    finally:
        _session_mod._set_session(None)


def test_a_failing_rank_waits_for_its_last_checkpoint_to_commit(tmp_path):
    """settle_before_error: the newest checkpoint with files up to this rank's last report
    commits (here 0.3 s later) before the error leaves the rank; bounded by its timeout."""
    import threading
    import time

    from tests.unit.test_ray_train_trainer import _session

    sess = _session(tmp_path)
    sess.uploader = None
    record = sess._next_record({"loss": 1.0})
    sess.last_files_index = record.index
    rel = rtc._files_rel(sess, record.index)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_bytes(b"x")
    record.checkpoint_rel, record.files = rel, sess.storage.upload_dir(str(src), rel)
    mgr = CheckpointManager(sess.storage, "run", None, EventLog(sess.storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    timer = threading.Timer(0.3, mgr.on_records, args=([record],))
    start = time.monotonic()
    timer.start()
    rtc.settle_before_error(sess, 30)
    assert 0.2 < time.monotonic() - start < 10 and committed_checkpoints(sess.storage, "run")
    sess.last_files_index = record.index + 5  # a checkpoint that never commits: the wait is bounded
    start = time.monotonic()
    rtc.settle_before_error(sess, 0.5)
    assert time.monotonic() - start < 5
