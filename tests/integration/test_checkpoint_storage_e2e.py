"""Checkpoints on object storage, end to end: ElasticTrainer on a real local Ray cluster
writing to real SeaweedFS (S3), Azurite (Azure Blob) and fake-gcs-server (GCS) servers.

- a node killed while its shard is being uploaded never leaves a loadable partial
  checkpoint, and the run resumes from the previous committed one;
- the S3 server stopped mid-run: uploads are retried and training continues once it is
  back; an outage longer than the retry budget ends in a TrainingFailedError naming the store;
- the GCS server stopped while a group re-forms after a node loss: the restore waits for it
  and loads the newest committed checkpoint, and nothing committed is deleted;
- a run resumes on a brand-new cluster from S3, Azure and GCS.

Credentials reach Ray workers the production way, through the environment: the module
fixture sets them in os.environ *before* the cluster starts, so every raylet (and every
worker it spawns) inherits them. The servers are private to this module (one is stopped
and restarted); every run gets its own prefix. Waits are bounded and keyed on the ranks'
own log lines (``raylastic.testing.ckpt_funcs``) and on storage listings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
import uuid
import zlib
from types import SimpleNamespace

import psutil
import pytest
import ray

from raylastic import (
    CheckpointConfig, ElasticTrainer, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError,
)
from raylastic.checkpoint import storage as storage_mod
from raylastic.checkpoint.manager import MANIFEST, CheckpointManager
from raylastic.checkpoint.storage import RetryPolicy, Storage
from raylastic.events import EVENTS_FILE, EventLog
from raylastic.events import read_log as read_event_log
from raylastic.testing.ckpt_funcs import load_checkpoint, read_log, shard_name, sharded_checkpoints
from raylastic.testing.cluster import LocalCluster, wait_until
from raylastic.testing.faults import FitThread

from storage_fixtures import clear_storage_env, create_azure_container  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MB = 1024 * 1024
CONTAINER = "checkpoints"


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def servers():
    """A SeaweedFS, an Azurite and a fake-gcs-server of this module's own, their credentials
    and endpoints in os.environ (set before any cluster starts, restored afterwards)."""
    from raylastic.testing.azurite import Azurite, AzuriteNotInstalled
    from raylastic.testing.gcs_emulator import FakeGcs, FakeGcsNotInstalled
    from raylastic.testing.seaweedfs import SeaweedNotInstalled, SeaweedS3

    try:
        s3 = SeaweedS3(bucket="raylastic-e2e")
        az = Azurite()
        gcs = FakeGcs(bucket="raylastic-e2e")
    except (SeaweedNotInstalled, AzuriteNotInstalled, FakeGcsNotInstalled) as exc:
        pytest.skip(str(exc))
    mp = pytest.MonkeyPatch()
    try:
        s3.start()
        az.start()
        gcs.start()
        clear_storage_env(mp)
        for key, value in {**s3.env(), **gcs.env()}.items():
            mp.setenv(key, value)
        mp.setenv("AZURE_STORAGE_CONNECTION_STRING", az.connection_string)
        create_azure_container(az.connection_string, CONTAINER)
        yield SimpleNamespace(s3=s3, az=az, gcs=gcs)
    finally:
        mp.undo()
        gcs.close()
        az.close()
        s3.close()


class _Clusters:
    """The module's LocalCluster (head + 3 one-CPU nodes), replaceable by a fresh one."""

    def __init__(self) -> None:
        self.current: LocalCluster | None = None

    def get(self) -> LocalCluster:
        if self.current is None:
            if ray.is_initialized():  # a driver left connected elsewhere
                ray.shutdown()
            self.current = LocalCluster(num_nodes=3).start()
        while len(self.current.worker_nodes) < 3:
            self.current.add_node()
        return self.current

    def fresh(self) -> LocalCluster:
        """Shut the cluster down completely (every raylet, the GCS) and start a new one."""
        self.close()
        return self.get()

    def close(self) -> None:
        if self.current is not None:
            self.current.shutdown()
            self.current = None


@pytest.fixture(scope="module")
def clusters(servers):
    holder = _Clusters()
    try:
        yield holder
    finally:
        holder.close()


