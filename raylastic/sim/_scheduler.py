"""Small helpers of the spot cloud: a one-thread timed scheduler, bounded waiting, a
free port, a temporary environment."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, List, Mapping, Optional

from raylastic.testing.cluster import wait_until
from raylastic.testing.ports import free_ports

logger = logging.getLogger(__name__)


class Scheduler(threading.Thread):
    """Runs callables at ``time.monotonic()`` times, in time order, on one thread."""

    def __init__(self, name: str = "spot-cloud-scheduler") -> None:
        super().__init__(name=name, daemon=True)
        self._heap: List[Any] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._running = 0

    def call_at(self, due: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        with self._cond:
            return not self._heap and not self._running

    def stop(self) -> None:
        """Drop what is queued and end the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self.is_alive():
            self.join(timeout=10)

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, _, fn = heapq.heappop(self._heap)
                self._running += 1
            try:
                fn()
            except Exception:  # noqa: BLE001  (one failed action must not stop the others)
                logger.exception("spot cloud: scheduled action failed")
            finally:
                with self._cond:
                    self._running -= 1


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: Any, interval_s: float = 0.1) -> Any:
    """``raylastic.testing.cluster.wait_until`` at the simulator's 0.1 s polling interval."""
    return wait_until(predicate, timeout_s, interval_s=interval_s, what=what)


def free_port() -> int:
    """A port free on every interface (the head's GCS binds the node address)."""
    return free_ports(1, host="")[0]


class environ:
    """``with environ({...}):`` sets environment variables for the block and restores
    them after (processes started inside inherit them)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env: Mapping[str, str] = dict(env)
        self._saved: Mapping[str, Optional[str]] = {}

    def __enter__(self) -> None:
        self._saved = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
