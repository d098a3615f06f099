"""The run lease (issue 22): one fit() per run, takeover after expiry, epoch numbering continues.

Pure storage logic on a local directory and on an object store seen through the same
``Storage`` seam (a local directory with ``is_local`` off exercises the write-then-read-back
path that S3/GCS/Azure take)."""

import json
import os
import threading

import pytest

from raylastic.checkpoint.lease import LEASE_FILE, RunLease, highest_checkpoint_epoch, parse_record
from raylastic.checkpoint.storage import Storage
from raylastic.errors import RunInUseError
from raylastic.trainer import ElasticTrainer
from raylastic.errors import ConfigError


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class ObjectStore:
    """The part of ``Storage`` a lease uses, as an object store answers it: whole-object PUTs,
    no conditional write (the write / settle / read-back path S3, GCS and Azure take)."""

    is_local = False
    uri = "s3://bucket/runs"

    def __init__(self):
        self.objects = {}

    def read_bytes(self, rel):
        if rel not in self.objects:
            raise FileNotFoundError(rel)
        return self.objects[rel]

    def write_bytes(self, rel, data):
        self.objects[rel] = bytes(data)

    def list_dir(self, rel):
        prefix = rel.rstrip("/") + "/"
        return sorted({k[len(prefix):].split("/")[0] for k in self.objects if k.startswith(prefix)})


def _storage(tmp_path, object_store=False):
    return ObjectStore() if object_store else Storage(str(tmp_path))


@pytest.mark.parametrize("object_store", [False, True])
def test_a_second_holder_is_refused_while_the_first_is_live(tmp_path, object_store):
    st = _storage(tmp_path, object_store)
    clock = Clock()
    first = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    assert first.acquire() == 0
    try:
        second = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
        with pytest.raises(RunInUseError) as e:
            second.acquire()
        assert "run" in e.value.run and first.holder == e.value.holder
        assert "RunConfig.name" in str(e.value) and "expires in 30 s" in str(e.value)
    finally:
        first.release()


@pytest.mark.parametrize("object_store", [False, True])
def test_a_dead_holder_is_taken_over_after_the_expiry_and_not_before(tmp_path, object_store):
    st = _storage(tmp_path, object_store)
    clock = Clock()
    dead = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    dead.acquire()
    dead._stop.set()  # the holder dies: it never renews, never releases
    clock.t += 29.0
    with pytest.raises(RunInUseError):
        RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock).acquire()
    clock.t += 1.5
    heir = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    heir.acquire()
    heir.release()
    # the old holder, if it comes back, finds the run taken and stops
    assert dead.renew() is False and "taken over" in dead.lost


def test_a_released_lease_is_free_at_once_and_keeps_the_epoch_floor(tmp_path):
    st = _storage(tmp_path)
    a = RunLease(st, "run", settle_s=0)
    a.acquire()
    a.note_epoch(7)
    a.release()
    rec = parse_record((tmp_path / "run" / LEASE_FILE).read_bytes())
    assert rec.released and rec.epoch == 7
    b = RunLease(st, "run", settle_s=0)
    assert b.acquire() == 7  # the next fit() numbers its first group 8
    b.release()


def test_the_epoch_floor_also_counts_checkpoint_directories(tmp_path):
    st = _storage(tmp_path)
    for name in ("checkpoint_00000003-e4", "checkpoint_00000009-e12", "not_a_checkpoint-e99"):
        os.makedirs(tmp_path / "run" / "checkpoints" / name)
    assert highest_checkpoint_epoch(st, "run") == 12
    lease = RunLease(st, "run", settle_s=0)
    assert lease.acquire() == 12
    lease.release()


def test_racing_takers_on_a_local_directory_one_wins(tmp_path):
    st = _storage(tmp_path)
    won, refused = [], []
    barrier = threading.Barrier(6)

    def take():
        lease = RunLease(st, "run", settle_s=0)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease)
        except RunInUseError:
            refused.append(lease)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1 and len(refused) == 5
    won[0].release()


