"""The run's structured event log: one JSON object per line, wall-clock stamped.

Every state transition, decision (with its reason), resize, failure and checkpoint
goes here. Reports (recovery times, lost steps, cost, goodput) are computed from this
file alone, so it is written as things happen, not reconstructed afterwards.

A log (``events.jsonl``, ``metrics.jsonl``) is a sequence of *segments* in the run
directory: ``events.jsonl``, then ``events.1.jsonl``, ``events.2.jsonl``, ... (numbers
increase, with gaps allowed); its records are those of every segment, in number order.
Local storage appends to the last segment (a normal local run only ever has
``events.jsonl``). Object stores cannot append, and rewriting one growing object would
upload quadratic bytes over a long run and could replace history with a partial copy, so
there each writer (each fit()) writes its own new segments, never reads or rewrites an
older one, and starts a new segment once the current one reaches
:data:`SEGMENT_BYTES`. Read a log with :func:`load_events` (a local directory) or
:func:`read_log` (any ``Storage``), never by opening ``events.jsonl`` alone.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import re
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

logger = logging.getLogger("raylastic")

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
# An object-store segment is closed once it holds this many bytes (plus its last line):
# each upload sends at most one growing segment, so bytes uploaded grow linearly.
SEGMENT_BYTES = 256 * 1024
_MAX_SEGMENT = 10**9  # segment numbers have at most 9 digits


class CorruptLogError(ValueError):
    """A line of a run's log that is not a JSON object (other than a torn last line), or
    a record field of the wrong type; the message names the file and line."""


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
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a persisted snapshot not written: upload busy
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


# ----------------------------------------------------------------------------- segments


@functools.lru_cache(maxsize=None)
def _segment_re(base: str) -> "re.Pattern[str]":
    stem = base[: -len(".jsonl")] if base.endswith(".jsonl") else base
    return re.compile(rf"{re.escape(stem)}(?:\.([1-9][0-9]{{0,8}}))?\.jsonl")


def segment_number(name: str, base: str) -> Optional[int]:
    """0 for ``base`` itself, n for ``<stem>.<n>.jsonl``, None for any other name."""
    m = _segment_re(base).fullmatch(name)
    return None if m is None else int(m.group(1) or 0)


def segment_name(base: str, number: int) -> str:
    stem = base[: -len(".jsonl")] if base.endswith(".jsonl") else base
    return base if number == 0 else f"{stem}.{number}.jsonl"


def log_segments(names: Iterable[str], base: str) -> List[str]:
    """The segments of log ``base`` among directory entries ``names``, in write order
    (unrelated names, e.g. a local writer's temp files, are left out)."""
    found = [(segment_number(n, base), n) for n in names]
    return [n for num, n in sorted((num, n) for num, n in found if num is not None)]


# ----------------------------------------------------------------------------- writing


class _Segment:
    """Lines of one object-store segment; ``name`` is chosen at its first upload."""

    __slots__ = ("name", "lines", "size", "synced")

    def __init__(self) -> None:
        self.name: Optional[str] = None
        self.lines: List[str] = []
        self.size = 0  # bytes
        self.synced = 0  # lines in its last successful upload


class JsonlWriter:
    """Appends JSON lines of log ``rel`` (``<dir>/<base>``) on any ``Storage``.

    Local storage appends and flushes every line to the log's last segment (a crash
    loses at most a partial last line, which readers skip). On object stores the lines go
    to this writer's own segments (module docstring): the current one is uploaded whole at
    most every ``sync_interval_s`` and on ``close()``, by a background thread, so during a
    storage outage the uploads retry there, never on the caller's thread (the controller's
    loop keeps reacting to failures meanwhile). A segment's name is chosen when it is first
    uploaded: one above every segment the store lists then (and above this writer's
    previous one). A listing that fails is not "no segments": the upload waits for the
    next sync. Nothing is ever read back, so an unreadable store cannot erase history.
    One writer per log at a time (the run's controller).
    """

    def __init__(self, storage, rel: str, sync_interval_s: float = 5.0, segment_bytes: int = SEGMENT_BYTES):
        self._storage = storage
        self._rel = rel
        self._dir, _, self._base = rel.rpartition("/")
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one upload at a time, in order
        self._sync_interval_s = sync_interval_s
        self._segment_bytes = segment_bytes
        self._segments: List[_Segment] = [_Segment()]  # the last one is being written
        self._number = -1  # this writer's last segment number
        self._fh = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if storage.is_local:
            directory = os.path.dirname(storage.path(rel))
            os.makedirs(directory, exist_ok=True)
            last = (log_segments(os.listdir(directory), self._base) or [self._base])[-1]
            self._fh = open(os.path.join(directory, last), "a", encoding="utf-8")
        else:
            self._thread = threading.Thread(target=self._sync_loop, name=f"raylastic-sync-{rel}", daemon=True)
            self._thread.start()

    def write(self, record: Dict[str, Any]) -> None:
        line = json.dumps(record, default=_json_default, sort_keys=False)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()
                return
            seg = self._segments[-1]
            seg.lines.append(line)
            seg.size += len(line.encode()) + 1
            if seg.size >= self._segment_bytes:  # full: its lines never change again
                self._segments.append(_Segment())

    def _sync_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._sync_interval_s)
            self._wake.clear()
            if not self._closed.is_set():
                self._sync()

    def _sync(self) -> bool:
        """Upload the full segments not uploaded whole yet, then the current one if it
        grew since its last upload; False on failure (the next sync tries again)."""
        with self._sync_lock:
            while True:
                with self._lock:
                    seg = self._segments[0]
                    current = len(self._segments) == 1
                    lines = list(seg.lines)
                if len(lines) > seg.synced:
                    try:
                        if seg.name is None:
                            seg.name = self._next_name()
                        self._storage.write_bytes(self._path(seg.name), _text(lines))
                    except Exception as e:  # noqa: BLE001 - logging must never kill training
                        logger.warning("could not sync %s: %s", self._rel, e)
                        return False
                    seg.synced = len(lines)
                if current:
                    return True
                with self._lock:  # a full segment, uploaded whole: done with it
                    self._segments.pop(0)

    def _next_name(self) -> str:
        """A segment number above every listed one and this writer's last one. A listing
        error propagates (after the Storage's retries): never guess "no segments"."""
        listed = [segment_number(n, self._base) for n in self._storage.list_dir(self._dir)]
        number = max([self._number] + [n for n in listed if n is not None]) + 1
        if number >= _MAX_SEGMENT:
            raise RuntimeError(f"{self._rel}: no segment number left after {number - 1}")
        self._number = number
        return segment_name(self._base, number)

    def _path(self, name: str) -> str:
        return f"{self._dir}/{name}" if self._dir else name

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


