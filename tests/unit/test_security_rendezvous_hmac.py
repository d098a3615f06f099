"""Security review (issue 22), finding 3: torch unpickles the azure-table rendezvous state, so
the backend hands torch only state written under the job's key (HMAC-SHA256); plus the medium
finding that cleanup deleted any old partition of a shared table.

No server: a real ``TableOps`` whose ``TableClient`` is an in-memory table with ETags.
"""

from __future__ import annotations

import itertools
import pickle
from datetime import datetime, timedelta, timezone

import pytest
from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import TableEntity
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _RendezvousState,
)

from raylastic.rendezvous import AzureTableRendezvousBackend
from raylastic.rendezvous import azure_table
from raylastic.rendezvous._endpoint import parse_endpoint
from raylastic.rendezvous._table import RetrySettings, TableOps, pack_chunks
from raylastic.rendezvous.cleanup import cleanup

KEY = "k" * 24 + "0123456789abcdef"  # 40 characters
OTHER_KEY = "o" * 40
KEY_ENV = "RAYLASTIC_RDZV_HMAC_KEY"
INSECURE_ENV = "RAYLASTIC_RDZV_INSECURE_NO_HMAC"
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


class MemoryTable:
    """The part of ``azure.data.tables.TableClient`` the backend and cleanup use."""

    def __init__(self) -> None:
        self.rows: dict = {}
        self._etags = itertools.count(1)

    def _store(self, entity, when=None) -> dict:
        etag = f"W/\"datetime'{next(self._etags)}'\""
        row = TableEntity(entity)
        row._metadata = {"etag": etag, "timestamp": when or datetime.now(timezone.utc)}
        self.rows[(entity["PartitionKey"], entity["RowKey"])] = row
        return {"etag": etag}

    def create_entity(self, entity, **_):
        if (entity["PartitionKey"], entity["RowKey"]) in self.rows:
            raise ResourceExistsError("EntityAlreadyExists")
        return self._store(entity)

    def update_entity(self, entity, mode=None, etag=None, match_condition=None, **_):
        current = self.rows.get((entity["PartitionKey"], entity["RowKey"]))
        if current is None:
            raise ResourceNotFoundError("ResourceNotFound")
        if etag is not None and current.metadata["etag"] != etag:
            raise ResourceModifiedError("UpdateConditionNotSatisfied")
        return self._store(entity)

    def upsert_entity(self, entity, **_):  # what an attacker with write access does
        return self._store(entity)

    def get_entity(self, pk, rk, **_):
        row = self.rows.get((pk, rk))
        if row is None:
            raise ResourceNotFoundError("ResourceNotFound")
        copy = TableEntity(row)
        copy._metadata = dict(row.metadata)
        return copy

    def list_entities(self, select=None, **_):
        return [self.get_entity(*key) for key in sorted(self.rows)]

    def query_entities(self, query_filter, parameters=None, select=None, **_):
        assert query_filter == "PartitionKey eq @pk", query_filter
        return [self.get_entity(*key) for key in sorted(self.rows) if key[0] == parameters["pk"]]

    def submit_transaction(self, batch, **_):
        assert len({op[1]["PartitionKey"] for op in batch}) == 1, "a transaction spans one partition"
        for op, entity in batch:
            assert op == "delete"
            del self.rows[(entity["PartitionKey"], entity["RowKey"])]


@pytest.fixture
def ops() -> TableOps:
    table_ops = TableOps(parse_endpoint("http://127.0.0.1:10002/devstoreaccount1", "rdzv"),
                         AzureNamedKeyCredential("devstoreaccount1", "a2V5"), RetrySettings(budget_s=1.0))
    table_ops.client = MemoryTable()
    return table_ops


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)


def _with_key(monkeypatch, key: str = KEY) -> None:
    monkeypatch.setenv(KEY_ENV, key)


UNPICKLED: list = []


def _mark_unpickled() -> _RendezvousState:
    UNPICKLED.append(True)
    return _RendezvousState()


class _Payload:
    """Stands for attacker code: unpickling it calls ``_mark_unpickled``."""

    def __reduce__(self):
        return (_mark_unpickled, ())


def _plant(ops: TableOps, run_id: str, state: bytes, **extra) -> None:
    """Write a state row as someone with write access to the table but without the key."""
    backend_pk = azure_table.partition_key(run_id)
    ops.client.upsert_entity({"PartitionKey": backend_pk, "RowKey": "state", "RunId": run_id, "Format": 1,
                              **pack_chunks(state, "s", "state"), **extra})


def _torch_sync(backend) -> None:
    """What every agent does: torch's state holder reads the state and unpickles it."""
    settings = RendezvousSettings("r", 1, 1, RendezvousTimeout(), timedelta(seconds=5), 3)
    holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    holder.sync()


# ------------------------------------------------------------------------ the key

def test_round_trip_with_the_key(monkeypatch, ops):
    _with_key(monkeypatch)
    writer, reader = AzureTableRendezvousBackend(ops, "job-1"), AzureTableRendezvousBackend(ops, "job-1")
    state = pickle.dumps(_RendezvousState())
    _, token, ok = writer.set_state(state)
    assert ok and reader.get_state() == (state, token)
    _, token2, ok = reader.set_state(state + b"", token)  # a replace is sealed again
    assert ok and writer.get_state() == (state, token2)
    _torch_sync(reader)  # torch's holder accepts it
    row = ops.client.rows[(azure_table.partition_key("job-1"), "state")]
    assert KEY not in str(dict(row)), "the key itself is never stored"


