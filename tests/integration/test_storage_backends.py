"""The storage seam against real servers: local disk, SeaweedFS (S3), Azurite (Azure Blob) and
fake-gcs-server (GCS).

Fixtures live in tests/integration/storage_fixtures.py. Outage tests stop a private server
mid-run: every operation must end in TransientStorageError within the RetryPolicy's bound
(never FileNotFoundError: an outage is not "no checkpoint"), and the same Storage object
must work again once the server is back. The CheckpointManager tests at the end check the
same through the manager: an outage while a group re-forms (or a new driver resumes) makes
the restore wait and load the newest committed checkpoint, or raise once the retries run
out; it never falls back to an older one, starts fresh, or deletes anything.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time

import pytest

from raylastic.checkpoint.storage import (
    PermanentStorageError,
    RetryPolicy,
    Storage,
    TransientStorageError,
)

from storage_fixtures import create_azure_container, clear_storage_env  # noqa: E402
from raylastic.checkpoint.manager import MANIFEST, CheckpointManager
from raylastic.checkpoint.storage import StorageError
from raylastic.events import EventLog
from raylastic.session import ReportRecord, checkpoint_rel

# One retry is a retry: every attempt against a stopped SeaweedFS costs ~0.6 s (pyarrow's
# S3 client has its own retry inside each), so each attempt more costs seconds per test.
FAST = RetryPolicy(max_attempts=2, base_delay_s=0.05, max_delay_s=0.2)


def _tree(root, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        path = os.path.join(root, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)


def _read_tree(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
    return out


def test_round_trip(storage_uri, tmp_path):
    s = Storage(storage_uri)
    assert s.list_dir() == [] and not s.exists("meta.json")

    s.write_bytes("meta.json", b"{}")
    s.write_bytes("meta.json", b'{"v": 2}')  # overwrite: last write wins
    assert s.read_bytes("meta.json") == b'{"v": 2}' and s.exists("meta.json")
    with pytest.raises(FileNotFoundError):
        s.read_bytes("absent.json")

    files = {"model.pt": os.urandom(3 * 1024 * 1024 + 7), "optim/rank0.pt": b"o0",
             "optim/rank1.pt": b"", "deep/a/b/c.bin": b"c"}
    uploaded = s.upload_dir(_tree(tmp_path / "src", files), "ckpt/000001")
    assert uploaded == sorted((k, len(v)) for k, v in files.items())
    assert s.list_dir() == ["ckpt", "meta.json"]
    assert s.list_dir("ckpt/000001") == ["deep", "model.pt", "optim"]
    assert s.list_dir("ckpt/000001/optim") == ["rank0.pt", "rank1.pt"]
    assert s.list_dir("nope") == []

    clone = pickle.loads(pickle.dumps(s))  # as shipped to a Ray worker
    clone.download_dir("ckpt/000001", str(tmp_path / "dst"))
    assert _read_tree(tmp_path / "dst") == files
    with pytest.raises(FileNotFoundError):
        s.download_dir("ckpt/absent", str(tmp_path / "dst2"))

    s.delete_file("ckpt/000001/optim/rank1.pt")
    s.delete_file("ckpt/000001/optim/rank1.pt")  # idempotent
    assert s.list_dir("ckpt/000001/optim") == ["rank0.pt"]
    s.delete_dir("ckpt/000001")
    s.delete_dir("ckpt/000001")  # idempotent
    assert s.list_dir("ckpt") == [] and not s.exists("ckpt/000001/model.pt")
    assert s.read_bytes("meta.json") == b'{"v": 2}'


# ---------------------------------------------------------------------------- permanent errors

def _fails_fast(fn, *needles: str, secret: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(PermanentStorageError) as info:
        fn()
    assert time.monotonic() - t0 < 5.0, "a permanent error must not be retried"
    msg = str(info.value)
    for needle in needles:
        assert needle in msg
    assert secret not in msg
    return msg


def test_s3_missing_bucket_is_permanent_and_named(s3_env):
    s = Storage(s3_env.uri("run", bucket="no-such-bucket"))
    _fails_fast(lambda: s.write_bytes("x", b"1"), "no-such-bucket", "AWS_ACCESS_KEY_ID",
                "create_container=True", secret=s3_env.secret_key)


def test_s3_bad_secret_is_permanent_and_not_shown(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-0123456789")
    s = Storage(s3_env.uri("run"))
    _fails_fast(lambda: s.read_bytes("x"), s3_env.bucket, "ACCESS_DENIED",
                secret="wrong-secret-0123456789")


def test_s3_create_container_is_opt_in(s3_env):
    s = Storage(s3_env.uri("run", bucket="made-on-request"), create_container=True)
    s.write_bytes("x", b"1")
    assert Storage(s3_env.uri("run", bucket="made-on-request")).read_bytes("x") == b"1"


def test_azure_missing_container_is_permanent_and_named(azure_env):
    s = Storage("abfs://no-such-container/run")
    _fails_fast(lambda: s.write_bytes("x", b"1"), "no-such-container",
                "AZURE_STORAGE_CONNECTION_STRING", secret=azure_env.account_key)
    s = Storage("az://made-on-request/run", create_container=True)
    s.write_bytes("x", b"1")
    assert Storage("az://made-on-request/run").read_bytes("x") == b"1"


def test_azure_bad_key_is_permanent_and_not_shown(azure_env, monkeypatch):
    bad_key = "d3Jvbmcta2V5LWZvci10ZXN0cw=="
    create_azure_container(azure_env.connection_string, "checkpoints")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       azure_env.connection_string.replace(azure_env.account_key, bad_key))
    s = Storage("abfs://checkpoints/run")
    _fails_fast(lambda: s.exists("x"), "checkpoints", "AuthorizationFailure", secret=bad_key)


def test_gcs_missing_bucket_is_permanent_and_named(gcs_env, monkeypatch):
    s = Storage(gcs_env.uri("run", bucket="no-such-bucket"))
    _fails_fast(lambda: s.write_bytes("x", b"1"), "no-such-bucket", "STORAGE_EMULATOR_HOST",
                "create_container=True", secret="\0")  # anonymous: no secret
    # Creating a bucket needs a project (the URI's project_id, or GOOGLE_CLOUD_PROJECT).
    s = Storage(gcs_env.uri("run?project_id=p1", bucket="made-on-request"), create_container=True)
    s.write_bytes("x", b"1")
    assert Storage(gcs_env.uri("run", bucket="made-on-request")).read_bytes("x") == b"1"
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "p2")
    s = Storage(gcs_env.uri("run", bucket="made-for-env-project"), create_container=True)
    s.write_bytes("x", b"2")


def test_azure_account_key_is_selected_without_leaking(azurite_server, monkeypatch):
    """Account name + key cannot point at an emulator (adlfs builds the public https URL),
    so only the selection is checked here; I/O with it needs a real account."""
    clear_storage_env(monkeypatch)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", azurite_server.account_name)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", azurite_server.account_key)
    s = Storage("abfs://keyed/run")
    assert "AZURE_STORAGE_ACCOUNT_KEY" in s.target and pickle.loads(pickle.dumps(s)).uri == s.uri
    assert azurite_server.account_key not in repr(s) + s.uri + s.target


# ---------------------------------------------------------------------------- outages

def _every_op_is_transient(s: Storage, tmp_path, attempts: int = FAST.max_attempts) -> None:
    ops = {
        "write": lambda: s.write_bytes("b", b"2"),
        "read": lambda: s.read_bytes("a"),
        "exists": lambda: s.exists("a"),
        "file_sizes": lambda: s.file_sizes(["a", "b"]),
        "list": lambda: s.list_dir(),
        "upload": lambda: s.upload_dir(_tree(tmp_path / "up", {"f": b"1"}), "ck"),
        "download": lambda: s.download_dir("", str(tmp_path / "down")),
        "delete_file": lambda: s.delete_file("a"),
        "delete_dir": lambda: s.delete_dir("ck"),
    }
    for name, op in ops.items():
        t0 = time.monotonic()
        with pytest.raises(TransientStorageError, match=f"after {attempts} attempt") as info:
            op()
        elapsed = time.monotonic() - t0
        assert elapsed < 30, f"{name} took {elapsed:.1f}s: retries must be bounded"
        assert s.target in str(info.value), name


def test_s3_server_stopped_mid_run_then_restarted(seaweed_private, monkeypatch, tmp_path):
    clear_storage_env(monkeypatch)
    for key, value in seaweed_private.env().items():
        monkeypatch.setenv(key, value)
    s = Storage(seaweed_private.uri("run"), retry=FAST)
    s.write_bytes("a", b"1")

    seaweed_private.stop()
    _every_op_is_transient(s, tmp_path)

    seaweed_private.start()  # same data dir: the object written before the outage survives
    assert s.read_bytes("a") == b"1"
    s.write_bytes("b", b"2")
    assert s.list_dir() == ["a", "b"]


def test_azure_server_stopped_mid_run_then_restarted(azurite_private, monkeypatch, tmp_path):
    clear_storage_env(monkeypatch)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_private.connection_string)
    create_azure_container(azurite_private.connection_string, "checkpoints")
    s = Storage("abfs://checkpoints/run", retry=FAST)
    s.write_bytes("a", b"1")

    azurite_private.stop()
    _every_op_is_transient(s, tmp_path)

    azurite_private.start()
    # Azurite keeps data in memory: its restart loses the container, unlike a real outage.
    with pytest.raises(PermanentStorageError, match="checkpoints"):
        s.write_bytes("b", b"2")
    create_azure_container(azurite_private.connection_string, "checkpoints")
    s.write_bytes("b", b"2")
    assert s.read_bytes("b") == b"2" and s.list_dir() == ["b"]


def test_gcs_server_stopped_mid_run_then_restarted(gcs_private, monkeypatch, tmp_path):
    clear_storage_env(monkeypatch)
    for key, value in gcs_private.env().items():
        monkeypatch.setenv(key, value)
    # pyarrow's GCS client spends ~1.5 s on each failed attempt whatever its retry window,
    # so one attempt per operation: what is checked here is that every operation's error is
    # classed transient (the retry loop itself is the same code as for S3 and Azure).
    s = Storage(gcs_private.uri("run"), retry=RetryPolicy(max_attempts=1))
    s.write_bytes("a", b"1")

    gcs_private.stop()
    _every_op_is_transient(s, tmp_path, attempts=1)

    gcs_private.start()  # filesystem backend: the object written before the outage survives
    assert s.read_bytes("a") == b"1"
    s.write_bytes("b", b"2")
    assert s.list_dir() == ["a", "b"]


def test_event_log_writes_never_wait_for_a_store_that_is_down(seaweed_private, monkeypatch):
    """The controller appends events on its loop; on an object store the uploads happen in
    a background thread, so an outage (each upload retrying for seconds) never blocks a
    write, and every line written during it is uploaded once the store is back."""
    from raylastic.events import JsonlWriter, read_jsonl

    clear_storage_env(monkeypatch)
    for key, value in seaweed_private.env().items():
        monkeypatch.setenv(key, value)
    slow = RetryPolicy(max_attempts=4, base_delay_s=0.5, max_delay_s=1.0)  # ~2 s per failing upload
    s = Storage(seaweed_private.uri("events"), retry=slow)
    w = JsonlWriter(s, "run/events.jsonl", sync_interval_s=0.05)
    w.write({"i": 0})
    deadline = time.monotonic() + 30
    while not s.exists("run/events.jsonl"):  # the background thread uploads on its own
        assert time.monotonic() < deadline, "the first line was never uploaded"
        time.sleep(0.05)

    seaweed_private.stop()
    t0 = time.monotonic()
    for i in range(1, 40):
        w.write({"i": i})
        time.sleep(0.02)  # spread over several sync intervals
    took = time.monotonic() - t0
    assert took < 0.02 * 39 + 1.0, f"40 writes took {took:.1f} s during the outage"

    seaweed_private.start()
    w.close()
    lines = list(read_jsonl(s.read_bytes("run/events.jsonl").decode()))
    assert [r["i"] for r in lines] == list(range(40))


# ---------------------------------------------------------------------------- checkpoints

class _RetryWatch(logging.Handler):
    """Counts the Storage's "attempt n/m failed, retrying" warnings per operation, so a
    test can wait until a call is provably blocked on the outage (no sleeps)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.messages.append(record.getMessage())
            self._cond.notify_all()

    def wait_for(self, needle: str, count: int, timeout_s: float = 60.0) -> None:
        def seen() -> bool:
            return sum(needle in m and "failed, retrying" in m for m in self.messages) >= count

        with self._cond:
            assert self._cond.wait_for(seen, timeout_s), \
                f"no {count} retried {needle!r} calls in {timeout_s}s: {self.messages[-3:]}"