# ------------------------------------------------------------------------------ helpers

def _has_retry_knob() -> bool:
    return "storage_retry" in {f.name for f in dataclasses.fields(RunConfig)}


def _run_config(name: str, uri: str, monkeypatch=None, retry: RetryPolicy | None = None,
                **kw) -> RunConfig:
    """RunConfig for a test run; ``retry`` replaces the default RetryPolicy of the run's
    Storage (through ``RunConfig(storage_retry=...)`` when that knob exists, else by making
    the driver's ``Storage(uri)`` build it: the policy travels inside the pickled Storage to
    the controller and every worker)."""
    if retry is not None:
        if _has_retry_knob():
            kw["storage_retry"] = retry
        else:
            real = storage_mod.RetryPolicy
            monkeypatch.setattr(storage_mod, "RetryPolicy",
                                lambda *a, **k: real(*a, **k) if (a or k) else retry)
    return RunConfig(name=name, storage_path=uri, verbose=False, progress=False,
                     tensorboard=False, **kw)


def _trainer(cfg: dict, run_config: RunConfig, workers: int = 2, keep_s: float | None = None) -> ElasticTrainer:
    return ElasticTrainer(sharded_checkpoints, train_loop_config=cfg,
                          scaling_config=ScalingConfig(min_workers=workers, max_workers=workers,
                                                       keep_workers_s=keep_s),
                          run_config=run_config)


def _events(storage: Storage, run: str) -> list[dict]:
    return read_event_log(storage, run, EVENTS_FILE)  # every segment: each fit() writes its own


def _kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def _dir(index: int, epoch: int) -> str:
    return f"checkpoint_{index:08d}-e{epoch}"


def _scratch_events(path: str) -> EventLog:
    """An event log outside the run, so checking a run never writes into it."""
    return EventLog(Storage(path), "events", verbose=False)


def _fresh_manager(storage: Storage, run: str, events: EventLog) -> CheckpointManager:
    """A manager as a new controller would build it (it scans storage afresh)."""
    return CheckpointManager(storage, run, None, events)


def _missing_or_short(storage: Storage, rel: str, files: list) -> list[str]:
    import pyarrow.fs as pafs

    infos = storage.fs.get_file_info([storage.path(rel, f[0]) for f in files])
    return [f[0] for f, i in zip(files, infos) if i.type != pafs.FileType.File or i.size != int(f[1])]


def _crc_mismatches(storage: Storage, rel: str, files: list) -> list[str]:
    bad = []
    for name, size, crc in files:
        data = storage.read_bytes(f"{rel}/{name}")
        if len(data) != int(size) or f"crc32:{zlib.crc32(data):08x}" != crc:
            bad.append(name)
    return bad


class CommitMonitor(threading.Thread):
    """Watches a run's checkpoints on storage while it trains: which directories ever had a
    manifest, whether a committed one ever lacked a file, and what a fresh manager's
    ``latest_valid()`` returned (and whether that one's files were complete)."""

    def __init__(self, uri: str, run: str, scratch: str, interval_s: float = 0.2):
        super().__init__(daemon=True, name="commit-monitor")
        self.storage = Storage(uri)
        self.run_name, self.interval_s = run, interval_s
        self.events = _scratch_events(scratch)
        self.committed: set[str] = set()
        self.latest_valid: list[tuple[int, int]] = []
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.rounds = 0
        self._halt = threading.Event()

    def run(self) -> None:
        ckpts = f"{self.run_name}/checkpoints"
        while not self._halt.is_set():
            try:
                for name in self.storage.list_dir(ckpts):
                    rel = f"{ckpts}/{name}"
                    try:
                        manifest = json.loads(self.storage.read_bytes(f"{rel}/{MANIFEST}"))
                    except FileNotFoundError:
                        continue
                    self.committed.add(name)
                    short = _missing_or_short(self.storage, rel, manifest["files"])
                    # Retention deletes the manifest first: only a manifest that is still there
                    # next to missing files is a violation.
                    if short and self.storage.exists(f"{rel}/{MANIFEST}"):
                        self.violations.append(f"{name} committed but {short} incomplete")
                best = _fresh_manager(self.storage, self.run_name, self.events).latest_valid()
                if best is not None:
                    self.latest_valid.append((best.index, best.epoch))
                    short = _missing_or_short(self.storage, best.rel, best.files)
                    if short and self.storage.exists(f"{best.rel}/{MANIFEST}"):
                        self.violations.append(f"latest_valid() gave {best.rel} with {short} incomplete")
                self.rounds += 1
            except Exception as e:  # noqa: BLE001 - a listing racing a delete: note, go on
                self.errors.append(f"{type(e).__name__}: {e}")
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        self.events.close()


