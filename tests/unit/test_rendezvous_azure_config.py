"""azure-table rendezvous: endpoint parsing, credential order, chunking, redaction (no server)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from raylastic.rendezvous import AzureTableSettings
from raylastic.rendezvous._endpoint import DEFAULT_TABLE, parse_endpoint, resolve_credential
from raylastic.rendezvous._table import (
    CHUNK_BYTES,
    MAX_CHUNKS,
    RetrySettings,
    is_entity_tag,
    pack_chunks,
    partition_key,
    redact,
    unpack_chunks,
)
from raylastic.rendezvous.cleanup import parse_age

KEY = "c2VjcmV0LWtleQ=="


@pytest.mark.parametrize(
    "raw, url, account, table",
    [
        ("https://acct1.table.core.windows.net", "https://acct1.table.core.windows.net", "acct1", DEFAULT_TABLE),
        ("https://acct1.table.core.windows.net/", "https://acct1.table.core.windows.net", "acct1", DEFAULT_TABLE),
        ("https://acct1.table.core.windows.net/myrdzv", "https://acct1.table.core.windows.net", "acct1", "myrdzv"),
        ("https://acct1.table.core.chinacloudapi.cn", "https://acct1.table.core.chinacloudapi.cn", "acct1", DEFAULT_TABLE),
        ("acct1", "https://acct1.table.core.windows.net", "acct1", DEFAULT_TABLE),
        ("acct1/tbl1", "https://acct1.table.core.windows.net", "acct1", "tbl1"),
        ("http://127.0.0.1:10002/devstoreaccount1", "http://127.0.0.1:10002/devstoreaccount1",
         "devstoreaccount1", DEFAULT_TABLE),
        ("http://localhost:10002/devstoreaccount1/runs", "http://localhost:10002/devstoreaccount1",
         "devstoreaccount1", "runs"),
    ],
)
def test_parse_endpoint_accepts_account_and_table_urls(raw, url, account, table):
    ep = parse_endpoint(raw)
    assert (ep.account_url, ep.account, ep.table) == (url, account, table)


def test_table_from_rdzv_conf_wins():
    assert parse_endpoint("https://acct1.table.core.windows.net/fromurl", "fromconf").table == "fromconf"


@pytest.mark.parametrize(
    "raw, fix",
    [
        ("", "--rdzv-endpoint=https://<account>.table.core.windows.net"),
        ("10.0.0.1:29400", "--rdzv-backend=c10d"),
        ("node0:29400", "--rdzv-backend=c10d"),
        ("tcp://node0:29400", "not an http(s) URL"),
        ("https://example.com/x", "is not an Azure Table endpoint"),
        ("https://acct1.blob.core.windows.net", "https://acct1.table.core.windows.net"),
        ("https://acct1.table.core.windows.net?sv=2024&sig=abc", "AZURE_STORAGE_SAS_TOKEN"),
        ("http://127.0.0.1:10002", "names the account in its path"),
        ("https://acct1.table.core.windows.net/a/b", "at most one path segment"),
        ("https://acct1.table.core.windows.net/1bad", "table names are 3-63 letters"),
    ],
)
def test_parse_endpoint_errors_name_the_fix(raw, fix):
    with pytest.raises(ValueError) as info:
        parse_endpoint(raw)
    assert fix in str(info.value)
    assert "sig=abc" not in str(info.value)


AZURITE = parse_endpoint("http://127.0.0.1:10002/devstoreaccount1")
CLOUD = parse_endpoint("https://acct1.table.core.windows.net")


def test_credential_order_connection_string_first():
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey={KEY}",
        "AZURE_STORAGE_ACCOUNT_KEY": "other",
        "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=x",
    }
    cred, source = resolve_credential(CLOUD, env)
    assert isinstance(cred, AzureNamedKeyCredential) and cred.named_key.key == KEY
    assert source == "AZURE_STORAGE_CONNECTION_STRING"


def test_credential_order_key_then_sas_then_default():
    cred, source = resolve_credential(CLOUD, {"AZURE_STORAGE_ACCOUNT_KEY": KEY, "AZURE_STORAGE_SAS_TOKEN": "sig=x"})
    assert source == "AZURE_STORAGE_ACCOUNT_KEY" and cred.named_key.name == "acct1"
    cred, source = resolve_credential(CLOUD, {"AZURE_STORAGE_KEY": KEY})
    assert source == "AZURE_STORAGE_ACCOUNT_KEY"
    cred, source = resolve_credential(CLOUD, {"AZURE_STORAGE_SAS_TOKEN": "?sv=1&sig=x"})
    assert isinstance(cred, AzureSasCredential) and cred.signature == "sv=1&sig=x"
    _, source = resolve_credential(CLOUD, {})
    assert source == "DefaultAzureCredential"


def test_connection_string_with_sas():
    cred, _ = resolve_credential(CLOUD, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct1;SharedAccessSignature=sv=1&sig=x"})
    assert isinstance(cred, AzureSasCredential)


@pytest.mark.parametrize(
    "endpoint, env, fix",
    [
        (AZURITE, {}, "AZURE_STORAGE_CONNECTION_STRING"),  # http: no Entra ID tokens
        (CLOUD, {"AZURE_STORAGE_CONNECTION_STRING": f"AccountName=other;AccountKey={KEY}"}, "names account 'acct1'"),
        (CLOUD, {"AZURE_STORAGE_ACCOUNT_NAME": "other", "AZURE_STORAGE_ACCOUNT_KEY": KEY}, "names account 'acct1'"),
        (CLOUD, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct1"}, "neither AccountKey"),
    ],
)
def test_credential_errors_name_the_fix_not_the_secret(endpoint, env, fix):
    with pytest.raises(ValueError) as info:
        resolve_credential(endpoint, env)
    assert fix in str(info.value)
    assert KEY not in str(info.value)


def test_redact_removes_sas_signature_and_keys():
    text = f"GET /t?sv=2024&sig=AbC%2Fd== failed; AccountKey={KEY};SharedAccessSignature=sv=1&sig=zz"
    out = redact(text)
    assert "AbC" not in out and KEY not in out and "zz" not in out
    assert "sig=<redacted>" in out


def test_chunks_round_trip_and_limits():
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 3 + 7)  # a bit over 3 chunks
    props = pack_chunks(data, "s", "state")
    assert props["sChunks"] == 4 and all(len(props[f"s{i:02d}"]) <= CHUNK_BYTES for i in range(4))
    assert unpack_chunks(props, "s", "state") == data
    assert unpack_chunks(pack_chunks(b"", "s", "state"), "s", "state") == b""
    with pytest.raises(RendezvousStateError, match="at most"):
        pack_chunks(b"x" * (MAX_CHUNKS * CHUNK_BYTES + 1), "s", "state")


@pytest.mark.parametrize("damage", ["drop_chunk", "flip_byte", "bad_count"])
def test_corrupt_chunks_raise_state_error(damage):
    props = pack_chunks(b"x" * (CHUNK_BYTES + 10), "s", "state")
    if damage == "drop_chunk":
        del props["s01"]
    elif damage == "flip_byte":
        props["s00"] = b"y" + props["s00"][1:]
    else:
        props["sChunks"] = "many"
    with pytest.raises(RendezvousStateError, match="corrupt"):
        unpack_chunks(props, "s", "state")


@pytest.mark.parametrize(
    "token, ok",
    [
        ("W/\"datetime'2026-11-24T08%3A18%3A18.8331252Z'\"", True),  # what the Table service issues
        ('"strong"', True), ('W/""', True),  # well formed: the service decides whether they match
        ("*", False),  # If-Match: * matches any entity and would bypass the fence
        ("", False), ("invalid", False), ('W/"a"b"', False), ('W/"a b"', False), ('"x"\r\nX: y', False),
        (' W/"x"', False), ('W/"\u00e9"', False), ("W/'x'", False),
        (b'W/"x"', False), (42, False), (None, False),
    ],
)
def test_only_str_entity_tags_are_sent_as_if_match(token, ok):
    assert is_entity_tag(token) is ok

def test_partition_key_is_table_safe():
    assert partition_key("job-42") == "run-job-42"
    odd = partition_key("a/b#c?d")
    assert odd.startswith("runh-") and not set("/#?\\") & set(odd)


def test_settings_from_rdzv_conf():
    params = RendezvousParameters("azure-table", "acct1", "r", 1, 2, table="tbl1", retry_timeout="3", read_timeout="7")
    s = AzureTableSettings.from_params(params)
    assert (s.table, s.retry_timeout_s, s.store_timeout_s, s.request_timeout_s) == ("tbl1", 3.0, 7.0, 10.0)
    with pytest.raises(ValueError, match="retry_timeout=0"):
        AzureTableSettings.from_params(RendezvousParameters("azure-table", "acct1", "r", 1, 2, retry_timeout="0"))
    with pytest.raises(ValueError, match="budget_s"):
        RetrySettings(budget_s=0)


def test_parse_age():
    assert parse_age("7d").total_seconds() == 7 * 86400
    assert parse_age("90s").total_seconds() == 90
    with pytest.raises(Exception, match="not an age"):
        parse_age("soon")


def test_torchrun_entry_point_is_installed():
    """torchrun finds the backend through this entry point (pyproject.toml)."""
    eps = {ep.name: ep for ep in entry_points(group="torchrun.handlers")}
    assert "azure-table" in eps, (
        'pyproject.toml needs  [project.entry-points."torchrun.handlers"]  '
        'azure-table = "raylastic.rendezvous.azure_table:torchrun_handler"  and a reinstall'
    )
    from raylastic.rendezvous import create_handler

    assert eps["azure-table"].load()() is create_handler
