"""Local stand-ins for the clouds' instance metadata services, for preemption-notice tests.

Each fake is an HTTP server on a free 127.0.0.1 port (``http.server.ThreadingHTTPServer``
in a daemon thread) that answers the preemption endpoints like the real service, including
its required headers and their error codes::

    from raylastic.testing.metadata_servers import FakeAWSMetadata

    with FakeAWSMetadata(imdsv2="required") as aws:
        source = AWSSpotSource(base_url=aws.base_url)
        aws.announce(in_s=120)           # the spot interruption notice appears
        aws.requests                     # what clients sent (method, path, headers)

| fake | serves | missing header |
|---|---|---|
| ``FakeAWSMetadata`` | ``PUT /latest/api/token`` (IMDSv2), ``GET /latest/meta-data/spot/instance-action`` | PUT without the TTL header: 400; GET without a token when ``imdsv2="required"``, or with an unknown token: 401 |
| ``FakeAzureMetadata`` | ``GET/POST /metadata/scheduledevents``, ``GET /metadata/instance/compute/name`` | no ``Metadata: true`` or no ``api-version``: 400 |
| ``FakeGCPMetadata`` | ``GET /computeMetadata/v1/instance/preempted`` (``wait_for_change``, ``last_etag``, ``timeout_sec``) | no ``Metadata-Flavor: Google``: 403 |

All state is per instance; nothing is shared between fakes.
"""

from __future__ import annotations

import email.utils
import json
import secrets
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["FakeAWSMetadata", "FakeAzureMetadata", "FakeGCPMetadata", "RecordedRequest"]

Reply = Tuple[int, Dict[str, str], bytes]


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # with the query string
    headers: Mapping[str, str]

    def header(self, name: str) -> Optional[str]:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)


def _text(status: int, body: str, **headers: str) -> Reply:
    return status, {"Content-Type": "text/plain", **headers}, body.encode()


def _json(status: int, doc, **headers: str) -> Reply:
    return status, {"Content-Type": "application/json; charset=utf-8", **headers}, json.dumps(doc).encode()


