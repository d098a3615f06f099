"""Where preemption notices come from: one class per cloud metadata service.

Each source's ``check(session)`` makes one request to its cloud's metadata service and
returns a :class:`PreemptionNotice` or ``None``; what the service answers and how it is
parsed differs per cloud (an IMDSv2 token on AWS, Scheduled Events filtered to this VM on
Azure, ``wait_for_change`` on GCP). Split out of ``notices.py`` so each cloud's protocol
reads on its own, apart from the watcher thread and the environment parsing that stay
there (``notices.py`` re-exports every name here). No Ray, no torch: ``urllib`` only.

Endpoints, defaults (below) and what each answer means: ``docs/preemption.md``.
"""

from __future__ import annotations

import abc
import email.utils
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Dict, Optional, Sequence

from raylastic._internal.cluster.metadata_http import HttpSession, MetadataError, _unexpected

logger = logging.getLogger("raylastic")

AWS_DEFAULT_URL = "http://169.254.169.254"
AZURE_DEFAULT_URL = "http://169.254.169.254"
GCP_DEFAULT_URL = "http://metadata.google.internal"
AWS_POLL_S, AZURE_POLL_S, GCP_POLL_S = 5.0, 1.0, 1.0
AWS_NOTICE_S, AZURE_NOTICE_S, GCP_NOTICE_S = 120.0, 30.0, 30.0  # when the answer has no time


@dataclass(frozen=True)
class PreemptionNotice:
    """A cloud said this VM goes away at ``deadline_ts`` (Unix seconds)."""

    source: str  # "aws" | "azure" | "gcp"
    deadline_ts: float
    reason: str
    raw: str  # the metadata service's answer, verbatim


