"""Preemption notices from cloud metadata services (AWS, Azure, GCP).

Each source is a small class whose ``check(session)`` makes one request to its cloud's
metadata service and returns a :class:`PreemptionNotice` or ``None``. A
:class:`NoticeWatcher` thread polls the enabled sources and calls a callback once, on the
first notice (in raylastic: drain this Ray node, see ``drain.py``; the controller then
moves the node's workers off gracefully). No Ray, no torch here: ``urllib`` only.

Endpoints, defaults (below), polling and how a notice flows: ``docs/preemption.md``.
Environment variables are read in :func:`sources_from_env` only; explicit constructor
arguments win.
"""

from __future__ import annotations

import abc
import email.utils
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic._internal.cluster.metadata_http import (  # noqa: F401 - part of this module's API
    REQUEST_TIMEOUT_S,
    HttpResponse,
    HttpSession,
    MetadataError,
    _unexpected,
)

logger = logging.getLogger("raylastic")

AWS_DEFAULT_URL = "http://169.254.169.254"
AZURE_DEFAULT_URL = "http://169.254.169.254"
GCP_DEFAULT_URL = "http://metadata.google.internal"
AWS_POLL_S, AZURE_POLL_S, GCP_POLL_S = 5.0, 1.0, 1.0
AWS_NOTICE_S, AZURE_NOTICE_S, GCP_NOTICE_S = 120.0, 30.0, 30.0  # when the answer has no time
SOURCES_ENV = "RAYLASTIC_PREEMPTION_SOURCES"


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


class NoticeWatcher:
    """Polls ``sources`` (each at its own interval) in a daemon thread; on the first notice
    calls ``callback(notice)`` once, acknowledges it where the source does, and stops.

    Never raises out of its loop: a failing source (unreachable, a 4xx, garbage) is logged
    (a warning when its error changes, debug otherwise) and polled again after its
    interval, or ``retry_s`` if longer."""

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        callback: Callable[[PreemptionNotice], object],
        session: Optional[HttpSession] = None,
        retry_s: float = 1.0,
    ):
        if not sources:
            raise ValueError("NoticeWatcher needs at least one source")
        self.sources = tuple(sources)
        self._callback = callback
        self._session = session or HttpSession()
        self.retry_s = retry_s  # after a failed check, wait at least this long
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_error: Dict[str, str] = {}
        self.notice: Optional[PreemptionNotice] = None
        self.errors = 0  # failed checks so far

    def start(self) -> "NoticeWatcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="raylastic-preemption-watcher")
            self._thread.start()
            logger.info("watching for preemption notices: %s", ", ".join(map(repr, self.sources)))
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def wait(self, timeout_s: Optional[float] = None) -> Optional[PreemptionNotice]:
        """Block until a notice was handled (or timeout); the notice or None."""
        self._fired.wait(timeout_s)
        return self.notice

    def _run(self) -> None:
        due = [0.0] * len(self.sources)
        while not self._stop.is_set():
            for i, source in enumerate(self.sources):
                if due[i] > time.monotonic() or self._stop.is_set():
                    continue
                notice, ok = self._check(source)
                # a failing source waits >= retry_s (wait_for_change has no interval)
                wait_s = source.interval_s if ok else max(self.retry_s, source.interval_s)
                due[i] = time.monotonic() + wait_s
                if notice is not None:
                    self._handle(source, notice)
                    return
            self._stop.wait(max(0.0, min(due) - time.monotonic()))

    def _check(self, source: NoticeSource) -> Tuple[Optional[PreemptionNotice], bool]:
        try:
            notice = source.check(self._session)
        except Exception as e:  # noqa: BLE001 - the loop must outlive any answer
            self.errors += 1
            msg = f"{type(e).__name__}: {e}"
            level = logging.DEBUG if self._last_error.get(source.name) == msg else logging.WARNING
            logger.log(
                level,
                "preemption notices (%s): check failed, will retry in %g s: %s",
                source.name,
                max(self.retry_s, source.interval_s),
                msg,
            )
            self._last_error[source.name] = msg
            return None, False
        if self._last_error.pop(source.name, None) is not None:
            logger.info("preemption notices (%s): metadata service answering again", source.name)
        return notice, True

    def _handle(self, source: NoticeSource, notice: PreemptionNotice) -> None:
        self.notice = notice
        logger.warning(
            "preemption notice from %s: %s; deadline in %.1f s",
            notice.source,
            notice.reason,
            notice.deadline_ts - time.time(),
        )
        try:
            self._callback(notice)
            source.acknowledge(self._session, notice)
        except Exception as e:  # noqa: BLE001
            logger.exception("preemption notice handler failed: %s", e)
        finally:
            self._fired.set()


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: must be > 0")
    return value


