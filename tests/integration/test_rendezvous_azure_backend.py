"""azure-table rendezvous backend and store against a real Azurite table service."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist
from azure.core.credentials import AzureNamedKeyCredential
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from raylastic.rendezvous import AzureTableRendezvousBackend, create_backend, create_handler
from raylastic.rendezvous._endpoint import parse_endpoint
from raylastic.rendezvous._table import CHUNK_BYTES, MAX_CHUNKS, RetrySettings, TableOps
from raylastic.rendezvous.cleanup import cleanup, main as cleanup_main
from raylastic.testing.azurite import Azurite, find_azurite

pytestmark = [pytest.mark.skipif(find_azurite() is None, reason="azurite not installed (make install)"),
              pytest.mark.no_ray]  # a local_cluster of the modules around may stay up (conftest)

# The state key every backend here authenticates its state rows with (docs/security.md): fixed,
# 64 hex characters, as `python -c 'import secrets; print(secrets.token_hex(32))'` makes them.
TEST_HMAC_KEY = "5f0c2a9e7b41d8c3e6a1f09b2d7c4e85a3b6f1d0c9e8a7b2f4d1c6e3a0b9f8d7"


@pytest.fixture(autouse=True)
def _rdzv_state_key(monkeypatch):
    """Every backend and handler of this module reads the key from the environment, as torchrun
    agents do; an ambient opt-out from the developer's shell must not weaken the tests."""
    monkeypatch.setenv("RAYLASTIC_RDZV_HMAC_KEY", TEST_HMAC_KEY)
    monkeypatch.delenv("RAYLASTIC_RDZV_INSECURE_NO_HMAC", raising=False)


@pytest.fixture(scope="module")
def azurite():
    with Azurite() as az:
        yield az


def _ops(az: Azurite, table: str = "rdzvtests", budget_s: float = 5.0) -> TableOps:
    ops = TableOps(
        parse_endpoint(az.table_endpoint, table),
        AzureNamedKeyCredential(az.account_name, az.account_key),
        RetrySettings(budget_s=budget_s, request_timeout_s=5.0),
    )
    ops.ensure_table()
    return ops


def _run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


# -- torch's RendezvousBackend contract, clause by clause ----------------------------------------
# (dynamic_rendezvous.RendezvousBackend.set_state; torch's c10d and etcd backends are the reference)


def _backend(az: Azurite) -> AzureTableRendezvousBackend:
    return AzureTableRendezvousBackend(_ops(az), _run_id())


def test_get_state_is_none_before_any_write(azurite):
    assert _backend(azurite).get_state() is None


def test_set_state_without_token_creates_only_when_empty(azurite):
    backend = _backend(azurite)
    state, token, ok = backend.set_state(b"v1")
    assert (state, ok) == (b"v1", True) and backend.get_state() == (b"v1", token)
    # token=None only creates: the existing state and its token come back, unchanged.
    assert backend.set_state(b"v2") == (b"v1", token, False)
    assert backend.get_state() == (b"v1", token)
    assert backend.name == "azure-table"


def test_set_state_with_the_current_token_replaces_and_issues_a_new_token(azurite):
    backend = _backend(azurite)
    _, token, _ = backend.set_state(b"v1")
    state, token2, ok = backend.set_state(b"v2", token)
    assert (state, ok) == (b"v2", True) and token2 != token
    assert backend.get_state() == (b"v2", token2)
    assert backend.set_state(b"v3", token2)[2]  # and the new token works in turn


def test_set_state_with_a_stale_token_returns_the_current_state(azurite):
    mine = _backend(azurite)
    _, stale, _ = mine.set_state(b"v1")
    other = AzureTableRendezvousBackend(mine._ops, mine._run_id)  # another agent, same run
    _, current, ok = other.set_state(b"v2", stale)
    assert ok
    assert mine.set_state(b"v3", stale) == (b"v2", current, False)
    assert mine.get_state() == (b"v2", current)


