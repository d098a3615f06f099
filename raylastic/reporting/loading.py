"""Reading a run directory from any storage path into plain event and metrics records.

A log is every segment of it in order (``events.jsonl``, ``events.1.jsonl``, ...; see
:mod:`raylastic.events`). The fields the report computes with are type-checked here, as
they are read: a log is data from a store, possibly damaged or written by something
else, and a field of the wrong type must be a one-line error naming the file, line and
field (:class:`~raylastic.events.CorruptLogError`), not a traceback deep in a pass.

The storage seam (``raylastic.checkpoint.storage``) pulls in pyarrow, about 0.2 s of
import: it is imported inside :func:`load_run` so ``raylastic report --help`` and code
that only builds reports from records stay light.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple

from raylastic.events import EVENTS_FILE, METRICS_FILE, CorruptLogError, log_segments, read_jsonl_numbered
from raylastic.reporting.prices import shown_value

# Timestamps are wall-clock seconds and durations seconds: far below this, so sums and
# differences of any number of them stay finite. Integers fit in 64 bits.
MAX_SECONDS = 1e13
MAX_INT = 2**63

Record = Dict[str, Any]


class NotARunError(ValueError):
    """The path holds no raylastic run (no readable events.jsonl)."""


@dataclass(frozen=True)
class RunData:
    path: str
    events: List[Dict[str, Any]]
    metrics: List[Dict[str, Any]]
    notes: Tuple[str, ...] = ()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured_warnings() -> Iterator[List[str]]:
    """read_jsonl warns through the 'raylastic' logger; keep those as report notes."""
    log, handler = logging.getLogger("raylastic"), _Capture()
    log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)


def load_run(path: str) -> RunData:
    """Read a run directory (local path, file://, s3://, gs://, abfs://, az://).

    NotARunError when there is no event log (naming runs found one level below);
    CorruptLogError (a ValueError) for a corrupt line that is not the last one or a field
    of the wrong type; StorageError from the store."""
    from raylastic.checkpoint.storage import Storage

    storage = Storage(path)
    names = storage.list_dir("")
    with _captured_warnings() as notes:
        events, segments, _ = _read_log(storage, path, names, EVENTS_FILE, _check_event, ("ts", "kind"))
        if not segments:
            raise NotARunError(_not_a_run_message(storage, path))
        metrics, _, metrics_bytes = _read_log(storage, path, names, METRICS_FILE, _check_metric, ("ts", "index"))
    if not events:
        raise NotARunError(
            f"{path}: {EVENTS_FILE} holds no events (the run never started, or the file is not a raylastic event log)"
        )
    if not metrics_bytes:
        notes.append(f"no {METRICS_FILE} in {path}: steps and goodput are unknown")
    return RunData(path, events, metrics, tuple(notes))


def _read_log(
    storage, path: str, names: List[str], base: str, check: Callable[[Record], None], required: Tuple[str, ...]
) -> Tuple[List[Record], int, int]:
    """Records of every segment of ``base`` that have the ``required`` fields (others are
    not the run's records), each checked; the number of segments read, and their bytes."""
    out: List[Record] = []
    segments = size = 0
    for name in log_segments(names, base):
        try:
            raw = storage.read_bytes(name)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue  # listed, then gone (or not a file): not a segment
        segments, size = segments + 1, size + len(raw)
        source = f"{path.rstrip('/')}/{name}"
        for line, record in read_jsonl_numbered(raw.decode("utf-8", "replace"), source):
            if all(k in record for k in required):
                try:
                    check(record)
                except CorruptLogError as e:
                    raise CorruptLogError(f"{source} line {line}: {e}") from None
                out.append(record)
    return out, segments, size


# ----------------------------------------------------------------------------- field types


def _bad(record: Record, key: str, expected: str) -> CorruptLogError:
    return CorruptLogError(f"field {key!r} is {shown_value(record[key])}; expected {expected}")


def _number(record: Record, key: str, limit: float) -> None:
    v = record.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= limit:  # NaN too
        raise _bad(record, key, f"a finite number of seconds within +-{limit:g}")


def _int(record: Record, key: str) -> None:
    v = record.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or abs(v) >= MAX_INT):
        raise _bad(record, key, "an integer (64-bit)")


def _typed(record: Record, key: str, types: tuple, expected: str) -> None:
    v = record.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
        raise _bad(record, key, expected)


_INT_FIELDS = ("epoch", "world_size", "restore_index", "index", "reached_index", "lost_steps", "bytes")
_SECONDS_FIELDS = ("resize_s", "sync_s", "stage_s", "wait_s", "upload_s", "async_s")
# Read as text (str() of anything else could be a huge or endlessly nested repr).
_STR_FIELDS = (
    "node_type",
    "market",
    "message",
    "reason",
    "cause",
    "failure_kind",
    "state",
    "decision",
    "error",
    "source",
)


def _check_event(e: Record) -> None:
    """The type of every event field a report pass reads (None: absent)."""
    if not isinstance(e["kind"], str):
        raise _bad(e, "kind", "a string")
    if e["ts"] is None:
        raise _bad(e, "ts", "a timestamp")
    for key in ("ts", "report_ts"):
        _number(e, key, MAX_SECONDS)
    for key in _SECONDS_FIELDS:
        _number(e, key, MAX_SECONDS)
    for key in _INT_FIELDS:
        _int(e, key)
    for key in _STR_FIELDS:
        _typed(e, key, (str,), "a string")
    for key in ("wid", "node_id"):
        _typed(e, key, (str, int), "a string or an integer")
    nodes = e.get("nodes")
    if nodes is not None and (
        not isinstance(nodes, list) or not all(isinstance(n, (str, int)) and not isinstance(n, bool) for n in nodes)
    ):
        raise _bad(e, "nodes", "a list of node ids")


def _check_metric(m: Record) -> None:
    """``ts`` and ``index`` (required), ``epoch``, ``world_size``, ``metrics`` (an object:
    non-numeric or non-finite values in it are simply not plotted)."""
    if m["ts"] is None or m["index"] is None:
        raise _bad(m, "ts" if m["ts"] is None else "index", "a value")
    _number(m, "ts", MAX_SECONDS)
    for key in ("index", "epoch", "world_size"):
        _int(m, key)
    _typed(m, "metrics", (dict,), "an object")


# ----------------------------------------------------------------------------- not a run


def _not_a_run_message(storage, path: str) -> str:
    head = f"{path} is not a raylastic run directory: it has no {EVENTS_FILE}"
    try:
        children = storage.list_dir("")
    except Exception:  # noqa: BLE001 - the hint is best effort
        children = []
    if not children and not storage.exists(""):
        return f"{path} does not exist (expected a run directory <storage_path>/<name>)"
    runs = [c for c in children[:50] if _safe_exists(storage, f"{c}/{EVENTS_FILE}")]
    if runs:
        shown = ", ".join(runs[:10]) + (" ..." if len(runs) > 10 else "")
        return (
            f"{head}; it looks like a storage_path holding runs: {shown}. "
            f"Try: raylastic report {path.rstrip('/')}/{runs[0]}"
        )
    return f"{head} (expected <storage_path>/<name>/{EVENTS_FILE}, written by fit())"


def _safe_exists(storage, rel: str) -> bool:
    try:
        return storage.exists(rel)
    except Exception:  # noqa: BLE001
        return False