def _log(log_dir: str, kind: str | None = None, **match) -> list[dict]:
    return [r for r in read_log(log_dir)
            if (kind is None or r["kind"] == kind) and all(r.get(k) == v for k, v in match.items())]


# ------------------------------------------------------------------------------ 1. node loss

def test_node_killed_during_upload_never_leaves_a_loadable_partial_checkpoint(
        clusters, servers, tmp_path):
    cluster = clusters.get()
    # 2 s between checkpoints, and the test lets rank 1 report one only once the one before
    # is committed: "previous committed, this one in flight" at the first gate, up to 3 gates.
    run, every, total = "killed-upload", 10, 50
    uri = servers.s3.uri(f"e2e-{uuid.uuid4().hex[:8]}")
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    # Rank 1 waits at each checkpoint from step 20 on until the test lets it go, then reports
    # and stops itself (SIGSTOP) with its upload just started: the test no longer races an
    # upload against its own polling. Racing it, a clean clone on a busy machine caught no
    # upload in flight before the run's 100 steps ended (2026-11-28, 6371072).
    # The group after the kill only has to finish: it steps without sleeping (pace.py).
    regrown = tmp_path / "killed"
    cfg = {"total_steps": total, "checkpoint_every": every, "step_sleep_s": 0.2, "log_dir": log_dir,
           "regrown_flag": str(regrown), "fast_at_world": 2,
           "shard_bytes": {1: 24 * MB},  # rank 1's upload takes a while; rank 0's is small
           "freeze": {"rank": 1, "from_step": 2 * every, "dir": str(gate_dir)}}
    trainer = _trainer(cfg, _run_config(run, uri, failure_config=FailureConfig(max_failures=0),
                                        checkpoint_config=CheckpointConfig(num_to_keep=2)))
    storage = Storage(uri)
    ckpts = f"{run}/checkpoints"
    scratch = _scratch_events(str(tmp_path / "scratch-main"))
    monitor = CommitMonitor(uri, run, str(tmp_path / "scratch"))
    monitor.start()
    th = FitThread(trainer)
    th.start()

    def logged(kind: str, index: int) -> bool:
        assert th.is_alive(), f"fit() ended early: {th.error or th.result}"
        return bool(_log(log_dir, kind, rank=1, epoch=1, index=index))

    # At each gate: once the checkpoint before is committed, let rank 1 report this one; it
    # stops itself right after. Keep it stopped only if storage confirms its upload is in
    # flight (its shard absent, no manifest) and the checkpoint before it is committed;
    # otherwise let it go and take the next gate.
    frozen = None  # never leave a stopped worker behind if an assertion fails
    try:
        victim, tries = None, 0
        for index in range(2 * every, total, every):
            previous = _dir(index - every, 1)
            wait_until(lambda i=index: logged("gate", i), 120, what=f"rank 1 at checkpoint {index}'s gate")
            wait_until(lambda p=previous: storage.exists(f"{ckpts}/{p}/{MANIFEST}"), 120,
                       what=f"checkpoint {previous} committed")
            (gate_dir / f"go-{index}").touch()
            wait_until(lambda i=index: logged("frozen", i), 60, what=f"rank 1 frozen after {index}")
            start = _log(log_dir, "start", rank=1, epoch=1)[0]
            frozen = start["pid"]
            wait_until(lambda pid=frozen: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 30,
                       what=f"rank 1 (pid {frozen}) stopped")
            tries += 1
            listing = storage.list_dir(f"{ckpts}/{_dir(index, 1)}")
            if shard_name(1) not in listing and MANIFEST not in listing \
                    and storage.exists(f"{ckpts}/{previous}/{MANIFEST}"):
                victim = {"index": index, "pid": frozen, "node_id": start["node_id"],
                          "listing": listing, "previous": previous}
                break
            os.kill(frozen, signal.SIGCONT)
            frozen = None
        assert victim is not None, f"no in-flight upload caught in {tries} tries; log: {read_log(log_dir)[-5:]}"

        # The node dies with the upload in flight: raylet first, then the (frozen) worker.
        cluster.remove_node(cluster.node_by_id(victim["node_id"]))
        wait_until(lambda: victim["node_id"] not in cluster.alive_node_ids(), 30, what="node death")
        os.kill(victim["pid"], signal.SIGKILL)
        frozen = None
        regrown.touch()
    except BaseException:
        if frozen is not None:
            os.kill(frozen, signal.SIGKILL)
        raise
    killed_at = time.time()
    print(f"rank 1 frozen and its node killed during the upload of checkpoint {victim['index']} "
          f"(attempt {tries}); that directory then held {victim['listing']}")
    partial = f"{ckpts}/{_dir(victim['index'], 1)}"
    assert not storage.exists(f"{partial}/{MANIFEST}")
    best = _fresh_manager(storage, run, scratch).latest_valid()
    assert best is not None and (best.index, best.epoch) != (victim["index"], 1)
    assert best.rel.endswith(victim["previous"])
    assert _missing_or_short(storage, best.rel, best.files) == []
    assert _crc_mismatches(storage, best.rel, best.files) == []

    result = th.wait(240)
    monitor.stop()

    assert result.error is None and result.metrics["step"] == total
    assert result.world_sizes == [2, 2]
    events = _events(storage, run)
    lost = _kind(events, "worker_lost")
    assert [(e["node_id"], e["cause"]) for e in lost] == [(victim["node_id"], "node_lost")]
    # The partial index never got a manifest, and the run resumed from the one before it.
    prev_index = victim["index"] - every
    assert [(e["index"], e["epoch"]) for e in _kind(events, "checkpoint_restored")] == [(prev_index, 2)]
    committed_e1 = [e["index"] for e in _kind(events, "checkpoint_committed") if e["epoch"] == 1]
    assert committed_e1 and max(committed_e1) == prev_index
    assert _dir(victim["index"], 1) not in monitor.committed
    assert (victim["index"], 1) not in monitor.latest_valid
    assert monitor.rounds >= 5 and monitor.violations == [], (monitor.violations, monitor.errors)
    # The new group loaded that checkpoint whole, on every rank.
    restored = _log(log_dir, "restored", epoch=2)
    assert sorted(r["rank"] for r in restored) == [0, 1]
    assert all(r["step"] == prev_index and r["problems"] == [] for r in restored)
    assert all(r["t"] > killed_at for r in restored)
    # The uncommitted directory was cleaned up; the last checkpoint is the final step.
    assert _dir(victim["index"], 1) not in storage.list_dir(ckpts)
    final = _fresh_manager(storage, run, scratch).latest_valid()
    assert final.index == total and load_checkpoint(result.checkpoint)["problems"] == []


