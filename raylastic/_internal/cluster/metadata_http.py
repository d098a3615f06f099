"""The HTTP client the preemption-notice sources (``notice_sources.py``) talk to metadata
services with: ``urllib`` only, short timeouts, no proxies, errors as
:class:`MetadataError`. Split out so each source's parsing reads on its own.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

REQUEST_TIMEOUT_S = 1.0


class MetadataError(Exception):
    """The metadata service did not answer, or answered something unexpected."""


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes
    headers: Mapping[str, str]  # lower-case names

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class HttpSession:
    """``urllib`` with short timeouts and no proxies (metadata addresses are link-local;
    an ``http_proxy`` in the environment must not swallow them). HTTP error statuses are
    returned; only a failed connection or a timeout raises :class:`MetadataError`."""

    def __init__(self, timeout_s: float = REQUEST_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        url: str,
        headers: Optional[Mapping[str, str]] = None,
        data: Optional[bytes] = None,
        timeout_s: Optional[float] = None,
    ) -> HttpResponse:
        req = urllib.request.Request(url, data=data, headers=dict(headers or {}), method=method)
        try:
            with self._opener.open(req, timeout=timeout_s or self.timeout_s) as r:
                return HttpResponse(r.status, r.read(), _lower(r.headers))
        except urllib.error.HTTPError as e:
            body = e.read() if e.fp is not None else b""
            return HttpResponse(e.code, body or b"", _lower(e.headers or {}))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            why = getattr(e, "reason", None) or e
            raise MetadataError(f"{method} {url}: {type(e).__name__}: {why}") from e


def _lower(headers) -> Dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _unexpected(source: str, url: str, r: HttpResponse, hint: str = "") -> MetadataError:
    return MetadataError(f"{source}: GET {url} answered {r.status}: {r.text[:200]!r}{hint}")
