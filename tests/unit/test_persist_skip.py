"""A persisted ElasticState snapshot whose upload would have to wait for the previous one
(storage down, uploads retrying) is skipped, not waited for;
the controller reports it and never commits it. No Ray: a real Session, AsyncUploader and
CheckpointManager on local storage whose upload is held open."""

import threading

import pytest
import torch

from raylastic.checkpoint.manager import CheckpointManager
from raylastic.checkpoint.storage import Storage
from raylastic.checkpoint.uploader import AsyncUploader
from raylastic.events import EventLog, load_events
from raylastic.session import GroupSpec, RestoreInfo, Session, _set_session
from raylastic.state import ElasticState


@pytest.fixture
def held(tmp_path):
    """Local storage whose uploads block until ``gate`` is set (an outage that retries)."""
    storage = Storage(str(tmp_path / "store"))
    gate = threading.Event()
    real = storage.upload_dir

    def upload_dir(local, rel):
        assert gate.wait(30), "the test never released the upload"
        return real(local, rel)

    storage.upload_dir = upload_dir
    yield storage, gate, tmp_path
    gate.set()
    _set_session(None)


def _session(storage, tmp_path, rank=0, world=2, async_upload=True, persist_every=2):
    spec = GroupSpec(epoch=1, rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0,
                     master_addr="127.0.0.1", master_port=0, backend="gloo")
    return Session(spec=spec, storage=storage, run_rel="run", run_name="run", restore=RestoreInfo(),
                   uploader=AsyncUploader(storage, staging_root=str(tmp_path / f"staging{rank}-{world}")),
                   async_upload=async_upload, persist_every=persist_every)


def _train(commits, sess):
    """Commit ``commits`` steps of a tiny model in a thread; returns (thread, done event)."""
    _set_session(sess)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model=model, optimizer=opt, step=0, striped=False)
    done = threading.Event()

    def run():
        for step in range(1, commits + 1):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            state.step = step
            state.commit({"step": step})
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_a_busy_upload_skips_the_persisted_snapshot_instead_of_blocking_training(held):
    storage, gate, tmp = held
    sess = _session(storage, tmp)
    t, done = _train(6, sess)  # persists at commits 2, 4, 6: the upload of 2 is held open
    assert done.wait(20), "training blocked on the held upload"
    records = {r.index: r for r in sess.drain()}  # 2 reaches the controller once uploaded
    assert sorted(records) == [1, 3, 4, 5, 6]
    assert [i for i, r in sorted(records.items()) if r.persist_skipped] == [4, 6]
    assert all(r.checkpoint_rel is None for r in records.values())
    gate.set()
    sess.uploader.wait(20)
    (two,) = sess.drain()
    assert two.index == 2 and two.checkpoint_rel and two.files and not two.persist_skipped
    t.join(5)


@pytest.mark.parametrize("world", [1, 2])
def test_synchronous_uploads_wait_as_asked(held, world):
    """CheckpointConfig(async_upload=False): training waits for every upload."""
    storage, gate, tmp = held
    sess = _session(storage, tmp, world=world, async_upload=False)
    t, done = _train(4, sess)
    assert not done.wait(1.0)  # blocked behind the held upload, as asked
    gate.set()
    assert done.wait(20)
    sess.uploader.wait(20)
    records = sess.drain()
    assert not any(r.persist_skipped for r in records)
    assert sorted(r.index for r in records if r.checkpoint_rel) == [2, 4]
    t.join(5)


def test_a_group_of_one_skips_too(held):
    """Waiting would not make anything durable sooner: the upload in flight goes on."""
    storage, gate, tmp = held
    sess = _session(storage, tmp, world=1)
    t, done = _train(4, sess)
    assert done.wait(20), "training blocked on the held upload"
    assert [r.index for r in sess.drain() if r.persist_skipped] == [4]
    gate.set()
    t.join(5)


def test_the_controller_reports_a_skipped_index_and_never_commits_it(tmp_path):
    from raylastic.session import ReportRecord, checkpoint_rel

    storage = Storage(str(tmp_path))
    events = EventLog(storage, "run", verbose=False)
    mgr = CheckpointManager(storage, "run", None, events)
    mgr.begin_epoch(1, 2)
    src = tmp_path / "src"
    src.mkdir()
    (src / "shard-1.bin").write_bytes(b"x")
    rel = checkpoint_rel("run", 4, 1)
    # sharded: rank 1 uploaded its shard of 4, rank 0 skipped it: 4 must not commit
    one = ReportRecord(index=4, rank=1, epoch=1, ts=0.0, metrics={}, checkpoint_rel=rel,
                       files=storage.upload_dir(str(src), rel))
    zero = ReportRecord(index=4, rank=0, epoch=1, ts=0.0, metrics={},
                        persist_skipped="the previous upload was still running")
    assert mgr.on_records([one, zero]) == [] and mgr.latest() is None
    events.close()
    [skipped] = [e for e in load_events(str(tmp_path / "run")) if e["kind"] == "checkpoint_skipped"]
    assert skipped["index"] == 4 and skipped["ranks"] == [0]
    assert skipped["reason"].startswith("rank 0: the previous upload was still running")


@pytest.mark.parametrize("world,error,skipped", [
    (2, "transient", True),   # an outage outlasting the retries: skip it, memory holds the state
    (1, "transient", True),
    (2, "permanent", False),  # credentials, a missing bucket: fail as any checkpoint would
])
def test_a_snapshot_upload_that_fails_is_skipped_only_for_an_outage(tmp_path, world, error, skipped):
    from raylastic.checkpoint.retry import PermanentStorageError, TransientStorageError
    from raylastic.errors import CheckpointError

    storage = Storage(str(tmp_path / "store"))

    def upload_dir(local, rel):
        cls = TransientStorageError if error == "transient" else PermanentStorageError
        raise cls(f"{error}: still failing after 5 attempt(s)")

    storage.upload_dir = upload_dir
    sess = _session(storage, tmp_path, world=world, persist_every=2)
    t, done = _train(2, sess)
    assert done.wait(20)
    sess.uploader.wait(20)
    records = {r.index: r for r in sess.drain()}
    if skipped:
        assert records[2].persist_skipped.startswith("its upload failed: transient")
        assert records[2].checkpoint_rel is None
        sess.raise_upload_error()  # nothing to raise: training goes on
    else:
        assert 2 not in records
        with pytest.raises(CheckpointError, match="could not persist checkpoint 2"):
            sess.raise_upload_error()
    t.join(5)


def test_a_graceful_stop_never_waits_on_an_upload(tmp_path):
    """Once the controller asked for a stop (a scale-up, a preemption notice), persisted
    snapshots are skipped: the group re-forms from the snapshot in memory, and an upload
    in flight would hold the stop (a rank finishes its uploads before it stops)."""
    from raylastic.session import StopTraining

    sess = _session(Storage(str(tmp_path / "store")), tmp_path, persist_every=2)
    _set_session(sess)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model=model, optimizer=opt, step=0, striped=False)

    def step(i):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        state.step = i
        state.commit({"step": i})

    step(1)
    step(2)
    sess.uploader.wait()
    assert sess.request_stop_at(4)
    step(3)
    with pytest.raises(StopTraining):
        step(4)
    assert not sess.uploader.pending
    records = {r.index: r for r in sess.drain()}
    assert records[2].checkpoint_rel and records[2].files and not records[2].persist_skipped
    assert records[4].persist_skipped == "the group stops to resize and re-forms from memory"
    assert not records[4].checkpoint_rel and not records[4].files