@pytest.fixture
def retry_watch():
    watch = _RetryWatch()
    log = logging.getLogger("raylastic.checkpoint.storage")
    log.addHandler(watch)
    try:
        yield watch
    finally:
        log.removeHandler(watch)


class _Call(threading.Thread):
    """Runs ``fn`` once; ``.value``/``.error`` and the monotonic time it finished."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error, self.done_at = fn, None, None, None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        self.done_at = time.monotonic()

    def result(self, timeout_s: float = 60.0):
        self.join(timeout_s)
        assert not self.is_alive(), f"still blocked after {timeout_s}s"
        if self.error is not None:
            raise self.error
        return self.value


def _committed_run(storage: Storage, tmp_path, count: int, scratch) -> CheckpointManager:
    """A one-rank run on ``storage`` with checkpoints 1..count committed (two files each)
    and checkpoint count+1 written but never committed (its writer died)."""
    mgr = CheckpointManager(storage, "run", None, scratch)
    mgr.begin_epoch(1, 1)
    for index in range(1, count + 2):
        src = tmp_path / f"src-{storage.root.replace('/', '-')}-{index}"
        src.mkdir()
        (src / "model.pt").write_bytes(os.urandom(1000 + index))
        (src / "optim" ).mkdir()
        (src / "optim" / "rank0.pt").write_bytes(b"o" * index)
        rel = checkpoint_rel("run", index, 1)
        rec = ReportRecord(index=index, rank=0, epoch=1, ts=0.0, metrics={"step": index},
                           checkpoint_rel=rel, files=storage.upload_dir(str(src), rel))
        if index <= count:
            assert [c.index for c in mgr.on_records([rec])] == [index]
    return mgr


def _listing(storage: Storage) -> dict[str, list[str]]:
    ckpts = "run/checkpoints"
    return {name: storage.list_dir(f"{ckpts}/{name}") for name in storage.list_dir(ckpts)}


@pytest.fixture
def scratch_events(tmp_path):
    events = EventLog(Storage(str(tmp_path / "scratch")), "events", verbose=False)
    yield events
    events.close()


# A budget of ~10-40 s: well past a restart of either server (SeaweedFS ~3.5 s).
PATIENT = RetryPolicy(max_attempts=40, base_delay_s=0.1, max_delay_s=0.5)


@pytest.mark.parametrize("private_store", ["s3", "gcs"], indirect=True)
def test_restore_waits_out_an_outage_and_loads_the_newest_checkpoint(
        private_store, tmp_path, scratch_events, retry_watch):
    """Storage stops while a group re-forms: the live manager's latest_valid() (checking
    the newest checkpoint's files) and a new driver's manager (scanning manifests) both wait
    for the store and return the newest committed checkpoint; nothing committed is deleted,
    and the uncommitted directory goes only once the store can say it has no manifest.
    In a second run the newest checkpoint lost a file behind our back: the outage must not
    make latest_valid() hand it out unverified; it waits, sees the damage, takes the previous."""
    storage = Storage(private_store.uri("ck"), retry=PATIENT)
    live = _committed_run(storage, tmp_path, 3, scratch_events)
    before = _listing(storage)
    assert len(before) == 4 and sum(MANIFEST in files for files in before.values()) == 3
    damaged_storage = Storage(private_store.uri("damaged"), retry=PATIENT)
    damaged = _committed_run(damaged_storage, tmp_path, 2, scratch_events)
    damaged_storage.delete_file(f"{checkpoint_rel('run', 2, 1)}/optim/rank0.pt")

    private_store.stop()
    t_stop = time.monotonic()

    def re_form():  # what the controller does when a group re-forms: plan, then begin
        best = live.latest_valid()
        at = time.monotonic()
        live.begin_epoch(2, 1)
        return best, at

    regroup = _Call(re_form)
    resume = _Call(lambda: CheckpointManager(Storage(private_store.uri("ck"), retry=PATIENT),
                                             "run", None, scratch_events).latest_valid())
    check_damaged = _Call(damaged.latest_valid)
    for call in (regroup, resume, check_damaged):
        call.start()
    # Both latest_valid() are checking their newest checkpoint's files against the outage.
    retry_watch.wait_for("stat 'run/checkpoints/checkpoint_00000003-e1/", 2)
    retry_watch.wait_for("stat 'run/checkpoints/checkpoint_00000002-e1/", 2)
    retry_watch.wait_for("checking access", 2)  # the new driver's storage probes it first
    assert regroup.is_alive() and resume.is_alive() and check_damaged.is_alive()
    t_start = time.monotonic()  # start() returns once the server is ready: take it before
    private_store.start()

    best, verified_at = regroup.result()
    fresh = resume.result()
    print(f"outage {t_start - t_stop:.1f} s; re-form done {regroup.done_at - t_start:.1f} s "
          f"and fresh scan {resume.done_at - t_start:.1f} s after the restart")
    assert verified_at > t_start, "latest_valid() answered during the outage, unverified"
    assert (best.index, fresh.index) == (3, 3)
    assert check_damaged.result().index == 1
    after = _listing(storage)
    assert after == {k: v for k, v in before.items() if MANIFEST in v}, "only the uncommitted one goes"


class _StopsAfterListing(Storage):
    """The store goes down right after the checkpoints directory is listed, so the manifest
    reads that follow meet the outage: the store could list, then could not be read."""

    def __init__(self, uri: str, store, **kw) -> None:
        super().__init__(uri, **kw)
        self._store = store
        self.stopped = False

    def list_dir(self, rel: str = "") -> list[str]:
        names = super().list_dir(rel)
        if rel.endswith("checkpoints") and not self.stopped:
            self._store.stop()
            self.stopped = True
        return names


def test_an_outage_past_the_retry_budget_raises_and_deletes_nothing(
        private_store, tmp_path, scratch_events):
    """Manifests that cannot be read are not "no checkpoint": once the retries run out the
    scan raises StorageError instead of returning an older checkpoint or none (a fresh
    start), and neither latest_valid() nor a new group's cleanup deletes anything."""
    # pyarrow's GCS client takes ~1.5 s per failed attempt: two attempts there.
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.05) if private_store.kind == "gcs" else FAST
    storage = Storage(private_store.uri("ck"), retry=retry)
    live = _committed_run(storage, tmp_path, 2, scratch_events)
    before = _listing(storage)

    flaky = _StopsAfterListing(private_store.uri("ck"), private_store, retry=retry)
    # The scan's next call after the listing fails: the manifest read, or the listing of
    # the run's named checkpoint directories (report(checkpoint_dir_name=...)).
    with pytest.raises(TransientStorageError, match="(read 'run/checkpoints/checkpoint_|list 'run' ).*"
                       f"still failing after {retry.max_attempts} attempt"):
        CheckpointManager(flaky, "run", None, scratch_events)
    assert flaky.stopped
    with pytest.raises(TransientStorageError, match="stat"):
        live.latest_valid()
    with pytest.raises(StorageError):
        live.begin_epoch(2, 1)

    private_store.start()
    if private_store.keeps_data:
        assert _listing(storage) == before
        assert CheckpointManager(storage, "run", None, scratch_events).latest().index == 2


@pytest.mark.parametrize("private_store", ["gcs"], indirect=True)
def test_a_train_function_reading_its_checkpoint_waits_out_an_outage(private_store, tmp_path, retry_watch):
    """What get_checkpoint() hands a restored train function: reading it is a storage
    call like the others, retried under the run's policy, so the restore survives a
    blip instead of failing the attempt. (fake-gcs-server: its restart serves objects
    at once; a restarting SeaweedFS answers HEAD before it serves data.)"""
    from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

    storage = Storage(private_store.uri("ck"), retry=PATIENT)
    rel = checkpoint_rel("run", 5, 1)
    storage.write_bytes(f"{rel}/model/state.pt", b"weights")  # nested: no directory marker on GCS
    ckpt = StorageCheckpoint(storage, rel)
    private_store.stop()

    def load():
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "model", "state.pt"), "rb") as f:
                return f.read()

    read = _Call(load)
    read.start()
    retry_watch.wait_for(f"list '{rel}'", 2)  # provably blocked on the outage
    assert read.is_alive()
    private_store.start()
    assert read.result() == b"weights"
