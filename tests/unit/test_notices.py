"""Cloud preemption notices against local fakes of the AWS, Azure and GCP metadata services.

No Ray here: drain.py's Ray side is tested in tests/integration/test_drain_local_node.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from raylastic._internal.cluster.notices import (
    AWSSpotSource,
    AzureScheduledEventsSource,
    GCPPreemptedSource,
    HttpResponse,
    HttpSession,
    MetadataError,
    NoticeWatcher,
    PreemptionNotice,
    sources_from_env,
    watcher_from_env,
)
from raylastic.testing.cluster import wait_until
from raylastic.testing.metadata_servers import FakeAWSMetadata, FakeAzureMetadata, FakeGCPMetadata

FAST = 0.02  # poll interval for watcher tests


@pytest.fixture
def session():
    return HttpSession(timeout_s=2.0)


def _raw_status(url, method="GET", headers=None):
    """Status of a plain request (no proxy), to check what the fakes demand."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with opener.open(req, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class _DropHeaders(HttpSession):
    """A client that forgets its headers (a bug, or a proxy that strips them)."""

    def request(self, method, url, headers=None, data=None, timeout_s=None):
        return super().request(method, url, {}, data, timeout_s)


class _Canned:
    """A session answering every request with one canned response."""

    timeout_s = 1.0

    def __init__(self, status, body):
        self.response = HttpResponse(status, body.encode(), {})

    def request(self, method, url, headers=None, data=None, timeout_s=None):
        return self.response


# -- no notice ---------------------------------------------------------------------------

@pytest.mark.parametrize("fake_cls,source_cls", [
    (FakeAWSMetadata, AWSSpotSource),
    (FakeAzureMetadata, AzureScheduledEventsSource),
    (FakeGCPMetadata, GCPPreemptedSource),
])
def test_no_notice_is_none(session, fake_cls, source_cls):
    with fake_cls() as fake:
        source = source_cls(base_url=fake.base_url)
        assert source.check(session) is None
        assert source.check(session) is None


# -- AWS ---------------------------------------------------------------------------------

def test_aws_imdsv2_token_flow(session):
    with FakeAWSMetadata(imdsv2="required") as aws:
        source = AWSSpotSource(base_url=aws.base_url)
        assert source.check(session) is None
        when = aws.announce(in_s=120, action="stop")
        notice = source.check(session)
        assert notice == PreemptionNotice("aws", when, "spot instance-action: stop", notice.raw)
        assert json.loads(notice.raw)["action"] == "stop"
        puts = [r for r in aws.requests if r.method == "PUT"]
        gets = [r for r in aws.requests if r.method == "GET"]
        assert len(puts) == 1, "the token is reused until it expires"
        assert puts[0].header("X-aws-ec2-metadata-token-ttl-seconds") == "21600"
        token = gets[0].header("X-aws-ec2-metadata-token")
        assert token and all(g.header("X-aws-ec2-metadata-token") == token for g in gets)


def test_aws_expired_token_is_renewed(session):
    with FakeAWSMetadata(imdsv2="required") as aws:
        source = AWSSpotSource(base_url=aws.base_url)
        assert source.check(session) is None
        aws.expire_tokens()  # next GET: 401, then one new token
        aws.announce(in_s=100)
        assert source.check(session) is not None
        assert [r.method for r in aws.requests] == ["PUT", "GET", "GET", "PUT", "GET"]


def test_aws_falls_back_to_imdsv1_when_the_token_put_fails(session):
    with FakeAWSMetadata(imdsv2="off") as aws:
        source = AWSSpotSource(base_url=aws.base_url)
        assert source.check(session) is None
        when = aws.announce(in_s=90)
        notice = source.check(session)
        assert notice is not None and notice.deadline_ts == when
        assert [r.method for r in aws.requests] == ["PUT", "GET", "GET"], "v1 until v1_retry_s"
        assert all(r.header("X-aws-ec2-metadata-token") is None
                   for r in aws.requests if r.method == "GET")


def test_aws_fake_answers_like_imds():
    with FakeAWSMetadata(imdsv2="required") as aws:
        assert _raw_status(aws.base_url + "/latest/api/token", "PUT") == 400  # no TTL header
        assert _raw_status(aws.base_url + FakeAWSMetadata.NOTICE_PATH) == 401  # no token
        assert _raw_status(aws.base_url + FakeAWSMetadata.NOTICE_PATH,
                           headers={"X-aws-ec2-metadata-token": "forged"}) == 401


def test_aws_malformed_answers():
    source = AWSSpotSource(clock=lambda: 1000.0, v1_retry_s=3600)
    with pytest.raises(MetadataError, match="not a JSON object"):
        source.check(_Canned(200, "<html>"))
    # a notice without a parsable time still counts, with EC2's two minutes
    notice = source.check(_Canned(200, '{"action": "terminate", "time": "soon"}'))
    assert notice.deadline_ts == 1120.0


