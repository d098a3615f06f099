"""The run's structured event log: one JSON object per line, wall-clock stamped.

Every state transition, decision (with its reason), resize, failure and checkpoint
goes here. Reports (recovery times, lost steps, cost, goodput) are computed from this
file alone, so it is written as things happen, not reconstructed afterwards.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

logger = logging.getLogger("raylastic")

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"


class EventKind(str, enum.Enum):
    RUN_STARTED = "run_started"
    PRICE_TABLE = "price_table"  # USD/h per node type, markets, the on-demand baseline type
    STATE = "state"  # controller state transition
    DECISION = "decision"  # a policy decision with its reason
    CAPACITY_WAIT = "capacity_wait"  # fewer than min_workers placeable
    WORKER_READY = "worker_ready"
    WORKER_LOST = "worker_lost"  # actor died (node loss, preemption, crash)
    PREEMPTION_NOTICE = "preemption_notice"  # a member's node is draining (deadline known)
    WORKER_RELEASED = "worker_released"  # run ended; the worker's slot is given back
    NODE_GONE = "node_gone"  # a node the run had held left the cluster (billing ends here)
    GROUP_FORMED = "group_formed"  # new membership epoch, ranks assigned
    TRAINING_STARTED = "training_started"  # train function entered on every rank
    FIRST_STEP = "first_step"  # first report of an epoch received
    FAILURE = "failure"  # a rank raised / crashed
    RESIZE = "resize"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_DELETED = "checkpoint_deleted"
    CHECKPOINT_RESTORED = "checkpoint_restored"
    CHECKPOINT_INVALID = "checkpoint_invalid"  # committed but damaged: skipped on restore
    RUN_FINISHED = "run_finished"
    RUN_FAILED = "run_failed"


class LossCause(str, enum.Enum):
    """Why a member left mid-run (the ``cause`` of a ``worker_lost`` event)."""

    NODE_LOST = "node_lost"  # its node went away without notice
    CRASH = "crash"  # its process died on a live node
    HUNG = "hung"  # it did not unwind after an abort: replaced
    PREEMPTED = "preempted"  # moved off a draining node in a graceful stop (a notice)
    RELEASED = "released"  # moved off on purpose in a graceful stop (migration to spot)

    @property
    def planned(self) -> bool:
        """A planned move, part of a graceful resize: never a recovery."""
        return self in (LossCause.PREEMPTED, LossCause.RELEASED)


class JsonlWriter:
    """Appends JSON lines under a run directory on any ``Storage``.

    Local storage appends and flushes every line (a crash loses at most a partial
    last line, which readers skip). Object stores cannot append, so the whole file is
    rewritten at most every ``sync_interval_s`` and on ``close()``, by a background
    thread: during a storage outage the uploads retry there, never on the caller's
    thread (the controller's loop keeps reacting to failures meanwhile).
    """

    def __init__(self, storage, rel: str, sync_interval_s: float = 5.0):
        self._storage = storage
        self._rel = rel
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one upload at a time, in order
        self._lines: List[str] = []
        self._sync_interval_s = sync_interval_s
        self._version = 0  # lines appended so far
        self._synced = 0  # lines in the last successful upload
        self._fh = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if storage.is_local:
            path = storage.path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")
        else:
            try:
                existing = storage.read_bytes(rel).decode("utf-8")
                self._lines = [ln for ln in existing.splitlines() if ln.strip()]
            except Exception:  # noqa: BLE001 - a new run has no file yet
                self._lines = []
            self._version = self._synced = len(self._lines)
            self._thread = threading.Thread(target=self._sync_loop, name=f"raylastic-sync-{rel}", daemon=True)
            self._thread.start()

    def write(self, record: Dict[str, Any]) -> None:
        line = json.dumps(record, default=_json_default, sort_keys=False)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()
                return
            self._lines.append(line)
            self._version += 1

    def _sync_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._sync_interval_s)
            self._wake.clear()
            if not self._closed.is_set():
                self._sync()

    def _sync(self) -> bool:
        """Upload the file if lines were added since the last upload; False on failure."""
        with self._sync_lock:
            with self._lock:
                version, text = self._version, "\n".join(self._lines) + "\n"
            if version == self._synced:
                return True
            try:
                self._storage.write_bytes(self._rel, text.encode())
            except Exception as e:  # noqa: BLE001 - logging must never kill training
                logger.warning("could not sync %s: %s", self._rel, e)
                return False
            self._synced = version
            return True

    def flush(self) -> None:
        """Upload now (object stores), on the caller's thread."""
        if self._fh is None:
            self._sync()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
                return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._sync()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except Exception:  # noqa: BLE001
            pass
    return repr(obj)


class EventLog:
    """Writes events for one run; also mirrors a human line to the logger."""

    def __init__(self, storage, run_rel: str, verbose: bool = True):
        self._writer = JsonlWriter(storage, f"{run_rel}/{EVENTS_FILE}")
        self._metrics = JsonlWriter(storage, f"{run_rel}/{METRICS_FILE}")
        self._verbose = verbose
        self._listeners: List[Any] = []

    def add_listener(self, fn) -> None:
        """``fn(record)`` is called for every event (e.g. TensorBoard's cost meter)."""
        self._listeners.append(fn)

    def emit(self, kind: EventKind, message: str = "", **fields: Any) -> Dict[str, Any]:
        record = {"ts": time.time(), "kind": kind.value, "message": message, **fields}
        self._writer.write(record)
        for fn in self._listeners:
            try:
                fn(record)
            except Exception as e:  # noqa: BLE001 - observers never break the run
                logger.warning("event listener failed: %s", e)
        if message:
            logger.info("%s", message)
            if self._verbose:
                print(f"[raylastic] {message}", flush=True)
        return record

    def metrics(self, record: Dict[str, Any]) -> None:
        self._metrics.write(record)

    def flush(self) -> None:
        self._writer.flush()
        self._metrics.flush()

    def close(self) -> None:
        self._writer.close()
        self._metrics.close()


def read_jsonl(text: str, source: str = "") -> Iterator[Dict[str, Any]]:
    """Parse JSON lines, skipping a truncated last line (a run that crashed mid-write)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logger.warning("skipping truncated last line %d of %s", i + 1, source or "log")
                continue
            raise ValueError(f"{source or 'log'} line {i + 1} is not valid JSON: {line[:80]!r}")


def load_events(path: str) -> List[Dict[str, Any]]:
    """Events of a run directory on local disk (tests, tools)."""
    p = os.path.join(os.path.expanduser(path), EVENTS_FILE)
    if not os.path.exists(p):
        return []
    with open(p, encoding="utf-8") as fh:
        return list(read_jsonl(fh.read(), p))


def filter_events(events: List[Dict[str, Any]], kind: EventKind) -> List[Dict[str, Any]]:
    return [e for e in events if e.get("kind") == kind.value]


def last(events: List[Dict[str, Any]], kind: EventKind) -> Optional[Dict[str, Any]]:
    found = filter_events(events, kind)
    return found[-1] if found else None