class NoticeSource(abc.ABC):
    """One cloud's preemption signal."""

    name: str = ""

    def __init__(self, base_url: str, interval_s: float, clock: Callable[[], float]):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{self.name}: base_url must start with http:// ({base_url!r})")
        if interval_s < 0:
            raise ValueError(f"{self.name}: interval_s must be >= 0 (got {interval_s})")
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self._clock = clock

    @abc.abstractmethod
    def check(self, session: HttpSession) -> Optional[PreemptionNotice]:
        """One request: a notice, ``None``, or :class:`MetadataError`."""

    def acknowledge(self, session: HttpSession, notice: PreemptionNotice) -> None:  # noqa: B027 - an optional hook
        """Tell the cloud the notice was handled (Azure only, when enabled)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, interval_s={self.interval_s:g})"


class AWSSpotSource(NoticeSource):
    """EC2 spot ``instance-action``: 404 until ~2 minutes before the interruption.

    Uses IMDSv2 (a session token from ``PUT /latest/api/token``); when the PUT fails (IMDS
    with v2 off, or a container beyond the PUT hop limit) falls back to IMDSv1 and tries
    a token again after ``v1_retry_s``."""

    name = "aws"
    PATH = "/latest/meta-data/spot/instance-action"

    def __init__(
        self,
        base_url: str = AWS_DEFAULT_URL,
        interval_s: float = AWS_POLL_S,
        token_ttl_s: int = 21600,
        v1_retry_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(base_url, interval_s, clock)
        self.token_ttl_s = token_ttl_s
        self.v1_retry_s = v1_retry_s
        self._token: Optional[str] = None
        self._token_expires = 0.0
        self._v1_until = 0.0  # after a failed PUT: IMDSv1 until then

    def _token_headers(self, session: HttpSession) -> Dict[str, str]:
        now = time.monotonic()
        if self._token is None or now >= self._token_expires:
            self._token = None
            if now < self._v1_until:
                return {}
            try:
                r = session.request(
                    "PUT",
                    f"{self.base_url}/latest/api/token",
                    {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                )
                why = "" if r.status == 200 and r.text.strip() else f"answered {r.status}"
            except MetadataError as e:
                why = str(e)
            if why:
                logger.info("aws: IMDSv2 token request failed (%s); using IMDSv1", why)
                self._v1_until = now + self.v1_retry_s
                return {}
            self._token = r.text.strip()
            self._token_expires = now + max(1.0, self.token_ttl_s - 60)
        return {"X-aws-ec2-metadata-token": self._token}

    def check(self, session: HttpSession) -> Optional[PreemptionNotice]:
        url = self.base_url + self.PATH
        headers = self._token_headers(session)
        r = session.request("GET", url, headers)
        if r.status == 401 and headers:  # token expired or revoked: one fresh token
            self._token = None
            headers = self._token_headers(session)
            r = session.request("GET", url, headers)
        if r.status == 404:
            return None
        if r.status != 200:
            hint = (
                (
                    "; IMDSv2 is required but the token PUT failed (in a container, raise the "
                    "instance's HttpPutResponseHopLimit to 2)"
                )
                if r.status == 401
                else ""
            )
            raise _unexpected(self.name, url, r, hint)
        try:
            doc = json.loads(r.text)
            action = str(doc.get("action", "?"))
        except (ValueError, AttributeError) as e:
            raise MetadataError(f"aws: {url}: not a JSON object: {r.text[:200]!r}") from e
        deadline = _parse_iso(doc.get("time")) or self._clock() + AWS_NOTICE_S
        return PreemptionNotice(self.name, deadline, f"spot instance-action: {action}", r.text)


class AzureScheduledEventsSource(NoticeSource):
    """Azure Scheduled Events: a ``Preempt`` event for this VM, >= 30 s ahead.

    Events of a scale set or availability set reach every VM in it; only those whose
    ``Resources`` name this VM count (name from ``vm_name`` or the instance metadata).
    ``acknowledge=True`` POSTs ``StartRequests`` after the drain, which lets Azure go
    ahead at once: leave it off unless you want the VM gone sooner."""

    name = "azure"
    API_VERSION = "2020-07-01"

    def __init__(
        self,
        base_url: str = AZURE_DEFAULT_URL,
        interval_s: float = AZURE_POLL_S,
        event_types: Sequence[str] = ("Preempt",),
        vm_name: Optional[str] = None,
        acknowledge: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(base_url, interval_s, clock)
        self.event_types = frozenset(event_types)
        self.vm_name = vm_name
        self.ack = acknowledge
        self._url = f"{self.base_url}/metadata/scheduledevents?api-version={self.API_VERSION}"

    def _local_name(self, session: HttpSession) -> Optional[str]:
        if self.vm_name is None:
            url = f"{self.base_url}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
            try:
                r = session.request("GET", url, {"Metadata": "true"})
                if r.status == 200 and r.text.strip():
                    self.vm_name = r.text.strip()
            except MetadataError:
                pass
        return self.vm_name

    def check(self, session: HttpSession) -> Optional[PreemptionNotice]:
        r = session.request("GET", self._url, {"Metadata": "true"})
        if r.status != 200:
            raise _unexpected(self.name, self._url, r)
        try:
            events = json.loads(r.text).get("Events") or []
        except (ValueError, AttributeError) as e:
            raise MetadataError(f"azure: {self._url}: not a JSON object: {r.text[:200]!r}") from e
        relevant = [ev for ev in events if isinstance(ev, dict) and ev.get("EventType") in self.event_types]
        if not relevant:
            return None
        name = self._local_name(session)  # only asked once an event could be ours
        for ev in relevant:
            resources = ev.get("Resources") or []
            if name is not None and resources and name not in resources:
                continue
            deadline = _parse_http_date(ev.get("NotBefore")) or self._clock()  # "" = started
            return PreemptionNotice(
                self.name, deadline, f"scheduled event {ev.get('EventType')} {ev.get('EventId', '?')}", json.dumps(ev)
            )
        return None

    def acknowledge(self, session: HttpSession, notice: PreemptionNotice) -> None:
        if not self.ack:
            return
        event_id = json.loads(notice.raw).get("EventId")
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        r = session.request("POST", self._url, {"Metadata": "true", "Content-Type": "application/json"}, data=body)
        if r.status != 200:
            raise _unexpected(self.name, self._url, r)


class GCPPreemptedSource(NoticeSource):
    """GCE ``instance/preempted``: ``TRUE`` once the 30 s preemption notice starts.

    ``wait_for_change=True`` hangs on the metadata server (``last_etag``) for up to
    ``hang_s`` per request instead of polling; the watcher thread blocks meanwhile."""

    name = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(
        self,
        base_url: str = GCP_DEFAULT_URL,
        interval_s: float = GCP_POLL_S,
        wait_for_change: bool = False,
        hang_s: int = 10,
        notice_s: float = GCP_NOTICE_S,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(base_url, 0.0 if wait_for_change else interval_s, clock)
        self.wait_for_change = wait_for_change
        self.hang_s = hang_s
        self.notice_s = notice_s
        self._etag: Optional[str] = None

    def check(self, session: HttpSession) -> Optional[PreemptionNotice]:
        url, timeout = self.base_url + self.PATH, None
        if self.wait_for_change and self._etag:
            q = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": self.hang_s})
            url, timeout = f"{url}?{q}", self.hang_s + session.timeout_s
        r = session.request("GET", url, {"Metadata-Flavor": "Google"}, timeout_s=timeout)
        if r.status != 200:
            self._etag = None
            raise _unexpected(self.name, url, r)
        self._etag = r.headers.get("etag")
        value = r.text.strip().upper()
        if value == "FALSE":
            return None
        if value != "TRUE":
            raise _unexpected(self.name, url, r, " (expected TRUE or FALSE)")
        return PreemptionNotice(self.name, self._clock() + self.notice_s, "instance preempted", r.text)


def _parse_iso(value) -> Optional[float]:
    """``2026-11-22T13:05:00Z`` -> Unix seconds (None if absent or malformed)."""
    try:
        dt = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def _parse_http_date(value) -> Optional[float]:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> Unix seconds (None if absent or malformed)."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(str(value)).timestamp()
    except (TypeError, ValueError):
        return None