# ------------------------------------------------------------------------------ 2. outages

def _wait_quiet_point(storage: Storage, run: str, log_dir: str, min_index: int) -> int:
    """Wait until both ranks' last reported checkpoint (>= min_index) is committed and the
    next one is not reported yet: no upload or commit is in flight, so the first storage
    call an outage starting now hits is a worker's upload of the next checkpoint."""

    def quiet():
        reps = _log(log_dir, "reported", epoch=1, checkpoint=True)
        both = [i for i in {r["index"] for r in reps}
                if {r["rank"] for r in reps if r["index"] == i} == {0, 1}]
        if not both or max(r["index"] for r in reps) != max(both) or max(both) < min_index:
            return None
        last = max(both)
        return last if storage.exists(f"{run}/checkpoints/{_dir(last, 1)}/{MANIFEST}") else None

    return wait_until(quiet, 120, interval_s=0.02, what="a committed checkpoint with none pending")


def test_storage_outage_is_retried_and_training_continues(clusters, servers, tmp_path, monkeypatch):
    clusters.get()
    s3 = servers.s3
    run, every, total = "outage", 4, 32
    uri = s3.uri(f"e2e-{uuid.uuid4().hex[:8]}")
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    # 60 attempts with up to 1 s of jittered backoff each: a budget of about 30 s, well past
    # the few seconds a SeaweedFS restart takes.
    retry = RetryPolicy(max_attempts=60, base_delay_s=0.2, max_delay_s=1.0)
    cfg = {"total_steps": total, "checkpoint_every": every, "step_sleep_s": 0.1,
           "log_dir": log_dir, "default_shard_bytes": 1 * MB}
    trainer = _trainer(cfg, _run_config(run, uri, monkeypatch, retry=retry,
                                        failure_config=FailureConfig(max_failures=0)))
    storage = Storage(uri)
    th = FitThread(trainer)
    th.start()
    quiet = _wait_quiet_point(storage, run, log_dir, every)
    s3.stop(grace_s=0)  # SIGKILL: connections refused from now on
    t_stop = time.time()
    try:
        # Both ranks handed the next checkpoint after the quiet point to the uploader and
        # went on to the next step: their uploads are retrying in the background. (On a
        # loaded machine the ranks may report it just before the stop returns: its upload
        # still meets the outage, and the next checkpoint's report waits for it.)
        def handed_over():
            during = [r for r in _log(log_dir, "reported", epoch=1, checkpoint=True) if r["index"] > quiet]
            if {r["rank"] for r in during} != {0, 1}:
                return None
            first = min(r["index"] for r in during)
            after = {r["rank"] for r in _log(log_dir, "reported", epoch=1) if r["index"] == first + 1}
            return first if after == {0, 1} else None

        outage_index = wait_until(handed_over, 60, what="checkpoint reports during the outage")
        assert th.is_alive()
    finally:
        s3.start()
    t_back = time.time()

    result = th.wait(180)
    assert result.error is None and result.metrics["step"] == total
    assert result.world_sizes == [2] and result.restarts == 0
    events = _events(storage, run)
    assert not _kind(events, "failure") and not _kind(events, "worker_lost")
    committed = {e["index"]: e for e in _kind(events, "checkpoint_committed")}
    # Nothing was dropped: every checkpoint, including the one reported while the store was
    # down, was uploaded (after retries) and committed.
    assert sorted(committed) == list(range(every, total + 1, every))
    retried = committed[outage_index]
    print(f"outage {t_back - t_stop:.1f} s; checkpoint {outage_index} reported during it was "
          f"committed after upload_s={retried['upload_s']:.1f} s")
    assert retried["upload_s"] >= 0.5 * (t_back - t_stop), (retried, t_back - t_stop)
    assert load_checkpoint(result.checkpoint)["problems"] == []