@pytest.mark.parametrize("planted", ["no_mac", "wrong_mac", "mac_of_other_state"])
def test_a_planted_state_is_refused_and_never_unpickled(monkeypatch, ops, planted):
    _with_key(monkeypatch)
    backend = AzureTableRendezvousBackend(ops, "job-1")
    backend.set_state(pickle.dumps(_RendezvousState()))
    good_mac = ops.client.rows[(azure_table.partition_key("job-1"), "state")].get("sHmac")
    evil = pickle.dumps(_Payload())
    extra = {"no_mac": {}, "wrong_mac": {"sHmac": "0" * 64}, "mac_of_other_state": {"sHmac": good_mac}}[planted]
    _plant(ops, "job-1", evil, **extra)
    UNPICKLED.clear()
    with pytest.raises(RendezvousStateError, match="failed authentication") as info:
        _torch_sync(backend)
    assert UNPICKLED == [], "torch unpickled a state that nobody with the key wrote"
    assert "RAYLASTIC_RDZV_HMAC_KEY" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(RendezvousStateError):  # the lost-race path reads it back too
        backend.set_state(pickle.dumps(_RendezvousState()), 'W/"stale"')
    assert UNPICKLED == []


def test_a_row_copied_from_another_run_is_refused(monkeypatch, ops):
    _with_key(monkeypatch)
    AzureTableRendezvousBackend(ops, "job-a").set_state(b"state of a")
    row = dict(ops.client.rows[(azure_table.partition_key("job-a"), "state")])
    row.update(PartitionKey=azure_table.partition_key("job-b"), RunId="job-b")
    ops.client.upsert_entity(row)
    with pytest.raises(RendezvousStateError, match="failed authentication"):
        AzureTableRendezvousBackend(ops, "job-b").get_state()


def test_agents_with_different_keys_refuse_each_others_state(monkeypatch, ops):
    _with_key(monkeypatch)
    AzureTableRendezvousBackend(ops, "job-1").set_state(b"s")
    _with_key(monkeypatch, OTHER_KEY)
    with pytest.raises(RendezvousStateError, match="MAC does not match"):
        AzureTableRendezvousBackend(ops, "job-1").get_state()


def test_no_key_refuses_to_start(ops, monkeypatch):
    with pytest.raises(ValueError, match=KEY_ENV) as info:
        AzureTableRendezvousBackend(ops, "job-1")
    assert INSECURE_ENV in str(info.value) and "secrets.token_hex" in str(info.value)
    # create_backend (what torchrun calls) refuses too, after the endpoint and credentials.
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "AccountName=devstoreaccount1;AccountKey=a2V5;TableEndpoint=http://127.0.0.1:1/x")
    monkeypatch.setattr(TableOps, "ensure_table", lambda self, budget_s=None: None)
    params = RendezvousParameters("azure-table", "http://127.0.0.1:1/devstoreaccount1", "job-1", 1, 1)
    with pytest.raises(ValueError, match=KEY_ENV):
        azure_table.create_backend(params)
    _with_key(monkeypatch)
    backend, _ = azure_table.create_backend(params)
    assert isinstance(backend, AzureTableRendezvousBackend)


def test_a_short_key_is_refused_without_echoing_it(ops, monkeypatch):
    _with_key(monkeypatch, "short-secret")
    with pytest.raises(ValueError, match="too short") as info:
        AzureTableRendezvousBackend(ops, "job-1")
    assert "short-secret" not in str(info.value)


def test_explicit_insecure_opt_out_round_trips_without_a_mac(ops, monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, "1")
    backend = AzureTableRendezvousBackend(ops, "job-1")
    _, token, _ = backend.set_state(b"plain")
    assert backend.get_state() == (b"plain", token)
    assert "sHmac" not in ops.client.rows[(azure_table.partition_key("job-1"), "state")]
    _with_key(monkeypatch)  # a key wins over the opt-out: the unsigned row is refused
    with pytest.raises(RendezvousStateError, match="no sHmac"):
        AzureTableRendezvousBackend(ops, "job-1").get_state()


# ------------------------------------------------------------------------ cleanup (medium finding)

def _seed(ops: TableOps, pk: str, rows, when) -> None:
    for rk in rows:
        ops.client._store({"PartitionKey": pk, "RowKey": rk}, when=when)


def test_cleanup_deletes_only_rendezvous_partitions_of_a_shared_table(ops):
    old, fresh = EPOCH, EPOCH + timedelta(days=30)
    _seed(ops, "run-oldjob", ["state", "kv-YWJj"], old)
    _seed(ops, "run-freshjob", ["state"], fresh)
    _seed(ops, "orders", ["invoice-1", "invoice-2"], old)  # another application's data
    _seed(ops, "run-mixed", ["state", "invoice-3"], old)  # our shape, with a foreign row
    lines = []
    deleted = cleanup(ops, older_than=timedelta(days=7), now=fresh, out=_Lines(lines))
    assert deleted == ["run-oldjob"]
    assert sorted(ops.client.rows) == [("orders", "invoice-1"), ("orders", "invoice-2"),
                                       ("run-freshjob", "state"), ("run-mixed", "invoice-3"),
                                       ("run-mixed", "state")]
    assert any("skipping partition 'run-mixed'" in line for line in lines)


def test_cleanup_by_run_id_queries_and_deletes_that_partition_only(ops, monkeypatch):
    _seed(ops, "run-job-1", ["state", "kv-eA"], EPOCH)
    _seed(ops, "run-job-12", ["state"], EPOCH)
    monkeypatch.setattr(ops.client, "list_entities", lambda **_: pytest.fail("scanned the whole table"))
    assert cleanup(ops, run_id="job-1", out=_Lines([])) == ["run-job-1"]
    assert sorted(ops.client.rows) == [("run-job-12", "state")]


class _Lines:
    def __init__(self, lines: list) -> None:
        self.lines = lines

    def write(self, text: str) -> None:
        if text.strip():
            self.lines.append(text)

    def flush(self) -> None:
        pass