# -- Azure -------------------------------------------------------------------------------

def test_azure_preempt_parsed_with_deadline_from_notbefore(session):
    with FakeAzureMetadata(vm_name="vm-7") as az:
        source = AzureScheduledEventsSource(base_url=az.base_url)
        before = time.time()
        event_id = az.announce(in_s=30)
        notice = source.check(session)
        assert notice is not None and notice.source == "azure"
        assert before + 29 <= notice.deadline_ts <= time.time() + 30  # NotBefore: whole seconds
        assert event_id in notice.reason and json.loads(notice.raw)["EventId"] == event_id
        assert source.vm_name == "vm-7", "the VM name comes from the instance metadata"
        assert all(r.header("Metadata") == "true" for r in az.requests)
        assert az.acknowledged == [], "acknowledging is off by default"


def test_azure_ignores_other_event_types_and_other_vms(session):
    with FakeAzureMetadata(vm_name="vm-1") as az:
        source = AzureScheduledEventsSource(base_url=az.base_url)
        for kind in ("Reboot", "Redeploy", "Freeze", "Terminate"):
            az.announce(in_s=300, event_type=kind)
        az.announce(in_s=30, resources=["vm-2"])  # a scale-set neighbour's preemption
        assert source.check(session) is None
        az.announce(in_s=30, resources=["vm-2", "vm-1"])
        assert source.check(session) is not None


def test_azure_fake_demands_metadata_header():
    with FakeAzureMetadata() as az:
        url = az.base_url + "/metadata/scheduledevents?api-version=2020-07-01"
        assert _raw_status(url) == 400
        assert _raw_status(az.base_url + "/metadata/scheduledevents", headers={"Metadata": "true"}) == 400
        assert _raw_status(url, headers={"Metadata": "true"}) == 200


def test_azure_acknowledge_after_the_callback():
    with FakeAzureMetadata() as az:
        seen = []
        source = AzureScheduledEventsSource(base_url=az.base_url, interval_s=FAST, acknowledge=True)
        watcher = NoticeWatcher([source], lambda n: seen.append(list(az.acknowledged))).start()
        event_id = az.announce(in_s=30)
        assert watcher.wait(5) is not None
        assert seen == [[]], "the drain runs before the event is acknowledged"
        assert az.acknowledged == [event_id]
        assert [r.method for r in az.requests][-1] == "POST"


# -- GCP ---------------------------------------------------------------------------------

def test_gcp_true_false(session):
    with FakeGCPMetadata() as gcp:
        source = GCPPreemptedSource(base_url=gcp.base_url, clock=lambda: 500.0)
        assert source.check(session) is None  # FALSE
        gcp.announce(in_s=30)
        assert source.check(session) == PreemptionNotice("gcp", 530.0, "instance preempted", "TRUE")
        assert all(r.header("Metadata-Flavor") == "Google" for r in gcp.requests)


def test_gcp_wait_for_change_returns_on_the_flip(session):
    with FakeGCPMetadata() as gcp:
        source = GCPPreemptedSource(base_url=gcp.base_url, wait_for_change=True, hang_s=20)
        assert source.check(session) is None  # a plain GET first: the current value and ETag
        timer = threading.Timer(0.3, gcp.announce)
        timer.start()
        t0 = time.monotonic()
        assert source.check(session) is not None  # hangs until the flip
        assert time.monotonic() - t0 < 10
        timer.join()
        assert "wait_for_change=true" in gcp.requests[-1].path and "last_etag=" in gcp.requests[-1].path


def test_gcp_fake_demands_metadata_flavor():
    with FakeGCPMetadata() as gcp:
        assert _raw_status(gcp.base_url + FakeGCPMetadata.PATH) == 403
        assert _raw_status(gcp.base_url + FakeGCPMetadata.PATH,
                           headers={"Metadata-Flavor": "Google", "X-Forwarded-For": "1.2.3.4"}) == 403


# -- the watcher -------------------------------------------------------------------------

def test_watcher_calls_the_callback_once():
    with FakeAWSMetadata() as aws:
        calls = []
        fired = threading.Event()
        watcher = NoticeWatcher([AWSSpotSource(base_url=aws.base_url, interval_s=FAST)],
                                lambda n: (calls.append(n), fired.set())).start()
        wait_until(lambda: len(aws.requests) >= 3, 5, what="a few polls")
        assert not calls
        when = aws.announce(in_s=120)
        assert fired.wait(5)
        watcher._thread.join(5)
        assert not watcher._thread.is_alive(), "the watcher stops after the first notice"
        assert len(calls) == 1 and calls[0].deadline_ts == when and watcher.notice == calls[0]
        watcher.stop()


