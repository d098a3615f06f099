"""Fault injection for tests, examples and benchmarks: act when a run reaches a point.

The run's own files are the clock: ``metrics.jsonl`` says which report index rank 0
reached and ``events.jsonl`` says what the controller did, so faults land at a given
training step without sleeps, and tests wait on events with bounded timeouts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

from raylastic.events import EVENTS_FILE, METRICS_FILE, EventKind, LossCause, read_jsonl
from raylastic.testing.cluster import LocalCluster, wait_until


def _read(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    # A line may be half-written while we read; drop an unterminated tail.
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return list(read_jsonl(text, path))


class RunWatcher:
    """Reads a local run directory while the run is in progress."""

    def __init__(self, run_path: str):
        self.run_path = os.path.expanduser(run_path)

    def events(self, kind: Optional[EventKind] = None) -> List[Dict[str, Any]]:
        evs = _read(os.path.join(self.run_path, EVENTS_FILE))
        return evs if kind is None else [e for e in evs if e.get("kind") == kind.value]

    def metrics(self) -> List[Dict[str, Any]]:
        return _read(os.path.join(self.run_path, METRICS_FILE))

    def last_index(self) -> int:
        m = self.metrics()
        return m[-1]["index"] if m else 0

    def wait_for_index(self, index: int, timeout_s: float) -> int:
        return wait_until(
            lambda: self.last_index() >= index and self.last_index(),
            timeout_s,
            what=f"report index {index} in {self.run_path}",
        )

    def wait_for_event(
        self,
        kind: EventKind,
        timeout_s: float,
        where: Callable[[Dict[str, Any]], bool] = lambda e: True,
        count: int = 1,
    ) -> Dict[str, Any]:
        def found():
            evs = [e for e in self.events(kind) if where(e)]
            return evs[count - 1] if len(evs) >= count else None

        return wait_until(found, timeout_s, what=f"{count} x {kind.value} event in {self.run_path}")

    def current_group(self) -> Dict[str, Any]:
        groups = self.events(EventKind.GROUP_FORMED)
        if not groups:
            raise RuntimeError("no group formed yet")
        return groups[-1]


def kill_node_at(cluster: LocalCluster, watcher: RunWatcher, index: int, timeout_s: float = 120, rank: int = -1) -> str:
    """When rank 0 reports ``index``, remove the node hosting ``rank`` of the current
    group (default: the last rank, so rank 0 survives). Returns the node id removed."""
    watcher.wait_for_index(index, timeout_s)
    node_id = watcher.current_group()["nodes"][rank]
    cluster.remove_node(cluster.node_by_id(node_id))
    return node_id


@contextlib.contextmanager
def slow_joins(delay_s: float) -> Iterator[None]:
    """Nodes started inside the block run workers that wait ``delay_s`` before each join
    of a process group: a window in which a test can lose a member the controller already
    chose, the others waiting for it in the rendezvous. (Ray workers inherit their raylet's
    environment, which is this process's when ``LocalCluster`` starts the node.)"""
    from raylastic._internal.worker_group.worker import JOIN_DELAY_ENV

    old = os.environ.get(JOIN_DELAY_ENV)
    os.environ[JOIN_DELAY_ENV] = str(float(delay_s))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(JOIN_DELAY_ENV, None)
        else:
            os.environ[JOIN_DELAY_ENV] = old


def kill_worker_process(pid: int) -> None:
    """SIGKILL one worker process (its node stays up): a crash, not a node loss."""
    os.kill(pid, signal.SIGKILL)


class FitThread(threading.Thread):
    """Runs ``trainer.fit()`` in a background thread so the main thread can add
    nodes (Ray requires that) and inject faults."""

    def __init__(self, trainer, **fit_kwargs: Any):
        super().__init__(daemon=True, name="raylastic-fit")
        self._trainer = trainer
        self._kwargs = fit_kwargs
        self.result = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.result = self._trainer.fit(**self._kwargs)
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def wait(self, timeout_s: float):
        self.join(timeout_s)
        if self.is_alive():
            raise TimeoutError(f"fit() did not return within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)


def hung_replacements(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ``worker_lost`` events of workers replaced because they did not unwind
    (``cause: hung``). Each is also raised as a warning with where the worker was stuck
    (``stuck_at``: its abort's result and its train thread's stack), so a test that
    tolerates the bounded fallback still shows, in the pytest summary, why it was taken."""
    import warnings

    hung = [
        e for e in events if e.get("kind") == EventKind.WORKER_LOST.value and e.get("cause") == LossCause.HUNG.value
    ]
    for e in hung:
        warnings.warn(f"{e.get('message')}; stuck at:\n{e.get('stuck_at') or '(not recorded)'}", stacklevel=2)
    return hung