def test_racing_takers_on_an_object_store_read_back_the_last_write(tmp_path):
    st = _storage(tmp_path, object_store=True)
    clock = Clock()
    a = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    b = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    # both read "no lease"; b writes after a, before a reads back: only b may proceed
    real_write = st.write_bytes

    def a_write_then_b_writes(rel, data):
        real_write(rel, data)
        if json.loads(data)["token"] == a.token:
            real_write(rel, json.dumps({**json.loads(data), "token": b.token, "holder": b.holder}).encode())

    st.write_bytes = a_write_then_b_writes
    with pytest.raises(RunInUseError) as e:
        a.acquire()
    assert "same moment" in str(e.value)


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"holder": 1}', b"\xff\xfe",
                                 b'{"holder":"h","token":"t","renewed_ts":1e999,"expires_ts":"x"}',
                                 b'{"holder":"h","token":"t","renewed_ts":1,"expires_ts":2,"epoch":-3}'])
def test_a_garbled_lease_record_never_locks_the_run(tmp_path, raw):
    st = _storage(tmp_path)
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / LEASE_FILE).write_bytes(raw)
    assert parse_record(raw) is None
    lease = RunLease(st, "run", settle_s=0)
    lease.acquire()  # treated as expired: an existing file is taken over by write + read back
    lease.release()


def test_renewals_keep_a_live_holder_ahead_of_its_expiry(tmp_path):
    st = _storage(tmp_path)
    clock = Clock()
    lease = RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock)
    lease.acquire()
    lease._stop.set()
    for _ in range(5):  # 5 renewals 10 s apart: 50 s after taking it, still live
        clock.t += 10
        assert lease.renew()
    with pytest.raises(RunInUseError):
        RunLease(st, "run", ttl_s=30, settle_s=0, clock=clock).acquire()


def test_restore_refuses_a_bare_bucket():
    with pytest.raises(ConfigError, match="s3://bucket/prefix"):
        ElasticTrainer.restore("s3://bucket", lambda: None)
    with pytest.raises(ConfigError):
        ElasticTrainer.restore("gs://bucket/", lambda: None)


_HOLDER = """
import sys, time
from raylastic.checkpoint.lease import RunLease
from raylastic.checkpoint.storage import Storage
lease = RunLease(Storage(sys.argv[1]), "run", ttl_s=3.0, settle_s=0)
lease.acquire()
print("HELD", flush=True)
time.sleep(600)
"""


def test_a_killed_holder_is_taken_over_within_the_lease_ttl(tmp_path):
    """A real holder process renews the lease, then is SIGKILLed (no release): a second
    taker is refused while the lease lives and takes the run within ttl after the kill."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "HELD"
        st = Storage(str(tmp_path))
        with pytest.raises(RunInUseError):
            RunLease(st, "run", ttl_s=3.0, settle_s=0).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    killed = time.monotonic()
    heir = RunLease(st, "run", ttl_s=3.0, settle_s=0)
    while True:  # bounded: the lease must expire within ttl (+ one renewal period of slack)
        try:
            heir.acquire()
            break
        except RunInUseError:
            assert time.monotonic() - killed < 3.0 + 1.5, "not taken over within the lease ttl"
            time.sleep(0.1)
    took = time.monotonic() - killed
    heir.release()
    assert took <= 3.0 + 1.5, took


def test_release_does_not_wait_out_a_store_that_is_down(tmp_path):
    """A run that failed because its store is down must not then block in release(): the
    lease is left to expire instead."""
    import time

    store = ObjectStore()
    lease = RunLease(store, "run", ttl_s=30, settle_s=0)
    lease.acquire()

    def hang(rel, data=None):
        time.sleep(60)  # an outage under the storage retry policy

    store.read_bytes = hang
    store.write_bytes = hang
    t0 = time.monotonic()
    lease.release()
    assert time.monotonic() - t0 < 2 * 2.0 + 1.0