def _text(lines: List[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


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
    """Parse JSON lines, skipping a truncated last line (a run that crashed mid-write).

    Lines end at "\\n" only (a JSON string may hold U+2028 and the like). Any other line
    that is not a JSON object raises :class:`CorruptLogError` naming ``source`` and line."""
    for _, record in read_jsonl_numbered(text, source):
        yield record


def read_jsonl_numbered(text: str, source: str = "") -> Iterator[Tuple[int, Dict[str, Any]]]:
    """:func:`read_jsonl`, with each record's 1-based line number."""
    lines = text.split("\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the text ends with a newline (or blanks): no torn last line
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # also: too deep, an int of > 4300 digits
            if i == len(lines) - 1:
                logger.warning("skipping truncated last line %d of %s", i + 1, source or "log")
                continue
            raise CorruptLogError(f"{source or 'log'} line {i + 1} is not valid JSON: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise CorruptLogError(f"{source or 'log'} line {i + 1} is not a JSON object: {line[:80]!r}")
        yield i + 1, record


def load_log(path: str, base: str = EVENTS_FILE) -> List[Dict[str, Any]]:
    """Records of log ``base`` of a run directory on local disk, every segment in order;
    [] when there is none. CorruptLogError for a corrupt line (bad UTF-8 is replaced)."""
    directory = os.path.expanduser(path)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: List[Dict[str, Any]] = []
    for name in log_segments(names, base):
        p = os.path.join(directory, name)
        with open(p, "rb") as fh:
            out += read_jsonl(fh.read().decode("utf-8", "replace"), p)
    return out


def load_events(path: str) -> List[Dict[str, Any]]:
    """Events of a run directory on local disk (tests, tools)."""
    return load_log(path, EVENTS_FILE)


def read_log(storage, run_rel: str, base: str = EVENTS_FILE) -> List[Dict[str, Any]]:
    """Records of log ``base`` of run ``run_rel`` on any ``Storage``, every segment in
    order; [] when there is none. StorageError from the store, CorruptLogError as above."""
    prefix = f"{run_rel.rstrip('/')}/" if run_rel.strip("/") else ""
    out: List[Dict[str, Any]] = []
    for name in log_segments(storage.list_dir(run_rel), base):
        out += read_jsonl(storage.read_bytes(prefix + name).decode("utf-8", "replace"), prefix + name)
    return out


def filter_events(events: List[Dict[str, Any]], kind: EventKind) -> List[Dict[str, Any]]:
    return [e for e in events if e.get("kind") == kind.value]


def last(events: List[Dict[str, Any]], kind: EventKind) -> Optional[Dict[str, Any]]:
    found = filter_events(events, kind)
    return found[-1] if found else None