def test_watcher_polls_several_sources():
    with FakeAWSMetadata() as aws, FakeGCPMetadata() as gcp:
        got = []
        watcher = NoticeWatcher([AWSSpotSource(base_url=aws.base_url, interval_s=FAST),
                                 GCPPreemptedSource(base_url=gcp.base_url, interval_s=FAST)],
                                got.append).start()
        gcp.announce()
        assert watcher.wait(5).source == "gcp" and len(got) == 1
        watcher.stop()


def test_missing_header_logs_and_surfaces_no_notice(caplog):
    caplog.set_level(logging.DEBUG, logger="raylastic")
    with FakeGCPMetadata() as gcp:
        gcp.announce()  # a notice is there, but a headerless client gets 403
        calls = []
        source = GCPPreemptedSource(base_url=gcp.base_url, interval_s=FAST)
        watcher = NoticeWatcher([source], calls.append, session=_DropHeaders(),
                                retry_s=FAST).start()
        wait_until(lambda: watcher.errors >= 3, 10, what="three failed checks")
        assert watcher._thread.is_alive() and watcher.notice is None and calls == []
        watcher.stop()
        assert not watcher._thread.is_alive()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per distinct error, then debug"
    assert "403" in warnings[0].getMessage() and "Missing Metadata-Flavor" in warnings[0].getMessage()


def test_unreachable_service_and_failing_callback_never_crash(caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(MetadataError):
        AzureScheduledEventsSource(base_url=dead).check(HttpSession(timeout_s=0.5))
    with FakeAzureMetadata() as az:
        def boom(notice):
            raise RuntimeError("drain failed")
        watcher = NoticeWatcher([AzureScheduledEventsSource(base_url=dead, interval_s=FAST),
                                 AzureScheduledEventsSource(base_url=az.base_url, interval_s=FAST)],
                                boom, session=HttpSession(timeout_s=0.5), retry_s=FAST).start()
        az.announce()
        assert watcher.wait(10) is not None  # the dead source did not stop the live one
        watcher.stop()
    assert any("drain failed" in r.getMessage() or "drain failed" in (r.exc_text or "")
               for r in caplog.records)


def test_metadata_requests_ignore_http_proxy(monkeypatch, session):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with FakeGCPMetadata() as gcp:
        assert GCPPreemptedSource(base_url=gcp.base_url).check(HttpSession()) is None


# -- configuration -----------------------------------------------------------------------

def test_env_default_is_no_sources():
    assert sources_from_env({}) == ()
    assert sources_from_env({"RAYLASTIC_PREEMPTION_SOURCES": " none "}) == ()
    assert watcher_from_env(print, {}) is None


def test_env_sources_urls_and_intervals():
    env = {"RAYLASTIC_PREEMPTION_SOURCES": "GCP, aws,azure,aws",
           "RAYLASTIC_AWS_METADATA_URL": "http://127.0.0.1:1234/",
           "RAYLASTIC_GCP_POLL_S": "0.5", "RAYLASTIC_AZURE_ACK_EVENTS": "1"}
    gcp, aws, azure = sources_from_env(env)
    assert isinstance(gcp, GCPPreemptedSource) and gcp.base_url == "http://metadata.google.internal"
    assert gcp.interval_s == 0.5 and not gcp.wait_for_change
    assert isinstance(aws, AWSSpotSource) and aws.base_url == "http://127.0.0.1:1234"
    assert aws.interval_s == 5.0
    assert isinstance(azure, AzureScheduledEventsSource) and azure.ack
    assert azure.base_url == "http://169.254.169.254" and azure.interval_s == 1.0
    watcher = watcher_from_env(print, env)
    assert watcher is not None and len(watcher.sources) == 3 and watcher._thread is None
    wait = sources_from_env({"RAYLASTIC_PREEMPTION_SOURCES": "gcp",
                             "RAYLASTIC_GCP_WAIT_FOR_CHANGE": "true"})[0]
    assert wait.wait_for_change and wait.interval_s == 0.0


@pytest.mark.parametrize("env,match", [
    ({"RAYLASTIC_PREEMPTION_SOURCES": "aws,oracle"}, "unknown source.*oracle.*aws,azure,gcp"),
    ({"RAYLASTIC_PREEMPTION_SOURCES": "aws,none"}, "unknown source.*none"),
    ({"RAYLASTIC_PREEMPTION_SOURCES": "aws", "RAYLASTIC_AWS_POLL_S": "fast"}, "RAYLASTIC_AWS_POLL_S"),
    ({"RAYLASTIC_PREEMPTION_SOURCES": "gcp", "RAYLASTIC_GCP_POLL_S": "0"}, "must be > 0"),
    ({"RAYLASTIC_PREEMPTION_SOURCES": "azure", "RAYLASTIC_AZURE_ACK_EVENTS": "maybe"}, "expected 1 or 0"),
    ({"RAYLASTIC_PREEMPTION_SOURCES": "gcp", "RAYLASTIC_GCP_METADATA_URL": "metadata:80"}, "http://"),
])
def test_env_errors_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        sources_from_env(env)