class _FakeMetadataServer:
    """HTTP plumbing shared by the fakes: subclasses implement ``_respond``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.requests: List[RecordedRequest] = []

    def start(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                fake._dispatch(self)

            do_PUT = do_POST = do_DELETE = do_GET

            def log_message(self, *args):  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{type(self).__name__}-http",
            daemon=True,
        )
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # release hanging wait_for_change requests
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        with self._cond:
            self.requests.append(RecordedRequest(h.command, h.path, dict(h.headers.items())))
        status, headers, payload = self._respond(h.command, url.path, query, h.headers, body)
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def _respond(self, method: str, path: str, query: Dict[str, str], headers, body: bytes) -> Reply:
        raise NotImplementedError


class FakeAWSMetadata(_FakeMetadataServer):
    """EC2 IMDS. ``imdsv2``: ``"optional"`` (tokens and IMDSv1 both work, the EC2 default),
    ``"required"`` (a GET without a token: 401), ``"off"`` (the token PUT answers 403, as
    when it is blocked; IMDSv1 works)."""

    NOTICE_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(self, imdsv2: str = "optional") -> None:
        super().__init__()
        if imdsv2 not in ("optional", "required", "off"):
            raise ValueError(f"imdsv2 must be optional, required or off (got {imdsv2!r})")
        self.imdsv2 = imdsv2
        self._tokens: Dict[str, float] = {}  # token -> expiry (monotonic)
        self._notice: Optional[dict] = None

    def announce(self, in_s: float = 120.0, action: str = "terminate") -> float:
        """Publish a spot interruption ``in_s`` from now; returns its Unix time (whole s)."""
        when = int(time.time() + in_s)
        stamp = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._cond:
            self._notice = {"action": action, "time": stamp}
        return float(when)

    def clear(self) -> None:
        with self._cond:
            self._notice = None

    def expire_tokens(self) -> None:
        """Invalidate every issued token (the next GET with one answers 401)."""
        with self._cond:
            self._tokens.clear()

    def _respond(self, method, path, query, headers, body) -> Reply:
        if path == "/latest/api/token":
            if method != "PUT":
                return _text(405, "Method Not Allowed")
            if self.imdsv2 == "off":
                return _text(403, "Forbidden")
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return _text(400, "Bad Request")
            token = secrets.token_urlsafe(24)
            with self._cond:
                self._tokens[token] = time.monotonic() + int(ttl)
            return _text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        if method != "GET":
            return _text(405, "Method Not Allowed")
        token = headers.get("X-aws-ec2-metadata-token")
        with self._cond:
            valid = token is not None and self._tokens.get(token, 0.0) > time.monotonic()
            notice = self._notice
        if (token is not None and not valid) or (token is None and self.imdsv2 == "required"):
            return _text(401, "Unauthorized")
        if path == self.NOTICE_PATH and notice is not None:
            return _json(200, notice)
        return _text(404, "Not Found")


class FakeAzureMetadata(_FakeMetadataServer):
    """Azure IMDS Scheduled Events for a VM named ``vm_name``."""

    def __init__(self, vm_name: str = "raylastic-vm-0") -> None:
        super().__init__()
        self.vm_name = vm_name
        self._events: List[dict] = []
        self._incarnation = 1
        self.acknowledged: List[str] = []  # EventIds POSTed in StartRequests

    def announce(
        self, in_s: float = 30.0, event_type: str = "Preempt", resources: Optional[Sequence[str]] = None
    ) -> str:
        """Schedule an event ``in_s`` from now (``NotBefore``, whole seconds) for
        ``resources`` (default: this VM); returns its EventId."""
        event_id = str(uuid.uuid4()).upper()
        event = {
            "EventId": event_id,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(resources) if resources is not None else [self.vm_name],
            "EventStatus": "Scheduled",
            "NotBefore": email.utils.formatdate(time.time() + in_s, usegmt=True),
            "Description": f"{event_type} scheduled by raylastic's fake",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
        with self._cond:
            self._events.append(event)
            self._incarnation += 1
        return event_id

    def clear(self) -> None:
        with self._cond:
            self._events.clear()
            self._incarnation += 1

    def _respond(self, method, path, query, headers, body) -> Reply:
        if (headers.get("Metadata") or "").lower() != "true":
            return _json(400, {"error": "Bad request. Required metadata header not specified"})
        if "api-version" not in query:
            return _json(400, {"error": "Bad request. api-version was not specified in the request"})
        if path == "/metadata/instance/compute/name" and method == "GET":
            return _text(200, self.vm_name)
        if path != "/metadata/scheduledevents":
            return _json(404, {"error": "Not found"})
        with self._cond:
            if method == "POST":
                try:
                    ids = {r["EventId"] for r in json.loads(body or b"{}").get("StartRequests", [])}
                except (ValueError, KeyError, TypeError, AttributeError):
                    return _json(400, {"error": "Bad request. Invalid StartRequests body"})
                self.acknowledged.extend(sorted(ids))
                self._events = [e for e in self._events if e["EventId"] not in ids]
                self._incarnation += 1
                return _text(200, "")
            if method != "GET":
                return _json(405, {"error": "Method not allowed"})
            return _json(200, {"DocumentIncarnation": self._incarnation, "Events": [dict(e) for e in self._events]})


class FakeGCPMetadata(_FakeMetadataServer):
    """GCE metadata ``instance/preempted``. ``announce`` flips it to ``TRUE`` at once (GCE's
    notice carries no time: the VM stops ~30 s later); ``wait_for_change`` requests hang
    until the value changes or ``timeout_sec`` passes."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self) -> None:
        super().__init__()
        self._preempted = False
        self._version = 0
        self.deadline_ts: Optional[float] = None  # what announce() was told; not served

    def _etag(self) -> str:
        return f"{self._version:016x}"

    def announce(self, in_s: float = 30.0) -> float:
        with self._cond:
            self._preempted, self._version = True, self._version + 1
            self.deadline_ts = time.time() + in_s
            self._cond.notify_all()
        return self.deadline_ts

    def clear(self) -> None:
        with self._cond:
            self._preempted, self._version, self.deadline_ts = False, self._version + 1, None
            self._cond.notify_all()

    def _respond(self, method, path, query, headers, body) -> Reply:
        if "X-Forwarded-For" in headers:
            return _text(403, "Forbidden: request with X-Forwarded-For")
        if headers.get("Metadata-Flavor") != "Google":
            return _text(
                403,
                "Your client does not have permission to get URL from this server. "
                "Missing Metadata-Flavor:Google header.",
            )
        if path != self.PATH:
            return _text(404, "Not Found")
        if method != "GET":
            return _text(405, "Method Not Allowed")
        with self._cond:
            if query.get("wait_for_change", "").lower() == "true":
                last = query.get("last_etag") or self._etag()
                timeout = min(float(query.get("timeout_sec") or 60), 300.0)
                self._cond.wait_for(lambda: self._closed or self._etag() != last, timeout)
            value, etag = ("TRUE" if self._preempted else "FALSE"), self._etag()
        return _text(200, value, ETag=etag, **{"Metadata-Flavor": "Google"})
