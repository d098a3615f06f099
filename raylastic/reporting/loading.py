"""Reading a run directory from any storage path into plain event and metrics records.

The storage seam (``raylastic.checkpoint.storage``) pulls in pyarrow, about 0.2 s of
import: it is imported inside :func:`load_run` so ``raylastic report --help`` and code
that only builds reports from records stay light.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

from raylastic.events import EVENTS_FILE, METRICS_FILE, read_jsonl


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
    ValueError for a corrupt line that is not the last one; StorageError from the store."""
    from raylastic.checkpoint.storage import Storage

    storage = Storage(path)
    try:
        raw = storage.read_bytes(EVENTS_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise NotARunError(_not_a_run_message(storage, path)) from None
    try:
        metrics_raw = storage.read_bytes(METRICS_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        metrics_raw = b""
    with _captured_warnings() as notes:
        events = [e for e in read_jsonl(raw.decode("utf-8", "replace"), f"{path}/{EVENTS_FILE}")
                  if isinstance(e, dict) and "ts" in e and "kind" in e]
        metrics = [m for m in read_jsonl(metrics_raw.decode("utf-8", "replace"),
                                         f"{path}/{METRICS_FILE}")
                   if isinstance(m, dict) and "ts" in m and "index" in m]
    if not events:
        raise NotARunError(f"{path}: {EVENTS_FILE} holds no events (the run never started, "
                           "or the file is not a raylastic event log)")
    if not metrics_raw:
        notes.append(f"no {METRICS_FILE} in {path}: steps and goodput are unknown")
    return RunData(path, events, metrics, tuple(notes))


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
        return (f"{head}; it looks like a storage_path holding runs: {shown}. "
                f"Try: raylastic report {path.rstrip('/')}/{runs[0]}")
    return f"{head} (expected <storage_path>/<name>/{EVENTS_FILE}, written by fit())"


def _safe_exists(storage, rel: str) -> bool:
    try:
        return storage.exists(rel)
    except Exception:  # noqa: BLE001
        return False