def _never_issued(current: str) -> list:
    """Tokens the table never issued for the current state: malformed, wildcard, foreign, other types."""
    return [
        "invalid",  # Azurite: 400 InvalidInput
        "*",  # If-Match: * would match ANY entity: it must never reach the service
        '"x"', current.replace("W/", "", 1),  # strong ETags: 400 InvalidInput
        'W/"whatever"', "W/\"datetime'garbage'\"",  # well formed, never issued: 412
        "a\nb", " " + current, "\u00e9t\u00e9", 'W/"a"b"',  # not an entity-tag (a\nb: SDK error)
        os.urandom(24).decode("latin-1"),  # random garbage
        current.encode(), b"foreign", 42, 3.5, (current,), object(),  # tokens are str
    ]


def test_set_state_with_a_never_issued_token_returns_the_current_state(azurite):
    backend = _backend(azurite)
    _, token, _ = backend.set_state(b"v1")
    for bad in _never_issued(token):
        assert backend.set_state(b"v2", bad) == (b"v1", token, False), repr(bad)
        # Writing the bytes that are already stored does not turn a refused write into a success.
        assert backend.set_state(b"v1", bad) == (b"v1", token, False), repr(bad)
    assert backend.get_state() == (b"v1", token)


def test_set_state_with_a_never_issued_token_and_no_state_returns_none(azurite):
    backend = _backend(azurite)
    probe = _backend(azurite)
    _, token, _ = probe.set_state(b"elsewhere")  # a real token, of another run
    for bad in _never_issued(token) + [token]:
        assert backend.set_state(b"v1", bad) is None, repr(bad)
    assert backend.get_state() is None


@pytest.mark.parametrize("empty", ["", b""], ids=["str", "bytes"])
def test_an_empty_token_means_no_token_as_in_torchs_backends(azurite, empty):
    # torch's c10d and etcd backends test ``if token:``: a falsy token is "create if absent".
    backend = _backend(azurite)
    state, token, ok = backend.set_state(b"v1", empty)
    assert (state, ok) == (b"v1", True)
    assert backend.set_state(b"v2", empty) == (b"v1", token, False)


def test_a_rejected_write_with_the_current_token_is_a_connection_error(azurite):
    """A 400 that is not about the token (here: a 64 KiB+ property) must not read as a lost race."""
    from raylastic.rendezvous._table import pack_chunks

    ops = _ops(azurite)
    backend = AzureTableRendezvousBackend(ops, "r" * 40_000)  # RunId property > 64 KiB: 400
    with pytest.raises(RendezvousConnectionError, match="HTTP 400"):
        backend.set_state(b"v1")
    meta = ops.client.create_entity({
        "PartitionKey": backend._pk, "RowKey": "state", "Format": 1, **pack_chunks(b"v1", "s", "s"),
        **backend._auth.seal(backend._pk, 1, b"v1"),  # the MAC get_state checks
    })
    assert backend.get_state() == (b"v1", meta["etag"])
    with pytest.raises(RendezvousConnectionError, match="HTTP 400.*exceeds"):
        backend.set_state(b"v2", meta["etag"])
    stale = 'W/"whatever"'  # a stale token first gets the current state, then the same error
    assert backend.set_state(b"v2", stale) == (b"v1", meta["etag"], False)