def _env_bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r}: expected 1 or 0")


def sources_from_env(environ: Optional[Mapping[str, str]] = None) -> Tuple[NoticeSource, ...]:
    """The sources enabled by the environment (the only place raylastic reads these):

    - ``RAYLASTIC_PREEMPTION_SOURCES``: comma-separated subset of ``aws,azure,gcp``, or
      ``none`` (default: none; nothing is polled).
    - ``RAYLASTIC_{AWS,AZURE,GCP}_METADATA_URL``: base URLs (defaults above).
    - ``RAYLASTIC_{AWS,AZURE,GCP}_POLL_S``: poll intervals (defaults 5, 1, 1 s).
    - ``RAYLASTIC_AZURE_ACK_EVENTS=1``: acknowledge Azure events after draining (default 0).
    - ``RAYLASTIC_GCP_WAIT_FOR_CHANGE=1``: hang on ``wait_for_change`` instead of polling.
    """
    env = os.environ if environ is None else environ
    raw = env.get(SOURCES_ENV, "").strip().lower()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names or names == ["none"]:
        return ()
    unknown = [n for n in names if n not in ("aws", "azure", "gcp")]
    if unknown:
        raise ValueError(
            f"{SOURCES_ENV}={raw!r}: unknown source(s) {', '.join(unknown)}; use a "
            "comma-separated subset of aws,azure,gcp, or none"
        )
    sources: List[NoticeSource] = []
    for name in dict.fromkeys(names):
        if name == "aws":
            sources.append(
                AWSSpotSource(
                    base_url=env.get("RAYLASTIC_AWS_METADATA_URL") or AWS_DEFAULT_URL,
                    interval_s=_env_float(env, "RAYLASTIC_AWS_POLL_S", AWS_POLL_S),
                )
            )
        elif name == "azure":
            sources.append(
                AzureScheduledEventsSource(
                    base_url=env.get("RAYLASTIC_AZURE_METADATA_URL") or AZURE_DEFAULT_URL,
                    interval_s=_env_float(env, "RAYLASTIC_AZURE_POLL_S", AZURE_POLL_S),
                    acknowledge=_env_bool(env, "RAYLASTIC_AZURE_ACK_EVENTS"),
                )
            )
        else:
            sources.append(
                GCPPreemptedSource(
                    base_url=env.get("RAYLASTIC_GCP_METADATA_URL") or GCP_DEFAULT_URL,
                    interval_s=_env_float(env, "RAYLASTIC_GCP_POLL_S", GCP_POLL_S),
                    wait_for_change=_env_bool(env, "RAYLASTIC_GCP_WAIT_FOR_CHANGE"),
                )
            )
    return tuple(sources)


def watcher_from_env(
    callback: Callable[[PreemptionNotice], object], environ: Optional[Mapping[str, str]] = None
) -> Optional[NoticeWatcher]:
    """A (not yet started) watcher for the sources the environment enables, or None."""
    sources = sources_from_env(environ)
    return NoticeWatcher(sources, callback) if sources else None
