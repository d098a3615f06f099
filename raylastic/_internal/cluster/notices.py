"""Preemption notices from cloud metadata services (AWS, Azure, GCP).

Each source is a small class whose ``check(session)`` makes one request to its cloud's
metadata service and returns a :class:`PreemptionNotice` or ``None``; the sources live in
``notice_sources.py`` and every name there is importable from here too. A
:class:`NoticeWatcher` thread polls the enabled sources and calls a callback once, on the
first notice (in raylastic: drain this Ray node, see ``drain.py``; the controller then
moves the node's workers off gracefully). No Ray, no torch here: ``urllib`` only.

Endpoints, defaults (in ``notice_sources.py``), polling and how a notice flows:
``docs/preemption.md``.
Environment variables are read in :func:`sources_from_env` only; explicit constructor
arguments win.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic._internal.cluster.metadata_http import (  # noqa: F401 - part of this module's API
    REQUEST_TIMEOUT_S,
    HttpResponse,
    HttpSession,
    MetadataError,
    _unexpected,
)
from raylastic._internal.cluster.notice_sources import (  # noqa: F401 - part of this module's API
    AWS_DEFAULT_URL,
    AWS_NOTICE_S,
    AWS_POLL_S,
    AZURE_DEFAULT_URL,
    AZURE_NOTICE_S,
    AZURE_POLL_S,
    GCP_DEFAULT_URL,
    GCP_NOTICE_S,
    GCP_POLL_S,
    AWSSpotSource,
    AzureScheduledEventsSource,
    GCPPreemptedSource,
    NoticeSource,
    PreemptionNotice,
    _parse_http_date,
    _parse_iso,
)

logger = logging.getLogger("raylastic")

SOURCES_ENV = "RAYLASTIC_PREEMPTION_SOURCES"


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