class _DropOneReply:
    """A TCP relay to Azurite. Once ``armed``, it delivers the next PUT to Azurite and then cuts
    the connection instead of relaying the answer: the write lands, the client never hears it."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed, self.dropped = threading.Event(), threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self._port), timeout=10)
            drop = threading.Event()
            threading.Thread(target=self._pump, args=(client, upstream, drop, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, drop, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, drop: threading.Event, request: bool) -> None:
        try:
            while data := src.recv(65536):
                if request and data.startswith(b"PUT ") and self.armed.is_set():
                    self.armed.clear()
                    drop.set()
                if not request and drop.is_set():
                    self.dropped.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._listener.close()


def test_a_retried_write_that_landed_the_first_time_is_a_success(azurite):
    """The one case where a 412 reads as success: our first attempt was applied but its answer
    was lost, so the retry fails against our own write (it finds our bytes stored)."""
    relay = _DropOneReply(azurite.table_port)
    try:
        ops = TableOps(
            parse_endpoint(f"http://127.0.0.1:{relay.port}/{azurite.account_name}", "rdzvtests"),
            AzureNamedKeyCredential(azurite.account_name, azurite.account_key),
            RetrySettings(budget_s=10.0, request_timeout_s=5.0),
        )
        ops.ensure_table()
        backend = AzureTableRendezvousBackend(ops, _run_id())
        _, token, _ = backend.set_state(b"v1")
        relay.armed.set()
        state, token2, ok = backend.set_state(b"v2", token)
        assert relay.dropped.is_set(), "the relay did not cut the first answer"
        assert (state, ok) == (b"v2", True) and token2 != token
        assert backend.get_state() == (b"v2", token2)
    finally:
        relay.close()

def test_concurrent_creators_without_token_have_one_winner(azurite):
    ops, run_id = _ops(azurite), _run_id()
    n = 6
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def writer(i: int) -> None:
        barrier.wait(timeout=30)
        results[i] = AzureTableRendezvousBackend(ops, run_id).set_state(f"creator{i}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert sum(r[2] for r in results) == 1, results
    assert len({(r[0], r[1]) for r in results}) == 1, "everyone sees the winner's state and token"


def test_concurrent_set_state_with_the_same_token_has_one_winner(azurite):
    backend = AzureTableRendezvousBackend(_ops(azurite), _run_id())
    _, token, _ = backend.set_state(b"base")
    for round_ in range(3):
        n = 6
        barrier = threading.Barrier(n)
        results: list = [None] * n

        def writer(i: int) -> None:
            barrier.wait(timeout=30)
            results[i] = backend.set_state(f"round{round_}-writer{i}".encode(), token)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join(timeout=60) for t in threads]
        winners = [r for r in results if r[2]]
        assert len(winners) == 1, results
        stored, token = backend.get_state()
        assert stored == winners[0][0]
        assert all(r[0] == stored for r in results), "losers get the winner's state back"


def test_large_state_is_chunked_across_properties(azurite):
    ops = _ops(azurite)
    backend = AzureTableRendezvousBackend(ops, _run_id())
    big = os.urandom(5 * CHUNK_BYTES + 123)
    _, token, ok = backend.set_state(big)
    assert ok and backend.get_state() == (big, token)
    entity = ops.client.get_entity(backend._pk, "state")
    assert entity["sChunks"] == 6 and len(entity["s05"]) == 123
    smaller = os.urandom(CHUNK_BYTES)  # a replace must not leave stale chunks behind
    _, token, ok = backend.set_state(smaller, token)
    assert ok and backend.get_state()[0] == smaller
    assert "s05" not in ops.client.get_entity(backend._pk, "state")
    with pytest.raises(RendezvousStateError, match="at most"):
        backend.set_state(b"x" * (MAX_CHUNKS * CHUNK_BYTES + 1), token)


def test_corrupt_state_raises_state_error(azurite):
    from azure.data.tables import UpdateMode

    ops = _ops(azurite)
    backend = AzureTableRendezvousBackend(ops, _run_id())
    backend.set_state(b"y" * 1000)
    ops.client.update_entity({"PartitionKey": backend._pk, "RowKey": "state", "s00": b"garbage"}, mode=UpdateMode.MERGE)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    ops.client.update_entity({"PartitionKey": backend._pk, "RowKey": "state", "Format": 99}, mode=UpdateMode.MERGE)
    with pytest.raises(RendezvousStateError, match="format 99"):
        backend.get_state()


def test_errors_are_mapped_when_azurite_is_down_and_retried_until_it_is_back():
    with Azurite() as az:
        ops = _ops(az, budget_s=1.0)
        backend = AzureTableRendezvousBackend(ops, _run_id())
        backend.set_state(b"x")
        az.stop()
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as info:
            backend.get_state()
        assert time.monotonic() - started < 10
        assert "nothing answers at" in str(info.value) and "retry_timeout" in str(info.value)
        for token in ("W/\"whatever\"", "invalid", None):  # never "lost the race" while down
            with pytest.raises(RendezvousConnectionError):
                backend.set_state(b"y", token)
        # A transient outage shorter than the budget is retried with backoff and succeeds.
        restarter = threading.Timer(1.0, az.start)
        restarter.start()
        try:
            ops.ensure_table(budget_s=30.0)
        finally:
            restarter.join()
        assert backend.get_state() is None  # in-memory Azurite came back empty


def test_wrong_key_is_a_connection_error_naming_credentials(azurite, monkeypatch):
    bad = azurite.connection_string.replace(azurite.account_key, "AAAA" + azurite.account_key[4:])
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", bad)
    params = RendezvousParameters("azure-table", azurite.table_endpoint, _run_id(), 1, 1)
    with pytest.raises(RendezvousConnectionError) as info:
        create_backend(params)
    assert "rejected the credentials" in str(info.value)
    assert azurite.account_key[4:] not in str(info.value)


def test_store_semantics_through_prefix_store(azurite, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    params = RendezvousParameters("azure-table", azurite.table_endpoint, _run_id(), 1, 1, read_timeout="2")
    _, store = create_backend(params)
    ps = dist.PrefixStore("torch.rendezvous.run.0", store)
    ps.set("addr", "10.0.0.1")
    assert ps.get("addr") == b"10.0.0.1"
    assert ps.multi_get(["addr"]) == [b"10.0.0.1"]
    assert ps.check(["addr"]) and not ps.check(["nope"])
    assert ps.compare_set("addr", "10.0.0.1", "10.0.0.2") == b"10.0.0.2"
    assert ps.compare_set("addr", "stale", "x") == b"10.0.0.2"
    assert ps.compare_set("fresh", "", "v") == b"v"
    assert ps.compare_set("absent", "expected", "v") == b"expected"
    big = os.urandom(2 * CHUNK_BYTES)
    ps.set("big", big)
    assert ps.get("big") == big

    counts: list = []
    threads = [threading.Thread(target=lambda: counts.append(ps.add("n", 1))) for _ in range(6)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert sorted(counts) == [1, 2, 3, 4, 5, 6]

    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="waiting for key"):
        ps.get("never")
    assert 1.5 < time.monotonic() - started < 10
    with pytest.raises(dist.DistStoreError):
        ps.wait(["never"], timedelta(milliseconds=300))
    threading.Timer(0.3, lambda: ps.set("late", "1")).start()
    ps.wait(["late"])  # blocks until another writer publishes

    assert store.delete_key("torch.rendezvous.run.0/late") and not store.delete_key("torch.rendezvous.run.0/late")
    assert store.num_keys() == 4  # addr, fresh, big, n ("absent" and "never" were never written)


def test_handler_forms_a_one_node_round_and_closes(azurite, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # restored after the test
    run_id = _run_id()
    params = RendezvousParameters(
        "azure-table", azurite.table_endpoint, run_id, 1, 1, local_addr="127.0.0.1",
        join_timeout="30", last_call_timeout="1", keep_alive_interval="1",
    )
    handler = create_handler(params)
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert handler.get_backend() == "azure-table" and not handler.use_agent_store
    info = handler.next_rendezvous()
    try:
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert info.bootstrap_store_info.master_port > 0
        assert not handler.is_closed() and handler.num_nodes_waiting() == 0
    finally:
        assert handler.shutdown()
    assert handler.is_closed()


def _seed_runs(az: Azurite, table: str, n: int) -> tuple[TableOps, list]:
    ops = _ops(az, table)
    run_ids = [_run_id() for _ in range(n)]
    for rid in run_ids:
        AzureTableRendezvousBackend(ops, rid).set_state(b"s")
    return ops, run_ids


def test_cleanup_by_run_id_and_age(azurite, capsys):
    ops, (keep, drop) = _seed_runs(azurite, "cleanupa", 2)
    assert cleanup(ops, run_id=drop) == [drop]
    assert AzureTableRendezvousBackend(ops, drop).get_state() is None
    assert AzureTableRendezvousBackend(ops, keep).get_state() is not None
    assert cleanup(ops, older_than=timedelta(days=1)) == []  # keep is fresh
    future = datetime.now(timezone.utc) + timedelta(days=2)
    assert cleanup(ops, older_than=timedelta(days=1), now=future, dry_run=True) == [keep]
    assert AzureTableRendezvousBackend(ops, keep).get_state() is not None
    assert cleanup(ops, older_than=timedelta(days=1), now=future) == [keep]
    assert list(ops.client.list_entities()) == []


def test_cleanup_cli(azurite, monkeypatch, capsys):
    ops, (rid,) = _seed_runs(azurite, "cleanupb", 1)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    endpoint = f"{azurite.table_endpoint}/cleanupb"
    assert cleanup_main(["--endpoint", endpoint, "--older-than", "7d"]) == 0
    assert "0 run(s) deleted" in capsys.readouterr().out
    assert cleanup_main(["--endpoint", endpoint, "--run-id", rid]) == 0
    out = capsys.readouterr().out
    assert f"deleting run {rid!r}" in out and "1 run(s) deleted" in out
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    assert cleanup_main(["--endpoint", endpoint, "--run-id", rid]) == 2
    assert "no storage credentials" in capsys.readouterr().err


def test_azurite_harness_restarts_on_same_ports_and_leaves_nothing():
    import psutil

    az = Azurite()
    with az:
        ports = (az.blob_port, az.table_port, az.queue_port)
        pid = az._proc.pid
        assert az.connection_string.count("127.0.0.1") == 3 and "devstoreaccount1" in az.blob_endpoint
        az.stop()
        assert not az.running and not psutil.pid_exists(pid)
        az.start()
        assert (az.blob_port, az.table_port, az.queue_port) == ports and az.running
        pid = az._proc.pid
    assert not psutil.pid_exists(pid)


def test_azurite_harness_moves_to_new_ports_only_before_its_first_start():
    """A port taken between picking it and binding it (another process's server, say):
    the first start moves to new ports; a restart keeps its ports, which clients hold, and
    fails clearly instead."""
    az = Azurite()
    taken = az.table_port
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        with az:
            assert az.running and az.table_port != taken
            holder.close()
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ports = (az.blob_port, az.table_port, az.queue_port)
            az.stop()
            holder.bind(("127.0.0.1", az.queue_port))
            holder.listen()
            with pytest.raises(RuntimeError, match="EADDRINUSE"):
                az.start()
            assert (az.blob_port, az.table_port, az.queue_port) == ports and not az.running
    finally:
        holder.close()


def test_table_scoped_sas_works_when_the_table_exists(azurite, monkeypatch):
    from azure.data.tables import TableSasPermissions, generate_table_sas

    _ops(azurite, "sastable")  # created with the account key
    sas = generate_table_sas(
        AzureNamedKeyCredential(azurite.account_name, azurite.account_key), "sastable",
        permission=TableSasPermissions(read=True, add=True, update=True, delete=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas)
    params = RendezvousParameters("azure-table", f"{azurite.table_endpoint}/sastable", _run_id(), 1, 1)
    backend, _ = create_backend(params)
    _, token, ok = backend.set_state(b"via-sas")
    assert ok and backend.get_state() == (b"via-sas", token)
    # The same SAS cannot create another table: a clear credentials error, signature redacted.
    params = RendezvousParameters("azure-table", f"{azurite.table_endpoint}/othertable", _run_id(), 1, 1)
    with pytest.raises(RendezvousConnectionError) as info:
        create_backend(params)
    assert "rejected the credentials" in str(info.value)
    sig = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    assert sig not in str(info.value)