def test_storage_outage_longer_than_the_retry_budget_fails_clearly(clusters, servers, tmp_path, monkeypatch):
    clusters.get()
    s3 = servers.s3
    run, every = "outage-too-long", 4
    uri = s3.uri(f"e2e-{uuid.uuid4().hex[:8]}")
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    cfg = {"total_steps": 400, "checkpoint_every": every, "step_sleep_s": 0.1, "log_dir": log_dir}
    # A small budget (2 attempts: one retry) that any outage outlasts. With the default
    # policy (5 attempts) the same failure took ~30 s to surface here: after the upload
    # gives up, the controller's own writes to the dead store wait out their budgets too.
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.1, max_delay_s=0.5)
    trainer = _trainer(cfg, _run_config(run, uri, monkeypatch, retry=retry,
                                        failure_config=FailureConfig(max_failures=0)))
    storage = Storage(uri)
    th = FitThread(trainer)
    th.start()
    _wait_quiet_point(storage, run, log_dir, 2 * every)
    s3.stop(grace_s=0)
    t_stop = time.monotonic()
    try:
        with pytest.raises(TrainingFailedError) as info:
            th.wait(120)
        took = time.monotonic() - t_stop
    finally:
        s3.start()
    text = str(info.value)
    print(f"failed {took:.1f} s after the store stopped:\n{text}")
    assert "max_failures=0" in text
    assert "could not persist checkpoint" in text
    assert f"s3 bucket {s3.bucket!r} at {s3.endpoint}" in text
    assert f"still failing after {retry.max_attempts} attempt(s)" in text
    assert s3.secret_key not in text
    assert {f.kind for f in info.value.failures} == {"error"}
    assert took < 60, f"the failure took {took:.0f} s to surface"


