"""Low findings of the security review (issue 22): secrets in errors, plain http, plugin
registration. Each test failed before its fix."""

import pytest

from raylastic.checkpoint.backends import parse_uri
from raylastic.checkpoint.retry import _redact
from raylastic.rendezvous._endpoint import parse_endpoint


@pytest.mark.parametrize("uri, secret", [
    ("ftp://alice:pa55word-x@host/x", "pa55word-x"),
    ("ftp://host/x?account_key=SECRETKEY123", "SECRETKEY123"),
    ("wasb://acct/c?sas_token=SASTOKEN99", "SASTOKEN99"),
    ("hdfs://nn/p?connection_string=AccountKey%3Dzzz", "zzz"),
    ("sftp://bob@host/p?token=TOKEN42x", "TOKEN42x"),
])
def test_an_unsupported_scheme_error_never_echoes_a_credential(uri, secret):
    with pytest.raises(ValueError, match="unsupported storage scheme") as e:
        parse_uri(uri)
    assert secret not in str(e.value)


def test_credentials_in_endpoint_override_are_refused_not_logged():
    with pytest.raises(ValueError, match="endpoint_override carries credentials") as e:
        parse_uri("s3://bucket/runs?endpoint_override=http://minio:SECRETPW@10.0.0.5:9000")
    assert "SECRETPW" not in str(e.value)
    ok = parse_uri("s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http")
    assert ok.options["endpoint_override"] == "127.0.0.1:9000"


def test_redact_hides_userinfo_in_any_url():
    assert _redact("GET https://user:pw@host/x failed", ()) == "GET https://***@host/x failed"


@pytest.mark.parametrize("endpoint", [
    "http://myaccount.table.core.windows.net", "http://8.8.8.8:10002/devstoreaccount1",
])
def test_plain_http_to_a_public_rendezvous_host_is_refused(endpoint):
    with pytest.raises(ValueError, match="plain http"):
        parse_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", [
    "http://127.0.0.1:10002/devstoreaccount1", "http://localhost:10002/devstoreaccount1",
    "http://10.1.2.3:10002/devstoreaccount1", "https://myaccount.table.core.windows.net",
])
def test_https_and_emulators_on_private_addresses_are_accepted(endpoint):
    assert parse_endpoint(endpoint).table


def test_register_refuses_a_foreign_backend_under_our_name():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from raylastic.rendezvous import BACKEND_NAME, register

    registry = rendezvous_handler_registry._registry
    saved = registry.pop(BACKEND_NAME, None)
    try:
        registry[BACKEND_NAME] = lambda params: None  # another package got there first
        with pytest.raises(ValueError, match="already registered"):
            register()
        registry.pop(BACKEND_NAME)
        register()
        register()  # idempotent for our own
    finally:
        registry.pop(BACKEND_NAME, None)
        if saved is not None:
            registry[BACKEND_NAME] = saved


def test_the_group_store_listens_on_the_node_address_only():
    """TCPStore given only a port binds every interface; ours binds the address ranks dial."""
    import psutil

    from raylastic._internal.distributed import process_group

    port = process_group.host_store("127.0.0.1", 1, 5.0)
    try:
        listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [a.ip for a in listening] == ["127.0.0.1"], listening
    finally:
        process_group.release_store()
