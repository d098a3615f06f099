"""The storage seam against real servers: local disk, SeaweedFS (S3) and Azurite (Azure Blob).

Fixtures live in tests/integration/storage_fixtures.py. Outage tests stop a private server
mid-run: every operation must end in TransientStorageError within the RetryPolicy's bound
(never FileNotFoundError: an outage is not "no checkpoint"), and the same Storage object
must work again once the server is back.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest

from raylastic.checkpoint.storage import (
    PermanentStorageError,
    RetryPolicy,
    Storage,
    TransientStorageError,
)

from storage_fixtures import create_azure_container, clear_storage_env  # noqa: E402

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2)


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

def _every_op_is_transient(s: Storage, tmp_path) -> None:
    ops = {
        "write": lambda: s.write_bytes("b", b"2"),
        "read": lambda: s.read_bytes("a"),
        "exists": lambda: s.exists("a"),
        "list": lambda: s.list_dir(),
        "upload": lambda: s.upload_dir(_tree(tmp_path / "up", {"f": b"1"}), "ck"),
        "download": lambda: s.download_dir("", str(tmp_path / "down")),
        "delete_file": lambda: s.delete_file("a"),
        "delete_dir": lambda: s.delete_dir("ck"),
    }
    for name, op in ops.items():
        t0 = time.monotonic()
        with pytest.raises(TransientStorageError, match="after 3 attempt") as info:
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