def _alive_workers_on(node_id: str) -> int:
    """TrainWorker actors whose constructor finished on ``node_id`` (GCS actor table)."""
    from ray._private import state

    return sum(1 for a in state.actors().values()
               if a.get("ActorClassName") == "TrainWorker" and a.get("State") == "ALIVE"
               and a.get("Address", {}).get("NodeID") == node_id)


def test_storage_stopped_while_a_group_re_forms(clusters, servers, tmp_path, monkeypatch):
    """A node is lost while the store is down: the new group's restore waits for the store
    (it neither starts fresh nor takes a checkpoint it could not check), then loads the
    newest committed checkpoint whose files are whole: the newest one lost a shard behind
    our back before the outage, so the one before it. Every checkpoint committed before
    the outage is still there afterwards.

    Why GCS: a restarting SeaweedFS answers HEAD before it serves GETs, so the test would
    also depend on how that window classifies; fake-gcs-server serves data as soon as it
    answers (the train function's own read is retried since: see
    test_a_train_function_reading_its_checkpoint_waits_out_an_outage)."""
    cluster = clusters.get()
    store = servers.gcs
    run, every, total = "re-form-outage", 4, 40
    uri = store.uri(f"e2e-{uuid.uuid4().hex[:8]}")
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    # Minutes of backoff (each failed GCS attempt also takes ~1.5 s): past node-loss
    # detection, a new worker process and the restart.
    retry = RetryPolicy(max_attempts=100, base_delay_s=0.2, max_delay_s=1.0)
    cfg = {"total_steps": total, "checkpoint_every": every, "step_sleep_s": 0.1,
           "log_dir": log_dir, "default_shard_bytes": 256 * 1024}
    trainer = _trainer(cfg, _run_config(run, uri, monkeypatch, retry=retry,
                                        failure_config=FailureConfig(max_failures=0)))
    storage = Storage(uri)
    th = FitThread(trainer)
    th.start()
    last = _wait_quiet_point(storage, run, log_dir, 2 * every)
    storage.delete_file(f"{run}/checkpoints/{_dir(last, 1)}/{shard_name(1)}")  # damaged
    good = last - every
    committed_before = {n for n in storage.list_dir(f"{run}/checkpoints")
                        if storage.exists(f"{run}/checkpoints/{n}/{MANIFEST}")}
    victim = _log(log_dir, "start", rank=1, epoch=1)[0]["node_id"]
    spare = [n.node_id for n in cluster.worker_nodes
             if n.node_id not in {r["node_id"] for r in _log(log_dir, "start", epoch=1)}]

    store.stop(grace_s=0)
    try:
        cluster.remove_node(cluster.node_by_id(victim))
        wait_until(lambda: victim not in cluster.alive_node_ids(), 30, what="node death")
        # The replacement worker is up on the spare node: the controller can form the new
        # group now, and its restore has to ask the store.
        wait_until(lambda: _alive_workers_on(spare[0]), 90, what="a replacement worker")
        with pytest.raises(TimeoutError):  # the new group does not start without its checkpoint
            wait_until(lambda: [r for r in _log(log_dir, "start") if r["epoch"] > 1], 8,
                       what="a start of the new group")
        assert th.is_alive(), f"fit() ended during the outage: {th.error or th.result}"
    finally:
        t_back = time.time()
        store.start()

    result = th.wait(240)
    assert result.error is None and result.metrics["step"] == total
    assert result.world_sizes == [2, 2]
    events = _events(storage, run)
    formed = _kind(events, "group_formed")[-1]  # its epoch: 2, or more if a formation failed
    restored = _log(log_dir, "restored", epoch=formed["epoch"])
    assert sorted(r["rank"] for r in restored) == [0, 1]
    assert all(r["step"] == good and r["problems"] == [] for r in restored), (good, restored)
    lost = [e for e in _kind(events, "worker_lost") if e["node_id"] == victim]
    print(f"loss seen {lost[0]['ts'] - t_back:+.1f} s and group formed "
          f"{formed['ts'] - t_back:+.1f} s from the restart")
    # The controller handled the loss during the outage, and formed the group only after.
    assert lost and lost[0]["ts"] < t_back
    assert formed["ts"] > t_back and formed["restore_index"] == good
    assert [(e["index"], e["epoch"]) for e in _kind(events, "checkpoint_restored")] == [
        (good, formed["epoch"])]
    assert {e["index"] for e in _kind(events, "checkpoint_invalid")} == {last}
    assert not _kind(events, "checkpoint_deleted")
    after = {n for n in storage.list_dir(f"{run}/checkpoints")
             if storage.exists(f"{run}/checkpoints/{n}/{MANIFEST}")}
    assert committed_before <= after, committed_before - after


# ------------------------------------------------------------------------------ 3. fresh cluster

BACKENDS = ["s3", "azure", "gcs"]


@pytest.fixture(scope="module")
def fresh_cluster_runs(clusters, servers, tmp_path_factory):
    """For each backend, a run of 7 steps on the module's cluster, then (the three runs done)
    one brand-new cluster, and a second fit() of each run to 12 steps on it: one cluster
    restart serves the three backends. Each run's outcome, or the error that ended it, goes to
    its backend's test. The fits keep their workers for the next one on the same cluster
    (``keep_workers_s``: 4 of 6 fits start no worker process; the fresh cluster starts new
    ones, with nothing of the first cluster's), where the module's other tests keep none."""
    runs = {}
    for backend in BACKENDS:
        prefix = f"e2e-{uuid.uuid4().hex[:8]}"
        uri = {"s3": servers.s3.uri(prefix), "azure": f"abfs://{CONTAINER}/{prefix}",
               "gcs": servers.gcs.uri(prefix)}[backend]
        runs[backend] = SimpleNamespace(uri=uri, run=f"fresh-{backend}", storage=Storage(uri),
                                        tmp=tmp_path_factory.mktemp(f"fresh-{backend}"), error=None)

    def fit(r: SimpleNamespace, total: int, log_dir: str):
        os.makedirs(log_dir)
        cfg = {"total_steps": total, "checkpoint_every": 3, "log_dir": log_dir}
        return _trainer(cfg, _run_config(r.run, r.uri), keep_s=30.0).fit()

    first_cluster = clusters.get()
    first_address = first_cluster.address
    for r in runs.values():
        try:
            r.first = fit(r, 7, str(r.tmp / "log1"))
        except Exception as exc:  # noqa: BLE001 - raised again in this backend's test
            r.error = exc
    second_cluster = clusters.fresh()
    for r in runs.values():
        r.first_address, r.second_address = first_address, second_cluster.address
        if r.error is None:
            try:
                r.second = fit(r, 12, str(r.tmp / "log2"))
            except Exception as exc:  # noqa: BLE001
                r.error = exc
    return runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_on_a_fresh_cluster(fresh_cluster_runs, backend):
    r = fresh_cluster_runs[backend]
    if r.error is not None:
        raise r.error
    storage, run, first, second = r.storage, r.run, r.first, r.second
    assert first.metrics["step"] == 7 and first.path == f"{storage.uri}/{run}"
    assert r.second_address != r.first_address and ray.is_initialized()

    # the second fit() numbers its groups after the first's (one group: epoch 1), so its
    # first group is epoch 2: checkpoint directory names are never reused
    restored = _log(str(r.tmp / "log2"), "restored", epoch=2)
    assert sorted(x["rank"] for x in restored) == [0, 1]
    assert all(x["step"] == 7 and x["problems"] == [] for x in restored), restored
    events = _events(storage, run)
    starts = _kind(events, "run_started")
    assert [s["resume_from"] for s in starts] == [None, 7]
    assert [e["index"] for e in _kind(events, "checkpoint_restored")] == [7]
    assert second.error is None and second.metrics["step"] == 12
    assert second.return_value["restored_from"] == 7
    assert load_checkpoint(second.checkpoint)["step"] == 12
